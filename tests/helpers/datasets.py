"""Module-level datasets, samplers, collate and init functions shared by the tests: the
behaviour tests' (compared with torch) and, at the end, the failure tests' (workers that fail,
die or sleep, and faults that fire once).

Everything here is picklable by reference, so it works with the 'spawn' and 'forkserver' start
methods (the child imports this module by name). Nothing here imports shmloader: the same objects
are fed to torch's DataLoader and to shmloader.DataLoader, and the outputs are compared with
`assert_same` / `canon`.
"""

import collections
import collections.abc
import copy
import math
import multiprocessing.util
import os
import random
import signal
import threading
import time
import weakref
from collections import OrderedDict, namedtuple
from collections.abc import Mapping

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info

Point = namedtuple("Point", ["x", "label"])

# State written by worker_init_fn inside a worker; read back by WorkerStateMap samples.
_WORKER_STATE = {}


def _worker_fields():
    """(id, num_workers, seed as str) of the calling worker, or (-1, 0, '') in the main process.

    The seed is a string because base_seed + id can exceed int64 and break default_collate.
    """
    info = get_worker_info()
    if info is None:
        return -1, 0, ""
    return info.id, info.num_workers, str(info.seed)


# --------------------------------------------------------------------------- map-style datasets
class SizedMap(Dataset):
    """A map-style dataset of `n` samples (the class's `n` where none is given): the length
    every one here keeps. A subclass says what sample i is."""

    n = 10

    def __init__(self, n=None):
        self.n = type(self).n if n is None else n

    def __len__(self):
        return self.n


class IndexMap(SizedMap):
    """Sample i = (i, float32 tensor [i, i, i])."""

    n = 20

    def __getitem__(self, i):
        return i, torch.full((3,), float(i), dtype=torch.float32)


class JitterMap(IndexMap):
    """IndexMap whose every 8th sample takes a little longer, so that with in_order=False batches
    can really arrive out of order. (No assertion depends on timing.)"""

    def __getitem__(self, i):
        if i % 8 == 0:
            time.sleep(0.02)
        return super().__getitem__(i)


class EpochTagged(SizedMap):
    """Item i is (i, the dataset's epoch attribute as the worker sees it)."""

    n = 8

    def __init__(self, n=None):
        super().__init__(n)
        self.epoch = 0

    def __getitem__(self, i):
        return torch.tensor([i, self.epoch])


class WorkerTrace(EpochTagged):
    """Item i: (i, the dataset's epoch as the worker sees it, worker id, its seed mod
    2**31, what mark_init_fn marked (-1: nothing), the worker's pid); the pid last: the
    one column in which torch's batches and shmloader's differ."""

    n = 16

    def __getitem__(self, i):
        info = get_worker_info()
        mark = _WORKER_STATE.get("mark", -1)
        return torch.tensor([i, self.epoch, info.id, info.seed % 2**31, mark, os.getpid()])


