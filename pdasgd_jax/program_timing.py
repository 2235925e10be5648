"""How one program's time is taken on this machine: the timers and one round of them.

``calibration`` decides what is measured (``PROGRAMS``), how rounds become a stable timing,
and how the result is keyed and cached; this module only takes times, so that the timers
(warm-up, median of repeated calls, interleaving, marginal costs) can be read and tested
apart from the fingerprint and the cache.

Every program is timed on its own, as its algorithm launches it: on a device where a launch
costs as much as a small model's compute, a fused program costs several times less than
the sum of its per-stage kernels.

* ``measure_round``: one round, every program's median of ``repeats`` timed calls.
* ``round_averaging_time``: the SPMD round's averaging, its marginal cost inside the step
  program, timed with ``interleaved_median_times``.
* ``measure_concurrency_curve`` (and ``measure_concurrency``, its ``g2``):
  ``TimingModel.concurrency``, how much faster concurrent calls finish than calls in a row.

Example::

    timing = measure_round(kernels, params, states, opt_states, x, y, repeats=10)
    timing.train_step_time(), timing.step_compute_time()
"""

from __future__ import annotations

import concurrent.futures
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from pdasgd_jax import affinity
from pdasgd_jax.collectives import allreduce_mean
from pdasgd_jax.delays import TimingModel
from pdasgd_jax.kernels import StageKernels, TrainState
from pdasgd_jax.optim import AveragingRule
from pdasgd_jax.replication import merge_program

ROUND_AXIS = "workers"  # the mapped axis of ``round_averaging_time``


