"""Command line: ``python -m pdasgd_jax train ...`` (flags generated from ``Config``)."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import sys
import warnings
from collections.abc import Callable, Sequence

from pdasgd_jax.bench import BENCHMARKS
from pdasgd_jax.config import RESUME_MAY_CHANGE, Config
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.presets import PRESETS
from pdasgd_jax.version import __version__

# Algorithms whose replicas are single workers, for which --workers is unambiguous.
WORKER_ALGOS = ("asgd", "local", "dasgd", "async-local")

_TYPES: dict[str, Callable] = {"str": str, "int": int, "float": float}


def _add_config_flags(parser: argparse.ArgumentParser, *, defaults: bool = True) -> None:
    """One flag per ``Config`` field; without ``defaults``, a flag not given is left out of the
    parsed namespace (``given_config_flags``)."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(Config):
        meta = f.metadata
        group = groups.setdefault(meta["group"], parser.add_argument_group(meta["group"]))
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            default = f.default if defaults else argparse.SUPPRESS
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=meta["help"])
            continue
        base = f.type.split("|")[0].strip()
        group.add_argument(
            flag,
            type=_TYPES[base],
            default=f.default if defaults else argparse.SUPPRESS,
            choices=meta["choices"],
            help=meta["help"],
            metavar=None if meta["choices"] else base.upper(),
        )


def _program_name() -> str:
    """How the user started us: ``pdasgd-jax`` (the console script) or ``python -m pdasgd_jax``."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "python -m pdasgd_jax" if name in ("", "__main__.py", "-m") or name.endswith(".py") else name


def build_parser(preset: str | None = None, *, defaults: bool = True) -> argparse.ArgumentParser:
    """The command line's parser; with ``preset``, ``train``'s defaults are that preset's values;
    without ``defaults``, ``train``'s config flags not given are absent from the namespace."""
    parser = argparse.ArgumentParser(
        prog=_program_name(), description="Asynchronous and delay-tolerant SGD in JAX (PD-ASGD, DaSGD and baselines)."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train", help="train one configuration", formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    _add_config_flags(train, defaults=defaults)
    train.add_argument(
        "--preset",
        choices=tuple(PRESETS),
        help="a paper's setup (docs/guide/recipes.md) as defaults: flags given explicitly win; "
        + "; ".join(f"{name}: {p.description}" for name, p in PRESETS.items()),
    )
    if preset is not None:
        train.set_defaults(**PRESETS[preset].values)
    train.add_argument(
        "--resume",
        metavar="DIR",
        help="continue the run saved in DIR with its saved config and newest checkpoint; a flag that would "
        "change what the run computes is refused unless it equals the saved value (allowed: "
        + ", ".join("--" + f.replace("_", "-") for f in RESUME_MAY_CHANGE if f != "out")
        + ")",
    )
    train.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run already in --out (deleting only the files pdasgd-jax wrote there)",
    )
    train.add_argument(
        "--schedule-only",
        action="store_true",
        help="with --simulate (asgd, pdasgd, pdasgd-block on one shared store): run the virtual clock without "
        "the numerics and print the virtual time to the budget, the staleness per stage, the devices' "
        "utilisation and the timing's source (and write them to --out's schedule.json); trains nothing",
    )
    train.add_argument(
        "--workers",
        type=int,
        metavar="W",
        help=f"alias of --replicas for {', '.join(WORKER_ALGOS)}, whose replicas are single workers",
    )
    hosts = train.add_argument_group("multi-host (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID)")
    hosts.add_argument("--coordinator-address", help="host:port of process 0 for jax.distributed")
    hosts.add_argument("--num-processes", type=int, help="number of processes in the run")
    hosts.add_argument("--process-id", type=int, help="this process's index")
    hosts.add_argument(
        "--coordinator-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="seconds to wait for every process to join; then exit 1 naming who is missing",
    )
    bench = sub.add_parser(
        "bench",
        help="benchmark this library on your own hardware",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="benchmarks:\n"
        + "\n".join(f"  {name:15} {text}" for name, text in BENCHMARKS.items())
        + "\n\nThe study behind the results page (delay grids, claims, runtime prediction) is not part of the "
        "package: from a clone of the repository, python -m benchmarks --help.",
    )
    bench.add_argument("name", metavar="NAME", help=f"which benchmark: {', '.join(BENCHMARKS)} (see below)")
    bench.add_argument("--out", default="bench_out", help="directory for <name>.json and <name>.md")
    bench.add_argument("--quick", action="store_true", help="a small, fast version (for tests and smoke checks)")
    bench.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bar over the runs (on stderr)"
    )
    compare = sub.add_parser(
        "compare",
        help="overlay finished runs in one plot and one table",
        description="Overlays finished runs in one PNG (train and test loss, test accuracy against examples, "
        "and against time in one panel per clock: simulated runs' virtual time and real runs' wall time are "
        "never put on one axis) and prints one markdown table, notes on what the runs do not share, and the "
        "absolute path of every file written. Runs are labelled by the shortest path suffix that tells them "
        "apart. Runs on different datasets are refused unless --allow-mixed-datasets.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    compare.add_argument("runs", nargs="+", help="run directories (each with summary.json and metrics.jsonl)")
    compare.add_argument("--plot", default="compare.png", help="path of the overlaid PNG plot (relative: to here)")
    compare.add_argument(
        "--allow-mixed-datasets",
        action="store_true",
        help="compare runs on different datasets (their losses and accuracies measure different tasks)",
    )
    replay = sub.add_parser(
        "replay",
        help="replay a run's events.jsonl (--event-log) and check it lands on its final variables",
        description="Rebuilds the run's experiment from DIR/config.json, re-executes every logged read and update "
        "with the logged versions, and compares the result with DIR/final_variables.npz leaf by leaf. Exit 0: "
        "'replay matches: max |diff| = ...'; exit 1: a mismatch (naming the largest mismatching leaf, or the "
        "event that did not replay as logged) or an incomplete log (a run that did not finish).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    replay.add_argument("run_dir", metavar="DIR", help="a run directory trained with --event-log")
    replay.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance per element")
    replay.add_argument("--atol", type=float, default=1e-6, help="absolute tolerance per element")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses the command line; ``train --preset NAME`` fills every flag not given explicitly
    from the preset (a second parse, with the preset's values as the defaults)."""
    args = build_parser().parse_args(argv)
    if getattr(args, "preset", None) is None:
        return args
    return build_parser(args.preset).parse_args(argv)


def config_from_args(args: argparse.Namespace) -> Config:
    """The ``Config`` of the parsed ``train`` flags (``--workers W`` read as ``--replicas W``).

    Raises:
      ConfigError: ``--workers`` for an algorithm whose replicas are not single workers, or
        together with another ``--replicas``.
    """
    config = Config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Config)})
    if args.workers is not None:
        if config.algo not in WORKER_ALGOS:
            raise ConfigError(
                f"--workers is ambiguous for --algo {config.algo}; say what you count: --devices, or "
                f"--replicas (pdasgd: groups of F forward + B backward workers)"
            )
        if config.replicas not in (0, args.workers):
            raise ConfigError(f"--workers {args.workers} and --replicas {config.replicas} disagree; give one")
        config.replicas = args.workers
    return config