class TaggingSampler(Sampler):
    """Sequential, and each iteration moves its dataset's epoch on, in the main process."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __iter__(self):
        self.dataset.epoch += 1
        return iter(range(len(self.dataset)))


class GeneratorMap(SizedMap):
    """Each sample draws from a torch.Generator the dataset shares with the loader or its
    sampler: each worker draws from its own copy, taken when the worker was started."""

    def __init__(self, n, generator):
        super().__init__(n)
        self.generator = generator

    def __getitem__(self, i):
        return torch.rand(2, generator=self.generator), i


class RNGMap(SizedMap):
    """Each sample draws from `random`, torch and numpy global RNGs and reports get_worker_info()."""

    n = 16

    def __getitem__(self, i):
        wid, nw, seed = _worker_fields()
        info = get_worker_info()
        return {
            "index": i,
            "wid": wid,
            "num_workers": nw,
            "seed": seed,
            "same_dataset": bool(info is not None and info.dataset is self),
            "initial_seed": str(torch.initial_seed()),
            "threads": torch.get_num_threads(),
            "py": random.random(),
            "py_int": random.getrandbits(31),
            "torch": torch.rand(3),
            "torch_int": torch.randint(0, 1 << 30, (2,)),
            "np": np.random.rand(3),
            "np_int": np.random.randint(0, 1 << 30, size=2),
        }


def _tensor_leaves(i):
    """Tensors of many dtypes (0-dim, empty, NaN/inf/-0.0), numpy arrays and scalars: the
    fixed-size leaves _rich_sample and _numeric_sample share."""
    g = torch.Generator().manual_seed(i)
    base = torch.randn(2, 3, generator=g)
    return {
        "u8": torch.arange(6, dtype=torch.uint8).reshape(2, 3) + i,
        "f32": base,
        "f16": base.to(torch.float16),
        "bf16": base.to(torch.bfloat16),
        "bool": base > 0,
        "i64": torch.tensor([i, -i, 2**40 + i]),
        "c64": torch.complex(base, -base),
        "i16": torch.full((2,), i, dtype=torch.int16),
        "f64_scalar": torch.tensor(i * 1.5, dtype=torch.float64),
        "i32_scalar": torch.tensor(i, dtype=torch.int32),
        "empty": torch.zeros(0, 4),
        "special": torch.tensor([math.nan, math.inf, -math.inf, -0.0, float(i)]),
        "np_f64": np.linspace(0.0, float(i), 5),
        "np_i32": np.arange(4, dtype=np.int32) * i,
        "np_u8": np.full((2, 2), i, dtype=np.uint8),
        "np_bool": np.array([i % 2 == 0, True]),
        "np_f16": np.array([i / 4, math.nan], dtype=np.float16),
        "np_c128": np.array([complex(i, -i)]),
        "np_empty": np.zeros((0, 3), dtype=np.float32),
        "np_f32_scalar": np.float32(i / 3),
        "np_i64_scalar": np.int64(i * 1000),
    }


def _rich_sample(i):
    return {
        **_tensor_leaves(i),
        "np_bool_scalar": np.bool_(i % 2),
        "int": i,
        "float": i / 7,
        "bool_py": i % 3 == 0,
        "str": f"s{i}",
        "bytes": f"b{i}".encode(),
        "tuple": (torch.tensor(i), (f"n{i}", np.array([i, i]))),
        "list": [torch.ones(2) * i, i],
        "point": Point(torch.tensor([i, i + 1]), f"p{i}"),
        "nested": {"a": {"b": torch.full((2,), i, dtype=torch.int8)}, "c": Point(i, np.float64(i))},
        "odict": OrderedDict([("z", i), ("a", torch.tensor(float(i)))]),
        "noncontig": torch.arange(12.0).reshape(3, 4).t() + i,
    }


class RichMap(SizedMap):
    """Samples with many leaf kinds: tensors of several dtypes (incl. 0-dim, empty, NaN/inf/-0.0,
    non-contiguous), numpy arrays and scalars, python scalars, str/bytes, tuples, lists,
    namedtuples, nested dicts and an OrderedDict."""

    n = 8

    def __getitem__(self, i):
        return _rich_sample(i)


class NumpyKindsMap(SizedMap):
    """Numpy arrays that a slot must keep as torch's pickling keeps them: read-only (arrives
    writable), structured (keeps its fields), Fortran-ordered (keeps its order), big-endian,
    datetime, and a non-contiguous view (arrives C-ordered)."""

    n = 12

    def __getitem__(self, i):
        points = np.zeros(3, dtype=[("x", "<i4"), ("y", "<f8"), ("tag", "S2")])
        points["x"], points["y"], points["tag"] = i, i / 2, b"ab"
        return {
            "read_only": np.frombuffer(bytes(range(i, i + 8)), dtype=np.uint8),
            "structured": points,
            "fortran": np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3) + i),
            "big_endian": np.arange(4, dtype=">i8") * i,
            "datetime": np.array([i, i + 1], dtype="datetime64[s]"),
            "strided": np.arange(10, dtype=np.int16)[::3] + i,
        }


def aliasing_collate(batch):
    """For IndexMap samples: one tensor twice, views of it, a transposed and an expanded view,
    and a view of a storage much larger than itself (copied alone by shmloader)."""
    x = torch.stack([s[1] for s in batch])
    big = torch.arange(1000.0)
    return {
        "x": x,
        "same": x,
        "inputs": x[:, :-1],
        "targets": x[:, 1:],
        "t": x.t(),
        "expanded": x[:1].expand(4, -1),
        "slice_of_big": big[:3],
        "again": [x, big[:3]],
    }


_reductions = 0  # ReductionCounter picklings in this process


class ReductionCounter:
    """Counts its picklings in the process that pickles it: each arrives holding the count
    its own pickling reached (a __reduce__ with a side effect)."""

    def __init__(self, count=0):
        self.count = count

    def __reduce__(self):
        global _reductions
        _reductions += 1
        return ReductionCounter, (_reductions,)


def reduction_counting_collate(batch):
    """For IndexMap samples: the stacked values beside a ReductionCounter."""
    return torch.stack([s[1] for s in batch]), ReductionCounter()


class BitsMap(IndexMap):
    """Samples of a dtype torch's default collate cannot stack: bytes viewed as `dtype`
    (bits8: no typed storage; quint8: quantized, without a quantizer)."""

    def __init__(self, n=None, dtype=torch.bits8):
        super().__init__(n)
        self.dtype = dtype

    def __getitem__(self, i):
        return torch.full((4,), i, dtype=torch.uint8).view(self.dtype)


def bits_collate(batch):
    """Stacks BitsMap samples as bytes: a batch of their dtype that torch's transport
    carries."""
    return torch.stack([s.view(torch.uint8) for s in batch]).view(batch[0].dtype)


class RuntimeClassErrorMap(IndexMap):
    """Item 7 raises an exception of a class made at run time (as boto3 makes its clients'
    errors): it cannot be pickled by name."""

    def __getitem__(self, i):
        if i == 7:
            raise type("NoSuchKey", (Exception,), {})(f"s3://bucket/{i} is missing")
        return super().__getitem__(i)


_WEIGHT = torch.ones(3, requires_grad=True)


def non_leaf_collate(batch):
    """For IndexMap samples: a batch computed from a tensor that requires grad (a non-leaf,
    which torch's pickling refuses to send)."""
    return torch.stack([s[1][:3] for s in batch]).float() * _WEIGHT


def twin_storages_collate(batch):
    """For IndexMap samples: two tensors over one numpy array's memory, each with a storage
    of its own (torch.from_numpy twice), as torch's transport keeps them: apart."""
    values = np.stack([s[1].numpy() for s in batch])
    return {"img": torch.from_numpy(values), "orig": torch.from_numpy(values)}


def repeated_objects_collate(batch):
    """For IndexMap samples: strings, bytes, lists, tensors and arrays each at several places,
    so that the metadata's pickle memo refers back to them (a shard reader's batch)."""
    x = torch.stack([s[1] for s in batch])
    name, raw, ids, array = "shard-0", b"\xff\xd8jpeg", [s[0] for s in batch], x.numpy().copy()
    return {
        "cls": [name, name],
        "jpg": [raw, raw],
        "ids": ids,
        "again": ids,
        "x": x,
        "xs": [x, x],
        "array": array,
        "arrays": (array, array),
        "name": name,
    }


def many_leaves_collate(batch):
    """For IndexMap samples: 5,000 small tensors, whose metadata outweighs their bytes."""
    return [torch.full((3,), float(k + s[0])) for s in batch for k in range(5000)]


def strided_collate(batch):
    """For IndexMap samples: tensors alone on their storages that span all of it but are not
    contiguous, and one that is a gappy part of a larger storage."""
    x = torch.stack([s[1] for s in batch])
    return {
        "transposed": x.t(),
        "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),
        "gappy": torch.arange(12.0)[::3],
    }


def sharing(batch):
    """What aliases what in an aliasing_collate batch, and whether in-place writes reach
    each other, in it and in a deepcopy of it: the facts torch's transport keeps (the views
    of x share x's storage object, its size and their offsets in it)."""
    same_object = [
        batch["x"] is batch["same"],
        batch["again"][0] is batch["x"],
        batch["again"][1] is batch["slice_of_big"],
    ]
    views = ("inputs", "targets", "t", "expanded")
    storage = batch["x"].untyped_storage()
    storages = [
        (
            batch[k].untyped_storage().data_ptr() == storage.data_ptr(),
            batch[k].untyped_storage().nbytes(),
            batch[k].storage_offset(),
        )
        for k in views
    ]
    copied = copy.deepcopy(batch)
    copied["x"].add_(100)
    batch["x"].add_(100)  # reaches every view of x, in torch's batches
    reached = [bool((b[k] >= 100).all()) for b in (batch, copied) for k in views]
    return same_object, storages, reached, float(batch["slice_of_big"].sum())


class GradMap(SizedMap):
    """Sample i = float32 [i, i, i]; every fourth, from 1 on, requires grad (a worker's
    default_collate refuses to stack those into shared memory)."""

    n = 10

    def __getitem__(self, i):
        return torch.full((3,), float(i)).requires_grad_(i % 4 == 1)


class GetItemsMap(SizedMap):
    """Has __getitems__, which torch's fetcher uses for a whole batch when auto-collating."""

    n = 10

    def __getitem__(self, i):
        return {"i": i, "via": "getitem"}

    def __getitems__(self, indices):
        return [{"i": i, "via": f"getitems{len(indices)}"} for i in indices]


class GrowingMap(SizedMap):
    """Sample 0 is empty; later samples grow geometrically (up to 4 MiB), so a slot sized from the
    first batch is too small for the later ones."""

    n = 12

    def __getitem__(self, i):
        size = 0 if i == 0 else min(16 * 4**i, 1 << 20)
        return torch.arange(size, dtype=torch.float32) + i


class SparseMap(SizedMap):
    """Sparse COO leaves (not slot-able: must take the fallback path) next to dense ones."""

    n = 6

    def __getitem__(self, i):
        sp = torch.sparse_coo_tensor([[0, i % 4]], [1.0, float(i)], (5,), check_invariants=True)
        return {"sparse": sp, "dense": torch.tensor([i, i])}


class MixedDtypeMap(SizedMap):
    """Samples whose tensor alternates between two dtypes (`dtypes`), holding a value (300)
    that the narrower of them cannot: torch's collate in a worker stacks into a tensor of the
    first sample's dtype (casting, or failing where it cannot), not torch.stack's promotion."""

    n = 24

    def __init__(self, n=None, dtypes=(torch.float32, torch.float64)):
        super().__init__(n)
        self.dtypes = dtypes

    def __getitem__(self, i):
        return torch.tensor([i + 0.5, 300.0]).to(self.dtypes[i % 2])


class ChannelsLastMap(SizedMap):
    """4-D channels_last samples (a clip of frames): torch's collate in a worker stacks them
    into a contiguous batch."""

    n = 16

    def __getitem__(self, i):
        return torch.full((2, 3, 4, 5), float(i)).contiguous(memory_format=torch.channels_last)


class MarkedTensor(torch.Tensor):
    """A tensor subclass with torch's default __torch_function__: what it stacks with is one."""


class SubclassSampleMap(SizedMap):
    """Sample `marked` is a MarkedTensor, the others plain: the batch holding it is stacked
    into a MarkedTensor (into the slot first), which only torch's pickling carries."""

    n = 64

    def __init__(self, n=None, marked=23):
        super().__init__(n)
        self.marked = marked

    def __getitem__(self, i):
        t = torch.full((4,), float(i))
        return t.as_subclass(MarkedTensor) if i == self.marked else t


class ProcessNameMap(SizedMap):
    """Sample i: the worker process's name without its number ("SpawnProcess"): what
    logging's %(processName)s shows."""

    n = 2

    def __getitem__(self, i):
        import multiprocessing

        return multiprocessing.current_process().name.rsplit("-", 1)[0]


class WorkerStateMap(SizedMap):
    """Samples expose what worker_init_fn did: a module global and an attribute it set on the
    worker's copy of the dataset."""

    n = 12

    def __init__(self, n=None):
        super().__init__(n)
        self.offset = 0

    def __getitem__(self, i):
        wid, nw, _ = _worker_fields()
        return {"i": i, "value": i + self.offset, "mark": _WORKER_STATE.get("mark", -1), "wid": wid}


class FailingMap(SizedMap):
    """Raises for indices in `bad`. exc selects the exception kind."""

    n = 12

    def __init__(self, n=None, bad=(3, 8), exc="ValueError"):
        super().__init__(n)
        self.bad = set(bad)
        self.exc = exc

    def __getitem__(self, i):
        if i in self.bad:
            if self.exc == "KeyError":
                raise KeyError(f"missing {i}")
            if self.exc == "TwoArgError":
                raise TwoArgError(f"bad {i}", i)
            raise ValueError(f"bad index {i}")
        return torch.tensor([i])


class NoneMap(SizedMap):
    """Sample 5 is None, which torch's default_collate rejects with a TypeError (in the worker)."""

    n = 10

    def __getitem__(self, i):
        return None if i == 5 else torch.tensor(i)


class SlowMap(SizedMap):
    n = 6

    def __init__(self, n=None, slow=(4,), delay=3.0):
        super().__init__(n)
        self.slow = set(slow)
        self.delay = delay

    def __getitem__(self, i):
        if i in self.slow:
            time.sleep(self.delay)
        return torch.tensor([i])


class TwoArgError(Exception):
    """Cannot be rebuilt from a single message: torch re-raises it as RuntimeError."""

    def __init__(self, a, b):
        super().__init__(a, b)


# --------------------------------------------------------------------------- iterable datasets
class ShardedIterable(IterableDataset):
    """Shards range(start, start+n) across workers with get_worker_info()."""

    def __init__(self, n=11, start=0):
        self.n = n
        self.start = start

    def __iter__(self):
        wid, nw, _ = _worker_fields()
        step = max(nw, 1)
        first = self.start + max(wid, 0)
        for i in range(first, self.start + self.n, step):
            yield {
                "i": i,
                "wid": wid,
                "x": torch.full((2,), i, dtype=torch.float64),
                "name": f"item{i}",
            }


class Unpicklable:
    """A sampler's index that pickle cannot take: it holds a lock."""

    def __init__(self):
        self.lock = threading.Lock()


class IndexIterable(IterableDataset):
    """IndexMap's samples, sharded across workers with get_worker_info()."""

    def __iter__(self):
        wid, nw, _ = _worker_fields()
        samples = IndexMap()
        for i in range(max(wid, 0), len(samples), max(nw, 1)):
            yield samples[i]


class LenIterable(ShardedIterable):
    def __len__(self):
        return self.n


class LyingLenIterable(ShardedIterable):
    """Reports half its real length: torch warns once more samples than len() were fetched."""

    def __len__(self):
        return self.n // 2


class UnshardedIterable(IterableDataset):
    """Every worker yields the whole range (duplicates, as torch documents)."""

    def __init__(self, n=5):
        self.n = n

    def __iter__(self):
        wid, _, _ = _worker_fields()
        for i in range(self.n):
            yield torch.tensor([i, wid])


class RNGIterable(IterableDataset):
    def __init__(self, n=10):
        self.n = n

    def __iter__(self):
        wid, nw, _ = _worker_fields()
        inner = RNGMap(self.n)
        for i in range(max(wid, 0), self.n, max(nw, 1)):
            yield inner[i]


class RichIterable(IterableDataset):
    def __init__(self, n=8):
        self.n = n

    def __iter__(self):
        wid, nw, _ = _worker_fields()
        for i in range(max(wid, 0), self.n, max(nw, 1)):
            yield _rich_sample(i)


class RangeIterable(IterableDataset):
    """torch's documented pattern: worker_init_fn (shard_init_fn) narrows [start, end)."""

    def __init__(self, start=3, end=20):
        self.start = start
        self.end = end

    def __iter__(self):
        return iter(range(self.start, self.end))


class FailingIterable(IterableDataset):
    """Worker 1 raises after yielding two items; worker 0 is fine."""

    def __init__(self, n=12):
        self.n = n

    def __iter__(self):
        wid, nw, _ = _worker_fields()
        for k, i in enumerate(range(max(wid, 0), self.n, max(nw, 1))):
            if wid == 1 and k == 2:
                raise ValueError(f"iterable failed at {i} in worker {wid}")
            yield torch.tensor(i)


# --------------------------------------------------------------------------- worker_init_fn
def mark_init_fn(worker_id):
    _WORKER_STATE["mark"] = 100 + worker_id
    get_worker_info().dataset.offset = 1000 * (worker_id + 1)


def reseed_init_fn(worker_id):
    # A common user pattern: derive numpy's seed from torch's per-worker seed, and draw in init.
    np.random.seed((torch.initial_seed() + 17) % 2**32)
    random.random()
    torch.rand(1)


def shard_init_fn(worker_id):
    info = get_worker_info()
    ds = info.dataset
    per = int(math.ceil((ds.end - ds.start) / float(info.num_workers)))
    ds.start = ds.start + worker_id * per
    ds.end = min(ds.start + per, ds.end)


def late_worker_0_init_fn(worker_id):
    # Worker 0 starts late (a slow import, say): its first batches travel by pipe, before
    # the ring exists, while worker 1's later ones come in slots.
    if worker_id == 0:
        time.sleep(0.5)


def failing_init_fn(worker_id):
    if worker_id == 1:
        raise ValueError(f"init failed for worker {worker_id}")


# --------------------------------------------------------------------------- samplers
class ReverseSampler(Sampler):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))

    def __len__(self):
        return self.n


