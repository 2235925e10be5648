"""``--merge eager`` for DaSGD under ``--fleet``, ``--quorum`` and ``--deadline`` (algorithms.md
§5a, ``simulate.fleet_rounds.run_local_rounds``): its identities, and each fleet event's run
against a hand-computed reference; ``--fragments K > 1`` is still refused there, by name."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from test_fleet_dasgd_async_local import STEP, _dasgd_run, _leaves

from pdasgd_jax.delays import DelayModel
from pdasgd_jax.kernels import TrainState, init_opt_states, make_train_step
from pdasgd_jax.simulate.fleet_rounds import plan_local_rounds


def _assert_equal(a, b):
    for x, y in zip(_leaves((a.params, a.states)), _leaves((b.params, b.states)), strict=True):
        np.testing.assert_array_equal(x, y)


def test_an_empty_fleet_and_a_quorum_of_every_replica_are_todays_eager_dasgd_to_the_last_bit():
    _, _, today = _dasgd_run(merge="eager")
    for other in (dict(fleet=""), dict(quorum=4), dict(fleet="churn:join=2,seed=3")):
        _, _, run = _dasgd_run(merge="eager", **other)
        assert run.extra["virtual_time"] == today.extra["virtual_time"]
        _assert_equal(today, run)


@pytest.mark.parametrize("average_opt_state", [False, True])
def test_eager_with_no_delay_under_a_fleet_is_correct_to_the_last_bit(average_opt_state):
    # d = 0: each merge follows its snapshot with no step between, so nothing is held back.
    spec = "slow:3x10@0-0.05,crash:2@0.5,leave:1@0.3,join:1@0.6"
    runs = [
        _dasgd_run(fleet=spec, quorum=3, delay_steps=0, merge=m, average_opt_state=average_opt_state)[2]
        for m in ("correct", "eager")
    ]
    assert runs[0].extra["local_rounds"] == runs[1].extra["local_rounds"]
    _assert_equal(*runs)


def _float(x) -> bool:
    return np.issubdtype(np.asarray(x).dtype, np.inexact)


def _mean(*xs):
    """The mean of equal-shaped leaves (integer leaves, equal on every replica: the first)."""
    return sum(xs[1:], xs[0]) / len(xs) if _float(xs[0]) else xs[0]


def _eager_reference(exp, schedule, d, average_opt_state=False):
    """Eager DaSGD's averages by hand, one replica and one step at a time: a continuing unit
    goes on from its replica's snapshot s and after d steps takes A_base + (theta - s) / n, n
    the units landed in A_base, holding back (theta - s) (1 - 1/n), which it gives with its
    next snapshot where that lands: A_j = A_{j-1} + mean over landed u of (s_u + c_u - A_base).
    With ``average_opt_state`` the optimizer state o likewise against the landed mean of
    o + c_o. A unit begun from an average carries nothing and takes its replica's optimizer
    state (a joiner's: the last landed mean)."""
    h = exp.config.period
    step = jax.jit(make_train_step(exp.model, exp.tx))
    v = exp.variables
    averages = {0: (jax.device_get(v.params), jax.device_get(v.states))}
    opt = dict.fromkeys(range(4), init_opt_states(exp.tx, v.params))
    opt_mean, landed_last, snapshot, after, carry = opt[0], set(), {}, {}, {}
    opt_averages = {}
    streams = [exp.train_stream(exp.config.batch_size, shard_index=w, num_shards=4) for w in range(4)]

    def own(x, s, n):
        return (x - s) / n if _float(x) else x - s

    def eager(a, x, s, n):  # the merged tree, and what it holds back
        merged = jax.tree.map(lambda a, x, y: a + own(x, y, n), a, x, s)
        return merged, jax.tree.map(lambda x, y: (x - y) - own(x, y, n) if _float(x) else 0 * x, x, s)

    for j in range(1, len(schedule.lands) + 1):
        for u in schedule.starts[j - 1]:
            if u.dropped:
                continue
            carry[u.worker] = None, None
            if u.continues:
                ts = s = snapshot[u.worker]
            else:
                mine = opt[u.worker] if j == 1 or u.worker in landed_last else opt_mean
                ts = TrainState(*averages[j - 1], mine)
            for i in range(h):
                if u.continues and i == d:
                    n = len(schedule.lands[u.base - 1])
                    model, c = eager(averages[u.base], (ts.params, ts.states), (s.params, s.states), n)
                    o, c_o = ts.opt_states, None
                    if average_opt_state:
                        o, c_o = eager(opt_averages[u.base], ts.opt_states, s.opt_states, n)
                    carry[u.worker] = c, c_o
                    ts = TrainState(*model, o)
                ts, _ = step(ts, *next(streams[u.worker]))
            after[u.worker] = ts
        landed = schedule.lands[j - 1]

        def given(u):
            (c, c_o), ts = carry[u.worker], after[u.worker]
            model = (ts.params, ts.states)
            model = model if c is None else jax.tree.map(lambda x, y: x + y, model, c)
            return model, ts.opt_states if c_o is None else jax.tree.map(lambda x, y: x + y, ts.opt_states, c_o)

        moved = [jax.tree.map(lambda a, b: a - b, given(u)[0], averages[u.base]) for u in landed]
        mean = jax.tree.map(lambda *xs: sum(xs[1:], xs[0]) / len(xs), *moved)
        averages[j] = jax.tree.map(lambda a, m: a + m, averages[j - 1], mean)
        if landed:
            opt_mean = jax.tree.map(_mean, *[given(u)[1] for u in landed])
            opt_averages[j] = opt_mean
        for u in landed:
            opt[u.worker] = opt_mean if average_opt_state else after[u.worker].opt_states
            snapshot[u.worker] = after[u.worker]
        landed_last = {u.worker for u in landed}
    return averages[len(schedule.lands)]


# A crash of replica 2 in the all-reduce of average 2 (closed at 8 s, done at 8.01 s on the
# plain schedule of 24.01 s): that average is taken again over the other three.
_IN_ALL_REDUCE = f"crash:2@{8.005 / 24.01!r}"


@pytest.mark.parametrize(
    "event, spec, more",
    [
        ("slow", "slow:3x10@0-0.05", {}),  # replica 3's units arrive late and land in a later average
        ("leave", "leave:1@0.3", {}),
        ("crash", "crash:2@0.4", {}),
        ("crash", _IN_ALL_REDUCE, {}),
        ("join", "leave:1@0.3,join:1@0.5", {}),
        ("churn", "churn:leave=1,join=2,slow=1x3,seed=4", {}),
        ("slow", "slow:3x10@0-0.05,leave:1@0.3,join:1@0.5", dict(average_opt_state=True)),
    ],
    ids=["slow", "leave", "crash", "crash-in-all-reduce", "join", "churn", "average-opt-state"],
)
def test_an_eager_dasgd_fleet_run_trains_the_hand_computed_model(event, spec, more):
    exp, _, result = _dasgd_run(fleet=spec, quorum=3, merge="eager", optimizer="momentum", **more)
    schedule, _ = plan_local_rounds(exp, STEP, DelayModel(), 4)
    report = result.extra["local_rounds"]
    # The averages merged have fewer than 4 units at least once: a share of 1/n, not 1/W.
    assert any(u.continues for units in schedule.starts for u in units)
    assert min(len(units) for units in schedule.lands) < 4
    if event == "slow":
        assert report["late_units"] >= 1
    if event in ("leave", "crash"):
        assert report["dropped_steps"][event] > 0
    if spec == _IN_ALL_REDUCE:
        assert [len(units) for units in schedule.lands][:2] == [4, 3]
        assert schedule.ends[1] > schedule.closes[1] + 0.01  # started again at the crash
    if event == "join":
        assert any(not u.continues and u.worker == 1 and u.base > 0 for units in schedule.starts for u in units)
    params, states = _eager_reference(exp, schedule, exp.config.averaging_delay, **more)
    for a, b in zip(_leaves((result.params, result.states)), _leaves((params, states)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_eager_under_a_fleet_differs_from_correct():
    # The merged share is 1/n of the replica's own progress: a different model from correct's.
    spec = "slow:3x10@0-0.05"
    eager, correct = (_dasgd_run(fleet=spec, quorum=3, merge=m)[2] for m in ("eager", "correct"))
    assert any(not np.array_equal(a, b) for a, b in zip(_leaves(eager.params), _leaves(correct.params), strict=True))
