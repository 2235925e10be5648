"""ASGD and PD-ASGD as simulated workers: who runs which stage operation, and when.

Every operation is a real kernel run through the ``StageExecutor`` at its virtual start
(reads: the forward's weights, a ``live`` backward's weights) and committed at its virtual
end (writes: a stage's update, its non-trainable state). Each worker draws one injected
delay per job, after its part of the job (idle time: the device is free meanwhile).

* ASGD (algorithms.md §2): each worker reads every stage in its forward, computes the full
  gradient and applies all stages at the end.
* PD-ASGD (§3): per replica ``F`` forward workers feed ``B`` backward workers
  through a channel of capacity ``Q`` (a full channel blocks the forward worker); a
  backward applies stage ``m``'s update at the end of stage ``m``'s backward (``layerwise``)
  or all updates after the whole backward (``pdasgd-block``). Every replica's workers read
  and update one shared store (``replication="shared"``); a stage whose home is another
  device costs a transfer before it is read (pull) and before its update lands (push).

Worker group ``g`` (ASGD worker or PD-ASGD replica) runs on ``sim.group_devices[g]``;
its workers are named ``w{g}`` and ``d{g}/forward{i}``, ``d{g}/backward{i}``, as in the
threaded runtime, so both draw the same delays.
"""

from __future__ import annotations

import functools

from pdasgd_jax.executor import Job
from pdasgd_jax.simulate.scheduler import BACKWARD, Channel, Device, Get, Kernel, Put, Sleep, Worker
from pdasgd_jax.simulate.simulation import Simulation


def forward_pass(sim: Simulation, job: Job, device: Device, worker: str) -> Worker:
    """Stage forwards ``0..M-1`` (each reads the stage current at its start) and the loss."""
    ex, c = sim.executor, sim.costs[device.index]
    for m in range(sim.num_stages):
        if c.transfer[m]:
            yield Sleep(c.transfer[m])
        yield Kernel(
            device, c.forward[m], functools.partial(ex.forward_stage, job, m, commit_state=False, worker=worker)
        )
        ex.commit_state(job, m, worker=worker)
    yield Kernel(device, c.loss, functools.partial(ex.loss, job, worker=worker))


def backward_pass(sim: Simulation, job: Job, device: Device, worker: str, *, layerwise: bool) -> Worker:
    """Stage backwards ``M-1..0`` with layer-wise updates, or all updates at the end."""
    ex, c = sim.executor, sim.costs[device.index]
    stages = range(sim.num_stages - 1, -1, -1)
    for m in stages:
        if ex.live and c.transfer[m]:  # re-linearises at the current weights: pull them if remote
            yield Sleep(c.transfer[m])
        work = c.backward[m] + (c.update[m] if layerwise else 0.0)
        yield Kernel(device, work, functools.partial(ex.backward_stage, job, m, worker=worker), BACKWARD)
        if layerwise:
            if c.transfer[m]:
                yield Sleep(c.transfer[m])
            ex.update_stage(job, m, worker=worker)
    if not layerwise:
        yield Kernel(device, sum(c.update[m] for m in stages), None, BACKWARD)
        yield Sleep(sum(c.transfer[m] for m in stages))
        for m in stages:
            ex.update_stage(job, m, worker=worker)


def asgd_worker(sim: Simulation, device: Device, name: str) -> Worker:
    """Hogwild!-style worker: read all stages, full gradient, apply, repeat."""
    rng = sim.delay_rng(name)
    compute = sim.forward_compute(device) + sim.backward_compute(device)
    while (job := sim.next_job(name)) is not None:
        yield from forward_pass(sim, job, device, name)
        yield from backward_pass(sim, job, device, name, layerwise=False)
        sim.job_done(job)
        yield sim.idle(rng, compute)


def forward_worker(sim: Simulation, device: Device, name: str, channel: Channel) -> Worker:
    """PD-ASGD forward worker: forward a batch, hand the job to the backward workers."""
    rng = sim.delay_rng(name)
    compute = sim.forward_compute(device)
    while (job := sim.next_job(name)) is not None:
        yield from forward_pass(sim, job, device, name)
        yield Put(channel, job)
        yield sim.idle(rng, compute)


def backward_worker(sim: Simulation, device: Device, name: str, channel: Channel, *, layerwise: bool) -> Worker:
    """PD-ASGD backward worker: take a job, backward with (layer-wise) updates; runs until
    no job will come (it then stays blocked and the simulation ends)."""
    rng = sim.delay_rng(name)
    compute = sim.backward_compute(device)
    while True:
        job = yield Get(channel)
        yield from backward_pass(sim, job, device, name, layerwise=layerwise)
        sim.job_done(job)
        yield sim.idle(rng, compute)


def spawn_asgd(sim: Simulation) -> None:
    """One ASGD worker per group (by default, per device)."""
    for g, device in enumerate(sim.group_devices):
        name = f"w{g}"
        sim.scheduler.spawn(name, asgd_worker(sim, device, name))


def spawn_pdasgd(sim: Simulation, *, forward_workers: int, backward_workers: int, queue: int, layerwise: bool) -> None:
    """Per replica (group; by default one per device) ``F`` forward and ``B`` backward
    workers and a channel of capacity ``Q``."""
    for g, device in enumerate(sim.group_devices):
        channel = Channel(queue)
        for i in range(forward_workers):
            name = f"d{g}/forward{i}"
            sim.scheduler.spawn(name, forward_worker(sim, device, name, channel))
        for i in range(backward_workers):
            name = f"d{g}/backward{i}"
            sim.scheduler.spawn(name, backward_worker(sim, device, name, channel, layerwise=layerwise))