class SettableSampler(Sampler):
    """Yields self.indices; the test changes them between epochs (the sampler lives in the main
    process, so this works with persistent workers too)."""

    def __init__(self, indices):
        self.indices = list(indices)

    def __iter__(self):
        return iter(list(self.indices))

    def __len__(self):
        return len(self.indices)


class ChunkBatchSampler(Sampler):
    """Batches of sizes 1, 2, 3, 1, 2, 3, ... over range(n)."""

    def __init__(self, n):
        self.n = n

    def _batches(self):
        out, start, k = [], 0, 0
        while start < self.n:
            size = k % 3 + 1
            out.append(list(range(start, min(start + size, self.n))))
            start += size
            k += 1
        return out

    def __iter__(self):
        return iter(self._batches())

    def __len__(self):
        return len(self._batches())


class KeyErrorSampler(ReverseSampler):
    """Looks attributes it lacks up in a dict: asking it for one raises a KeyError (a
    __getattr__ that torch never calls)."""

    def __getattr__(self, name):
        raise KeyError(name)


class SlotsKeyErrorSampler:
    """A sampler that is a plain iterable with __slots__ and no __dict__, whose __getattr__
    raises a KeyError for names it lacks (even "__dict__"), holding a weakref.proxy to an
    object that is gone."""

    __slots__ = ("n", "gone")

    def __init__(self, n):
        self.n = n
        self.gone = weakref.proxy(ReverseSampler(n))  # its referent is freed at once

    def __getattr__(self, name):
        raise KeyError(name)

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))


