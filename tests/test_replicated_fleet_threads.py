"""--fleet slow, leave, crash and join on threads for replicated PD-ASGD (--replication replicas,
algorithms.md §5a): a group that leaves drops only its unfinished jobs, one that joins starts from
the mean of the stores up, a job is applied or dropped never both, a slow window changes no
count, and what the path cannot take is refused by name."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdasgd_jax import Config
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.optim import AveragingRule
from pdasgd_jax.replication import GroupRounds
from pdasgd_jax.runners.async_local_fleet import ThreadFleet
from pdasgd_jax.runtime.control import Control
from pdasgd_jax.runtime.group_fleet import GroupEpoch, GroupFleet
from pdasgd_jax.runtime.groups import Aborts, GroupControl, GroupGate, LockedRounds
from pdasgd_jax.runtime.queue import BoundedQueue, WouldBlock
from pdasgd_jax.runtime.replicas import ReplicatedRuntime, run_threads
from pdasgd_jax.runtime.settings import RuntimeSettings
from pdasgd_jax.store import ParameterStore

RUN = dict(
    algo="pdasgd",
    replication="replicas",
    devices=3,
    replicas=3,
    period=4,
    delay_steps=2,
    epochs=1,
    seed=3,
    model="mlp",
    progress=False,
)


@pytest.fixture(scope="module")
def exp():
    """One experiment whose data, model and compiled kernels every run here shares."""
    return Experiment.from_config(Config(**RUN))


def _runtime(exp, fleet):
    run = exp.with_config(fleet=fleet)
    return ReplicatedRuntime(run, RuntimeSettings.from_config(run))


def _run(rt):
    run = rt.exp
    return rt.run(MetricsLog(run.evaluate, total_examples=run.total_examples, eval_every=10**9, progress=False))


def _batches(run_exp):
    return math.ceil(run_exp.total_examples / run_exp.config.batch_size)


def _bits(tree):
    return [np.asarray(leaf).view(np.uint8).tobytes() for leaf in jax.tree.leaves(tree)]


def test_a_group_that_leaves_and_joins_starts_from_the_mean_and_every_batch_is_applied_or_dropped(exp):
    rt = _runtime(exp, "leave:1@0.2,join:1@0.4")
    joined = []

    def on_join(g, averaged, received):
        # Two groups up: their mean is (a + b) / 2 leaf by leaf, exact in float32 as numpy takes
        # it (counters: the first's).
        assert len(averaged) == 2
        mean = jax.tree.map(
            lambda a, b: (
                (np.asarray(a) + np.asarray(b)) / np.float32(2)
                if jnp.issubdtype(a.dtype, jnp.inexact)
                else np.asarray(a)
            ),
            *averaged,
        )
        joined.append((g, _bits(rt.stores[g].snapshot()), _bits(received), _bits(mean)))

    rt.fleet.on_join = on_join
    result = _run(rt)
    run, extra = rt.exp, result.extra

    # The rejoined group's store holds the mean it pulled, parameters, states and optimizer state.
    ((g, store_bits, received_bits, mean_bits),) = joined
    assert g == 1 and store_bits == received_bits == mean_bits

    fleet = extra["fleet"]
    leave, join = fleet["events"]
    batch = run.config.batch_size
    assert (leave["group"], leave["kind"], join["group"], join["kind"]) == (1, "leave", 1, "join")
    assert leave["at"] == math.ceil(0.2 * run.total_examples / batch) * batch
    assert join["at"] == math.ceil(0.4 * run.total_examples / batch) * batch
    assert leave["taken_jobs"] == leave["applied_jobs"] + leave["dropped_jobs"]
    # Every batch of the budget was taken once and is applied or dropped, never both.
    jobs = fleet["jobs"]
    assert jobs["in_flight_at_end"] == 0 and jobs["taken"] == _batches(run)
    assert jobs["taken"] == jobs["applied"] + jobs["dropped"] and jobs["dropped"] == leave["dropped_jobs"]
    assert result.step == jobs["applied"] == sum(extra["jobs_per_group"])
    for group in jobs["per_group"]:
        assert group["taken"] == group["applied"] + group["dropped"] + group["in_flight_at_end"]
    # Back in the rounds, its new workers took batches again, booked in the new epoch.
    assert extra["jobs_per_group"][1] > leave["applied_jobs"]
    assert {"d1/forward0/e1", "d1/backward0/e1"} <= set(extra["utilisation"])
    assert rt.gates[1] is rt.fleet.history[1][-1].gate  # the gate the rounds pause is the new workers'
    assert "crashed_groups" not in extra and "crashes" not in extra
    assert extra["averaging_rounds"] > 0


def test_a_slow_window_changes_no_count(exp):
    plain = _run(_runtime(exp, None))
    slowed = _run(_runtime(exp, "slow:0x3@0-1"))
    assert slowed.step == plain.step == _batches(exp)
    assert slowed.extra["jobs_per_group"] != [] and slowed.extra["fleet"]["jobs"]["dropped"] == 0
    (window,) = slowed.extra["fleet"]["slowed"]
    assert window["group"] == 0 and window["jobs"] > 0 and window["slept"] > 0
    assert not slowed.extra["fleet"]["events"]


def _tiny_fleet(events):
    """A ``GroupFleet`` of two one-scalar stores on two devices, H = 2 and d = 1, with nothing
    running; its rounds pause and unpause each group's current gate, as the runtime's do."""
    add = lambda m, p, o, g, tau, old: (p + g, o)
    stores = [ParameterStore([jnp.float32(v)], [{}], [(jnp.float32(10 * v),)], add) for v in (1.0, 3.0)]
    feed = BoundedQueue(4)
    feed.put_many([0, 1, 2, 3])
    gates = [GroupGate(feed) for _ in stores]
    current = list(gates)
    rounds = GroupRounds(
        stores,
        AveragingRule(period=2, delay=1),
        start_allreduce=lambda k: rounds.arrive(k),
        mean=lambda snapshots: [jax.tree.map(lambda *x: sum(x) / len(x), *snapshots)] * len(snapshots),
        pause=lambda g: current[g].pause(),
        unpause=lambda g: current[g].unpause(),
        clock=lambda: 0.0,
    )
    rounds.start()
    booking = LockedRounds(rounds)
    control = Control()
    controls = [GroupControl(control, booking, g) for g in range(2)]
    rejoined = []

    def rejoin(g, gate, group_control):
        rejoined.append((g, group_control.epoch))
        current[g] = gate
        return [], []

    fleet = GroupFleet(
        ThreadFleet(tuple(events), None, ()),
        batch_size=1,
        booking=booking,
        epochs=[GroupEpoch(gate, [], c) for gate, c in zip(gates, controls, strict=True)],
        devices=jax.devices()[:2],
        control=control,
        waits=Aborts(gates),
        rejoin=rejoin,
    )
    return fleet, booking, stores, gates, controls, rejoined


def test_a_join_waits_for_the_departed_epochs_last_worker_and_its_jobs_are_never_booked():
    fleet, booking, stores, gates, controls, rejoined = _tiny_fleet([(2, 1, "leave"), (3, 1, "join")])
    controls[1].thread_started()  # group 1's worker
    gates[1].get()  # its first job
    assert booking.applied(1, 0)  # booked before the leave
    gates[1].get()  # its second job: the take that makes it leave
    assert not booking.applied(1, 0) and booking.rounds.crashed == {1}  # dropped, never booked
    gates[0].get()  # the join is due, but group 1's worker has not exited
    assert not rejoined and booking.rounds.crashed == {1}
    controls[1].thread_exited()  # it exits: the join happens
    assert rejoined == [(1, 1)] and booking.rounds.crashed == set()
    params, _, opt_states = stores[1].snapshot()
    assert float(params[0]) == 1.0 and float(opt_states[0][0]) == 10.0  # the one store up: group 0's
    gate = fleet.history[1][-1].gate
    gate.get()  # a job of its new epoch, through its new gate
    assert not booking.applied(1, 0) and booking.applied(1, 1)  # the old epoch's reports stay dropped
    # Its next round (1, snapshotted at the join) is due to merge, and group 0 has not snapshotted
    # it: the rounds pause the rejoined group's new gate.
    with pytest.raises(WouldBlock):
        gate.get(block=False)
    summary = fleet.summary()
    leave, join = summary["events"]
    assert (leave["taken_jobs"], leave["applied_jobs"], leave["dropped_jobs"]) == (2, 1, 1)
    assert (join["group"], join["kind"], join["at"]) == (1, "join", 3)
    group0, group1 = summary["jobs"]["per_group"]
    assert (group1["taken"], group1["applied"], group1["dropped"], group1["in_flight_at_end"]) == (3, 2, 1, 0)
    assert (group0["taken"], group0["applied"], group0["in_flight_at_end"]) == (1, 0, 1)


BASE = {**RUN, "fleet": "leave:1@0.4,join:1@0.7"}


@pytest.mark.parametrize(
    "changes, named",
    [
        (dict(fleet="churn:leave=0.5"), "not churn (its events are drawn on the virtual clock)"),
        (dict(merge="eager"), "leave:1@0.4, join:1@0.7 takes no --merge eager"),
        (dict(event_log=True, out="unused"), "leave:1@0.4, join:1@0.7 takes no --event-log"),
        (dict(fleet="join:1@0.5"), "join:1@0.5"),
        (dict(fleet="leave:3@0.5"), "leave:3@0.5"),
        (dict(replication="shared"), "--replication shared"),
    ],
)
def test_what_the_threaded_replicated_fleet_cannot_take_is_refused_by_name(changes, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        Config(**{**BASE, **changes}).validate()


def test_slow_windows_alone_take_an_eager_merge_and_an_event_log():
    Config(**{**RUN, "fleet": "slow:1x2@0.1-0.5", "merge": "eager"}).validate()
    Config(**{**RUN, "fleet": "slow:1x2@0.1-0.5", "event_log": True, "out": "unused"}).validate()


def test_a_run_with_fleet_events_refuses_to_resume(exp):
    class Checkpointed:
        def latest_step(self):
            return 4

    run = exp.with_config(fleet="leave:1@0.4,join:1@0.7")
    metrics = MetricsLog(run.evaluate, total_examples=run.total_examples, eval_every=10**9, progress=False)
    with pytest.raises(ConfigError, match="cannot resume a run yet"):
        run_threads(run, metrics, Checkpointed())
