"""fetch="sample" (with assignment="interleaved" and "dynamic"): workers fetch single samples and
write each into its row of a shared batch slot.  Batches and their order must be exactly torch's
DataLoader's (and fetch="batch"'s); a sample that breaks the layout the first sample fixed is that
batch's error; bad combinations are ValueErrors at construction; a dead worker is a prompt
WorkerDied and leaves nothing behind.

Scenarios run the same dataset through torch's DataLoader and through shmloader.DataLoader with
the test_equivalence harness (same seeds, fresh generators per run, every batch kept alive,
main-process RNG state and warnings compared).  Datasets here never depend on which worker
fetched a sample: with fetch="sample" that differs from torch by design.
"""

import functools
import gc
import math
import os
import re
import signal

import pytest
import torch
import torch.utils.data as tud

from shmloader import DataLoader as ShmDataLoader
from shmloader import SampleLayoutError, WorkerDied
from tests.equivalence.test_equivalence import (
    SEED,
    Fresh,
    assert_results_same,
    each_next,
    gen,
    run,
    seed_all,
)
from tests.helpers import datasets as D
from tests.helpers.datasets import Dying, Images, Sleepy
from tests.helpers.procs import deadline, forget, our_segments, own_children, wait_gone

# Tests whose datasets or collate functions are defined in the test (local):
# they reach workers only by fork, whatever the default start method.
LOCAL_OBJECTS = "fork"

TorchDataLoader = tud.DataLoader
P = functools.partial
ASSIGNMENTS = ["interleaved", "dynamic"]
# A worker's death must show within this long, else the test fails as hung (a hang bound, not a
# speed check: docs/design.md asks for about a second).  Generous: the bounded span includes
# starting the workers and fetching batches, on a loaded 2-core machine too; processes
# that should be gone are polled for as long.
HANG_S = 60.0


def sample_loader(assignment, **extra):
    return P(ShmDataLoader, fetch="sample", assignment=assignment, **extra)


# --------------------------------------------------------------------------- equivalence grid
W2 = dict(num_workers=2)
W3 = dict(num_workers=3)

