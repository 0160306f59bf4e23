"""SharedList: a dataset index in one memfd segment.  What it holds and gives back, that it
behaves as a list, that every start method and both loaders send its segment rather than
its entries, that a worker reading it neither copies it nor maps pages it did not read,
and that its memory goes with the last process that holds it."""

import collections
import copy
import enum
import fcntl
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shmloader
from shmloader import SharedList, shared_list
from tests.helpers import ROOT
from tests.helpers.procs import alive, preload_library, wait_until

CONTEXTS = ["fork", "spawn", "forkserver"]
LOADERS = {"torch": torch.utils.data.DataLoader, "shmloader": shmloader.DataLoader}
SEGMENT_NAME = "/memfd:shmloader-list"


def same(a, b) -> bool:
    """Equal and of the same type, recursively; floats by repr (-0.0 and nan too)."""
    if type(a) is not type(b):
        return False
    if type(a) is tuple:
        return len(a) == len(b) and all(map(same, a, b))
    return repr(a) == repr(b)


def segments_of(pid="self") -> set:
    """Inodes of the SharedList segments process `pid` holds, by fd or by mapping."""
    found = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # the process is gone
        return found
    for fd in fds:
        try:  # (an fd closed meanwhile: listdir's own, for one)
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(SEGMENT_NAME):
                found.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
        except OSError:
            continue
    try:
        with open(f"/proc/{pid}/maps") as f:
            found.update(int(line.split()[4]) for line in f if SEGMENT_NAME in line)
    except OSError:  # the process is gone
        pass
    return found


def segment_of(entries: SharedList) -> int:
    return os.fstat(entries._fd).st_ino


def uss_bytes() -> int:
    """This process's unique set size: the pages no other process maps."""
    with open("/proc/self/smaps_rollup") as f:
        fields = dict(line.split(":", 1) for line in f.read().splitlines()[1:])
    return sum(int(fields[name].split()[0]) * 1024 for name in ("Private_Clean", "Private_Dirty"))


class IndexDataset(torch.utils.data.Dataset):
    """An ImageFolder without the images: __getitem__ unpacks one (path, label) entry,
    and says which SharedList segments the process reading it maps."""

    def __init__(self, samples):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        path, label = self.samples[index]
        return path, label, sorted(segments_of())


EVERY_TYPE = [
    "",
    "path/to/n01440764_10026.JPEG",
    "é字😀",
    "\udcff-undecodable-name",  # os.fsdecode's
    b"",
    b"\x00\xff raw",
    0,
    7,
    -1,
    2**63,
    -(2**100),
    True,
    False,
    0.0,
    -0.0,
    1.5,
    1e308,
    float("inf"),
    float("-inf"),
    float("nan"),
    None,
    (),
    ("img.jpg", 3),
    ("a", b"b", 1, 2.5, None, True),
    (("nested", (1, ())), None),
]


def test_entries_of_every_type_come_back_equal_and_of_their_type():
    entries = SharedList(EVERY_TYPE)
    assert len(entries) == len(EVERY_TYPE)
    for i, entry in enumerate(EVERY_TYPE):
        assert same(entries[i], entry), (i, entries[i], entry)
    assert all(map(same, entries, EVERY_TYPE))  # iteration decodes them alike


@pytest.mark.parametrize("chunk", [1, 3, 1 << 16])
def test_lists_longer_than_a_chunk_are_stored_and_read_whole(chunk):
    """Entries are encoded, iterated and compared a chunk at a time: each chunk's offsets
    must continue from the last one's."""
    entries = [(f"img/{i}.jpg", i) if i % 4 else None for i in range(10)]
    with mock.patch.object(shared_list, "_CHUNK", chunk):
        shared = SharedList(entries)
        assert [shared[i] for i in range(10)] == entries
        assert list(shared) == entries and shared[2:9] == entries[2:9] and shared == entries
        assert shared.index((f"img/{9}.jpg", 9), 4) == 9 and shared.count(None) == 3


def test_subclasses_come_back_as_their_base_types():
    Sample = collections.namedtuple("Sample", "path label")

    class Path(str):
        pass

    class Label(enum.IntEnum):
        CAT = 3

    entries = SharedList([Sample(Path("a.jpg"), Label.CAT), np.float64(0.5), (np.str_("b"),)])
    assert same(entries[0], ("a.jpg", 3)) and same(entries[1], 0.5) and same(entries[2], ("b",))


