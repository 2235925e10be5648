"""Writes the Colab notebooks in ``notebooks/`` from the cell sources below.

The notebooks are generated so they can be reviewed (and diffed) as code; edit this file,
then run ``python scripts/make_notebooks.py``. ``--check`` exits with status 1 if a
committed notebook differs from what this file generates. Outputs are never committed:
the notebooks are written with empty outputs and execution counts.

Every notebook starts the same way: a Colab-only install cell, a small-size switch
(``PDASGD_SMALL``, small unless set to 0: CI and ``tests/test_notebooks.py`` execute the
small versions), and a cell printing the devices. Its last cell prints one machine-checkable
``RESULT key=value ...`` line: every run's final accuracy and whatever else a statement in the
notebook's text rests on, which ``tests/test_notebooks.py`` checks against that text. So a
statement about a result goes in the text only with its check, and holds at the small sizes
as well as the full ones. Every rate of SGD with momentum is at most ``Config``'s default for
its algorithm (0.02 for the asynchronous ones, 0.05 for the others), smaller where staleness
grows.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

import nbformat

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
# The repository's address (not confirmed yet): the Colab badges and the default install source.
REPO_URL = "https://github.com/pdasgd-jax/pdasgd-jax"
# The notebooks' default install source (README, "Notebooks", says how to point them elsewhere).
PIP_SPEC = f"pdasgd-jax[all] @ git+{REPO_URL}"
# The oldest JAX the package supports: pyproject.toml's floor, which the install cell checks.
JAX_FLOOR = re.search(r'"jax>=([0-9.]+)"', (pathlib.Path(__file__).parent.parent / "pyproject.toml").read_text())[1]

Cell = tuple[str, str]  # ("md" | "code", source)


def md(source: str) -> Cell:
    return ("md", source.strip("\n"))


def code(source: str) -> Cell:
    return ("code", source.strip("\n"))


def colab_badge(name: str) -> str:
    repo = REPO_URL.removeprefix("https://github.com/")
    url = f"https://colab.research.google.com/github/{repo}/blob/main/notebooks/{name}.ipynb"
    return f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({url})"


# The install cell. It installs nothing where pdasgd_jax already imports (a checkout with the
# package installed, the test suite, a second run on Colab); otherwise it installs from the
# checkout the notebook sits in, else from PDASGD_SOURCE. The JAX already there (Colab's
# accelerator build and its plugins) is kept: pip is constrained to the installed versions.
INSTALL = code(
    '''
# Where pdasgd-jax comes from when it is not installed yet: any pip requirement (a git URL, or a
# wheel's path or URL followed by [all]); the environment variable PDASGD_SOURCE overrides it.
PDASGD_SOURCE = "@PIP_SPEC@"

import importlib.metadata
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import tempfile

KEEP = ("jax", "libtpu", "numpy", "ipywidgets")  # installed packages pip must not replace
JAX_FLOOR = "@JAX_FLOOR@"  # the oldest JAX pdasgd-jax supports


def version_tuple(version):
    return tuple(int(part) for part in re.findall(r"\\d+", version)[:3])


try:
    installed_jax = importlib.metadata.version("jax")
except importlib.metadata.PackageNotFoundError:
    installed_jax = None
if installed_jax and version_tuple(installed_jax) < version_tuple(JAX_FLOOR):
    # The install keeps the runtime's JAX (its accelerator build): an older one must be upgraded first.
    raise RuntimeError(
        f"pdasgd-jax needs jax >= {JAX_FLOOR}, and this runtime has jax {installed_jax}, which the install "
        f"keeps. Upgrade it first (pip install -U 'jax[cuda12]' on a GPU runtime, 'jax[tpu]' on a TPU one, "
        f"'jax' on CPU), restart the runtime and run this cell again."
    )


def checkout_root():
    """The clone of the repository this notebook runs in, if it runs in one."""
    for root in (pathlib.Path.cwd(), *pathlib.Path.cwd().parents):
        pyproject = root / "pyproject.toml"
        if pyproject.is_file() and 'name = "pdasgd-jax"' in pyproject.read_text():
            return root
    return None


if importlib.util.find_spec("pdasgd_jax") is None:
    root = None if "PDASGD_SOURCE" in os.environ else checkout_root()
    requirement = f"{root}[all]" if root else os.environ.get("PDASGD_SOURCE", PDASGD_SOURCE)
    pins = sorted(
        {f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions()
         if (d.metadata.get("Name") or "").lower().startswith(KEEP)}
    )
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as constraints:
        constraints.write("\\n".join(pins))
    print("installing", requirement, "keeping", ", ".join(pins) or "nothing")
    # ipywidgets draws tqdm's progress bars in a notebook (Config(progress=True)).
    pip = [sys.executable, "-m", "pip", "install", "-q", "-c", constraints.name, requirement, "ipywidgets"]
    subprocess.check_call(pip)

import pdasgd_jax

print("pdasgd-jax", pdasgd_jax.__version__, "from", pathlib.Path(pdasgd_jax.__file__).parent)
'''.replace("@PIP_SPEC@", PIP_SPEC).replace("@JAX_FLOOR@", JAX_FLOOR)
)

SMALL_SWITCH = code("""
import os