SCENARIOS = {
    # partial last batch kept (10 = 4 + 4 + 2), many leaf kinds and containers
    "numeric-bs4-w2": (P(D.NumericMap, 10), dict(batch_size=4, **W2)),
    "numeric-bs3-droplast-w3": (P(D.NumericMap, 11), dict(batch_size=3, drop_last=True, **W3)),
    "numeric-bs3-keeplast-w3": (P(D.NumericMap, 11), dict(batch_size=3, drop_last=False, **W3)),
    "numeric-bs4-w1": (P(D.NumericMap, 9), dict(batch_size=4, num_workers=1)),
    "numeric-shuffle-generator-w2": (
        P(D.NumericMap, 10),
        dict(batch_size=4, shuffle=True, generator=gen(5), epochs=2, **W2),
    ),
    "index-shuffle-global-rng-w1": (
        P(D.IndexMap, 13),
        dict(batch_size=4, shuffle=True, epochs=2, num_workers=1),
    ),
    "bare-int-w3": (P(D.ScalarMap, 11), dict(batch_size=4, **W3)),
    "bare-noncontiguous-tensor-w2": (P(D.TensorMap, 9), dict(batch_size=4, **W2)),
    # Regression (fixed): batch_size=1 raises OSError [Errno 22] "starting rows of slot 0 (must be
    # CLAIMED, 0 <= first_row < nrows)": the probed first sample is row 0 of a 1-row batch, so
    # _dispatch calls rows_begin(first_row=1, nrows=1).  Same for any first batch of size 1
    # (see test_first_batch_of_one_sample below).
    "bs1-w2": (P(D.NumericMap, 5), dict(batch_size=1, **W2)),
    "bs-larger-than-dataset-w2": (P(D.IndexMap, 3), dict(batch_size=8, **W2)),
    "bs-larger-than-dataset-droplast-w2": (
        P(D.IndexMap, 3),
        dict(batch_size=8, drop_last=True, **W2),
    ),
    "prefetch1-w2": (P(D.IndexMap, 12), dict(batch_size=2, prefetch_factor=1, **W2)),
    "sampler-list-repeats-w2": (
        P(D.IndexMap, 10),
        dict(batch_size=3, sampler=[7, 3, 3, 0, 9, 9, 1], **W2),
    ),
    "sampler-random-replacement-generator-w2": (
        P(D.IndexMap, 10),
        dict(
            batch_size=4,
            sampler=Fresh(
                lambda: tud.RandomSampler(
                    range(10),
                    replacement=True,
                    num_samples=15,
                    generator=torch.Generator().manual_seed(4),
                )
            ),
            epochs=2,
            **W2,
        ),
    ),
    # custom batch samplers: batches larger than the first one (which fixed the rows of a slot)
    # must still be delivered whole and right, and smaller ones too
    "batch-sampler-growing-w2": (
        P(D.NumericMap, 14),
        dict(batch_sampler=D.VaryingBatchSampler(14, [2, 5, 1, 3]), **W2),
    ),
    "batch-sampler-shrinking-w3": (
        P(D.NumericMap, 14),
        dict(batch_sampler=D.VaryingBatchSampler(14, [5, 2, 1, 6]), **W3),
    ),
    "batch-sampler-lists-w2": (
        P(D.IndexMap, 20),
        dict(batch_sampler=[[3, 0], [1, 2, 4, 5, 6, 13], [19], [7, 8, 9, 10, 11]], **W2),
    ),
    "batch-sampler-iterators-w2": (
        P(D.IndexMap, 12),
        dict(batch_sampler=D.IteratorBatchSampler(), **W2),
    ),
    "batch-sampler-varying-w1": (
        P(D.IndexMap, 10),
        dict(batch_sampler=D.VaryingBatchSampler(10, [2, 3, 1]), num_workers=1),
    ),
    # persistent workers over several epochs (the layout and ring are kept, rows rewritten)
    "persistent-numeric-3ep-w2": (
        P(D.NumericMap, 10),
        dict(batch_size=3, shuffle=True, generator=gen(9), persistent_workers=True, epochs=3, **W2),
    ),
    "persistent-index-3ep-w3": (
        P(D.IndexMap, 14),
        dict(batch_size=4, shuffle=True, persistent_workers=True, epochs=3, **W3),
    ),
    "persistent-batch-sampler-2ep-w2": (
        P(D.IndexMap, 12),
        dict(
            batch_sampler=D.VaryingBatchSampler(12, [2, 4, 1]),
            persistent_workers=True,
            epochs=2,
            **W2,
        ),
    ),
    "nonpersistent-2ep-w2": (
        P(D.NumericMap, 7),
        dict(batch_size=3, shuffle=True, generator=gen(2), epochs=2, **W2),
    ),
    # torch's Subset and StackDataset have __getitems__, which only passes a batch on to
    # datasets of theirs that have one: over plain datasets, sample by sample is the same
    "subset-w2": (
        lambda: tud.Subset(D.NumericMap(12), [11, 0, 5, 3, 7, 2, 9]),
        dict(batch_size=3, **W2),
    ),
    "stack-dataset-w2": (
        lambda: tud.StackDataset(a=D.IndexMap(9), b=D.NumericMap(9)),
        dict(batch_size=4, **W2),
    ),
    # num_workers=0 is torch's own path whatever fetch says
    "w0": (P(D.NumericMap, 7), dict(batch_size=3, shuffle=True, generator=gen(1))),
}


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_same_output_as_torch(name, assignment):
    make_dataset, kw = SCENARIOS[name]
    t = run(TorchDataLoader, make_dataset, **kw)
    s = run(sample_loader(assignment), make_dataset, **kw)
    assert_results_same(t, s)


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
@pytest.mark.parametrize(
    "make_dataset, kw",
    [
        pytest.param(P(D.JitterMap, 20), dict(batch_size=2, **W2), id="jitter-w2"),
        pytest.param(
            P(D.IndexMap, 14),
            dict(
                batch_size=3,
                shuffle=True,
                generator=gen(3),
                persistent_workers=True,
                epochs=2,
                **W3,
            ),
            id="shuffle-persistent-w3",
        ),
    ],
)
def test_in_order_false_same_multiset(make_dataset, kw, assignment):
    t = run(TorchDataLoader, make_dataset, in_order=False, **kw)
    s = run(sample_loader(assignment), make_dataset, in_order=False, **kw)
    assert_results_same(t, s, ordered=False)