class KeyErrorStream(ShardedIterable):
    """As KeyErrorSampler, an IterableDataset."""

    def __getattr__(self, name):
        raise KeyError(name)


class NoneAt(SizedMap):
    """Sample i = float32 [i, i, i], but None at index `bad`."""

    def __init__(self, n, bad):
        super().__init__(n)
        self.bad = bad

    def __getitem__(self, i):
        return None if i == self.bad else torch.full((3,), float(i))


class IteratorBatchSampler(Sampler):
    """Batches that are iterators without a length, as torch's fetcher accepts."""

    def __len__(self):
        return 3

    def __iter__(self):
        yield iter([0, 1, 2, 3])
        yield map(int, [7, 5])
        yield iter(range(8, 11))


class CountingBatchSampler(Sampler):
    """Counts how many batches the loader has pulled from it (in the main process)."""

    def __init__(self, n, batch_size):
        self.n = n
        self.batch_size = batch_size
        self.pulled = 0

    def __iter__(self):
        for s in range(0, self.n, self.batch_size):
            self.pulled += 1
            yield list(range(s, min(s + self.batch_size, self.n)))

    def __len__(self):
        return (self.n + self.batch_size - 1) // self.batch_size


# --------------------------------------------------------------------------- collate functions
def numpy_collate(batch):
    """For IndexMap samples: numpy arrays out, no tensors."""
    return np.array([s[0] for s in batch]), np.stack([s[1].numpy() for s in batch])


