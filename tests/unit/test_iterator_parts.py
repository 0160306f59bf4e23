"""The iterator's parts built and driven alone, without an iterator or
workers: the dispatch record, the ring keeper, the receiver, delivery, the
epoch planner and the deferred warnings (see _iterator.py's docstring)."""

import warnings

import pytest
import torch

import shmloader
from shmloader._main._dispatch_record import DispatchRecord
from shmloader._main._iter_deliver import Delivery
from shmloader._main._iter_epochs import EpochPlanner
from shmloader._main._iter_receive import Receiver
from shmloader._main._iter_ring import RingKeeper
from shmloader._main._ring_memory import RingHandover
from shmloader._main._stats import Counters
from shmloader._main._warn import DeferredWarnings
from shmloader._shm import _layout
from shmloader._worker._arena import Arena
from shmloader._worker._protocol import MEASURE, NO_SLOT

# ---- DispatchRecord ----------------------------------------------------------


def test_record_deals_tasks_round_robin_and_numbers_them_per_worker():
    record = DispatchRecord(num_workers=3, iterable=True)
    for _ in range(5):
        worker = record.next_worker(max_tasks=6, cap_each=False)
        record.take_position(2)
        record.sent(worker, None)
    assert [record.tasks[i].worker_id for i in range(5)] == [0, 1, 2, 0, 1]
    assert record.task_numbers == {0: 0, 1: 0, 2: 0, 3: 1, 4: 1}
    assert (record.send_idx, record.position, record.outstanding) == (5, 10, 5)
    assert record.workers_num_tasks == [2, 2, 1]


def test_record_skips_workers_that_ran_out_and_caps_each_worker():
    record = DispatchRecord(num_workers=2, iterable=False)
    record.workers_status[0] = False
    assert [record.next_worker(4, cap_each=False) for _ in range(2)] == [1, 1]
    record.workers_num_tasks[1] = 4  # its share of 4 tasks, alone
    assert record.next_worker(4, cap_each=True) is None
    record.workers_status[1] = False
    assert record.next_worker(4, cap_each=False) is None


def test_record_yields_in_turn_and_passes_over_silent_workers():
    record = DispatchRecord(num_workers=2, iterable=False)
    for worker in (0, 1, 0):
        record.sent(worker, None)
    record.tasks[2].result = "late"  # worker 0's second result overtook its first
    assert record.first_in_turn([2], per_worker=True) is None
    assert record.first_in_turn([2], per_worker=False) == 2
    record.workers_status[0] = False  # ran out: its unanswered tasks are passed over
    assert record.next_in_line() == 1
    assert 0 not in record.tasks
    record.tasks[1].result = "one"
    assert record.yielded(1) == (1, "one", None)
    assert record.workers_num_tasks == [2, 0]


def test_fresh_record_numbers_on_and_ends_where_the_last_epoch_did():
    record = DispatchRecord(num_workers=2, iterable=False)
    record.sent(0, None)
    record.sent(1, None)
    fresh = record.fresh()
    assert (fresh.epoch_base, fresh.send_idx, fresh.tasks) == (2, 0, {})
    assert fresh.next_task_id == 2


def test_adopting_the_next_epoch_shifts_its_tasks_and_returns_the_broken_off():
    record = DispatchRecord(num_workers=2, iterable=False)
    for worker in (0, 1):
        record.sent(worker, None)
    record.tasks[1].result = "arrived"
    record.start_next_epoch()
    for worker in (0, 1):
        record.sent(worker, None)
    assert record.end == 2
    stale, arrived = record.adopt_next_epoch()
    assert (stale, arrived) == (1, ["arrived"])  # task 0 in flight, task 1 arrived
    assert sorted(record.tasks) == [0, 1] and record.epoch_base == 2
    assert (record.send_idx, record.rcvd_idx, record.next_epoch_at) == (2, 0, None)
    assert record.outstanding == 3  # two of the new epoch, plus the stale one until it arrives


# ---- RingKeeper ----------------------------------------------------------------


class _Pool:
    """What the keeper hands a ring to: records it, as WorkerPool sends it."""

    def __init__(self):
        self.rings, self.messages = [], []

    def send_ring(self, ring):
        self.rings.append(ring)

    def broadcast(self, message):
        self.messages.append(message)


def _keeper(handover=None, counters=None, **options):
    settings = dict(
        handover=handover or RingHandover(),
        counters=counters or Counters(),
        warn=DeferredWarnings(counters or Counters()).warn,
        num_workers=2,
        prefetch_factor=2,
        fetch="batch",
        slot_bytes=None,
        num_slots=None,
        state_bytes=0,
        register=False,
    )
    settings.update(options)
    return RingKeeper(**settings)


def test_keeper_measures_first_then_makes_the_ring_from_what_it_learned():
    keeper = _keeper()
    assert keeper.ring is None and keeper.claim() == MEASURE
    keeper.measured(100_000)
    learned = keeper.handover.learned_slot_bytes
    assert learned == 100_000 + 100_000 // 16 + 65536
    pool = _Pool()
    keeper.start(keeper.known_slot_bytes(), pool)
    assert pool.rings == [keeper.ring] and keeper.ring.nslots == 2 * 2 + 4
    assert keeper.batch_room() >= learned