@pytest.mark.slow
def test_spawn_context_same_output():
    kw = dict(
        batch_size=4,
        shuffle=True,
        generator=gen(3),
        num_workers=2,
        persistent_workers=True,
        epochs=2,
    )
    # Torch's batches do not depend on the start method for this dataset: fork keeps it cheap.
    t = run(TorchDataLoader, P(D.NumericMap, 7), **kw)
    s = run(sample_loader("interleaved"), P(D.NumericMap, 7), multiprocessing_context="spawn", **kw)
    # Python 3.12+ warns at each fork() of a multi-threaded process: a warning of torch's
    # start method here, not of its loader.
    t = t._replace(warnings=[w for w in t.warnings if "use of fork()" not in w[1]])
    assert_results_same(t, s)


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_same_as_fetch_batch(assignment):
    kw = dict(batch_size=3, shuffle=True, generator=gen(4), num_workers=2, epochs=2)
    b = run(ShmDataLoader, P(D.NumericMap, 8), **kw)
    s = run(sample_loader(assignment), P(D.NumericMap, 8), **kw)
    assert_results_same(b, s)


def test_rows_are_written_in_place_not_collated_by_one_worker():
    """The batches really are assembled from samples fetched by several workers: with
    "interleaved", the sample at epoch position p is fetched by worker p % num_workers
    (fetch="batch" gives every sample of batch k to worker k % num_workers)."""
    nw, bs = 3, 4
    seed_all(SEED)
    sample = list(
        ShmDataLoader(
            D.WhoMap(14),
            batch_size=bs,
            shuffle=True,
            num_workers=nw,
            fetch="sample",
            assignment="interleaved",
        )
    )
    positions = [(p, int(w)) for p, w in enumerate(torch.cat([b["wid"] for b in sample]).tolist())]
    assert [w for _, w in positions] == [p % nw for p, _ in positions]
    seed_all(SEED)
    batch = list(ShmDataLoader(D.WhoMap(14), batch_size=bs, shuffle=True, num_workers=nw))
    assert [b["wid"].tolist() for b in batch] == [
        [k % nw] * len(b["i"]) for k, b in enumerate(batch)
    ]
    # the same samples in the same order either way
    assert [b["i"].tolist() for b in sample] == [b["i"].tolist() for b in batch]


def test_dynamic_assignment_fetches_every_sample_once():
    seed_all(SEED)
    loader = ShmDataLoader(
        D.WhoMap(30), batch_size=4, num_workers=3, fetch="sample", assignment="dynamic"
    )
    got = list(loader)
    assert torch.cat([b["i"] for b in got]).tolist() == list(range(30))
    assert set(torch.cat([b["wid"] for b in got]).tolist()) <= {0, 1, 2}
    stats = loader.stats()
    assert sum(w.samples for w in stats.workers) == 30


def test_kept_batches_never_change():
    """Rows are written into slots: a batch the user keeps must not be overwritten by later
    batches (list(loader) holds more batches than the ring has slots)."""
    seed_all(SEED)
    loader = ShmDataLoader(
        D.NumericMap(24), batch_size=2, num_workers=2, fetch="sample", persistent_workers=True
    )
    first = list(loader)
    expected = list(tud.DataLoader(D.NumericMap(24), batch_size=2))
    second = list(loader)
    for k, (e, a, b) in enumerate(zip(expected, first, second, strict=True)):
        D.assert_same(e, a, f"epoch0.batch{k}")
        D.assert_same(e, b, f"epoch1.batch{k}")


class _LazyViews(tud.Dataset):
    """Complex samples, as conjugate views (`conj`) and negative views (`neg`) where `lazy`
    holds for the index."""

    def __init__(self, lazy):
        self.lazy = lazy

    def __len__(self):
        return 6

    def __getitem__(self, i):
        z = torch.complex(torch.arange(3.0) + i, torch.arange(3.0) - i)
        if self.lazy(i):
            return {"conj": z.conj(), "neg": z.conj().imag}
        return {"conj": z.conj().resolve_conj(), "neg": z.conj().imag.resolve_neg()}


@pytest.mark.parametrize("lazy", ["all", "not-first-of-batch"])
def test_negative_and_conjugate_views_as_torch_collates_them(lazy):
    """A worker's default_collate makes the batch tensor from the batch's first sample, and
    fails when that is a conjugate or negative view; views elsewhere in a batch are stacked as
    their values."""
    views = _LazyViews((lambda i: True) if lazy == "all" else (lambda i: i % 3 != 0))
    expected = each_next(
        TorchDataLoader(views, batch_size=3, num_workers=2, multiprocessing_context=LOCAL_OBJECTS)
    )
    assert len(expected) == 2
    for assignment in ASSIGNMENTS:
        got = each_next(
            sample_loader(assignment)(
                views, batch_size=3, num_workers=2, multiprocessing_context=LOCAL_OBJECTS
            )
        )
        assert len(got) == 2
        for e, g in zip(expected, got):
            if isinstance(e, tuple):
                assert g[0] is e[0] and g[1] == e[1]
            else:
                D.assert_same(e, g, assignment)