def given_config_flags(argv: Sequence[str]) -> dict[str, object]:
    """The ``Config`` fields that ``train``'s flags in ``argv`` set explicitly, with their values
    (``--workers W`` as ``replicas``)."""
    given = vars(build_parser(defaults=False).parse_args(argv))
    fields = {f.name for f in dataclasses.fields(Config)}
    out = {name: value for name, value in given.items() if name in fields}
    if given.get("workers") is not None:
        out["replicas"] = given["workers"]
    return out


def resume_config(args: argparse.Namespace, argv: Sequence[str]) -> Config:
    """``train --resume DIR``'s config: the saved one, with the flags given here over it (which
    ``train_and_evaluate`` then refuses where they change what the run computes), and this
    command's progress display.

    Raises:
      ConfigError: ``--preset`` (a new run's defaults), or an ``--out`` other than ``DIR``.
    """
    from pdasgd_jax.train import load_run_config

    if args.preset is not None:
        raise ConfigError(f"--preset {args.preset} sets a new run's defaults; a resumed run keeps its saved config")
    given = given_config_flags(argv)
    if given.get("out", args.resume) != args.resume:
        raise ConfigError(f"--resume {args.resume} names the run directory; drop --out {given['out']}")
    config = load_run_config(args.resume)
    return dataclasses.replace(config, **{**given, "out": args.resume, "progress": args.progress})


def _one_line_library_warning(message, category, filename, lineno, line=None) -> str:
    """This library's warnings (a damaged checkpoint skipped, ...) as one line for the user,
    without the source line the default format appends; others as Python formats them."""
    if category.__module__.startswith("pdasgd_jax"):
        return f"warning: {message}\n"
    return _PYTHON_FORMATWARNING(message, category, filename, lineno, line)


