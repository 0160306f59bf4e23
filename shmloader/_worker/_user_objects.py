"""Reading the user's objects (datasets, samplers) without trusting them.

Both sides read them: a worker asks its dataset whether it can say where it
stands (state_dict), the main process asks the same of samplers.  So this
module imports nothing of shmloader's.
"""

from __future__ import annotations


def attribute(obj, name):
    """obj.name, or None where it has none: a __getattr__ may raise anything
    for a name it does not know (a KeyError, from a dict it reads)."""
    try:
        return getattr(obj, name)
    except Exception:  # noqa: BLE001 - see above
        return None
