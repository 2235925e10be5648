"""A run-level result cache, so an interrupted benchmark cell resumes from its finished runs.

The long benchmarks (``bench delays``, ``delays-network``, ``claims``; ``benchmarks/scripts/delays_subgrid.py``
and ``benchmarks/scripts/claims_part.py``) spend hours in ``delays.time_to_target`` runs, a cell at a time.
Inside ``with active(directory):`` every such run first looks for its result in ``directory``
and, when it is not there, stores it once finished, so a rerun of the same command resumes where
the last one stopped and recomputes nothing it already has. Outside ``active`` (or with
``active(None)``) nothing is read or written: the runs behave exactly as without this module.

What is cached: one JSON file per finished run, ``DIR/<key>.json``, holding the run's
``Outcome`` (a diverged run's too: it is a result) beside every input of its key (readable
provenance). The key is the SHA-256 of a canonical JSON of everything that determines the
outcome: the caller's ``inputs`` (``time_to_target``'s arguments, its protocol with every field,
and the calibration it actually used: its fingerprint and a digest of its timing, so a
recalibration invalidates the runs timed by the old one), a digest of the package's source
(every ``pdasgd_jax/**/*.py``: any code change invalidates every entry), the versions of the
libraries that compute or generate the data (``LIBRARIES``) and the process's JAX environment
(``environment()``: every ``JAX_*`` and ``XLA_*`` environment variable, name and value, e.g.
``XLA_FLAGS`` with the fake device count or ``JAX_DEFAULT_PRNG_IMPL=rbg``, and the
``jax.config`` values that change numerics or randomness, ``JAX_CONFIG``; read at every key, so a
``jax.config.update`` between runs keys apart too). Equal values in other spellings (``1`` and
``1.0``) key apart, as does an environment variable that changes nothing: at worst a spurious
recomputation, never a wrong hit.

The source digest in the keys is taken when this module is imported (the benchmarks import it at
start, with the package), since that is the code the process runs: a digest read lazily at the
first key would file the results of the imported (old) code under the key of files edited since
(a ``git merge`` into the checkout mid-run). Keys always use the import-time digest, so a ``get``
finds only entries stored by processes that imported the same sources. ``put`` reads the sources
again and, when they no longer match that digest, stores nothing (one warning per process names
the change; the caller still returns its run's outcome): the process may already have imported
some modules from the edited files, so its results belong under neither key.

Files are written through a temporary file and ``os.replace`` (``write_json_atomic``), so a
run interrupted mid-write leaves either no entry or a whole one (at worst a stray
``.tmp-*.json``, never read). An entry that cannot be read, parsed or checked against its key
is recomputed and replaced, with a warning, never trusted. Infinite and nan floats are stored
as ``{"__float__": "inf"}`` and read back exactly; the files are strict JSON.

The active cache is a ``contextvars.ContextVar``: threads started inside ``active`` do not
see it (the benchmarks call ``time_to_target`` on the thread that entered it).

Example::

    with run_cache.active("bench_out/runs"):
        delays.cell("pdasgd", 4, 1.0, False, delays.LRS["pdasgd"], delays.SEEDS, delays.EPOCHS)
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import dataclasses
import enum
import functools
import hashlib
import importlib.metadata
import json
import math
import os
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import jax
import numpy as np

from pdasgd_jax.reporting import write_json_atomic

# The benchmarks whose runs go through ``delays.time_to_target`` (the others ignore a cache).
BENCHMARKS = ("delays", "delays-network", "claims", "concurrency-map", "preregistered")
FORMAT = 2  # bumped when what an entry holds or how it is keyed changes
# Libraries whose versions change a run's numerics or its generated data (mnist1d, sklearn's digits).
LIBRARIES = ("jax", "jaxlib", "flax", "optax", "numpy", "scikit-learn", "mnist1d")
# ``jax.config`` options that change a run's numbers or random draws (those this jax lacks are skipped).
JAX_CONFIG = (
    "jax_default_prng_impl",
    "jax_enable_x64",
    "jax_default_matmul_precision",
    "jax_threefry_partitionable",
    "jax_random_seed_offset",
    "jax_numpy_dtype_promotion",
    "jax_softmax_custom_jvp",
)
ENV_PREFIXES = ("JAX_", "XLA_")  # environment variables read by JAX or XLA at start
_FLOAT = "__float__"  # the tag of a non-finite float in the JSON

R = TypeVar("R", bound=NamedTuple)


def _encode(x: Any) -> Any:
    """``x`` as JSON-ready values: dataclasses and mappings as objects, sequences as lists,
    non-finite floats tagged (``_FLOAT``); anything else is refused rather than keyed by its repr."""
    if isinstance(x, np.generic):
        x = x.item()
    if x is None or isinstance(x, bool | int | str):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else {_FLOAT: repr(x)}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _encode(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, Mapping):
        return {str(k): _encode(v) for k, v in x.items()}
    if isinstance(x, tuple | list):
        return [_encode(v) for v in x]
    raise TypeError(f"run cache: cannot key or store a value of type {type(x).__name__}: {x!r}")


def _decode_float(obj: dict[str, Any]) -> Any:
    return float(obj[_FLOAT]) if obj.keys() == {_FLOAT} else obj


def canonical_json(x: Any) -> str:
    """The one JSON text of ``x`` (sorted keys, no whitespace, strict JSON) that keys hash."""
    return json.dumps(_encode(x), sort_keys=True, separators=(",", ":"), allow_nan=False)


def digest(x: Any) -> str:
    """SHA-256 (hex) of ``canonical_json(x)``."""
    return hashlib.sha256(canonical_json(x).encode()).hexdigest()


def _source_files() -> list[tuple[str, Path]]:
    """The files whose code decides a run's result: ``pdasgd_jax/**/*.py`` and this harness's own
    protocol modules (``benchmarks/**/*.py`` but its tests and archived diagnostics), each with the
    path it is hashed under."""
    import pdasgd_jax

    files = []
    for root in (Path(pdasgd_jax.__file__).resolve().parent, Path(__file__).resolve().parent):
        for path in root.rglob("*.py"):
            relative = path.relative_to(root.parent)
            if relative.parts[1] not in ("tests", "diagnostics"):
                files.append((relative.as_posix(), path))
    return sorted(files)


def disk_source_digest() -> str:
    """SHA-256 over every file of ``_source_files`` (relative path and contents) as on disk now."""
    h = hashlib.sha256()
    for name, path in _source_files():
        h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


# Taken at import: the code this process runs, not whatever the files hold at the first key.
_IMPORTED_SOURCE = disk_source_digest()
_sources_changed = False  # set once ``put`` found the files edited since import (then it stores nothing)


def source_digest() -> str:
    """The ``disk_source_digest()`` taken when this module was imported, which every key holds."""
    return _IMPORTED_SOURCE


def environment() -> dict[str, Any]:
    """The process's JAX environment, as keys hold it: ``env``, every environment variable named
    ``JAX_*`` or ``XLA_*`` (sorted, name -> value), and ``config``, the ``JAX_CONFIG`` options
    this jax has (name -> value; an enum as its value, anything else not a plain scalar as its ``str``)."""
    env = {name: value for name, value in sorted(os.environ.items()) if name.startswith(ENV_PREFIXES)}
    missing = object()
    config = {}
    for name in JAX_CONFIG:
        value = getattr(jax.config, name, missing)
        if value is not missing:
            value = value.value if isinstance(value, enum.Enum) else value
            config[name] = value if value is None or type(value) in (bool, int, float, str) else str(value)
    return {"env": env, "config": config}


@functools.cache
def library_versions() -> dict[str, str | None]:
    """Installed versions of ``LIBRARIES`` (None: not installed)."""
    versions: dict[str, str | None] = {}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


class RunCache:
    """Finished runs' results in ``directory``, one JSON file each, keyed by their inputs.

    Args:
      directory: where the entries live (created at the first ``put``).
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)

    def keyed(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """Everything a key hashes: ``inputs``, the source digest, the library versions, the JAX
        environment, ``FORMAT``."""
        return {
            "format": FORMAT,
            "inputs": inputs,
            "source": source_digest(),
            "libraries": library_versions(),
            "environment": environment(),
        }

    def key(self, inputs: Mapping[str, Any]) -> str:
        """The SHA-256 key of a run with these ``inputs`` under this code and these libraries."""
        return digest(self.keyed(inputs))

    def path(self, inputs: Mapping[str, Any]) -> Path:
        """The file a run with these ``inputs`` is stored in."""
        return self.directory / f"{self.key(inputs)}.json"

    def get(self, inputs: Mapping[str, Any], record: type[R]) -> R | None:
        """The stored ``record`` (a NamedTuple of numbers, bools and tuples of numbers) of the run
        with these ``inputs``; None when there is none or the entry is unreadable (a warning says
        so, and the next ``put`` replaces it)."""
        key = self.key(inputs)
        path = self.directory / f"{key}.json"
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        try:
            entry = json.loads(text, object_hook=_decode_float)
            if entry["key"] != key or digest(entry["keyed"]) != key:
                raise ValueError("its key does not match its inputs")
            fields = entry["outcome"]
            if set(fields) != set(record._fields):
                raise ValueError(f"its fields {sorted(fields)} are not {list(record._fields)}")
            return record(**{name: _value(name, v) for name, v in fields.items()})
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            warnings.warn(f"run cache entry {path} is unreadable ({e}); running it again", stacklevel=2)
            return None

    def put(self, inputs: Mapping[str, Any], outcome: NamedTuple) -> None:
        """Stores ``outcome`` (a NamedTuple) as the result of the run with these ``inputs``, atomically;
        stores nothing (warning once per process) when the package's sources on disk are no longer
        those imported, whose digest the key holds."""
        global _sources_changed
        if not _sources_changed and (now := disk_source_digest()) != source_digest():
            _sources_changed = True
            warnings.warn(
                f"run cache: the pdasgd_jax or benchmarks sources on disk changed since this process imported them "
                f"(digest {source_digest()[:12]} at import, {now[:12]} now); no run of this "
                f"process is stored in {self.directory} from now on (rerun the command to cache under the new code)",
                stacklevel=2,
            )
        if _sources_changed:
            return
        keyed = self.keyed(inputs)
        key = digest(keyed)
        self.directory.mkdir(parents=True, exist_ok=True)
        entry = {"key": key, "keyed": keyed, "outcome": outcome._asdict()}
        write_json_atomic(str(self.directory / f"{key}.json"), _encode(entry))


def _value(name: str, v: Any) -> Any:
    """A stored outcome field back as the record holds it (lists as tuples); refuses other types."""
    if isinstance(v, list) and all(isinstance(x, int | float) for x in v):
        return tuple(v)
    if isinstance(v, bool | int | float):
        return v
    raise TypeError(f"field {name!r} holds {v!r}, not a number, bool or list of numbers")


_ACTIVE: contextvars.ContextVar[RunCache | None] = contextvars.ContextVar("pdasgd_jax_run_cache", default=None)


@contextlib.contextmanager
def active(directory: str | os.PathLike | None) -> Iterator[RunCache | None]:
    """Caches every ``delays.time_to_target`` run inside the block in ``directory`` (None: no
    cache, as outside any block); yields the cache."""
    cache = None if directory is None else RunCache(directory)
    token = _ACTIVE.set(cache)
    try:
        yield cache
    finally:
        _ACTIVE.reset(token)


def current() -> RunCache | None:
    """The cache of the innermost ``active`` block (None: none)."""
    return _ACTIVE.get()


def add_flags(parser: argparse.ArgumentParser) -> None:
    """``--run-cache DIR`` and ``--no-run-cache`` (exclusive), for the benchmark scripts whose
    default is ``OUT/runs`` (``directory_from_args``)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--run-cache",
        metavar="DIR",
        help="keep each finished run in DIR (one JSON file each) and read it back, not rerun it, when the same "
        "command runs again with the same code and calibration (default: OUT/runs)",
    )
    group.add_argument("--no-run-cache", action="store_true", help="run every run, read and keep none")


def directory_from_args(args: argparse.Namespace, out: str) -> str | None:
    """The cache directory ``add_flags``'s flags name: ``--run-cache``, else ``out/runs``; None with
    ``--no-run-cache``."""
    return None if args.no_run_cache else args.run_cache or os.path.join(out, "runs")
