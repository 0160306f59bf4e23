"""The messages between the main process and its workers (shmloader/_worker/_protocol.py): every
record's wire() builds a plain tuple (pickle's fast path) that the receiving side reads back
into that record, field for field."""

import inspect
import pickle

import pytest

from shmloader._worker import _protocol
from shmloader._worker._protocol import Segment, from_main, from_worker

TO_WORKER = [
    _protocol.RingFds,
    _protocol.UseLayout,
    _protocol.Task,
    _protocol.Rows,
    _protocol.Probe,
    _protocol.ResumeWorker,
]
TO_MAIN = [
    Segment,
    _protocol.Batch,
    _protocol.ErrorReply,
    _protocol.RowErrorReply,
    _protocol.Described,
    _protocol.Stop,
    _protocol.Resumed,
]


@pytest.mark.parametrize(
    "record, read",
    [(r, from_main) for r in TO_WORKER] + [(r, from_worker) for r in TO_MAIN],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_wire_tuple_reads_back_as_its_record(record, read):
    names = list(inspect.signature(record.wire).parameters)
    sent = record.wire(*names)  # each field holds its own name
    assert type(sent) is tuple and record._fields[0] == "kind"
    got = read(pickle.loads(pickle.dumps(sent, pickle.HIGHEST_PROTOCOL)))
    assert type(got) is record
    fields = [f for f in record._fields[1:] if not (record is Segment and f == "lease")]
    assert fields == names
    assert all(getattr(got, name) == name for name in names)


def test_kinds_are_unique_each_way():
    for records, read in ((TO_WORKER, from_main), (TO_MAIN, from_worker)):
        kinds = [r.wire(*inspect.signature(r.wire).parameters)[0] for r in records]
        assert len(set(kinds)) == len(kinds)
    assert from_main(_protocol.EXIT) is _protocol.EXIT
