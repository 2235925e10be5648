"""The fleets benchmark's threads per device: which rows run several (and why the others cannot
yet, on their clocks), and that a fleet event hits a device, every thread of it."""

from __future__ import annotations

import math

import pytest

from benchmarks.delays import simulation
from benchmarks.delays.protocol import STRAGGLER_FACTOR, THREADS_PER_DEVICE
from benchmarks.fleets import cells, protocol
from pdasgd_jax.layout import Layout, resolve

W = 16


def _config(row: str, threads: int | None = None):
    """``row``'s config at W = 16 under the straggler as ``delays``' ``time_to_target`` runs it
    (``threads``: in place of the row's own threads per device)."""
    run = protocol.overrides(row, protocol.Scenario(W, "straggler"), 0)
    if threads is not None:
        run["threads_per_device"] = threads
    return cells.run_config(run, W, 0.1, 0, protocol.EPOCHS_BY_W[W])


def test_every_row_indexes_its_fleet_by_device():
    # One replica per device, or (the event-driven clock's rows) the fleet on the devices:
    # either way the fleet's W indices are the W devices, and the churn is drawn for W.
    for row, row_config in protocol.ROWS.items():
        config = _config(row)
        config.validate()
        layout = resolve(config, 1)
        assert layout.devices == W, row
        if row_config["algo"] == "sync":
            assert protocol.threads(row) == 1
        elif row_config["algo"] == "lpp" or row_config.get("replication") == "replicas":
            assert protocol.threads(row) == THREADS_PER_DEVICE
        else:
            assert layout == Layout(W, W) and protocol.threads(row) == 1, row


def test_the_one_thread_averaging_rows_can_share_a_device_on_the_clock():
    # Their three-thread variants: each clock runs a device's replicas one after another, but for
    # local SGD's streaming merges under a fleet (their fragments' schedule gives each replica a
    # device), refused by name.
    rows = [r for r, c in protocol.ROWS.items() if c["algo"] != "sync" and protocol.threads(r) == 1]
    assert {protocol.ROWS[r]["algo"] for r in rows} == {"local", "dasgd", "async-local"}
    for row in rows:
        config = _config(row, THREADS_PER_DEVICE)
        if protocol.ROWS[row]["algo"] == "async-local":  # its clock runs a device's replicas one at a time
            config.validate()
            assert resolve(config, 1) == Layout(W, W * THREADS_PER_DEVICE), row
        elif config.fragments > 1:
            with pytest.raises(ValueError, match=f"--fragments {config.fragments} with 3 replicas per device"):
                config.validate()
        else:
            config.validate()
            assert resolve(config, 1) == Layout(W, W * THREADS_PER_DEVICE), row


def test_the_straggler_of_a_three_thread_row_slows_exactly_the_last_devices_threads(monkeypatch):
    real, seen = simulation.run_simulated, []

    def recorded(exp, metrics, **kwargs):
        result = real(exp, metrics, **kwargs)
        seen.append((exp.config, result.extra))
        return result

    monkeypatch.setattr(simulation, "run_simulated", recorded)
    cells.run_once("lpp", protocol.Scenario(W, "straggler"), 0.2, protocol.TUNING_SEEDS[0], 1.0)
    [(config, extra)] = seen
    assert config.fleet == protocol.straggler(W) and (config.devices, config.replicas) == (W, W * THREADS_PER_DEVICE)
    stretch = extra["fleet"]["stretch"]
    assert stretch[W - 1] > 0 and not any(stretch[: W - 1])
    # Thread g runs on device g % W: the last device's threads and its averaging are every kernel it
    # ran, and each was stretched whole, STRAGGLER_FACTOR times: the seconds added are
    # (F - 1) / F of the device's busy time, so every one of its threads was slowed.
    busy = extra["utilisation"]["workers"]
    on_last = [f"w{g}" for g in range(W - 1, W * THREADS_PER_DEVICE, W)] + [f"d{W - 1}/averaging"]
    assert all(busy[name] > 0 for name in on_last[:-1])
    device_busy = sum(busy[name] for name in on_last) * extra["virtual_time"]
    assert math.isclose(stretch[W - 1], (STRAGGLER_FACTOR - 1) / STRAGGLER_FACTOR * device_busy, rel_tol=1e-6)


def test_at_w64_three_threads_leave_a_shard_under_a_batch_and_are_refused_before_any_run():
    # 192 replicas' shards of digits' 1438 training examples hold 7 each, less than a batch of 16.
    scenario = protocol.Scenario(64, "straggler")
    for row in ("local", "async-local"):
        with pytest.raises(cells.Refused, match="16 x 192 replicas exceeds the 1438 training examples"):
            cells.check(row, scenario, 0.2, protocol.TUNING_SEEDS[:1], 60.0, "3 threads")
        cells.check(row, scenario, 0.2, protocol.TUNING_SEEDS[:1], 60.0, "1 thread")