def dict_collate(batch):
    """For RichMap samples: a dict mixing tensors, numpy, strings, ints, None, a namedtuple."""
    return {
        "index": [s["int"] for s in batch],
        "names": tuple(s["str"] for s in batch),
        "f32": torch.stack([s["f32"] for s in batch]),
        "bf16": torch.stack([s["bf16"] for s in batch]),
        "np": np.stack([s["np_f64"] for s in batch]),
        "meta": {
            "n": len(batch),
            "tag": "dict_collate",
            "none": None,
            "pt": Point(len(batch), "x"),
        },
    }


def identity_collate(batch):
    return batch


class Box:
    """An arbitrary user object holding a tensor: cannot live in a slot, must be pickled."""

    def __init__(self, tensor, label):
        self.tensor = tensor
        self.label = label


def object_collate(batch):
    """For IndexMap samples: arbitrary objects and non-tensor leaves."""
    idx = [s[0] for s in batch]
    return {
        "box": Box(torch.stack([s[1] for s in batch]), label=f"box{idx[0]}"),
        "set": frozenset(idx),
        "none": None,
        "complex": complex(idx[0], 1),
        "np_scalar": np.float64(sum(idx)),
        "big_int": 2**70 + idx[0],
        "str_list": [str(i) for i in idx],
    }


# --------------------------------------------------------------------------- comparison
def _tensor_bits(t):
    # clone(contiguous_format) gives standard strides even where torch already calls
    # the tensor contiguous (empty tensors, size-1 dimensions), which view() needs.
    t = t.detach().clone(memory_format=torch.contiguous_format).reshape(-1)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.view(torch.uint8)


def assert_same(a, b, path="out"):
    """Recursive equality: exact type, dtype, shape and bit-identical values (so NaN == NaN and
    -0.0 != 0.0), container types (tuple/list/dict/namedtuple/OrderedDict) and key order.
    `a` is torch's output, `b` shmloader's."""
    assert type(a) is type(b), (
        f"{path}: type {type(a).__name__} (torch) != {type(b).__name__} (shm)"
    )
    if isinstance(a, type):
        assert a is b, f"{path}: {a.__name__} (torch) != {b.__name__} (shm)"
        return
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert a.layout == b.layout, f"{path}: layout {a.layout} != {b.layout}"
        assert a.device == b.device, f"{path}: device {a.device} != {b.device}"
        assert a.requires_grad == b.requires_grad, f"{path}: requires_grad differs"
        if a.layout != torch.strided:
            a, b = a.to_dense(), b.to_dense()
        elif a.is_contiguous():
            assert b.is_contiguous(), f"{path}: torch's tensor is contiguous, shm's is not"
        assert torch.equal(_tensor_bits(a), _tensor_bits(b)), (
            f"{path}: values differ\n torch: {a}\n shm:   {b}"
        )
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {a.shape} != {b.shape}"
        assert a.flags.writeable == b.flags.writeable, f"{path}: writeable flag differs"
        assert a.strides == b.strides, f"{path}: strides {a.strides} != {b.strides}"
        assert a.tobytes() == b.tobytes(), f"{path}: values differ\n torch: {a!r}\n shm:   {b!r}"
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.tobytes() == b.tobytes(), f"{path}: {a!r} != {b!r}"
    elif isinstance(a, (float, complex)):
        assert repr(a) == repr(b), f"{path}: {a!r} != {b!r}"  # NaN-aware, sign-of-zero-aware
    elif isinstance(a, (str, bytes, int, type(None), frozenset, set)):
        assert a == b, f"{path}: {a!r} != {b!r}"
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for k, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{k}]")
    elif isinstance(a, Mapping):
        assert list(a.keys()) == list(b.keys()), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif hasattr(a, "__dict__"):
        assert_same(vars(a), vars(b), f"{path}.__dict__")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def canon(x):
    """A hashable, exact description of a batch (type, dtype, shape, bytes), for multiset compare."""
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided:
            x = x.to_dense()
        return ("T", str(x.dtype), tuple(x.shape), bytes(_tensor_bits(x).numpy()))
    if isinstance(x, np.ndarray):
        return ("N", str(x.dtype), x.shape, x.tobytes())
    if isinstance(x, np.generic):
        return ("G", str(x.dtype), x.tobytes())
    if isinstance(x, (tuple, list)):
        return (type(x).__name__, tuple(canon(v) for v in x))
    if isinstance(x, Mapping):
        return (type(x).__name__, tuple((k, canon(v)) for k, v in x.items()))
    if isinstance(x, float):
        return ("float", repr(x))
    return (type(x).__name__, repr(x))