def _median_time(fn: Callable, *args: Any, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compiles and warms up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_median_times(programs: dict[str, Callable], *args: Any, repeats: int) -> dict[str, float]:
    """Each program's median of ``repeats`` timed calls on ``args`` (after one warm-up call
    each), the programs called in turn within each repeat, in reversed order every other
    repeat, so load drift and call order weigh on all of them alike."""
    for fn in programs.values():
        jax.block_until_ready(fn(*args))  # compiles and warms up
    names = list(programs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats):
        for name in names if i % 2 == 0 else reversed(names):
            start = time.perf_counter()
            jax.block_until_ready(programs[name](*args))
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def measure_round(kernels: StageKernels, params, states, opt_states, x, y, repeats: int) -> TimingModel:
    """One round: every program's median of ``repeats`` timed calls (after a warm-up), each
    called on its own as its algorithm launches it.

    ``forward`` is the stashing forward and ``backward`` the stashed backward (per stage);
    ``job_gradients`` the whole job's gradient in one program, ``update_all`` every stage's
    update in one program and ``train_step`` the fused
    whole-model step (gradient and updates), on a batch already on the device; ``host_step``
    the synchronous loops' per-step ``jax.device_put`` of a host batch.
    """
    num_stages = kernels.num_stages
    host_x, host_y = np.asarray(x), np.asarray(y)
    forward, backward, update = [0.0] * num_stages, [0.0] * num_stages, [0.0] * num_stages
    vjps, h = [], x
    for m in range(num_stages):
        forward[m] = _median_time(kernels.forward_stashed(m), params[m], states[m], h, repeats=repeats)
        h, _, vjp = kernels.forward_stashed(m)(params[m], states[m], h)
        vjps.append(vjp)
    loss = _median_time(kernels.loss_grad, h, y, repeats=repeats)
    _, delta = kernels.loss_grad(h, y)
    grads = [None] * num_stages
    backward_update = [0.0] * num_stages
    for m in reversed(range(num_stages)):
        backward[m] = _median_time(kernels.backward_stashed(m), vjps[m], delta, repeats=repeats)
        backward_update[m] = _median_time(
            kernels.backward_update_stashed, vjps[m], delta, params[m], opt_states[m], 0, params[m], repeats=repeats
        )
        grads[m], delta = kernels.backward_stashed(m)(vjps[m], delta)
    for m in range(num_stages):
        update[m] = _median_time(kernels.update(m), params[m], opt_states[m], grads[m], repeats=repeats)
    params, states, opt_states = tuple(params), tuple(states), tuple(opt_states)
    update_all = _median_time(kernels.update_all, params, opt_states, tuple(grads), repeats=repeats)
    job = _median_time(kernels.job_gradients, params, states, x, y, repeats=repeats)
    # Host batches, as the runtime's workers pass them (jit copies them to the device inside
    # the call); the synchronous loops ``device_put`` each batch first (``host_step``) and
    # call their fused step on device arrays, so it is timed so.
    host_step = _median_time(lambda: jax.device_put((host_x, host_y)), repeats=repeats)
    dev_x, dev_y = jax.device_put((host_x, host_y))
    step = _median_time(kernels.train_step, TrainState(params, states, opt_states), dev_x, dev_y, repeats=repeats)
    forward_all = _median_time(kernels.forward_all_stashed, params, states, x, y, repeats=repeats)
    merge, average = _averaging_times(params, states, repeats)
    round_average = round_averaging_time(kernels, TrainState(params, states, opt_states), dev_x, dev_y, repeats)
    return TimingModel(
        forward,
        backward,
        update,
        loss,
        job_gradients=job,
        train_step=step,
        forward_all=forward_all,
        backward_update=backward_update,
        host_step=host_step,
        merge=merge,
        average=average,
        update_all=update_all,
        round_average=round_average,
    )


def _averaging_times(params: tuple, states: tuple, repeats: int) -> tuple[list[float], float]:
    """A replicated run's merge of each stage and its mean's program on one device, called as
    the runtime calls them (``replication.merge_program``, ``allreduce_mean``)."""
    rule = AveragingRule(period=1, delay=0, merge="correct")
    merge = [_median_time(merge_program, rule, p, p, p, repeats=repeats) for p in params]
    leaf = jax.tree.leaves(params)[0]
    device = next(iter(leaf.devices())) if isinstance(leaf, jax.Array) else jax.devices()[0]
    average = _median_time(lambda tree: allreduce_mean([tree], (device,)), (params, states), repeats=repeats)
    return merge, average


def round_averaging_time(kernels: StageKernels, ts: TrainState, x: Any, y: Any, repeats: int) -> float:
    """The SPMD round's averaging on one worker's device, as ``local_rounds.make_round`` computes it
    inside the round program: the snapshot's ``pmean`` over the workers' axis (here mapped over
    one worker: the cross-device reduction is the network's, priced by ``CommModel``) and the
    ``correct`` merge of parameters and non-trainable states.

    The round pays no launch of its own for it, so it is the marginal cost: a program running
    the fused training step (``kernels.train_step``) with the averaging, minus the same program
    without it, both mapped over one worker and timed interleaved (``interleaved_median_times``)
    so the machine's load drifts over both alike. The difference is clamped at 0: on a
    launch-bound device the averaging costs less than the timing noise, and a negative charge
    would credit DaSGD and local SGD time for averaging.
    """
    rule = AveragingRule(period=1, delay=1, merge="correct")

    def step_and_average(ts: TrainState, x: Any, y: Any) -> tuple[TrainState, Any]:
        snapshot = (ts.params, ts.states)
        average = rule.average(snapshot, ROUND_AXIS)  # issued before the step, as in the round
        stepped, loss = kernels.train_step(ts, x, y)
        params, states = rule.merge_tree((stepped.params, stepped.states), snapshot, average)
        return TrainState(params, states, stepped.opt_states), loss

    def one_worker(fn: Callable) -> Callable:
        return jax.jit(jax.vmap(fn, axis_name=ROUND_AXIS))

    programs = {"step_and_average": one_worker(step_and_average), "step": one_worker(kernels.train_step)}
    args = jax.tree.map(lambda a: a[None], (ts, x, y))
    times = interleaved_median_times(programs, *args, repeats=repeats)
    return max(times["step_and_average"] - times["step"], 0.0)


def measure_concurrency(fn: Callable, *args: Any, repeats: int = 10) -> float:
    """Calibrates ``TimingModel.concurrency`` as one number: how much faster two concurrent
    calls finish (``measure_concurrency_curve``'s ``g2``, clipped to ``[1, 2]``).

    Example::

        c = measure_concurrency(k.forward(0), params[0], states[0], x)
        timing = dataclasses.replace(timing, concurrency=c)
    """
    return min(2.0, max(1.0, measure_concurrency_curve(fn, *args, programs=2, repeats=repeats)[1]))


def measure_concurrency_curve(
    fn: Callable, *args: Any, programs: int = 3, repeats: int = 10, host_cpus: tuple[int, ...] | None = None
) -> tuple[float, ...]:
    """A device's concurrency curve ``(1, g2, ..., g_programs)`` for ``TimingModel.concurrency``.

    Times ``n`` calls of ``fn(*args)`` from ``n`` threads of one pool at once, for ``n`` from 1
    (medians of ``repeats``); ``g_n = n * alone / together``, ``alone`` the one call's time,
    clipped to ``n`` (below 1 when concurrent calls slow each other down). The call alone goes
    through the pool too, so its hand-offs between threads weigh on every ``n`` alike rather than
    lowering ``g_n`` on short programs. Meaningful on an accelerator, whose programs may leave it
    partly idle; on a CPU it measures idle cores and the thread pools' contention.

    Args:
      fn: the program (a jitted function); ``args``: its arguments.
      programs: the largest number of concurrent calls (the curve's length).
      repeats: timed calls (or groups of concurrent calls) per median.
      host_cpus: the cores the calling threads are pinned to while they dispatch, as the
        threaded runtime pins its workers (``affinity.resolve_host_cpus``); None leaves them
        unpinned. XLA's own compute threads are never pinned.

    Returns:
      ``(1.0, g2, ..., g_programs)``.

    Example::

        curve = measure_concurrency_curve(k.job_gradients, params, states, x, y)
        timing = dataclasses.replace(timing, concurrency=curve)
    """
    if repeats < 1 or programs < 1:
        raise ValueError(f"repeats {repeats!r} and programs {programs!r} must be >= 1")

    with affinity.pinned_thread(host_cpus):
        pool = concurrent.futures.ThreadPoolExecutor(
            programs, initializer=affinity.pin_current_thread, initargs=(host_cpus,)
        )
        with pool:

            def together(n: int) -> None:
                for future in [pool.submit(fn, *args) for _ in range(n)]:
                    jax.block_until_ready(future.result())

            seconds = [_median_time(together, n, repeats=repeats) for n in range(1, programs + 1)]
    return tuple(min(float(n), n * seconds[0] / t) for n, t in enumerate(seconds, 1))
