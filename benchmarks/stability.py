"""``stability``: does the default threaded PD-ASGD collapse, and is its default rate slow?

Runs PD-ASGD exactly as ``python -m pdasgd_jax train --algo pdasgd --replicas 2 --epochs 40``
runs it (threaded runtime, digits, every other flag at its default, the default rate of
``config.ASYNCHRONOUS_DEFAULT_LR`` included) over 30 seeds, and reports each seed's final test accuracy,
the minimum and how many runs collapsed: ended below ``COLLAPSED_BELOW`` test accuracy or
were stopped by the divergence watch. A collapse exits 0 unless the watch catches it, so
only many seeds show how often the default rate fails. Sync at its own default rate over
the first ``REFERENCE_SEEDS`` seeds is the reference the asynchronous rate must not fall far
behind.
"""

from __future__ import annotations

import statistics
import warnings
from collections.abc import Sequence
from typing import Any

from pdasgd_jax.compare import markdown_table
from pdasgd_jax.config import Config
from pdasgd_jax.outcome import RunFailedWarning
from pdasgd_jax.reporting import NonFiniteLossError
from pdasgd_jax.train import train_and_evaluate

SEEDS = tuple(range(30))
REFERENCE_SEEDS = 5
EPOCHS = 40.0
REPLICAS = 2
COLLAPSED_BELOW = 0.9  # well below what digits' MLP reaches (BENCHMARKS.md, stability): a run below has lost its way


def seed_outcomes(algo: str, seeds: Sequence[int], *, epochs: float = EPOCHS, **overrides: Any) -> list[dict]:
    """One default-flag threaded run of ``algo`` on digits per seed, run one after another.

    Returns, per seed, its final ``test_accuracy`` (None when the divergence watch stopped it),
    ``diverged`` and ``collapsed`` (diverged, or below ``COLLAPSED_BELOW``). ``overrides`` are
    further ``Config`` fields, such as a candidate ``lr``.
    """
    replicas = {"replicas": REPLICAS} if algo != "sync" else {}
    outcomes = []
    for seed in seeds:
        config = Config(algo=algo, dataset="digits", epochs=epochs, seed=seed, progress=False, **replicas, **overrides)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RunFailedWarning)  # a collapse is what this counts
                accuracy, diverged = float(train_and_evaluate(config)["test_accuracy"]), False
        except NonFiniteLossError:  # the divergence watch's stop, or a NaN loss
            accuracy, diverged = None, True
        collapsed = diverged or accuracy < COLLAPSED_BELOW
        outcomes.append({"seed": seed, "test_accuracy": accuracy, "diverged": diverged, "collapsed": collapsed})
    return outcomes


def _row(label: str, lr: float, outcomes: list[dict]) -> dict[str, Any]:
    accs = [o["test_accuracy"] for o in outcomes if o["test_accuracy"] is not None]
    return {
        "run": label,
        "lr": lr,
        "seeds": len(outcomes),
        "collapsed": sum(o["collapsed"] for o in outcomes),
        "min": f"{min(accs):.4f}" if accs else "-",
        "median": f"{statistics.median(accs):.4f}" if accs else "-",
    }


def run(out_dir: str, *, quick: bool) -> tuple[dict[str, Any], str]:
    """Runs the protocol (``quick``: 3 seeds, 3 epochs, sync on one); returns results and table."""
    del out_dir  # the runs' own files are not kept
    seeds, epochs, reference = (SEEDS[:3], 3.0, 1) if quick else (SEEDS, EPOCHS, REFERENCE_SEEDS)
    pdasgd_lr, sync_lr = (Config(algo=a).effective_lr for a in ("pdasgd", "sync"))
    pdasgd = seed_outcomes("pdasgd", seeds, epochs=epochs)
    sync = seed_outcomes("sync", seeds[:reference], epochs=epochs)
    results = {
        "settings": {"dataset": "digits", "replicas": REPLICAS, "epochs": epochs, "collapsed_below": COLLAPSED_BELOW},
        "pdasgd": {"lr": pdasgd_lr, "runs": pdasgd},
        "sync": {"lr": sync_lr, "runs": sync},
    }
    rows = [_row(f"pdasgd, {REPLICAS} replicas (threaded)", pdasgd_lr, pdasgd), _row("sync", sync_lr, sync)]
    per_seed = " ".join(
        f"{o['seed']}:{'diverged' if o['test_accuracy'] is None else format(o['test_accuracy'], '.3f')}" for o in pdasgd
    )
    table = markdown_table(rows, ("run", "lr", "seeds", "collapsed", "min", "median"))
    header = f"stability: digits, {epochs:g} epochs, default flags; collapsed: stopped or accuracy < {COLLAPSED_BELOW}"
    return results, "\n".join([header, "", table, "", f"pdasgd per seed: {per_seed}"])