# --------------------------------------------------------------------------- fetch="sample" & co
def _numeric_sample(i):
    """_rich_sample's leaf kinds less str/bytes (fetch="sample" refuses text): every leaf has one
    dtype and shape for all i.  Nested dicts, tuples, lists, namedtuples, an OrderedDict, tensors
    of many dtypes (0-dim, empty, NaN/inf/-0.0, non-contiguous: transposed, strided, expanded),
    numpy arrays (also non-contiguous and 0-dim) and scalars, python ints, floats and bools."""
    return {
        **_tensor_leaves(i),
        "np_0d": np.array(i * 0.25),
        "np_noncontig": (np.arange(12.0).reshape(3, 4) + i).T,
        "np_u16_scalar": np.uint16(i),
        "np_bool_scalar": np.bool_(i % 2),
        "int": i,
        "neg_int": -(i * 7) - 1,
        "float": i / 7,
        "bool_py": i % 3 == 0,
        "tuple": (torch.tensor(i), (np.array([i, i]), i * 0.5)),
        "list": [torch.ones(2) * i, i],
        "point": Point(torch.tensor([i, i + 1]), np.int16(i)),
        "nested": {"a": {"b": torch.full((2,), i, dtype=torch.int8)}, "c": Point(i, np.float64(i))},
        "odict": OrderedDict([("z", i), ("a", torch.tensor(float(i)))]),
        "noncontig": torch.arange(12.0).reshape(3, 4).t() + i,
        "strided": (torch.arange(20) + i)[::3],
        "expanded": torch.tensor([float(i)]).expand(3),
        "channels_last": (torch.arange(24.0).reshape(1, 2, 3, 4) + i).contiguous(
            memory_format=torch.channels_last
        )[0],
    }


class NumericMap(SizedMap):
    """Samples of _numeric_sample: everything fetch="sample" can put in a row."""

    def __getitem__(self, i):
        return _numeric_sample(i)


class ScalarMap(SizedMap):
    """Sample i is the python int i (the simplest sample: a bare leaf)."""

    n = 10

    def __getitem__(self, i):
        return i


class TensorMap(SizedMap):
    """Sample i is a bare float32 tensor [i, 2i, 3i, 4i] (non-contiguous for odd i)."""

    n = 10

    def __getitem__(self, i):
        t = torch.tensor([[i, 3 * i], [2 * i, 4 * i]], dtype=torch.float32)
        return t.t() if i % 2 else t.t().contiguous()


class TensorSub(torch.Tensor):
    """A tensor subclass, which torch's collate keeps as the batch's type."""


class MetaDict(dict):
    """A dict with an attribute, which torch's collate copies from a batch's first sample."""


Pair = collections.namedtuple("Pair", "p q")


class SlotsDict(dict):
    """A dict whose attribute lives in __slots__ (no __dict__)."""

    __slots__ = ("index",)


class SlotsSequence(collections.abc.Sequence):
    """A Sequence without __dict__, which collate rebuilds as a list."""

    __slots__ = ("items",)

    def __init__(self, items):
        self.items = list(items)

    def __getitem__(self, i):
        return self.items[i]

    def __len__(self):
        return len(self.items)


class MangledSlotsDict(dict):
    """A dict whose attribute is a private (name-mangled) slot."""

    __slots__ = ("__meta",)

    def set(self, meta):
        self.__meta = meta


class Settings:
    """A plain object without __eq__."""


SETTINGS = Settings()


class StructureMap(SizedMap):
    """Samples whose structure or leaves differ in ways a layout fixed by the first sample
    cannot show (odd samples differ from even ones unless said otherwise), by `kind`."""

    def __init__(self, kind, n=8):
        super().__init__(n)
        self.kind = kind

    def __getitem__(self, i):
        t = torch.full((2,), float(i))
        odd = i % 2 == 1
        kind = self.kind
        if kind == "key-order":
            return {"b": -t, "a": t} if odd else {"a": t, "b": -t}
        if kind == "other-key":
            return {"y": t} if odd else {"x": t}
        if kind == "int-vs-list":
            return {"b": [i]} if odd else {"b": i}
        if kind == "nesting":
            return [[t], t + 1] if odd else [t, t + 1]
        if kind == "tensor-vs-int":
            return i if odd else torch.tensor(i)
        if kind == "namedtuple-vs-tuple":
            return Pair(t, i) if i >= 2 else (t, i)
        if kind == "dict-attribute":
            d = MetaDict(x=t)
            d.meta = i
            return d
        if kind == "tensor-subclass":
            return t.as_subclass(TensorSub)
        if kind == "numpy-negative-strides":
            return (np.arange(4.0) + i)[::-1]
        if kind == "quantized":
            return torch.quantize_per_tensor(t, 0.1, 0, torch.quint8)
        if kind == "bits8":
            return torch.full((2,), i, dtype=torch.uint8).view(torch.bits8)
        if kind == "slots-sequence-shrinks":
            return SlotsSequence([t] if odd else [t, t + 1])
        if kind == "slots-attribute":
            d = SlotsDict(x=t)
            d.index = i
            return d
        if kind.startswith("same-attribute-"):  # equal in every sample: torch's batches
            d = MetaDict(x=t)
            d.meta = {
                "same-attribute-numpy": np.zeros(3),
                "same-attribute-nan": float("nan"),
                "same-attribute-tensor": torch.ones(2),
                "same-attribute-object": SETTINGS,
            }.get(kind)
            if kind == "same-attribute-shared":  # one tensor twice, or two equal ones
                d.meta = torch.ones(2)
                d.scale = d.meta if odd else torch.ones(2)
            return d
        if kind == "mangled-slot-attribute":
            d = MangledSlotsDict(x=t)
            d.set(i)
            return d
        if kind == "defaultdict-factory":
            return collections.defaultdict(list if odd else dict, x=t)
        if kind == "key-types":
            return {True: t} if odd else {1: t}
        raise ValueError(kind)


