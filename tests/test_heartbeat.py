"""Hung-peer detection (``runtime.heartbeat``) on an in-memory key-value store and a fake
clock: no processes, no waiting."""

import threading

import pytest

from pdasgd_jax.runtime.heartbeat import Heartbeat


class MemoryStore:
    """The key-value calls ``Heartbeat`` makes, on a dict; ``down`` makes every call fail."""

    def __init__(self):
        self.values, self.down = {}, False

    def key_value_set(self, key, value, allow_overwrite=False):
        if self.down:
            raise ConnectionError("coordinator unreachable")
        assert allow_overwrite or key not in self.values
        self.values[key] = value

    def key_value_dir_get(self, prefix):
        if self.down:
            raise ConnectionError("coordinator unreachable")
        return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _three(timeout_s=10.0):
    store, clock = MemoryStore(), Clock()
    beats = [
        Heartbeat("run", timeout_s, print, kv=store, process=p, processes=3, interval_s=1.0, clock=clock)
        for p in range(3)
    ]
    return store, clock, beats


def test_a_live_peer_is_never_reported_and_a_silent_one_is_within_the_timeout():
    _, clock, (a, b, c) = _three(timeout_s=10.0)
    for _ in range(30):  # 30 s of all three beating every second: nobody is silent
        for hb in (a, b, c):
            hb.beat()
        assert [hb.check() for hb in (a, b, c)] == [None, None, None]
        clock.now += 1.0
    # Process 2 hangs: its last beat was at t = 29 s; 0 and 1 go on beating and checking.
    reported = {}
    while clock.now < 29.0 + 12.0:
        for hb in (a, b):
            hb.beat()
            if hb.process not in reported and (message := hb.check()) is not None:
                reported[hb.process] = (clock.now, message)
        clock.now += 1.0
    assert sorted(reported) == [0, 1]  # every live process notices, and neither reports the other
    for p, (when, message) in reported.items():
        assert 29.0 + 10.0 < when <= 29.0 + 10.0 + 1.0 + 1e-9  # within one check interval of the timeout
        assert message.startswith(f"process {p} of 3: process 2 has been silent for")
        assert "longer than --peer-timeout 10 s (last heard from at" in message


def test_a_peer_never_heard_from_gets_the_startup_grace_from_the_start():
    _, clock, (a, _, _) = _three(timeout_s=5.0)
    assert a.startup_s == 300.0  # max(--peer-timeout, STARTUP_GRACE_S): hosts do not start in step
    a.beat()
    clock.now = 300.0
    assert a.check() is None
    clock.now = 300.5
    message = a.check()
    assert "process 1 has not been heard from in the 300.5 s since this process started its run" in message
    assert "max(--peer-timeout, 300 s)" in message


def test_an_unreachable_store_is_reported_after_the_timeout():
    store, clock, (_, b, _) = _three(timeout_s=5.0)
    assert b.check() is None  # the store answered at t = 0
    store.down = True
    clock.now = 4.0
    assert b.check() is None
    clock.now = 6.0
    message = b.check()
    assert "the coordinator's key-value store (process 0) has not answered for 6.0 s" in message
    assert "coordinator unreachable" in message


def test_the_thread_beats_and_calls_on_silent_once_then_ends():
    store, silent = MemoryStore(), []
    called = threading.Event()

    def on_silent(message):
        silent.append(message)
        called.set()

    hb = Heartbeat("run", 0.2, on_silent, kv=store, process=0, processes=2, interval_s=0.01, startup_s=0.2)
    hb.start()
    assert called.wait(10.0)
    hb.thread.join(10.0)
    assert not hb.thread.is_alive() and len(silent) == 1 and "process 1 has not been heard from" in silent[0]
    assert int(store.values["run/heartbeat/0"].split()[0]) >= 2  # it kept beating meanwhile


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan")])
def test_a_non_positive_timeout_is_refused(timeout):
    with pytest.raises(ValueError, match=r"--peer-timeout .* must be a positive number of seconds"):
        Heartbeat("run", timeout, print, kv=MemoryStore(), process=0, processes=2)