def test_keeper_with_every_slot_taken_says_so_once():
    counters = Counters()
    keeper = _keeper(counters=counters, slot_bytes=4096, num_slots=2)
    assert keeper.ring is not None  # known before the workers start
    keeper.claim(), keeper.claim()
    with pytest.warns(shmloader.ShmloaderWarning, match="all 2 ring slots are in use"):
        assert keeper.claim() == NO_SLOT
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert keeper.claim() == NO_SLOT
    assert counters.warned_ring_full


def test_keeper_hands_its_ring_to_the_next_keeper_of_the_loader():
    handover = RingHandover()
    first = _keeper(handover=handover, slot_bytes=4096)
    ring = first.ring
    first.hand_back(loader_alive=True)
    assert first.ring is None and handover.spare_ring is ring
    assert _keeper(handover=handover, slot_bytes=4096).ring is ring


def test_keeper_outgrown_by_a_batch_asks_for_larger_slots():
    keeper = _keeper(slot_bytes=None)
    keeper.measured(10_000)
    keeper.start(keeper.known_slot_bytes(), _Pool())
    assert keeper.outgrown() is None
    keeper.measured(keeper.batch_room() * 2)
    assert keeper.outgrown() == keeper.handover.learned_slot_bytes > keeper.batch_room()


# ---- Receiver and Delivery -----------------------------------------------------


def _publish(ring, task_id, batch):
    """Write `batch` into a slot with an Arena and publish it, as a worker does."""
    slot = ring.claim()
    memory = ring.memory(slot)
    arena = Arena(memory, torch.frombuffer(memory, dtype=torch.uint8).untyped_storage())
    meta = _layout.dumps(batch, arena.place_all, len(batch["x"]))
    ring.publish(slot, task_id, *arena.write_meta(meta))


class _NoPipes:
    wait_fds: list = []

    def receive(self, fired):
        return []


def test_receiver_and_delivery_turn_a_published_slot_into_views_of_it():
    counters = Counters()
    keeper = _keeper(counters=counters, slot_bytes=1 << 18)
    receiver = Receiver(
        ring_keeper=keeper, pool=_NoPipes(), counters=counters, timeout=5, in_order=True
    )
    batch = {"x": torch.arange(3 * 4096).reshape(3, -1), "label": torch.arange(3)}
    ring = keeper.ring
    for task_id in (7, 5):  # published out of order
        _publish(ring, task_id, batch)
    assert receiver.take(7).seq == 7  # 5 came first, and is kept for the next take
    task_id, lease = receiver.next_of_epoch(epoch_base=0)
    assert task_id == 5
    delivery = Delivery(
        ring_keeper=keeper,
        counters=counters,
        warn=DeferredWarnings(counters).warn,
        pin_memory=False,
        pin_memory_device=None,
        pin_device_id=None,
        device_stage=None,
    )
    got, state = delivery.unpack(lease)
    assert torch.equal(got["x"], batch["x"]) and torch.equal(got["label"], batch["label"])
    assert state is None
    start = ring.data_address
    assert start <= got["x"].data_ptr() < start + ring.data_bytes  # a view of the slot
    # (a small leaf is copied out, so that keeping it does not keep the slot)
    assert not start <= got["label"].data_ptr() < start + ring.data_bytes
    assert (counters.batches, counters.slot_batches, counters.samples) == (1, 1, 3)


def test_receiver_times_out_with_torchs_message():
    keeper = _keeper(slot_bytes=4096)
    receiver = Receiver(
        ring_keeper=keeper, pool=_NoPipes(), counters=Counters(), timeout=0.05, in_order=True
    )
    with pytest.raises(RuntimeError, match="DataLoader timed out after 0.05 seconds"):
        receiver.next()


# ---- EpochPlanner ----------------------------------------------------------------


def test_planner_numbers_epochs_and_prefetches_only_for_its_loaders_iterator():
    loader = shmloader.DataLoader(
        range(10), batch_size=2, num_workers=2, persistent_workers=True, prefetch_next_epoch=True
    )
    planner = EpochPlanner(
        loader=loader,
        resume=None,
        base_seed=0,
        num_workers=2,
        auto_collation=True,
        warn=DeferredWarnings(loader._counters).warn,
    )
    assert loader._progress is planner.progress
    planner.begin(loader, fresh_workers=True)
    first = planner.epoch
    assert planner.start_next_epoch(object(), loader._index_sampler) is None  # not its iterator
    loader._iterator = its_iterator = object()
    drawn = planner.start_next_epoch(its_iterator, loader._index_sampler)
    assert planner.epoch == first + 1 and planner.prefetched is not None
    assert [next(drawn) for _ in range(5)] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert planner.progress.next_start is not None  # what state_dict() saves meanwhile
    assert planner.samples_in([3, 4]) == 2


# ---- DeferredWarnings ---------------------------------------------------------------


def test_a_warning_made_an_error_waits_and_a_forgotten_one_comes_again():
    counters = Counters()
    deferred = DeferredWarnings(counters)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        counters.warned_spill = True
        deferred.warn("shmloader: kept", "warned_spill")  # no raise here
    assert deferred.errors
    deferred.forget()
    assert not deferred.errors and not counters.warned_spill
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        deferred.warn("shmloader: raised later")
    with pytest.raises(UserWarning, match="raised later"):
        deferred.raise_first()
