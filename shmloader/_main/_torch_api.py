"""The torch internals shmloader builds on, in one place, and what the
installed torch does where its versions differ (torch 2.6 and newer).

shmloader follows torch's DataLoader step by step, which takes private names
of torch.utils.data; they are all imported here, once, so that a torch that
moved one fails at `import shmloader` with the name and the torch version,
not deep in a worker.  Where torch versions behave differently (a message, a
warning, a dispatch rule, pin-memory semantics), the behaviour is read off
the installed torch's own code objects, not from a table of versions."""

from __future__ import annotations

import importlib

import torch

SUPPORTED = "torch>=2.6"

# (module, name) of every private torch name used anywhere in shmloader
# (tests/unit/test_torch_api.py checks the imports against it).
_NEEDED = [
    ("torch", "_neg_view"),
    ("torch._C", "_get_privateuse1_backend_name"),
    ("torch.autograd", "_profiler_enabled"),
    ("torch._utils", "ExceptionWrapper"),
    ("torch._utils", "_element_size"),
    ("torch.multiprocessing", "_set_thread_name"),
    ("torch.multiprocessing.reductions", "reduce_tensor"),
    ("torch.utils.data", "_DatasetKind"),
    ("torch.utils.data", "_utils"),
    ("torch.utils.data.dataloader", "_BaseDataLoaderIter"),
    ("torch.utils.data.dataloader", "_DatasetKind"),
    ("torch.utils.data.dataloader", "_MultiProcessingDataLoaderIter"),
    ("torch.utils.data.dataloader", "_SingleProcessDataLoaderIter"),
    ("torch.utils.data.dataloader", "_sharding_worker_init_fn"),
    ("torch.utils.data.dataloader", "IterDataPipe"),
    ("torch.utils.data.dataloader", "MapDataPipe"),
    ("torch.utils.data._utils", "collate"),
    ("torch.utils.data._utils", "pin_memory"),
    ("torch.utils.data._utils", "signal_handling"),
    ("torch.utils.data._utils", "worker"),
    ("torch.utils.data._utils.collate", "collate"),
    ("torch.utils.data._utils.collate", "collate_tensor_fn"),
    ("torch.utils.data._utils.collate", "default_collate"),
    ("torch.utils.data._utils.collate", "default_collate_fn_map"),
    ("torch.utils.data._utils.collate", "default_collate_err_msg_format"),
    ("torch.utils.data._utils.signal_handling", "_set_SIGCHLD_handler"),
    ("torch.utils.data._utils.signal_handling", "_set_worker_signal_handlers"),
    ("torch.utils.data._utils.worker", "_generate_state"),
    ("torch.utils.data._utils.worker", "WorkerInfo"),
    ("torch.utils.data.graph_settings", "apply_random_seed"),
]
# What torch's _BaseDataLoaderIter.__init__ sets that shmloader's iterators read.
ITERATOR_ATTRIBUTES = (
    "_dataset",
    "_dataset_kind",
    "_IterableDataset_len_called",
    "_auto_collation",
    "_drop_last",
    "_index_sampler",
    "_num_workers",
    "_world_size",
    "_rank",
    "_pin_memory",
    "_pin_memory_device",
    "_timeout",
    "_collate_fn",
    "_sampler_iter",
    "_base_seed",
    "_persistent_workers",
    "_num_yielded",
)


def unsupported(what: str) -> str:
    """The message for a torch whose internals are not what shmloader needs."""
    return (
        f"shmloader needs {what}, which torch {torch.__version__} does not have: shmloader "
        f"supports {SUPPORTED}, and this torch moved a private name it relies on. Install "
        "a torch in that range, or a shmloader release made for this torch."
    )


def _check_names() -> None:
    for module, name in _NEEDED:
        try:
            getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            raise ImportError(unsupported(f"{module}.{name}")) from None


_check_names()

from torch.utils.data import dataloader as _dataloader  # noqa: E402  (checked above)


def check_iterator(iterator) -> None:
    """After torch's _BaseDataLoaderIter.__init__: the attributes it set."""
    for name in ITERATOR_ATTRIBUTES:
        if not hasattr(iterator, name):
            raise RuntimeError(unsupported(f"_BaseDataLoaderIter.{name}"))


def _constant(function, prefix: str) -> str | None:
    """The string constant of `function`'s code that starts with `prefix`:
    a message the installed torch gives, word for word, or None if it has
    none such."""
    return next(
        (c for c in function.__code__.co_consts if isinstance(c, str) and c.startswith(prefix)),
        None,
    )


_MP_ITER = _dataloader._MultiProcessingDataLoaderIter

# The AssertionErrors torch raises for num_workers or prefetch_factor <= 0
# (set after the loader was made) as its workers' iterator starts: with these
# messages (a later torch), or a bare assert's (None).
NUM_WORKERS_MESSAGE = _constant(_MP_ITER.__init__, "num_workers must be")
PREFETCH_FACTOR_MESSAGE = _constant(_MP_ITER.__init__, "prefetch_factor must be")
# The warning torch gives when a worker's arguments cannot be pickled (None:
# this torch gives none).
PICKLE_ERROR_WARNING = _constant(_MP_ITER.__init__, "Got pickle error")
# torch's error when a batch's fds cannot be received.
TOO_MANY_FILES = _constant(_MP_ITER._try_get_data, "Too many open files") or (
    "Too many open files. Communication with the workers is no longer possible."
)
# Whether in_order=False also caps each worker's tasks in flight at its share
# of prefetch_factor * num_workers (a later torch), or only the total.
IN_ORDER_FALSE_CAPS_EACH_WORKER = "_workers_num_tasks" in _MP_ITER._try_put_index.__code__.co_names


def check_workers_and_prefetch(num_workers, prefetch_factor) -> None:
    """torch's checks as its workers' iterator starts, which compare in
    either order (a None left from num_workers=0 fails in the comparison,
    whose TypeError names the operator)."""
    _check_positive(num_workers, NUM_WORKERS_MESSAGE)
    _check_positive(prefetch_factor, PREFETCH_FACTOR_MESSAGE)


def _check_positive(value, message: str | None) -> None:
    if message is not None:
        if value <= 0:
            raise AssertionError(message)
    elif not value > 0:
        raise AssertionError()


def pins_to_cuda(iterator) -> bool:
    """Whether torch's iterator would pin batches for CUDA: its
    _pin_memory_device is the device type (torch.accelerator's, in later
    torch) or the user's pin_memory_device, where "" and None mean CUDA."""
    return iterator._pin_memory and (iterator._pin_memory_device or "cuda") == "cuda"


def pin_thread_device(iterator) -> int:
    """The device index torch's iterator gives its pin-memory thread, looked
    up as the installed torch does (so that it fails as torch's does, where
    it fails: a pin_memory_device with no such device).  Later torch asks
    the current accelerator whatever the device; earlier torch looks up the
    device pin_memory_device names, and for any other asks the current
    accelerator (None) or gives -1 (torch 2.8), or CUDA (torch 2.6)."""
    names = _MP_ITER.__init__.__code__.co_names
    if "xpu" not in names:
        return torch.accelerator.current_device_index()
    device = iterator._pin_memory_device
    if device == "cuda":
        return torch.cuda.current_device()
    if device == "xpu":
        return torch.xpu.current_device()
    if device == torch._C._get_privateuse1_backend_name():
        return getattr(torch, device).current_device()
    if "accelerator" in names:
        return torch.accelerator.current_device_index() if device is None else -1
    return torch.cuda.current_device()