# --------------------------------------------------------------------------- errors in samples
def _exc_summary(e):
    """Type, header with the worker number blanked (which worker fetches a sample differs from
    torch's with fetch="sample", and with "dynamic" from run to run), 'Original Traceback' line
    and the original exception's last line."""
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    header = re.sub(r"worker process \d+", "worker process N", lines[0])
    return type(e), header, lines[1], lines[-1]


def _events(cls, make_dataset, *, epochs=2, **kw):
    """Every batch and every error of `epochs` epochs, continuing after errors like a training
    loop that skips bad batches; a SettableSampler so the last epoch can leave the bad ones out."""
    seed_all(SEED)
    dataset = make_dataset()
    sampler = D.SettableSampler(range(len(dataset)))
    loader = cls(dataset, sampler=sampler, **kw)
    events = []
    for epoch in range(epochs):
        if epoch == epochs - 1 > 0:
            sampler.indices = [i for i in range(len(dataset)) if i not in dataset.bad]
        it = iter(loader)
        for _ in range(3 * len(loader) + 2):  # bounded: re-raising forever must not hang
            try:
                events.append(("batch", next(it)))
            except StopIteration:
                events.append(("stop",))
                break
            except Exception as e:  # noqa: BLE001 - the exception is what we compare
                events.append(("exc",) + _exc_summary(e))
                assert "__getitem__" in str(e), "worker traceback lacks the dataset's frame"
                forget(e)
        del it
        gc.collect()
    return events


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
@pytest.mark.parametrize(
    "bad, exc, persistent",
    [
        pytest.param((3, 8), "KeyError", True, id="two-batches-persistent"),
        pytest.param((0, 5), "ValueError", False, id="first-sample-of-loader"),
        pytest.param((4, 5), "TwoArgError", True, id="two-rows-of-one-batch-persistent"),
    ],
)
@pytest.mark.slow
def test_getitem_error_like_torch(bad, exc, persistent, assignment):
    """A sample raising in __getitem__: same exception type and message as torch, at the same
    batch (the first failing sample of that batch), and the loader goes on with later batches
    and with the next epoch."""
    make = P(D.FailingMap, 12, bad=bad, exc=exc)
    kw = dict(batch_size=4, num_workers=2, persistent_workers=persistent)
    t = _events(TorchDataLoader, make, **kw)
    with deadline(60):
        s = _events(sample_loader(assignment), make, **kw)
    assert any(ev[0] == "exc" for ev in t)
    D.assert_same(t, s, "events")


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
@pytest.mark.parametrize("bad, raises", [(4, 6), (6, 4)], ids=["mismatch-first", "raise-first"])
def test_a_samples_error_wins_over_another_rows_layout_mismatch_like_torch(bad, raises, assignment):
    """torch fetches every sample of a batch before it collates: a sample that raises is the
    batch's error even when an earlier row does not fit the layout."""
    make = P(D.MismatchMap, 12, bad=bad, kind="shape", raises=raises)
    kw = dict(batch_size=4, num_workers=2)
    t = _events(TorchDataLoader, make, epochs=1, **kw)
    with deadline(60):
        s = _events(sample_loader(assignment), make, epochs=1, **kw)
    assert [ev[0] for ev in t].count("exc") == 1
    D.assert_same(t, s, "events")


MISMATCH = {
    # kind: (substrings of the message: field path, the first sample's, this sample's)
    "shape": ("['meta']['box']", "float32 of shape (2,)", "float32 of shape (3,)"),
    "dtype": ("['meta']['box']", "float32 of shape (2,)", "float64 of shape (2,)"),
    "ndim": ("['image']", "float32 of shape (3,)", "float32 of shape (1, 3)"),
    "none": ("['meta']['box']", "a field of a fixed layout", "is a NoneType"),
}


@pytest.mark.parametrize("kind", list(MISMATCH))
@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_layout_mismatch_is_that_batch_error(kind, assignment):
    """A sample whose field differs in shape or dtype from the first sample's: SampleLayoutError
    (a RuntimeError) naming the field, the expected and the actual dtype/shape, as the error of
    the batch holding it; the batches before and after are right."""
    loader = ShmDataLoader(
        D.MismatchMap(12, bad=5, kind=kind),
        batch_size=4,
        num_workers=2,
        fetch="sample",
        assignment=assignment,
    )
    want = list(tud.DataLoader(D.MismatchMap(12, bad=-1), batch_size=4))
    got = []
    it = iter(loader)
    with deadline(60):
        for _ in range(6):
            try:
                got.append(next(it))
            except StopIteration:
                break
            except SampleLayoutError as e:
                got.append(str(e))
                forget(e)
    assert len(got) == 3, got
    D.assert_same(want[0], got[0], "batch0")
    D.assert_same(want[2], got[2], "batch2")
    message = got[1]
    assert isinstance(message, str), "batch 1 holds the bad sample 5 and must be an error"
    assert issubclass(SampleLayoutError, RuntimeError)
    field, expected, actual = MISMATCH[kind]
    for part in (field, expected, actual, "(the sample is dataset[5])"):
        assert part in message, f"{part!r} missing from the error: {message}"
    assert re.search(r"Caught SampleLayoutError in DataLoader worker process \d", message)