@pytest.mark.parametrize(
    "bad, name",
    [
        ([1, 2], "list"),
        ({"a": 1}, "dict"),
        ({1}, "set"),
        (bytearray(b"x"), "bytearray"),
        (np.int64(3), "numpy.int64"),
        (Path("a.jpg"), f"{Path.__module__}.PosixPath"),  # (pathlib._local on 3.13)
        (1j, "complex"),
        (np.zeros(2), "numpy.ndarray"),
    ],
)
@pytest.mark.parametrize("where", [0, 5])
def test_an_unsupported_type_is_a_type_error_naming_the_first_entry_that_holds_one(
    bad, name, where
):
    entries = [("ok.jpg", 1)] * 10
    entries[where] = ("bad.jpg", bad)
    entries[where + 2] = [1, 2]  # a later one is not named
    with mock.patch.object(shared_list, "_CHUNK", 4), pytest.raises(TypeError) as error:
        SharedList(entries)
    message = str(error.value)
    assert f"entry {where}, ('bad.jpg', " in message and f"it holds a {name} " in message, message
    assert "str, bytes, int, float, bool, None and tuples of them" in message, message


scalars = (
    st.text() | st.binary() | st.integers() | st.floats(allow_nan=False) | st.booleans() | st.none()
)
entry_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3).map(tuple), max_leaves=6
)


@settings(deadline=None)  # no timing in tests: a loaded machine may take any time
@given(
    entries=st.lists(entry_values, max_size=12),
    positions=st.lists(st.integers(-14, 14), max_size=6),
    slices=st.lists(
        st.tuples(
            st.none() | st.integers(-14, 14),
            st.none() | st.integers(-14, 14),
            st.none() | st.integers(-4, 4).filter(bool),
        ),
        max_size=4,
    ),
    probe=entry_values,
    window=st.tuples(st.integers(-14, 14), st.integers(-14, 14)),
)
def test_it_answers_as_the_list_it_was_built_from(entries, positions, slices, probe, window):
    with mock.patch.object(shared_list, "_CHUNK", 3):  # several chunks in a short list
        shared = SharedList(entries)
        assert len(shared) == len(entries) and shared == entries and entries == shared
        assert list(shared) == entries and list(reversed(shared)) == entries[::-1]
        for i in positions:
            if -len(entries) <= i < len(entries):
                assert same(shared[i], entries[i])
            else:
                with pytest.raises(IndexError, match="SharedList index out of range"):
                    shared[i]
        for start, stop, step in slices:
            got = shared[start:stop:step]
            assert type(got) is list and all(map(same, got, entries[start:stop:step]))
            assert len(got) == len(entries[start:stop:step])
        for value in (probe, *entries[:2]):
            assert (value in shared) == (value in entries)
            assert shared.count(value) == entries.count(value)
            try:
                want = entries.index(value, *window)
            except ValueError:
                with pytest.raises(ValueError, match="is not in SharedList"):
                    shared.index(value, *window)
            else:
                assert shared.index(value, *window) == want


def test_integers_of_other_types_index_it_and_other_indices_are_a_type_error():
    shared = SharedList(["a", "b", "c"])
    assert shared[np.int64(1)] == shared[torch.tensor(1)] == shared[True] == "b"
    for index in ("1", 1.0, None):
        with pytest.raises(TypeError, match="SharedList indices must be integers or slices"):
            shared[index]


def test_equal_to_lists_of_equal_entries_only_and_unhashable_as_a_list():
    shared = SharedList([("a", 1), ("b", 2)])
    assert shared == [("a", 1), ("b", 2)] == shared and shared == SharedList(shared)
    assert shared != [("a", 1), ("b", 3)] and shared != [("a", 1)]
    assert shared != (("a", 1), ("b", 2))  # as a list is not equal to a tuple
    with pytest.raises(TypeError, match="unhashable"):
        hash(shared)
    assert repr(shared) == "SharedList([('a', 1), ('b', 2)])"
    assert repr(SharedList(range(5))) == "SharedList([0, 1, 2, ... 2 more])"


def test_an_empty_list_and_a_generator():
    empty = SharedList()
    assert len(empty) == 0 and list(empty) == [] and empty == [] and empty[:] == []
    with pytest.raises(IndexError):
        empty[0]
    assert SharedList(f"{i}.jpg" for i in range(3)) == ["0.jpg", "1.jpg", "2.jpg"]


class _Overstated:
    """A sized iterable whose len() says more than it gives."""

    def __len__(self):
        return 10

    def __iter__(self):
        return iter(range(7))


def test_entries_fewer_than_their_len_are_an_error_not_a_list_with_holes():
    with (
        mock.patch.object(shared_list, "_CHUNK", 4),
        pytest.raises(ValueError, match=r"len\(\) is 10, but iterating them gave 7"),
    ):
        SharedList(_Overstated())