_PYTHON_FORMATWARNING = warnings.formatwarning


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status.

    0: the run trained (``summary.json``'s ``status`` is ``ok``). 2: bad input (``ConfigError``,
    a TFDS dataset not prepared), with a one-line message, before any work. 3: the run failed
    (``pdasgd_jax.outcome``: a non-finite or diverged training loss, a non-finite final test
    loss, or a final accuracy at chance), with one line saying how; its summary says so too.
    1: no space left on the device. Any other exception is a failure during the work and
    propagates with its traceback (Python's exit 1).
    """
    args = parse_args(argv)
    warnings.formatwarning = _one_line_library_warning
    from pdasgd_jax.data import DatasetNotPreparedError
    from pdasgd_jax.errors import LossDivergedError, NonFiniteLossError
    from pdasgd_jax.outcome import FAILED_RUN_EXIT, RunFailedWarning, failure_line

    run_dir = args.resume or getattr(args, "out", None) if args.command == "train" else None
    try:
        if args.command == "train":
            from pdasgd_jax import interrupts
            from pdasgd_jax.distributed import initialize_from_env_or_args
            from pdasgd_jax.reporting import summary_line
            from pdasgd_jax.train import train_and_evaluate

            if args.resume:
                if args.schedule_only:
                    raise ConfigError(f"--schedule-only plans a new run from its flags, not --resume {args.resume}")
                config = resume_config(args, sys.argv[1:] if argv is None else argv)
            else:
                config = config_from_args(args).validate()
            if args.schedule_only:
                return _schedule_only(config)
            initialize_from_env_or_args(
                args.coordinator_address, args.num_processes, args.process_id, args.coordinator_timeout
            )
            with (
                interrupts.remembered(),
                warnings.catch_warnings(),
            ):  # a Ctrl-C swallowed by library code still stops the run
                warnings.simplefilter("ignore", RunFailedWarning)  # said below, as the command's error
                summary = train_and_evaluate(config, resume=bool(args.resume), overwrite=args.overwrite)
            print(summary_line(summary))
            if summary["status"] != "ok":
                print(f"error: {failure_line(summary)}", file=sys.stderr)
                return FAILED_RUN_EXIT
        elif args.command == "compare":
            from pdasgd_jax.compare import compare

            comparison = compare(args.runs, args.plot, allow_mixed_datasets=args.allow_mixed_datasets)
            print(comparison.text)
            for path in comparison.files:
                print(f"wrote {path}")
        elif args.command == "replay":
            from pdasgd_jax.runners.replay import replay_run

            report = replay_run(args.run_dir, rtol=args.rtol, atol=args.atol)
            print(report.text)
            return 0 if report.matches else 1
        elif args.command == "bench":
            from pdasgd_jax.bench import run_benchmark

            if args.name not in BENCHMARKS:
                raise ConfigError(_unknown_benchmark(args.name))
            print(run_benchmark(args.name, args.out, quick=args.quick, show_progress=args.progress))
    except (ConfigError, DatasetNotPreparedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NonFiniteLossError as e:
        print(
            f"error: run failed ({'diverged' if isinstance(e, LossDivergedError) else 'non-finite'}): {e}",
            file=sys.stderr,
        )
        return FAILED_RUN_EXIT
    except KeyboardInterrupt:
        print(f"interrupted{_resume_hint(run_dir)}", file=sys.stderr)
        return 130
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        print(f"error: no space left on the device writing {e.filename or run_dir or 'the run'}", file=sys.stderr)
        print(f"{_resume_hint(run_dir).lstrip('; ')}", file=sys.stderr)
        return 1
    return 0


def _schedule_only(config: Config) -> int:
    """``train --schedule-only``: prints the run's planned schedule (``simulate.plan_schedule``)
    and writes it to ``--out``'s ``schedule.json``; refuses what it does not plan before any work."""
    from pdasgd_jax.reporting import write_json_atomic
    from pdasgd_jax.simulate.schedule_only import SCHEDULE_FILE, check_schedule_only, plan_schedule

    check_schedule_only(config)
    plan = plan_schedule(config)
    print(plan.text())
    if config.out:
        os.makedirs(config.out, exist_ok=True)
        path = os.path.join(config.out, SCHEDULE_FILE)
        write_json_atomic(path, plan.to_dict())
        print(f"wrote {os.path.abspath(path)}")
    return 0


# The study's protocols (``benchmarks.STUDIES``, which the package cannot import), named so that
# ``bench NAME`` can say where one runs.
_STUDY_PROTOCOLS = (
    "parity",
    "delays",
    "delays-network",
    "runtime",
    "overlap",
    "stability",
    "concurrency-map",
    "claims",
    "preregistered",
)


def _unknown_benchmark(name: str) -> str:
    """Why ``bench NAME`` is refused, and where a protocol of the study runs now."""
    if name in _STUDY_PROTOCOLS:
        return (
            f"bench {name} is a protocol of the study behind the results page, not of the package: from a clone "
            f"of the repository, run python -m benchmarks {name}"
        )
    return f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}"


def _resume_hint(run_dir: str | None) -> str:
    """Where an interrupted run's last checkpoint is and how to go on from it (one line)."""
    if not run_dir:
        return "; nothing was saved (no --out)"
    import jax

    from pdasgd_jax.rundir import CHECKPOINT_DIR

    directory = os.path.join(run_dir, CHECKPOINT_DIR)
    if jax.process_count() > 1 and os.path.isdir(own := os.path.join(directory, f"process{jax.process_index()}")):
        directory = own  # a multi-process replicated run: each process's own checkpoints
    steps = [int(n) for n in os.listdir(directory) if n.isdigit()] if os.path.isdir(directory) else []
    where = f"the last checkpoint is {os.path.join(directory, str(max(steps)))}" if steps else "no checkpoint yet"
    return f"; {where}; go on with: python -m pdasgd_jax train --resume {run_dir}"