STRUCTURE_KINDS = [
    "key-order",
    "other-key",
    "int-vs-list",
    "nesting",
    "tensor-vs-int",
    "namedtuple-vs-tuple",
    "dict-attribute",
    "tensor-subclass",
    "numpy-negative-strides",
    "quantized",
    "bits8",
    "slots-sequence-shrinks",
    "slots-attribute",
    "mangled-slot-attribute",
    "defaultdict-factory",
    "key-types",
]
# Leaves torch cannot batch at all: the same error as torch's, every batch.
TORCH_REFUSES = {"numpy-negative-strides", "quantized", "bits8"}


@pytest.mark.parametrize("kind", STRUCTURE_KINDS)
def test_samples_unlike_the_first_never_give_other_data(kind):
    """The layout is fixed by the loader's first sample; torch collates each batch from its
    own samples. Where they could differ (keys in another order or other keys, other
    containers, nesting or types, container attributes, tensor subclasses), a batch is either
    torch's or a clear error; leaves torch cannot batch fail with torch's own error."""
    dataset = D.StructureMap(kind)
    expected = each_next(TorchDataLoader(dataset, batch_size=2, num_workers=2))
    for assignment in ASSIGNMENTS:
        got = each_next(sample_loader(assignment)(dataset, batch_size=2, num_workers=2))
        assert len(got) == len(expected)
        refused = 0
        for b, (e, g) in enumerate(zip(expected, got)):
            if isinstance(g, tuple) and isinstance(g[0], type):
                if kind in TORCH_REFUSES:
                    assert g == e, f"batch {b}: {g} where torch raised {e}"
                else:
                    assert g[0] is SampleLayoutError or g == e, f"batch {b}: {g}"
                refused += 1
            else:
                assert not (isinstance(e, tuple) and isinstance(e[0], type)), (
                    f"batch {b}: a batch where torch raised {e}"
                )
                D.assert_same(e, g, f"{assignment} batch {b}")
        assert refused, "every sample fit the first one's layout: the case tests nothing"


class _SubclassSamples(tud.Dataset):
    """Every sample a tensor subclass, as torchvision's v2 transforms return tv_tensors."""

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return torch.full((2,), float(index)).as_subclass(D.TensorSub)


def test_a_first_sample_of_a_tensor_subclass_is_refused_saying_what_to_return():
    """The loader's first sample fixes the layout: a subclass there is refused with the
    remedy (plain tensors, torchvision's ToPureTensor), not a claim about torch's collate
    that holds for some subclasses only (torch's batch of tv_tensors is a plain tensor)."""
    loader = ShmDataLoader(_SubclassSamples(), batch_size=2, num_workers=2, fetch="sample")
    with pytest.raises(SampleLayoutError, match=r"TensorSub \(a torch.Tensor subclass\)") as caught:
        next(iter(loader))
    assert "fetch='batch', or return plain tensors" in str(caught.value)
    assert "ToPureTensor()" in str(caught.value)


@pytest.mark.parametrize(
    "kind",
    [
        "same-attribute-numpy",
        "same-attribute-nan",
        "same-attribute-tensor",
        "same-attribute-object",
        "same-attribute-shared",
    ],
)
def test_container_attributes_equal_in_every_sample_are_torchs(kind):
    """A dict subclass whose attribute is the same in every sample (an array, NaN, a tensor, a
    shared object without __eq__) is what torch's batches carry: no error."""
    dataset = D.StructureMap(kind)
    expected = list(TorchDataLoader(dataset, batch_size=2, num_workers=2))
    for assignment in ASSIGNMENTS:
        got = list(sample_loader(assignment)(dataset, batch_size=2, num_workers=2))
        assert len(got) == len(expected)
        for e, g in zip(expected, got):
            assert type(g) is type(e)
            D.assert_same(dict(e), dict(g), assignment)
            if kind == "same-attribute-nan":
                assert math.isnan(g.meta)
            elif kind != "same-attribute-object":
                D.assert_same(e.meta, g.meta, "meta")
            if kind == "same-attribute-shared":
                D.assert_same(e.scale, g.scale, "scale")