def test_no_process_can_change_the_entries():
    shared = SharedList([("a.jpg", 1)])
    with pytest.raises(TypeError):
        shared[0] = ("b.jpg", 2)
    seals = fcntl.fcntl(shared._fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_WRITE and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
    with pytest.raises(PermissionError):
        os.pwrite(shared._fd, b"x", 40)
    assert shared[0] == ("a.jpg", 1)


def test_a_copy_is_itself_and_plain_pickle_carries_the_entries_into_a_segment_of_its_own():
    shared = SharedList([("a.jpg", 1), ("b.jpg", 2)])
    assert copy.copy(shared) is shared and copy.deepcopy([shared])[0] is shared
    assert segment_of(SharedList(shared)) == segment_of(shared)  # immutable: shared again
    loaded = pickle.loads(pickle.dumps(shared))
    assert type(loaded) is SharedList and loaded == shared
    assert segment_of(loaded) != segment_of(shared)


@pytest.mark.one_mode  # names its start method; the SharedList's segment, not the ring
@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("loader", LOADERS)
def test_workers_of_either_loader_read_the_segment_itself_under_every_start_method(loader, context):
    """One line changes the dataset; the loader is torch's or shmloader's, its workers
    started by any method: they map the main process's segment, never a copy."""
    entries = [(f"train/{i % 3}/{i}.JPEG", i % 3) for i in range(24)]
    data = IndexDataset(SharedList(entries))
    mine = segments_of()
    batches = list(
        LOADERS[loader](data, batch_size=None, num_workers=2, multiprocessing_context=context)
    )
    assert [(path, label) for path, label, _ in batches] == entries
    for _, _, mapped in batches:
        assert segment_of(data.samples) in mapped and set(mapped) <= mine, (mapped, mine)


def _receive(queue, results):
    entries = queue.get()
    results.put((list(entries), sorted(segments_of())))


@pytest.mark.one_mode  # names its start method; no loader
@pytest.mark.parametrize("context", CONTEXTS)
def test_a_queue_to_a_running_process_sends_the_segment(context):
    """Outside a process start multiprocessing passes the fd through its resource sharer,
    as torch's file_descriptor strategy passes a tensor's."""
    ctx = multiprocessing.get_context(context)
    queue, results = ctx.Queue(), ctx.Queue()
    process = ctx.Process(target=_receive, args=(queue, results))
    process.start()
    shared = SharedList([("a.jpg", 1), ("b.jpg", 2)])
    queue.put(shared)
    got, mapped = results.get(timeout=120)
    process.join(60)
    assert got == [("a.jpg", 1), ("b.jpg", 2)] and segment_of(shared) in mapped


def _read_all(entries, results):
    """What a worker does over a shuffled epoch: each entry once, unpacked."""
    before = uss_bytes()
    for i in range(len(entries)):
        _path, _label = entries[i]
    results.put(uss_bytes() - before)


def _growth_of_a_forked_reader(entries) -> int:
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    process = ctx.Process(target=_read_all, args=(entries, results))
    process.start()
    growth = results.get(timeout=120)
    process.join(60)
    return growth


def test_a_forked_worker_reading_every_entry_copies_nothing():
    """pytorch issue 13246: reading a list's entries writes their reference counts, so a
    forked reader copies the pages that hold them; reading a SharedList's copies none."""
    count = 200_000
    entries = [(f"/data/train/n{i // 1000:08d}/{i}.JPEG", i // 1000) for i in range(count)]
    list_growth = _growth_of_a_forked_reader(entries)
    shared = SharedList(entries)
    del entries
    shared_growth = _growth_of_a_forked_reader(shared)
    assert list_growth > 10 << 20, list_growth  # (the measure sees the copy)
    assert shared_growth < 2 << 20, shared_growth


def _mapped_after_reading_one(entries, results):
    entries[len(entries) // 2]
    address = np.frombuffer(entries._map, dtype=np.uint8).ctypes.data
    with open("/proc/self/smaps") as f:
        blocks = f.read().split("\n")
    for i, line in enumerate(blocks):
        start = line.split("-", 1)[0]
        if SEGMENT_NAME in line and int(start, 16) == address:
            rss = next(b for b in blocks[i + 1 :] if b.startswith("Rss:"))
            results.put(int(rss.split()[1]) * 1024)
            return
    results.put(None)


def test_a_spawned_worker_maps_only_the_pages_it_reads():
    """Reading one entry touches the header, one page of offsets and one or two of data;
    the kernel maps up to 16 pages about each (fault-around: neighbours already in
    memory, which cost none), not the 10 MB the segment takes."""
    shared = SharedList(f"/data/train/{i:09d}.JPEG" for i in range(400_000))
    assert shared.nbytes > 10 << 20
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    process = ctx.Process(target=_mapped_after_reading_one, args=(shared, results))
    process.start()
    resident = results.get(timeout=120)
    process.join(60)
    assert resident is not None and resident <= 4 * 16 * os.sysconf("SC_PAGESIZE"), resident


KILLED_SCRIPT = """
import sys, time
import torch
import shmloader
from shmloader import SharedList
from tests.unit.test_shared_list import IndexDataset

if __name__ == "__main__":
    Loader = shmloader.DataLoader if sys.argv[1] == "shmloader" else torch.utils.data.DataLoader
    data = IndexDataset(SharedList((f"train/{i}.JPEG", i % 10) for i in range(100_000)))
    # (fork: under forkserver torch's workers take the server for the main process,
    # and outlive a SIGKILL of it by as long as the server lives)
    it = iter(Loader(data, batch_size=None, num_workers=2, shuffle=True, multiprocessing_context="fork"))
    next(it)
    workers = it._pool.pids if hasattr(it, "_pool") else [w.pid for w in it._workers]
    print("iterating", *workers, flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("loader", LOADERS)
def test_nothing_is_left_after_the_main_process_is_killed_while_iterating(loader):
    """SIGKILL of the training process mid-epoch: its workers exit (torch's within its
    5 s watchdog) and no process keeps the segment (memory held only by fds and
    mappings goes with the last of them)."""
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_SCRIPT, loader], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        said, *pids = child.stdout.readline().split()
        assert said == "iterating"
        segment = segments_of(child.pid)
        workers = [int(p) for p in pids]  # (a forkserver's children, under it)
        assert len(segment) == 1 and len(workers) >= 2, (segment, workers)
        wait_until(
            lambda: all(segments_of(p) == segment for p in workers),
            60,
            "every worker holds the segment",
        )
        child.send_signal(signal.SIGKILL)
        child.wait(60)
        wait_until(lambda: not any(alive(p) for p in workers), 60, "the workers exited")
        holders = [p for p in os.listdir("/proc") if p.isdigit() and segments_of(p) & segment]
        assert holders == [], f"processes {holders} keep the killed loader's SharedList alive"
    finally:
        child.kill()
        child.wait()


@pytest.fixture(scope="module")
def memfd_refused(tmp_path_factory):
    """A library under which memfd_create fails, as a seccomp filter or a kernel older
    than 3.17 makes it fail."""
    return preload_library(
        tmp_path_factory.mktemp("preload"),
        "no_memfd",
        "#include <errno.h>\n"
        "int memfd_create(const char *name, unsigned int flags) "
        "{ errno = ENOSYS; return -1; }\n",
    )


FALLBACK_SCRIPT = """
import os
from shmloader import SharedList
entries = [(f"{i}.jpg", i) for i in range(1000)]
shared = SharedList(entries)
assert shared == entries
print(os.readlink(f"/proc/self/fd/{shared._fd}"))
"""


def test_where_memfd_create_is_refused_the_segment_is_an_unnamed_file_in_dev_shm(memfd_refused):
    before = set(os.listdir("/dev/shm"))
    done = subprocess.run(
        [sys.executable, "-c", FALLBACK_SCRIPT],
        cwd=ROOT,
        text=True,
        check=False,
        capture_output=True,
        env={**os.environ, "LD_PRELOAD": memfd_refused},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    link = done.stdout.strip()
    assert link.startswith("/dev/shm/") and link.endswith("(deleted)"), link
    # Nothing left behind (other processes' semaphores and torch's files come and go).
    theirs = ("sem.", "torch_")
    assert {n for n in os.listdir("/dev/shm") if not n.startswith(theirs)} <= before


SHORT_SCRIPT = """
from shmloader import SharedList, SharedMemoryError
try:
    SharedList(f"{i:020d}.jpg" for i in range(100_000))
except SharedMemoryError as e:
    print(e)
"""


def test_memory_running_out_is_a_shared_memory_error_saying_what_to_do(memfd_refused):
    """Where memfd_create is refused the segment lives in /dev/shm: a 1 MB one runs out."""
    setup = "mount -t tmpfs -o size=1m tmpfs /dev/shm"
    if subprocess.run(
        ["unshare", "-m", "sh", "-c", setup], capture_output=True, check=False
    ).returncode:
        pytest.skip("needs `unshare -m` and mount (root) for a private /dev/shm")
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", f'{setup} && exec {sys.executable} -c "$0"', SHORT_SCRIPT],
        cwd=ROOT,
        text=True,
        capture_output=True,
        check=False,
        env={**os.environ, "LD_PRELOAD": memfd_refused},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(
        "SharedList ran out of shared memory (No space left on device) after writing "
    ), done.stdout
    assert "size of /dev/shm" in done.stdout, done.stdout
