"""A loss that stays far above where it started stops the run (or warns), at the step it is seen."""

import numpy as np
import pytest

from pdasgd_jax import Config
from pdasgd_jax.cli import main
from pdasgd_jax.divergence import START_STEPS, DivergenceWatch
from pdasgd_jax.errors import ConfigError, LossDivergedError, NonFiniteLossError
from pdasgd_jax.metrics import MetricsLog


def _feed(log, losses):
    for step, loss in enumerate(losses, start=1):
        log.add_loss(step, np.float32(loss))


def test_a_sustained_rise_stops_the_run_at_the_window_end_and_a_spike_does_not():
    start = [2.0] * START_STEPS
    watch = DivergenceWatch(factor=3.0, window=5, action="stop")
    log = MetricsLog(lambda p, s: {}, total_examples=10**6, eval_every=10**9, progress=False, divergence=watch)
    # A spike shorter than the window, then back down: nothing happens.
    _feed(log, [*start, 7.0, 7.0, 7.0, 7.0, 1.0])
    with pytest.raises(LossDivergedError, match=r"above 3 x its starting value 2 for 5 steps, 6.7 at step 20"):
        for step, loss in enumerate([6.7] * 5, start=START_STEPS + 6):
            log.add_loss(step, np.float32(loss))
    assert issubclass(LossDivergedError, NonFiniteLossError)  # the CLI and benchmarks treat it as a failed run
    assert watch.event["step"] == 20 and watch.event["starting_loss"] == 2.0


def test_warn_records_the_event_once_and_goes_on():
    watch = DivergenceWatch(factor=2.0, window=3, action="warn")
    with pytest.warns(RuntimeWarning, match="training loss diverged"):
        for step, loss in enumerate([1.0] * START_STEPS + [5.0] * 10, start=1):
            watch.observe(step, loss)
    assert watch.event["step"] == START_STEPS + 3
    off = DivergenceWatch(factor=2.0, window=1, action="off")
    for step, loss in enumerate([1.0] * START_STEPS + [50.0] * 3, start=1):
        off.observe(step, loss)
    assert off.event is None


def test_bad_divergence_flags_are_refused(capsys):
    with pytest.raises(ConfigError, match=r"--divergence-factor 1\.0 must be > 1"):
        Config(divergence_factor=1.0).validate()
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--on-divergence", "later"])
    assert exit_info.value.code == 2
    assert "--on-divergence: invalid choice: 'later' (choose from 'stop', 'warn', 'off')" in capsys.readouterr().err


def test_a_run_records_no_divergence_when_there_was_none(tmp_path):
    from pdasgd_jax import train_and_evaluate

    summary = train_and_evaluate(Config(epochs=0.5, progress=False))
    assert summary["divergence"] is None