def test_extra_field_is_that_batch_error():
    loader = ShmDataLoader(
        D.MismatchMap(12, bad=6, kind="fields"), batch_size=4, num_workers=2, fetch="sample"
    )
    it = iter(loader)
    assert next(it)["meta"]["label"].tolist() == [0, 1, 2, 3]
    with pytest.raises(SampleLayoutError, match=r"\['meta'\] has keys \['label', 'box', 'more'\]"):
        next(it)
    assert next(it)["meta"]["label"].tolist() == [8, 9, 10, 11]
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.parametrize("kind", ["str", "bytes"])
def test_text_in_samples_is_refused(kind):
    """Strings/bytes cannot live in a fixed-size row: every batch is a SampleLayoutError that
    says so, and the epoch still ends (no hang, no endless errors)."""
    loader = ShmDataLoader(D.TextMap(6, kind=kind), batch_size=2, num_workers=2, fetch="sample")
    errors = []
    it = iter(loader)
    with deadline(60):
        for _ in range(10):
            try:
                next(it)
                pytest.fail("a batch of samples holding text was delivered")
            except StopIteration:
                break
            except SampleLayoutError as e:
                errors.append(str(e))
                forget(e)
    assert len(errors) == len(loader) == 3
    assert kind in errors[0] and "fetch='batch'" in errors[0]


