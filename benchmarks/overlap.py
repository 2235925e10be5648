"""``overlap``: does DaSGD hide its communication? (algorithms.md §6)

Two parts:

* **virtual clock**: per-step time of ``dasgd`` (H = 8, d = 4), ``local`` (d = 0) and ``sync``
  against compute only, for all-reduces costing 0.5 to 8 steps of compute; the per-step
  compute is this machine's measured round time below. This part prices communication
  only: its hand-built timing has no ``average``/``merge`` costs, so the mean's and the
  merge's device work (which the averaging clock charges from a calibration, and which no
  delay hides) is left out, and DaSGD's rows show the schedule's hiding of network time.
  The real part's rounds include that work.
* **real**: the compiled round program on this machine's devices (D workers of the digits
  MLP; ``shard_map`` over the devices, or ``vmap`` on one): ``dasgd`` and ``local`` rounds
  against the same local steps with no averaging at all.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from pdasgd_jax import data, models, spmd
from pdasgd_jax.bench import progress
from pdasgd_jax.compare import markdown_table
from pdasgd_jax.delays import CommModel, DelayModel, TimingModel
from pdasgd_jax.kernels import make_train_step
from pdasgd_jax.optim import AveragingRule
from pdasgd_jax.simulate.averaging_clock import averaging_step_end_times, sync_step_end_times

PERIOD, DELAY, WORKERS, BATCH = 8, 4, 8, 32


def _compute_only_program(model, tx, mesh):
    """The round's H local steps with no averaging: what communication hiding is judged against."""
    step = make_train_step(model, tx)

    def steps(ws, x_HxB, y_HxB):
        train, loss = jax.lax.scan(lambda ts, xy: step(ts, *xy), ws.train, (x_HxB, y_HxB))
        return ws._replace(train=train), loss

    mapped = jax.vmap(steps)
    if mesh is None:
        return jax.jit(mapped, donate_argnums=0)
    spec = P(spmd.WORKER_AXIS)
    return jax.jit(
        jax.shard_map(mapped, mesh=mesh, in_specs=(spec, spec, spec), out_specs=(spec, spec), check_vma=False),
        donate_argnums=0,
    )


def _time_rounds(program, ws, x, y, rounds: int, repeats: int) -> list[float]:
    """Seconds per local step, one sample per repeat of ``rounds`` rounds (after a compile run)."""
    ws, loss = program(ws, x, y)
    jax.block_until_ready(loss)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(rounds):
            previous = loss
            ws, loss = program(ws, x, y)
            spmd.wait_for_round(previous)
        jax.block_until_ready((ws, loss))
        samples.append((time.perf_counter() - start) / (rounds * PERIOD))
        progress.tick()
    return samples


def _real(quick: bool) -> dict[str, Any]:
    ds = data.load_dataset("digits")
    model, variables = models.build_model("mlp", ds, seed=0)
    tx = optax.sgd(0.05, momentum=0.9)
    mesh = spmd.worker_mesh(WORKERS)
    sharding = spmd.worker_sharding(mesh)
    batches = list(data.train_batches(ds.train, BATCH, seed=0, epoch=0))[:PERIOD]
    x = jax.device_put(np.broadcast_to(np.stack([b[0] for b in batches]), (WORKERS, PERIOD, BATCH, 8, 8, 1)), sharding)
    y = jax.device_put(np.broadcast_to(np.stack([b[1] for b in batches]), (WORKERS, PERIOD, BATCH)), sharding)
    rounds, repeats = (5, 3) if quick else (50, 7)
    results = {
        "workers": WORKERS,
        "devices": 1 if mesh is None else mesh.size,
        "period": PERIOD,
        "delay": DELAY,
        "batch_per_worker": BATCH,
        "rounds_per_sample": rounds,
    }
    programs = {
        "compute_only": _compute_only_program(model, tx, mesh),
        "dasgd": spmd.make_round_program(model, tx, AveragingRule(PERIOD, DELAY), mesh),
        "local": spmd.make_round_program(model, tx, AveragingRule(PERIOD, 0), mesh),
    }
    for name, program in programs.items():
        ws = spmd.init_workers(variables, tx, AveragingRule(PERIOD, DELAY), WORKERS, sharding)
        samples = _time_rounds(program, ws, x, y, rounds, repeats)
        results[name] = {
            "step_s_median": statistics.median(samples),
            "step_s_min": min(samples),
            "step_s_max": max(samples),
        }
    return results


def _virtual(step_seconds: float) -> list[dict[str, Any]]:
    rows = []
    nbytes = 10**6
    for multiple in (0.5, 1, 2, 4, 8):
        allreduce = multiple * step_seconds
        beta = 2 * (WORKERS - 1) / WORKERS * nbytes / allreduce
        timing = TimingModel(
            forward=(step_seconds / 4,),
            backward=(step_seconds / 2,),
            update=(step_seconds / 4,),
            comm=CommModel(beta=beta),
        )
        steps = 64 * PERIOD
        kw = dict(num_workers=WORKERS, steps=steps, seed=0)
        per_step = {
            "dasgd": averaging_step_end_times(
                timing, DelayModel(), period=PERIOD, delay=DELAY, model_nbytes=nbytes, **kw
            )[-1]
            / steps,
            "local": averaging_step_end_times(timing, DelayModel(), period=PERIOD, delay=0, model_nbytes=nbytes, **kw)[
                -1
            ]
            / steps,
            "sync": sync_step_end_times(timing, DelayModel(), grad_nbytes=nbytes, **kw)[-1] / steps,
        }
        rows.append(
            {
                "allreduce_in_steps": multiple,
                **{f"{k}_vs_compute": v / timing.step_compute_time() for k, v in per_step.items()},
            }
        )
    return rows


def run(out_dir: str, *, quick: bool) -> tuple[dict[str, Any], str]:
    """Runs both parts; returns the results and a markdown report."""
    real = _real(quick)
    compute = real["compute_only"]["step_s_median"]
    virtual = _virtual(compute)
    real_rows = [
        {
            "program": name,
            "ms/step (median)": 1e3 * real[name]["step_s_median"],
            "min": 1e3 * real[name]["step_s_min"],
            "max": 1e3 * real[name]["step_s_max"],
            "vs compute only": real[name]["step_s_median"] / compute,
        }
        for name in ("compute_only", "dasgd", "local")
    ]
    table = (
        f"Virtual clock ({WORKERS} workers, H={PERIOD}, d={DELAY}; time per step / compute-only step):\n\n"
        + markdown_table(virtual, list(virtual[0]))
        + "\n\n"
        + f"Real round program on {real['devices']} device(s), {WORKERS} workers, digits MLP, "
        + f"batch {BATCH}/worker ({jax.devices()[0].platform}):\n\n"
        + markdown_table(real_rows, list(real_rows[0]))
    )
    return {"virtual": virtual, "real": real, "platform": jax.devices()[0].platform}, table
