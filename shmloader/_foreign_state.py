"""load_state_dict() of a state shmloader did not make (stub)."""

from __future__ import annotations


def foreign_state(loader, state: dict) -> dict:
    raise ValueError(
        "load_state_dict expects a dict made by shmloader's "
        "DataLoader.state_dict(); this dict has no 'version' key"
    )