def overlapping_collate(batch):
    """Views overlapping themselves on part of one stacked batch: expanded (stride 0) and an
    as_strided window; another batch leaf keeps the rest of the storage out of the slot's
    shared copies (each view is alone on its storage)."""
    x = torch.stack([torch.full((1000,), float(i)) for i, _ in batch])
    y = x.clone()
    return {
        "expanded": x[1:2].expand(2000, -1),
        "window": y[1:].flatten()[3:].as_strided((2, 2), (1, 1)),
    }


class LazyBitsMap(Dataset):
    """Unbatched samples torch's transport changes on the way: a negative view and a
    conjugate view (their lazy bit is dropped, the raw storage values arrive) and empty
    tensors with zero strides (kept)."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return {
            "neg": torch._neg_view(torch.full((2,), float(i))),
            "conj": torch.full((2,), complex(i, i)).conj(),
            "empty": torch.empty_strided((3, 0), (0, 0)),
            "empty_t": torch.empty((0, 2)).t(),
        }


class MismatchMap(SizedMap):
    """{"image": float32 (3,), "meta": {"label": int, "box": float32 (2,)}}; sample `bad` breaks
    the layout the first sample fixed, by `kind`: "shape" (box of shape (3,)), "dtype" (box as
    float64), "text" (label as a str), "fields" (an extra key), "ndim" (image of shape (1, 3)),
    "none" (box is None: an optional field left out).
    Sample `raises` raises a KeyError."""

    n = 12

    def __init__(self, n=None, bad=5, kind="shape", raises=None):
        super().__init__(n)
        self.bad = bad
        self.kind = kind
        self.raises = raises

    def __getitem__(self, i):
        if i == self.raises:
            raise KeyError(f"sample {i} is missing")
        image = torch.full((3,), float(i))
        label = i
        box = torch.tensor([i, -i], dtype=torch.float32)
        extra = {}
        if i == self.bad:
            if self.kind == "shape":
                box = torch.tensor([i, -i, 0], dtype=torch.float32)
            elif self.kind == "dtype":
                box = box.double()
            elif self.kind == "text":
                label = f"label{i}"
            elif self.kind == "fields":
                extra = {"more": i}
            elif self.kind == "ndim":
                image = image.reshape(1, 3)
            elif self.kind == "none":
                box = None
        return {"image": image, "meta": {"label": label, "box": box, **extra}}


class TextMap(SizedMap):
    """Every sample holds a str (or bytes): fetch="sample" must refuse them."""

    n = 6

    def __init__(self, n=None, kind="str"):
        super().__init__(n)
        self.kind = kind

    def __getitem__(self, i):
        name = f"name{i}" if self.kind == "str" else f"name{i}".encode()
        return {"x": torch.tensor([i]), "name": name}


class AugmentMap(SizedMap):
    """Random 'augmentations' drawn from random, numpy and torch's global RNGs, on top of a
    deterministic base: whatever seeds the worker's RNGs decides what a sample looks like."""

    n = 12

    def __getitem__(self, i):
        base = torch.full((3,), float(i))
        return {
            "index": i,
            "flip": random.random() < 0.5,
            "py": random.random(),
            "py_int": random.randint(0, 1 << 30),
            "np": np.random.rand(2),
            "np_int": np.random.randint(0, 1 << 30, size=2),
            "torch": base + torch.rand(3),
            "torch_int": torch.randint(0, 1 << 30, (2,)),
            "normal": torch.randn(2),
        }


class VaryingBatchSampler(Sampler):
    """Batches of the given sizes over range(n) in order (a batch larger than the first one
    must still be delivered whole and right)."""

    def __init__(self, n, sizes):
        self.n = n
        self.sizes = list(sizes)

    def _batches(self):
        out, start = [], 0
        while start < self.n:
            size = self.sizes[len(out) % len(self.sizes)]
            out.append(list(range(start, min(start + size, self.n))))
            start += size
        return out

    def __iter__(self):
        return iter(self._batches())

    def __len__(self):
        return len(self._batches())


class EpochRandomSampler(Sampler):
    """A sampler with set_epoch whose permutation depends on (seed, epoch) only, like
    DistributedSampler without a process group; records set_epoch calls."""

    def __init__(self, n, seed=0):
        self.n = n
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 1000 + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self):
        return self.n


class FailingEpochSampler(EpochRandomSampler):
    """EpochRandomSampler whose iteration raises in epoch `bad`."""

    def __init__(self, n, bad):
        super().__init__(n)
        self.bad = bad

    def __iter__(self):
        if self.epoch == self.bad:
            raise ValueError(f"no epoch {self.epoch} here")
        return super().__iter__()


class WhoMap(SizedMap):
    """Sample i = {"i": i, "wid": id of the worker that fetched it (-1 in the main process)}."""

    n = 12

    def __getitem__(self, i):
        wid, _, _ = _worker_fields()
        return {"i": i, "wid": wid}


def late_worker_init_fn(worker_id):
    """Worker 1 starts late (0.4 s): meanwhile the other workers run the first batches alone."""
    if worker_id == 1:
        time.sleep(0.4)


# --------------------------------------------------------------------------- failures and cleanup
class Images(SizedMap):
    """Small deterministic uint8 'images'."""

    def __init__(self, n, shape=(3, 8, 8)):
        super().__init__(n)
        self.shape = shape

    def __getitem__(self, i):
        return torch.full(self.shape, i % 251, dtype=torch.uint8)


class Buckets(Sampler):
    """A bucketing batch sampler's batches: 2 to 60 samples, a large one before a larger one."""

    def __init__(self, sizes=(2, 40, 4, 60, 2, 60, 8, 1)):
        self.sizes = sizes

    def __len__(self):
        return len(self.sizes)

    def __iter__(self):
        start = 0
        for n in self.sizes:
            yield list(range(start, start + n))
            start += n


