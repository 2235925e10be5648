"""The cross-process rounds' protocol (``runtime.processes.ProcessRounds``) in one process:
two instances share an in-memory key-value store and a collective made of a barrier, so the
joining of rounds and the timeout are checked without starting processes."""

import threading

import pytest

from pdasgd_jax.runtime.processes import ProcessRounds, RoundsTimeout


class MemoryStore:
    """The key-value calls ``ProcessRounds`` makes, on a dict."""

    def __init__(self):
        self._values, self._lock = {}, threading.Lock()

    def key_value_set(self, key, value):
        with self._lock:
            self._values[key] = value

    def key_value_dir_get(self, prefix):
        with self._lock:
            return [(k, v) for k, v in self._values.items() if k.startswith(prefix)]


class BarrierMean:
    """A collective over ``n`` callers: each passes one number per group and gets the mean of all."""

    def __init__(self, n):
        self._barrier, self._trees = threading.Barrier(n, timeout=30), {}

    def __call__(self, process, trees):
        self._trees[process] = trees
        self._barrier.wait()
        values = [x for t in self._trees.values() for x in t]
        mean = sum(values) / len(values)
        self._barrier.wait()  # everyone has read this round's trees before the next round writes
        return [mean] * len(trees)


def _rounds(process, snapshots, final, store, collective, arrived, errors, timeout_s=30.0):
    return ProcessRounds(
        snapshots=lambda k: [snapshots.get(k)],
        finals=lambda: [final],
        allreduce=lambda trees: collective(process, trees),
        arrive=lambda k, means: arrived.append((k, means[0])),
        fail=errors.append,
        keys="test",
        timeout_s=timeout_s,
        kv=store,
        process=process,
        processes=2,
    )


def test_a_process_whose_data_ended_joins_the_rounds_the_other_starts_then_both_take_the_final_mean():
    store, collective, errors = MemoryStore(), BarrierMean(2), []
    arrived = {0: [], 1: []}
    # Process 0's groups snapshot rounds 0..4; process 1's data ends after rounds 0 and 1.
    a = _rounds(0, {k: float(k) for k in range(5)}, 100.0, store, collective, arrived[0], errors)
    b = _rounds(1, {0: 0.0, 1: 1.0}, 101.0, store, collective, arrived[1], errors)
    for rounds in (a, b):
        rounds.start()
    for k in range(2):
        b.start_round(k)
    b.data_done(jobs=4)
    for k in range(5):
        a.start_round(k)
    a.data_done(jobs=10)
    for rounds in (a, b):
        rounds.wait(lambda: bool(errors))
    assert errors == []
    # Rounds 0 and 1 average the snapshots; from round 2 on process 1 contributes its final store.
    expected = [(0, 0.0), (1, 1.0), (2, 51.5), (3, 52.0), (4, 52.5)]
    assert arrived[0] == expected and arrived[1] == expected
    assert (a.joined, b.joined) == (0, 3)
    assert a.final == b.final == 100.5
    assert a.total_jobs == b.total_jobs == 14


def test_a_process_left_waiting_for_the_others_fails_naming_the_round():
    store, errors = MemoryStore(), []
    rounds = _rounds(1, {}, 1.0, store, BarrierMean(2), [], errors, timeout_s=0.3)
    rounds.start()
    rounds.data_done(jobs=0)  # process 0 never says it is done
    with pytest.raises(RoundsTimeout, match=r"process 1 of 2: round 0 waited more than 0.3 s .* done so far: \[1\]"):
        rounds.wait(lambda: False)
    rounds.abort()
