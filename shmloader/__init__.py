"""shmloader: torch's DataLoader, with batches moved through shared-memory slots."""

from . import _torch_api  # noqa: F401  (first: checks the torch internals used)
from ._pool import WorkerDied
from ._ring_memory import SharedMemoryError
from ._sample_layout import SampleLayoutError
from ._stats import LoaderStats
from ._warn import RingBypassedWarning
from .dataloader import DataLoader
from .shared_list import SharedList

__all__ = [
    "DataLoader",
    "LoaderStats",
    "RingBypassedWarning",
    "SampleLayoutError",
    "SharedList",
    "SharedMemoryError",
    "WorkerDied",
]
__version__ = "0.1.0"