class WorkerTempDirs(Images):
    """An image and the path of its worker's multiprocessing temp dir, which the
    worker makes as torch's fd sharing does."""

    def __getitem__(self, i):
        return super().__getitem__(i), multiprocessing.util.get_temp_dir()


class Failing(SizedMap):
    """Sample i = i; sample `bad` raises a ValueError."""

    def __init__(self, n, bad):
        super().__init__(n)
        self.bad = bad

    def __getitem__(self, i):
        if i == self.bad:
            raise ValueError(f"sample {i} is broken")
        return i


class Dying(SizedMap):
    """Its worker dies at sample `at`: by `signum`, or os._exit(code) for 0.  With `linger`,
    it first closes every file it has (its pipes to the main process break) and dies that
    many seconds later, as a loaded machine's forkserver can report a worker's exit later
    than its pipes broke."""

    def __init__(self, n, at, signum, code=1, linger=0.0):
        super().__init__(n)
        self.at = at
        self.signum = signum
        self.code = code
        self.linger = linger

    def __getitem__(self, i):
        if i == self.at:
            if self.linger:
                os.closerange(3, os.sysconf("SC_OPEN_MAX"))
                time.sleep(self.linger)
            if self.signum:
                os.kill(os.getpid(), self.signum)
                time.sleep(5)
            os._exit(self.code)
        return i


class Sleepy(SizedMap):
    """Sample i = i, each after `seconds` of sleep."""

    def __init__(self, n, seconds):
        super().__init__(n)
        self.seconds = seconds

    def __getitem__(self, i):
        time.sleep(self.seconds)
        return i


class Rows(SizedMap):
    """Samples a raw row copy must not be used for: `kind` picks which."""

    def __init__(self, n, kind):
        super().__init__(n)
        self.kind = kind

    def __getitem__(self, i):
        base = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) + i
        if self.kind == "transposed":
            return base.transpose(0, 2)
        if self.kind == "conj":
            return torch.complex(base, -base).conj()
        if self.kind == "grad":
            return base.requires_grad_()
        if self.kind == "mixed_dtype":
            return base.double() if i % 2 else base
        if self.kind == "mixed_shape":
            return base if i % 3 else base[:1]
        return base


# --------------------------------------------------------------------------- faults that fire once
# For tests/helpers/kill_driver.py.  The first process to create `stamp` (O_EXCL) fires the
# fault, after writing "<time.monotonic()> <pid>" there; every later call, in any process, does
# not.  So the fault is transient (one bad read, one OOM kill) and the next epoch, with fresh or
# persistent workers, must work.  time.monotonic() is CLOCK_MONOTONIC, the same clock in every
# process, so the main process can measure how long after the fault its error came.
def _fire_once(stamp):
    try:
        fd = os.open(stamp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return False
    try:
        os.write(fd, f"{time.monotonic()!r} {os.getpid()}\n".encode())
    finally:
        os.close(fd)
    return True


class FaultOnce(SizedMap):
    """Ints 0..n-1; loading sample `at` fails once, by `how`: "sigkill",
    "sigsegv" (a real segfault: a read at address 0), "exit" (os._exit(1)) or
    "raise" (ValueError)."""

    def __init__(self, n, at, how, stamp):
        super().__init__(n)
        self.at = at
        self.how = how
        self.stamp = stamp

    def __getitem__(self, i):
        if i == self.at and _fire_once(self.stamp):
            if self.how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(10)
            elif self.how == "sigsegv":
                import ctypes

                ctypes.string_at(0)
                time.sleep(10)
            elif self.how == "exit":
                os._exit(1)
            raise ValueError(f"sample {i} is broken (FaultOnce)")
        return i


class InitFailsOnce:
    """A worker_init_fn: worker `worker_id` raises LookupError, once."""

    def __init__(self, worker_id, stamp):
        self.worker_id = worker_id
        self.stamp = stamp

    def __call__(self, worker_id):
        if worker_id == self.worker_id and _fire_once(self.stamp):
            raise LookupError(f"worker_init_fn failed in worker {worker_id} (InitFailsOnce)")


class StreamFailsOnce(IterableDataset):
    """Ints 0..n-1 sharded by get_worker_info(); __iter__ of worker
    `bad_worker` raises KeyError once, before returning an iterator."""

    def __init__(self, n, bad_worker, stamp):
        self.n = n
        self.bad_worker = bad_worker
        self.stamp = stamp

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        if wid == self.bad_worker and _fire_once(self.stamp):
            raise KeyError(f"__iter__ failed in worker {wid} (StreamFailsOnce)")
        return iter(range(wid, self.n, nw))


class PickleCounted(SizedMap):
    """Counts, in the process that pickles it, how often it was pickled; holds
    what multiprocessing sends by fd (a tensor's shared storage, a SharedList,
    a Lock) beside a plain list, and gives samples read from all of them."""

    pickled = 0

    def __init__(self, n=32):
        import multiprocessing

        import shmloader

        super().__init__(n)
        self.table = torch.arange(float(n))
        self.index = [(f"/data/{i}.jpg", i % 5) for i in range(n)]
        self.shared = shmloader.SharedList(self.index)
        self.lock = multiprocessing.get_context("spawn").Lock()

    def __getstate__(self):
        type(self).pickled += 1
        return self.__dict__

    def __getitem__(self, i):
        with self.lock:
            return self.table[i] + self.index[i][1] + self.shared[i][1]


class EnvironMark(SizedMap):
    """Each sample: SHMLOADER_TEST_MARK in the worker's environment, as an int (-1 unset)."""

    def __getitem__(self, i):
        return int(os.environ.get("SHMLOADER_TEST_MARK", "-1"))


class ParentPid(SizedMap):
    """Each sample: the pid of the process that forked the worker."""

    def __getitem__(self, i):
        return os.getppid()