# Small sizes by default (the sizes CI runs every notebook at, on two CPU cores);
# set the environment variable PDASGD_SMALL=0, or SMALL = False here, for the full-size runs.
SMALL = os.environ.get("PDASGD_SMALL", "1") == "1"
print("small sizes" if SMALL else "full sizes")
""")

DEVICES = code("""
import jax

# JAX picks a GPU or TPU by itself when the runtime has one.
print(jax.default_backend(), jax.devices())
""")

# Plotting helpers shared by the notebooks: a run's metrics.jsonl, and figures shown inline.
SHOW = '''
def show(fig):
    """Displays `fig` as a PNG, whichever matplotlib backend is active (the library writes
    its own plot files with the non-interactive Agg backend, which silences plt.show())."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80, bbox_inches="tight")
    plt.close(fig)
    display(Image(buffer.getvalue()))
'''

HELPERS = code(
    '''
import io
import json
import pathlib

import matplotlib.pyplot as plt
from IPython.display import Image, display


def load_rows(run_dir):
    """The evaluations of a finished run: one dict per line of its metrics.jsonl."""
    with open(pathlib.Path(run_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]

'''
    + SHOW
)

PLOT_ONLY = code(
    """
import io

import matplotlib.pyplot as plt
from IPython.display import Image, display

"""
    + SHOW
)


def quickstart() -> list[Cell]:
    return [
        md(f"""
# PD-ASGD quick start: asynchronous vs synchronous SGD on digits

{colab_badge("quickstart")}

**PD-ASGD** (asynchronous SGD with decoupled backpropagation and layer-wise updates,
arXiv 2410.05985) runs forward and backward passes in separate worker threads: a forward
worker pushes activations into a bounded queue, backward workers pop them and update each
layer as soon as its gradient is ready, so every layer's update is slightly stale.

This notebook trains the same MLP on scikit-learn's 8x8 digits (shipped with the package,
no download) three ways, with one call each, `train_and_evaluate(Config(...))`:

* `sgd`: plain minibatch SGD, one fused jitted step;
* `sync`: synchronous data parallel SGD over the devices of this runtime (8 cores on a Colab TPU v2-8);
* `pdasgd`: PD-ASGD on the real threaded runtime (1 forward and 2 backward worker threads).

It then plots test accuracy against wall time and against examples processed, and shows the
per-layer staleness PD-ASGD's updates had.
"""),
        INSTALL,
        SMALL_SWITCH,
        DEVICES,
        HELPERS,
        md("""
## Three runs with one configuration

Every run is a `Config`; `out=` makes it write `metrics.jsonl` (one row per evaluation),
`summary.json` and `curves.png`. All three see the same number of examples with the same
optimizer: SGD with momentum 0.9, batch 32 and learning rate `LR = 0.02`. That is the
asynchronous algorithms' default rate (`Config(lr=None)` picks it for `pdasgd`), chosen with a
wide margin below the rates at which threaded PD-ASGD collapses to chance (BENCHMARKS.md,
"stability"); `sgd` and `sync`, whose default is 0.05, take it too, so the three take the same
steps.
"""),
        code("""
import math

from pdasgd_jax import Config, train_and_evaluate

EPOCHS = 5 if SMALL else 30
LR = 0.02  # Config.lr's default for the asynchronous algorithms (pdasgd_jax.config.ASYNCHRONOUS_DEFAULT_LR)
RUNS = pathlib.Path("runs/quickstart")
COMMON = dict(dataset="digits", epochs=EPOCHS, batch_size=32, lr=LR, optimizer="momentum",
              eval_every=320, seed=0, progress=False)

configs = {
    "sgd": Config(algo="sgd", **COMMON),
    # The global batch of 32 is split over the devices (as many as divide it).
    "sync": Config(algo="sync", devices=math.gcd(32, jax.device_count()), **COMMON),
    # One replica: 1 forward and 2 backward worker threads, a queue of 2 between them.
    "pdasgd": Config(algo="pdasgd", replicas=1, forward_workers=1, backward_workers=2, **COMMON),
}
summaries = {}
for name, config in configs.items():
    config.out = str(RUNS / name)
    s = summaries[name] = train_and_evaluate(config, overwrite=True)  # re-running a cell replaces its run
    print(f"{name:7s} test accuracy {s['test_accuracy']:.4f}   wall time {s['wall_time']:5.2f} s   "
          f"{s['examples_per_s']:8.0f} examples/s   devices {s['devices']}")
"""),
        md("""
All three end above 0.9 test accuracy, at the small sizes (5 epochs) and the full ones (30).

## Accuracy against wall time and against examples

Wall time includes compilation; against examples the three algorithms are compared per unit
of data.
"""),
        code("""
fig, (ax_time, ax_examples) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
for name in configs:
    rows = load_rows(RUNS / name)
    accuracy = [r["test_accuracy"] for r in rows]
    ax_time.plot([r["wall_time"] for r in rows], accuracy, marker=".", label=name)
    ax_examples.plot([r["examples"] for r in rows], accuracy, marker=".", label=name)
ax_time.set(xlabel="wall time (s)", ylabel="test accuracy", title="accuracy vs wall time")
ax_examples.set(xlabel="examples processed", title="accuracy vs examples")
ax_time.legend()
show(fig)
"""),
        md("""
`compare_runs` does the same from the run directories: an overlaid plot (loss and accuracy
against examples and time) and a markdown table of the summaries.
"""),
        code("""
from IPython.display import Markdown

from pdasgd_jax.compare import compare_runs

table = compare_runs([str(RUNS / name) for name in configs], str(RUNS / "compare.png"))
display(Markdown(table))
display(Image(filename=str(RUNS / "compare.png")))
"""),
        md("""
## How stale were PD-ASGD's updates?

The staleness of an update is the number of updates other workers applied to the same
layer between the forward pass reading it and the backward pass writing it. A backward pass
runs from the last layer to the first, so the first layer waits longest for its gradient: on
average its updates are at least as stale as any later layer's, and each layer's at least as
stale as the next one's. The queue's capacity limits how many jobs are in flight at once, and
so how stale an update can be.
"""),
        code("""
per_stage = summaries["pdasgd"]["staleness"]["per_stage"]
fig, axes = plt.subplots(1, len(per_stage), figsize=(4 * len(per_stage), 3), sharey=True)
for m, (ax, stats) in enumerate(zip(axes, per_stage)):
    ax.bar(range(len(stats["histogram"])), stats["histogram"])
    ax.set(title=f"stage {m}: mean {stats['mean']:.2f}, max {stats['max']}", xlabel="staleness")
axes[0].set_ylabel("updates")
show(fig)
"""),
        code("""
# The values the text's statements rest on (tests/test_notebooks.py checks them).
print("RESULT " + " ".join(f"{name}_accuracy={s['test_accuracy']:.4f}" for name, s in summaries.items())
      + f" test_accuracy={summaries['pdasgd']['test_accuracy']:.4f} "
      + " ".join(f"pdasgd_staleness_stage{m}={stats['mean']:.4f}" for m, stats in enumerate(per_stage)))
"""),
    ]


def staleness_simulation() -> list[Cell]:
    return [
        md(f"""
# Staleness on a virtual clock: injected delays and worker counts

{colab_badge("staleness_simulation")}

With `simulate=True` every algorithm runs on a deterministic **virtual clock**: the real
jitted kernels compute every gradient and update, while a timing model (per-stage kernel
costs measured once on this machine) and a delay model (injected idle time per job) decide
*when* each operation happens, and so which parameter versions each worker reads. This
predicts how the algorithms behave with many devices and slow links on any machine, and
the same seed gives the same run.

Two sweeps on digits, same per-worker batch for everyone (synchronous SGD's global batch is
`W` times it):

1. **Injected delays**: each worker's job (sync: each step, which waits for the slowest
   worker) is delayed by `Exp(mean = k x one step's compute)`; sync vs Hogwild!-style ASGD
   vs PD-ASGD on `W` devices, accuracy against virtual time.
2. **Worker counts**: how staleness grows with `W` for ASGD and PD-ASGD: histograms.

**Learning rates.** Synchronous SGD runs at 0.05, its default in `Config`. ASGD and PD-ASGD run
at 0.02, the asynchronous algorithms' default (chosen with a wide margin below the rates at
which threaded PD-ASGD on 2 replicas collapses to chance: BENCHMARKS.md, "stability"), divided
by `W / 2` beyond 2 workers, since staleness grows with `W` (sweep 2). That keeps every
asynchronous rate at or below one that reached the target in each cell of the `delays`
benchmark's runs of this same setting (digits, batch 16 per worker, the simulator;
bench_results/delays), which tune the rate per algorithm, `W` and `k`. Every run below ends
above 0.9 test accuracy, at the small sizes and the full ones.
"""),
        INSTALL,
        SMALL_SWITCH,
        DEVICES,
        HELPERS,
        code('''
from pdasgd_jax import Config, train_and_evaluate

BATCH = 16                      # examples per job and worker
EPOCHS = 4 if SMALL else 20
TARGET = 0.9                    # for the time-to-accuracy column
RUNS = pathlib.Path("runs/staleness")


def learning_rate(algo, workers):
    """Sync: its default, 0.05. Asynchronous: their default, 0.02, divided by W / 2 beyond 2 workers."""
    return 0.05 if algo == "sync" else 0.02 / max(1.0, workers / 2)


def simulate(algo, workers, k, **overrides):
    """One simulated run; returns (summary, evaluation rows)."""
    out = RUNS / f"{algo}-W{workers}-k{k}"
    config = Config(
        algo=algo, simulate=True, devices=workers, dataset="digits", lr=learning_rate(algo, workers), epochs=EPOCHS,
        batch_size=BATCH * workers if algo == "sync" else BATCH, eval_every=8 * BATCH,
        delay_model="exponential" if k else "none", delay_mean=k, seed=0, progress=False,
        out=str(out), **overrides)
    return train_and_evaluate(config, overwrite=True), load_rows(out)


def time_to(rows, target=TARGET):
    """Virtual seconds until the test accuracy first reaches `target` (None: never)."""
    return next((r["virtual_time"] for r in rows if r["test_accuracy"] >= target), None)
'''),
        md("""
## Sweep 1: injected delays

PD-ASGD's workers are `F = 1` forward and `B = 2` backward threads per device; a device runs
one kernel at a time, so extra workers only help by filling the idle time the delays create:
PD-ASGD's virtual time for the same epochs, as a fraction of ASGD's, is smaller at the largest
delay than without delays. Synchronous SGD waits at every step for the slowest of its `W`
workers, so its virtual time grows more with `k` than either asynchronous algorithm's.
"""),
        code("""
W = 4
K_VALUES = [0.0, 2.0] if SMALL else [0.0, 0.5, 1.0, 2.0, 4.0]
ALGOS = ["sync", "asgd", "pdasgd"]

delay_runs = {(algo, k): simulate(algo, W, k) for k in K_VALUES for algo in ALGOS}
print(f"{'algo':7s} {'k':>4s} {'accuracy':>9s} {'virtual ms':>11s} {'ms to ' + str(TARGET):>10s} "
      f"{'staleness, stage 0':>19s}")
for (algo, k), (s, rows) in delay_runs.items():
    reached = time_to(rows)
    stale = s["staleness"]["per_stage"][0]["mean"]
    print(f"{algo:7s} {k:4.1f} {s['test_accuracy']:9.4f} {s['virtual_time'] * 1e3:11.2f} "
          f"{'-' if reached is None else f'{reached * 1e3:.2f}':>10s} {stale:19.2f}")
for k in K_VALUES:
    print(f"k = {k}: PD-ASGD's virtual time / ASGD's "
          f"{delay_runs['pdasgd', k][0]['virtual_time'] / delay_runs['asgd', k][0]['virtual_time']:.2f}")
"""),
        code("""
fig, axes = plt.subplots(1, len(K_VALUES), figsize=(5 * len(K_VALUES), 3.8), sharey=True, squeeze=False)
for ax, k in zip(axes[0], K_VALUES):
    for algo in ALGOS:
        rows = delay_runs[algo, k][1]
        ax.plot([r["virtual_time"] * 1e3 for r in rows], [r["test_accuracy"] for r in rows], marker=".", label=algo)
    ax.set(title=f"W = {W}, delay Exp(mean = {k} x step)", xlabel="virtual time (ms)")
axes[0, 0].set_ylabel("test accuracy")
axes[0, 0].legend()
show(fig)
"""),
        md("""
## Sweep 2: worker counts

One delay level, more devices. ASGD's staleness grows with `W`: every update another worker
applies between a read and the write counts. PD-ASGD's grows with `W` too and is higher than
ASGD's at every `W`: its queue and its `B` backward workers per device keep more jobs in
flight. It also differs per layer: a backward runs from the last stage to the first, so the
first stage waits the longest for its gradient, and on average each stage's updates are at
least as stale as the next stage's. Staleness is why `learning_rate` above divides the
asynchronous rate by `W / 2` beyond 2 workers: each update is computed on older weights, and
the largest rate that trains in the `delays` benchmark's runs of this setting shrinks as `W`
grows (`Config(staleness_rule="staleness-aware")` instead divides each update's step by its
staleness). That benchmark (`python -m benchmarks delays`) tunes the rate per algorithm and
cell before comparing times.
"""),
        code("""
WORKER_COUNTS = [2, 8] if SMALL else [1, 4, 16, 64]
K = 1.0

worker_runs = {(algo, w): simulate(algo, w, K) for algo in ("asgd", "pdasgd") for w in WORKER_COUNTS}
for (algo, w), (s, rows) in worker_runs.items():
    means = ", ".join(f"{st['mean']:.2f}" for st in s["staleness"]["per_stage"])
    print(f"{algo:7s} W={w:3d} lr {learning_rate(algo, w):.6f}  accuracy {s['test_accuracy']:.4f}  "
          f"virtual time {s['virtual_time'] * 1e3:7.2f} ms  mean staleness per stage [{means}]")
"""),
        code("""
fig, axes = plt.subplots(2, len(WORKER_COUNTS), figsize=(4 * len(WORKER_COUNTS), 6), squeeze=False)
for row, algo in enumerate(("asgd", "pdasgd")):
    for col, w in enumerate(WORKER_COUNTS):
        ax = axes[row, col]
        per_stage = worker_runs[algo, w][0]["staleness"]["per_stage"]
        for m, stats in enumerate(per_stage):
            ax.step(range(len(stats["histogram"])), stats["histogram"], where="mid", label=f"stage {m}")
        ax.set(title=f"{algo}, W = {w}", xlabel="staleness")
    axes[row, 0].set_ylabel("updates")
axes[0, 0].legend()
fig.tight_layout()
show(fig)
"""),
        code("""
def mean_staleness(algo, w):
    per_stage = worker_runs[algo, w][0]["staleness"]["per_stage"]
    return sum(st["mean"] for st in per_stage) / len(per_stage)

fig, ax = plt.subplots(figsize=(5, 3.5))
for algo in ("asgd", "pdasgd"):
    ax.plot(WORKER_COUNTS, [mean_staleness(algo, w) for w in WORKER_COUNTS], marker="o", label=algo)
ax.set(xscale="log", xlabel="devices W", ylabel="mean staleness (all stages)")
ax.legend()
show(fig)
"""),
        code("""
# The values the text's statements rest on (tests/test_notebooks.py checks them). Keys name
# the run: k0p5 is k = 0.5, W16 is 16 devices.
values = {"test_accuracy": delay_runs["pdasgd", max(K_VALUES)][0]["test_accuracy"]}
for (algo, k), (s, rows) in delay_runs.items():
    tag = f"k{k:g}".replace(".", "p")
    values[f"{algo}_{tag}_accuracy"] = s["test_accuracy"]
    values[f"{algo}_{tag}_virtual_ms"] = s["virtual_time"] * 1e3
for (algo, w), (s, rows) in worker_runs.items():
    values[f"{algo}_W{w}_accuracy"] = s["test_accuracy"]
    values[f"{algo}_W{w}_staleness"] = mean_staleness(algo, w)
    for m, stats in enumerate(s["staleness"]["per_stage"]):
        values[f"{algo}_W{w}_staleness_stage{m}"] = stats["mean"]
print("RESULT " + " ".join(f"{key}={value:.4f}" for key, value in values.items()))
"""),
    ]


def dasgd() -> list[Cell]:
    return [
        md(f"""
# Local SGD and DaSGD over devices

{colab_badge("dasgd")}

**Local SGD**: `D` workers each take `H` (`period`) optimizer steps on their own data, then
their models are averaged. **DaSGD** (arXiv 2006.00441) starts that average and keeps
training: the average, taken at step `t0`, is merged `d` (`delay_steps`) steps later, so the
all-reduce runs while the workers compute and its time is hidden. The merge is either
`correct` (the average plus the worker's own progress during the delay, `a + (theta - s)`)
or `overwrite` (`a`). Each round of `H` steps is one compiled program (`shard_map` over a
mesh of devices, one block of workers per device), so XLA can overlap the collective with
the local steps.

On a **Colab TPU** runtime with 8 cores (TPU v2-8) the 8 cores are 8 real devices and the
`D = 8` workers below run one per core, averaging over the TPU interconnect. With fewer
devices the workers are spread evenly over as many devices as divide `D` (vmapped within
each); on a single GPU all of them are vmapped on it. On a CPU, the next cell asks XLA for
8 host devices so the same program runs over a real 8-device mesh (no faster than one
device, but the same collectives).
"""),
        INSTALL,
        code("""
import os

# Must run before JAX starts; it only affects the CPU platform (GPU and TPU are untouched).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
"""),
        SMALL_SWITCH,
        DEVICES,
        HELPERS,
        md("""
## Runs

All runs train for the same number of epochs with the same optimizer: SGD with momentum 0.9
and learning rate 0.05, `Config`'s default for these synchronous algorithms (no worker applies
a gradient computed on older weights; only DaSGD's merged average is `d` steps old). Local
SGD and DaSGD use 16 examples per worker per step; synchronous SGD over the same 8 devices
takes one step on a global batch of 8 x 16 = 128 wherever the local workers take one step
each, and all-reduces gradients at every step.
"""),
        code("""
from pdasgd_jax import Config, train_and_evaluate

D = 8
BATCH = 16
EPOCHS = 6 if SMALL else 30
PERIODS = [8] if SMALL else [4, 8, 16]
RUNS = pathlib.Path("runs/dasgd")
COMMON = dict(dataset="digits", epochs=EPOCHS, lr=0.05, eval_every=4 * D * BATCH, seed=0, progress=False)

# sync: one replica per device; local SGD and DaSGD: D replicas spread over the devices.
configs = {"sync": Config(algo="sync", devices=D, batch_size=D * BATCH, **COMMON)}
for H in PERIODS:
    configs[f"local H={H}"] = Config(algo="local", replicas=D, period=H, batch_size=BATCH, **COMMON)
    for d, merge in [(H // 2, "correct"), (H // 2, "overwrite"), (H, "correct")]:
        configs[f"dasgd H={H} d={d} {merge}"] = Config(
            algo="dasgd", replicas=D, period=H, delay_steps=d, merge=merge, batch_size=BATCH, **COMMON)

summaries = {}
for name, config in configs.items():
    config.out = str(RUNS / name.replace(" ", "_").replace("=", ""))
    s = summaries[name] = train_and_evaluate(config, overwrite=True)  # re-running a cell replaces its run
    print(f"{name:28s} test accuracy {s['test_accuracy']:.4f}  steps {s['steps']:4d}  "
          f"wall time {s['wall_time']:5.2f} s  devices {s['devices']}  {s.get('placement', '')}")
"""),
        md("""
## Accuracy against examples

What to look for: the `correct` merge keeps the progress each worker made while the average
was in flight, `overwrite` throws it away, and with `d = H` every merged average is a whole
round old. On digits every run ends above 0.9 test accuracy, all within 0.03 of each other.
The difference shows early in training: at the first evaluation, `overwrite` is behind
`correct` with the same `H` and `d`. To look further, change `PERIODS`, `D` or the data set
(`dataset="mnist1d"`).
"""),
        code("""
fig, axes = plt.subplots(1, len(PERIODS), figsize=(6 * len(PERIODS), 4), sharey=True, squeeze=False)
for ax, H in zip(axes[0], PERIODS):
    for name, config in configs.items():
        if config.algo == "sync" or config.period == H:
            rows = load_rows(config.out)
            ax.plot([r["examples"] for r in rows], [r["test_accuracy"] for r in rows], marker=".", label=name)
    ax.set(title=f"D = {D} workers, period H = {H}", xlabel="examples processed")
    ax.legend(fontsize="small")
axes[0, 0].set_ylabel("test accuracy")
show(fig)
"""),
        md("""
How much communication DaSGD hides is measured on real devices by the benchmark
`python -m benchmarks overlap` (step time with the all-reduce vs without it).
"""),
        code("""
# The values the text's statements rest on (tests/test_notebooks.py checks them): each run's
# final accuracy and its accuracy at its first evaluation. Keys name the run as its directory does.
H = PERIODS[0]
values = {"test_accuracy": summaries[f"dasgd H={H} d={H // 2} correct"]["test_accuracy"]}
for name, config in configs.items():
    key = pathlib.Path(config.out).name
    values[f"{key}_accuracy"] = summaries[name]["test_accuracy"]
    values[f"{key}_first_accuracy"] = load_rows(config.out)[0]["test_accuracy"]
print("RESULT " + " ".join(f"{key}={value:.4f}" for key, value in values.items()))
"""),
    ]


def bring_your_own_model() -> list[Cell]:
    return [
        md(f"""
# Bring your own model

{colab_badge("bring_your_own_model")}

The library works on a model as a **chain of stages**: stage `m` maps
`x_m = f_m(theta_m, x_(m-1))`, and every algorithm updates the tuple of per-stage parameter
trees (PD-ASGD updates one stage at a time). This notebook

1. turns your own Flax NNX modules into a staged model with `from_modules`;
2. trains it on your own arrays with your optax optimizer, one `train_and_evaluate` call per
   algorithm: PD-ASGD on the simulator and on real threads, and DaSGD; then writes the trained
   weights back into your modules with `update_modules`.

Then the pieces underneath, for your own training loops:

3. chaining the per-stage backward kernels gives `jax.grad` of the whole model;
4. one jitted per-stage optax update per stage;
5. DaSGD's optax-style `delayed_averaging` inside your own jitted step, with the workers
   under `jax.vmap(..., axis_name="workers")`.
"""),
        INSTALL,
        SMALL_SWITCH,
        DEVICES,
        PLOT_ONLY,
        md("""
## Data

scikit-learn's 8x8 digits (shipped with scikit-learn, no download), flattened to 64 features.
"""),
        code("""
import numpy as np
from sklearn.datasets import load_digits

digits = load_digits()
x_all = (digits.data / 16.0).astype(np.float32)
y_all = digits.target.astype(np.int32)
perm = np.random.default_rng(0).permutation(len(x_all))
x_train, y_train = x_all[perm[:1437]], y_all[perm[:1437]]
x_test, y_test = x_all[perm[1437:]], y_all[perm[1437:]]
print(x_train.shape, x_test.shape)
"""),
        md("""
## Your model as a list of NNX modules

One module per stage; fold activations into the stage before them with `nnx.Sequential`.
`from_modules` returns the pure description (`model`) and the per-stage arrays (`variables`).
"""),
        code("""
import jax.numpy as jnp
import optax
from flax import nnx

from pdasgd_jax import StageKernels, chained_gradients, from_modules, make_eval_step

rngs = nnx.Rngs(0)
modules = [
    nnx.Sequential(nnx.Linear(64, 128, rngs=rngs), nnx.LayerNorm(128, rngs=rngs), nnx.gelu),
    nnx.Sequential(nnx.Linear(128, 128, rngs=rngs), nnx.gelu),
    nnx.Linear(128, 10, rngs=rngs),
]
model, variables = from_modules(modules, names=["embed", "hidden", "head"])
for stage, params in zip(model.stages, variables.params):
    print(f"{stage.name:7s} {sum(p.size for p in jax.tree.leaves(params)):6d} parameters")
"""),
        md("""
## Training it with PD-ASGD and DaSGD

`train_and_evaluate` takes your model (`model=(model, variables)`), any optax optimizer and
your arrays (`dataset=(x_train, y_train, x_test, y_test)`); everything else comes from the
`Config`, as for a built-in model: the algorithm, simulated or real, replicas, delays,
`eval_every`, `target_accuracy`, `out`. Every run starts from the same initial `variables`.
It returns the run summary (a dict) with the trained variables as `.variables`, which
`update_modules` writes back into your NNX modules.

Your optimizer replaces the config's optimizer and rate (`Config.lr` is not used; its defaults
are rates for SGD with momentum). Here it is AdamW at 1e-3, the usual rate for Adam and the
one the library's presets give Adam on IMDb. Each of the three runs ends above 0.9 test
accuracy, at the small sizes (3 epochs) and the full ones (20), threads included, although how
the OS schedules the threads varies their result a little from run to run. Your modules then
hold DaSGD's trained weights and score its test accuracy (to one test example, which float
rounding in a different program can flip).
"""),
        code("""
from pdasgd_jax import Config, train_and_evaluate, update_modules

RUNS = {
    "PD-ASGD, simulated": dict(algo="pdasgd", simulate=True),
    "PD-ASGD, threads": dict(algo="pdasgd"),
    "DaSGD": dict(algo="dasgd"),
}
results = {}
for name, setup in RUNS.items():
    config = Config(**setup, replicas=2, epochs=3 if SMALL else 20, progress=False)
    results[name] = train_and_evaluate(
        config, model=(model, variables), optimizer=optax.adamw(1e-3), dataset=(x_train, y_train, x_test, y_test)
    )
    print(f"{name:19s} test accuracy {results[name]['test_accuracy']:.4f}")

update_modules(modules, results["DaSGD"].variables)  # your modules now hold DaSGD's trained weights
network = nnx.Sequential(*modules)
modules_accuracy = float((network(x_test).argmax(-1) == y_test).mean())
print(f"your modules after update_modules: test accuracy {modules_accuracy:.4f}")
"""),
        md("""
## Chained per-stage gradients equal `jax.grad`

`StageKernels` compiles, per stage, the forward (keeping its VJP), the backward and an
optax update. `chained_gradients` runs the forwards, the loss, then the backwards from the
last stage to the first: this is what PD-ASGD's backward workers do, one stage at a time.
The two gradients agree to float rounding (below 1e-4 in every entry).
"""),
        code("""
tx = optax.sgd(0.05, momentum=0.9)
kernels = StageKernels(model, tx)
x, y = jnp.asarray(x_train[:64]), jnp.asarray(y_train[:64])

loss, chained = chained_gradients(kernels, variables.params, variables.states, x, y)
whole = jax.grad(lambda params: model.loss_and_states(params, variables.states, x, y)[0])(variables.params)
grad_diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(chained), jax.tree.leaves(whole)))
print(f"loss {float(loss):.4f}; largest difference between chained and jax.grad gradients: {grad_diff:.2e}")
"""),
        md("""
## Training with per-stage optax updates

Each stage has its own optimizer state (`init_opt_states`) and its own jitted update,
`kernels.update(m)`: the building block of the layer-wise asynchronous algorithms. Run in
order like this it is plain SGD with momentum.
"""),
        code("""
from pdasgd_jax import init_opt_states

EPOCHS = 5 if SMALL else 20
BATCH = 32
eval_step = make_eval_step(model)


def accuracy(params, states):
    _, correct = eval_step(params, states, jnp.asarray(x_test), jnp.asarray(y_test), jnp.ones(len(y_test), bool))
    return int(correct) / len(y_test)


params, states = list(variables.params), variables.states
opt_states = list(init_opt_states(tx, params))
rng = np.random.default_rng(0)
curves = {"per-stage updates": [], "DaSGD, 4 workers": []}
layerwise_steps = 0
for epoch in range(EPOCHS):
    order = rng.permutation(len(x_train))
    for i in range(0, len(order) - BATCH + 1, BATCH):
        idx = order[i:i + BATCH]
        layerwise_steps += 1
        loss, grads = chained_gradients(kernels, params, states, jnp.asarray(x_train[idx]), jnp.asarray(y_train[idx]))
        for m in reversed(range(model.num_stages)):  # the last stage's gradient is ready first
            params[m], opt_states[m] = kernels.update(m)(params[m], opt_states[m], grads[m])
    curves["per-stage updates"].append(accuracy(params, states))
    print(f"epoch {epoch + 1}: loss {float(loss):.4f}, test accuracy {curves['per-stage updates'][-1]:.4f}")
layerwise_accuracy = curves["per-stage updates"][-1]
"""),
        md("""
## Data parallel DaSGD inside your own jitted step

`delayed_averaging(inner, period, delay, axis_name)` is an optax transform: each worker runs
`inner` on its own gradients and the workers' parameters are averaged over the mapped axis
`axis_name` every `period` steps, the average merged `delay` steps after it was taken.
Give every worker its own copy of the parameters and optimizer state (a leading worker axis),
and map your step over the workers with `jax.vmap(..., axis_name="workers")` (or
`jax.shard_map` over a device mesh, with the worker axis sharded).
"""),
        code("""
from pdasgd_jax import delayed_averaging

WORKERS, PERIOD, DELAY = 4, 8, 4
da_tx = delayed_averaging(optax.sgd(0.05, momentum=0.9), period=PERIOD, delay=DELAY, axis_name="workers")


def worker_step(params, opt_state, x, y):
    def loss_fn(p):
        return model.loss_and_states(p, variables.states, x, y)[0]  # no BatchNorm: states stay fixed
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = da_tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


train_step = jax.jit(jax.vmap(worker_step, axis_name="workers"))

# Every worker starts from the same model; delayed_averaging's init needs no collective.
params_W = jax.tree.map(lambda a: jnp.broadcast_to(a, (WORKERS, *a.shape)), variables.params)
opt_state_W = jax.vmap(da_tx.init)(params_W)
shard = len(x_train) // WORKERS  # each worker trains on its own shard of the data
step = 0
for epoch in range(EPOCHS):
    order = np.stack([w * shard + rng.permutation(shard) for w in range(WORKERS)])
    for i in range(0, shard - BATCH + 1, BATCH):
        idx_WxB = order[:, i:i + BATCH]
        params_W, opt_state_W, loss_W = train_step(params_W, opt_state_W, x_train[idx_WxB], y_train[idx_WxB])
        step += 1
    mean_params = jax.tree.map(lambda a: a.mean(0), params_W)
    curves["DaSGD, 4 workers"].append(accuracy(mean_params, variables.states))
    print(f"epoch {epoch + 1}: step {step}, mean loss {float(loss_W.mean()):.4f}, "
          f"test accuracy of the workers' mean {curves['DaSGD, 4 workers'][-1]:.4f}")
dasgd_accuracy = curves["DaSGD, 4 workers"][-1]
"""),
        md("""
Per epoch, DaSGD's 4 workers together see the same data as the single model, in a quarter
of the steps each (on 4 devices the workers' steps run side by side). Both end above 0.9 test
accuracy, at the small sizes (5 epochs) and the full ones (20).
"""),
        code("""
fig, ax = plt.subplots(figsize=(5.5, 3.5))
for label, accuracies in curves.items():
    ax.plot(range(1, len(accuracies) + 1), accuracies, marker="o", label=label)
ax.set(xlabel="epoch", ylabel="test accuracy")
ax.legend()
show(fig)
"""),
        md("""
The library's own algorithms run these same pieces: see the other notebooks for PD-ASGD's
threads and simulator and the compiled DaSGD rounds, on built-in models and datasets.
"""),
        code("""
# The values the text's statements rest on (tests/test_notebooks.py checks them).
print(f"RESULT test_accuracy={dasgd_accuracy:.4f} layerwise_accuracy={layerwise_accuracy:.4f} "
      f"grad_max_abs_diff={grad_diff:.3e} layerwise_steps={layerwise_steps} dasgd_steps={step} "
      f"dasgd_workers={WORKERS} "
      f"pdasgd_simulated_accuracy={results['PD-ASGD, simulated']['test_accuracy']:.4f} "
      f"pdasgd_threads_accuracy={results['PD-ASGD, threads']['test_accuracy']:.4f} "
      f"dasgd_library_accuracy={results['DaSGD']['test_accuracy']:.4f} modules_accuracy={modules_accuracy:.4f}")
"""),
    ]


NOTEBOOKS = {
    "quickstart": quickstart,
    "staleness_simulation": staleness_simulation,
    "dasgd": dasgd,
    "bring_your_own_model": bring_your_own_model,
}


def build(name: str) -> nbformat.NotebookNode:
    """The notebook ``name`` with deterministic cell ids and no outputs."""
    nb = nbformat.v4.new_notebook()
    nb.metadata = {
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"},
        "colab": {"provenance": [], "name": f"{name}.ipynb"},
    }
    for i, (kind, source) in enumerate(NOTEBOOKS[name]()):
        make = nbformat.v4.new_markdown_cell if kind == "md" else nbformat.v4.new_code_cell
        nb.cells.append(make(source, id=f"{name}-{i}"))
    nbformat.validate(nb)
    return nb


def render(name: str) -> str:
    return nbformat.writes(build(name)) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a committed notebook is out of date")
    args = parser.parse_args(argv)
    stale = []
    for name in NOTEBOOKS:
        path = NOTEBOOK_DIR / f"{name}.ipynb"
        text = render(name)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print("out of date (run python scripts/make_notebooks.py):\n  " + "\n  ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
