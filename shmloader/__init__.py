"""shmloader: torch's DataLoader, with batches moved through shared-memory slots."""

from ._errors import (
    RingBypassedWarning,
    SampleLayoutError,
    SharedMemoryError,
    ShmloaderError,
    ShmloaderWarning,
    WorkerDied,
)
from ._main import _torch_api  # noqa: F401  (first: checks the torch internals used)
from ._main._stats import LoaderStats
from .dataloader import DataLoader
from .shared_list import SharedList

__all__ = [
    "DataLoader",
    "LoaderStats",
    "RingBypassedWarning",
    "SampleLayoutError",
    "SharedList",
    "SharedMemoryError",
    "ShmloaderError",
    "ShmloaderWarning",
    "WorkerDied",
]
__version__ = "0.1.0"
