"""``EventLog`` builds its events without ``Event.__init__``: they must be the same objects."""

import pickle

import pytest

from pdasgd_jax.executor import Event, EventKind, EventLog, ReplicaLog


def test_a_logged_event_is_the_event_its_constructor_builds():
    log = EventLog()
    fields = {"time": 2.5, "stage": 1, "worker": "b0", "replaced_version": 3, "staleness": 2}
    log.record(EventKind.UPDATE, 7, **fields)
    (got,) = log.events
    want = Event(0, EventKind.UPDATE, 7, **fields)
    assert got == want and hash(got) == hash(want) and repr(got) == repr(want)
    assert list(vars(got).items()) == list(vars(want).items())
    assert pickle.dumps(got) == pickle.dumps(want)


def test_a_log_refuses_a_field_no_event_has():
    with pytest.raises(TypeError):
        EventLog().record(EventKind.START, 0, nonsense=1)


def test_a_replica_log_names_its_replica():
    log = EventLog()
    ReplicaLog(log, 2).record(EventKind.START, 0, batch_id=4, time=1.0)
    assert log.events == [Event(0, EventKind.START, 0, batch_id=4, time=1.0, replica=2)]