def test_text_in_later_sample_is_that_batch_error():
    loader = ShmDataLoader(
        D.MismatchMap(12, bad=9, kind="text"), batch_size=4, num_workers=2, fetch="sample"
    )
    it = iter(loader)
    assert next(it)["image"][:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert next(it)["image"][:, 0].tolist() == [4.0, 5.0, 6.0, 7.0]
    with pytest.raises(SampleLayoutError, match="str"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


# --------------------------------------------------------------------------- construction
INVALID = {
    "iterable-dataset": (
        P(D.ShardedIterable, 6),
        dict(batch_size=2, num_workers=2, fetch="sample"),
    ),
    "batch-size-none": (P(D.IndexMap, 6), dict(batch_size=None, num_workers=2, fetch="sample")),
    "custom-collate": (
        P(D.IndexMap, 6),
        dict(batch_size=2, num_workers=2, fetch="sample", collate_fn=D.identity_collate),
    ),
    "bad-fetch": (P(D.IndexMap, 6), dict(batch_size=2, num_workers=2, fetch="samples")),
    # torch would call __getitems__ with whole batches
    "getitems": (P(D.GetItemsMap, 6), dict(batch_size=2, num_workers=2, fetch="sample")),
    "subset-of-getitems": (
        lambda: tud.Subset(D.GetItemsMap(6), [1, 2, 3]),
        dict(batch_size=2, num_workers=2, fetch="sample"),
    ),
    "fetch-none": (P(D.IndexMap, 6), dict(batch_size=2, num_workers=2, fetch=None)),
    "bad-assignment": (
        P(D.IndexMap, 6),
        dict(batch_size=2, num_workers=2, fetch="sample", assignment="round-robin"),
    ),
    "assignment-with-fetch-batch": (
        P(D.IndexMap, 6),
        dict(batch_size=2, num_workers=2, assignment="dynamic"),
    ),
    "interleaved-with-fetch-batch": (
        P(D.IndexMap, 6),
        dict(batch_size=2, num_workers=2, fetch="batch", assignment="interleaved"),
    ),
}


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_samples_requiring_grad_fail_their_batch_like_torch(assignment):
    """torch's workers stack with out= into shared memory, which autograd refuses: the
    batches holding such a sample raise torch's error, the others arrive."""
    want = each_next(TorchDataLoader(D.GradMap(10), batch_size=2, num_workers=2))
    got = each_next(sample_loader(assignment)(D.GradMap(10), batch_size=2, num_workers=2))
    assert sum(type(o) is tuple for o in want) == 3, want  # samples 1, 5, 9
    D.assert_same(want, got, "outcomes")


@pytest.mark.parametrize(
    "batches",
    [[[0, 1], [], [2, 3], [4, 5]], [[], [0, 1], [2, 3]]],
    ids=["empty-later", "empty-first"],
)
def test_empty_batch_fails_alone_like_torch(batches):
    """A batch_sampler's empty batch raises collate's IndexError for that batch only (the
    ring's rows need a sample; one worker collates it whole, as torch's)."""
    kw = dict(batch_sampler=batches, num_workers=2)
    want = each_next(TorchDataLoader(D.IndexMap(10), **kw), epochs=2)
    got = each_next(sample_loader("dynamic")(D.IndexMap(10), slot_bytes=1 << 16, **kw), epochs=2)
    assert sum(type(o) is tuple for o in want) == 2, want
    D.assert_same(want, got, "outcomes")


def _pad(batch, *, collate_fn_map=None):
    return torch.nn.utils.rnn.pad_sequence(batch, batch_first=True)


def test_changed_default_collate_fn_map_is_refused(monkeypatch):
    """Rows of fixed size are torch's own stacking: with default_collate_fn_map changed,
    default_collate batches otherwise, so fetch="sample" refuses, naming the change."""
    from torch.utils.data._utils.collate import default_collate_fn_map

    loader = ShmDataLoader(D.IndexMap(6), batch_size=2, num_workers=2, fetch="sample")
    monkeypatch.setitem(default_collate_fn_map, torch.Tensor, _pad)
    with pytest.raises(
        ValueError, match=r"default_collate_fn_map was changed .*_pad.*fetch='batch'"
    ):
        iter(loader)
    with pytest.raises(ValueError, match="default_collate_fn_map"):
        ShmDataLoader(D.IndexMap(6), batch_size=2, num_workers=2, fetch="sample")


@pytest.mark.parametrize("name", list(INVALID))
def test_invalid_combination_is_value_error_at_construction(name):
    make_dataset, kw = INVALID[name]
    children = own_children()
    with pytest.raises(ValueError) as info:
        ShmDataLoader(make_dataset(), **kw)
    message = str(info.value)
    assert "fetch" in message or "assignment" in message, message
    # (New ones only: a child of an earlier test may end meanwhile.)
    assert set(own_children()) <= set(children), "a rejected loader must not start workers"


def test_slot_bytes_too_small_is_clear_value_error():
    """slot_bytes below what one batch of rows needs: a ValueError naming slot_bytes and the size
    needed; nothing left behind; with that size the loader works."""
    children = own_children()
    loader = ShmDataLoader(
        D.NumericMap(10), batch_size=4, num_workers=2, fetch="sample", slot_bytes=64
    )
    with pytest.raises(ValueError) as info, deadline(60):
        next(iter(loader))
    message = str(info.value)
    forget(info.value)
    del info
    assert "slot_bytes" in message and "64" in message, message
    needed = max(int(n) for n in re.findall(r"\d+", message))
    assert needed > 64 * 4, f"no plausible size needed in: {message}"
    gc.collect()
    assert wait_gone(set(own_children()) - set(children), HANG_S)[0] == []
    assert our_segments() == []
    t = run(TorchDataLoader, P(D.NumericMap, 10), batch_size=4, num_workers=2)
    s = run(
        P(ShmDataLoader, slot_bytes=needed, fetch="sample"),
        P(D.NumericMap, 10),
        batch_size=4,
        num_workers=2,
    )
    assert_results_same(t, s)


# --------------------------------------------------------------------------- worker deaths
@pytest.mark.parametrize("assignment", ASSIGNMENTS)
@pytest.mark.parametrize("at", [0, 21], ids=["probe-sample", "mid-epoch"])
def test_worker_sigkilled_raises_promptly_and_leaves_nothing(at, assignment):
    """A worker SIGKILLed while fetching a sample (the layout's first one, or mid-epoch): the main
    process raises WorkerDied naming the pid and the signal; every other worker is gone;
    nothing in /dev/shm; the next epoch starts fresh workers and is whole."""
    children = set(own_children())
    loader = ShmDataLoader(
        Dying(64, at=at, signum=int(signal.SIGKILL)),
        batch_size=4,
        num_workers=2,
        fetch="sample",
        assignment=assignment,
        persistent_workers=True,
    )
    yielded = 0
    # (iter() itself may raise: it waits for the first sample, which fixes the layout)
    with pytest.raises(WorkerDied) as info, deadline(HANG_S):
        for _ in loader:
            yielded += 1
    message = str(info.value)
    assert "SIGKILL" in message and re.search(r"pid \d+", message), message
    assert yielded <= at // 4
    forget(info.value)
    del info
    gc.collect()
    assert wait_gone(set(own_children()) - children, HANG_S)[0] == []
    assert our_segments() == []
    loader.dataset.at = -1
    got = list(loader)
    assert torch.cat(got).tolist() == list(range(64))
    del loader, got
    gc.collect()
    assert wait_gone(set(own_children()) - children, HANG_S)[0] == []


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_worker_killed_from_outside_mid_epoch(assignment):
    """SIGKILL sent to a worker by someone else while every worker is busy with rows."""
    loader = ShmDataLoader(
        Sleepy(200, seconds=0.01),
        batch_size=4,
        num_workers=2,
        fetch="sample",
        assignment=assignment,
    )
    it = iter(loader)
    pids = list(it._pool.pids)
    assert next(it).tolist() == [0, 1, 2, 3]
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(WorkerDied, match=rf"pid {pids[1]}\).*SIGKILL"), deadline(HANG_S):
        for _ in it:
            pass
    del it
    gc.collect()
    assert wait_gone(pids, HANG_S)[0] == []
    assert our_segments() == []


# --------------------------------------------------------------------------- bugs found
def _late_worker_batches(assignment, n=120, bs=4):
    """Worker 1 starts 0.4 s late (worker_init_fn), every sample takes 4 ms: worker 0 fetches
    the first batches alone, and worker 1 then finds their (now stale) tasks in its inbox."""
    loader = ShmDataLoader(
        D.SlowMap(n, slow=tuple(range(n)), delay=0.004),
        batch_size=bs,
        num_workers=2,
        fetch="sample",
        assignment=assignment,
        worker_init_fn=D.late_worker_init_fn,
    )
    with deadline(60):
        return [b.flatten().tolist() for b in loader]


def test_dynamic_rows_never_land_in_another_batch():
    """Regression (fixed; assignment="dynamic"): a worker that reads a batch's "rows" task after
    the other workers completed that batch still calls row_claim(slot) on its slot, which by
    then was yielded, released and handed to a LATER batch (rows_begin reset its row counter).
    It writes the OLD batch's samples into the new batch's rows and counts them done, so later
    batches hold other batches' samples: silent corruption.  (With failing samples the stray
    row error also makes _iterator._with_row_errors call _pool.receive(None) -> TypeError, or
    spin forever while another slot is ready.)  Nothing checks that the slot's seq is still
    the task's before claiming."""
    n, bs = 120, 4
    want = [list(range(s, min(s + bs, n))) for s in range(0, n, bs)]
    got = _late_worker_batches("dynamic", n, bs)
    wrong = [k for k, (g, w) in enumerate(zip(got, want)) if g != w]
    assert len(got) == len(want) and not wrong, (
        f"{len(wrong)} of {len(want)} batches hold other samples, e.g. batch {wrong[0]} = "
        f"{got[wrong[0]]}, want {want[wrong[0]]}"
    )


def test_late_worker_interleaved_is_right():
    """The control for the test above: the same load with assignment="interleaved"."""
    n, bs = 120, 4
    assert _late_worker_batches("interleaved", n, bs) == [
        list(range(s, min(s + bs, n))) for s in range(0, n, bs)
    ]


# --------------------------------------------------------------------------- large samples
@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_large_samples_and_batches_beyond_the_first_size(assignment):
    """12 KiB images; the first batch has 2 samples, later ones up to 6: the ring's rows were
    fixed by the first batch, bigger batches still arrive whole."""
    sizes = [2, 6, 3, 1]
    make = P(Images, 30, shape=(3, 32, 128))
    t = run(
        TorchDataLoader,
        make,
        batch_sampler=D.VaryingBatchSampler(30, sizes),
        num_workers=2,
        persistent_workers=True,
        epochs=2,
    )
    s = run(
        sample_loader(assignment),
        make,
        batch_sampler=D.VaryingBatchSampler(30, sizes),
        num_workers=2,
        persistent_workers=True,
        epochs=2,
    )
    assert_results_same(t, s)
    assert [len(b) for b in s.epochs[0]] == [2, 6, 3, 1, 2, 6, 3, 1, 2, 4]


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_first_batch_of_one_sample(assignment):
    """Regression (fixed): a first batch of one sample (batch_size=1, or a batch_sampler starting
    with a 1-index batch) fails with OSError [Errno 22] from Ring.rows_begin: _dispatch passes
    first_row=1 (the probed sample is row 0) with nrows=1, which the C core rejects."""
    make = P(D.IndexMap, 9)
    sampler = P(D.VaryingBatchSampler, 9, [1, 3, 2])
    t = run(TorchDataLoader, make, batch_sampler=Fresh(sampler), num_workers=2)
    s = run(sample_loader(assignment), make, batch_sampler=Fresh(sampler), num_workers=2)
    assert_results_same(t, s)
