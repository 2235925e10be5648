"""What every table of the results page shares: its one interval method, its verdicts, the
number formats and the sources its rows cite.

The interval method is the one ``benchmarks.log_ratio_ci95`` implements and
``docs/preregistration.md`` fixes for the headline cells (there at 97.5 %, split over two cells;
here at 95 %): the delta method over the reported seeds with Student's t at the smaller sample's
degrees of freedom; on the log scale for
a ratio of means and for the mean of a positive quantity (times, staleness: positive,
asymmetric intervals), on the linear scale for a difference of means (accuracy points). Every
interval on the page is recomputed here from the raw per-seed values, whatever interval the raw
file stored beside them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
import statistics
from collections.abc import Collection, Sequence
from typing import Any

from benchmarks import ci95_half_width, log_ratio_ci95
from benchmarks.scripts import delays_report
from pdasgd_jax.compare import markdown_table

# The papers' headline factors the page judges (arXiv 2410.05985's abstract).
CLAIM_VS_SYNC = delays_report.TARGET_VS_SYNC
CLAIM_VS_ASYNC = 2.14
NOT_SETTLED = "not settled"
NOT_RECORDED = "not recorded"

Interval = tuple[float, float, float]  # (estimate, lower end, upper end)


def finite(values: Sequence[float | None]) -> list[float]:
    """The finite values of ``values`` (a raw file writes a missing or infinite value as null)."""
    return [float(v) for v in values if v is not None and math.isfinite(v)]


def mean_ci95(values: Sequence[float | None]) -> Interval:
    """The mean of non-negative ``values`` with its 95 % interval on the log scale: the delta
    method, ``mean x exp(+-t s / (sqrt(n) mean))``; ``[0, 0]`` when every value is 0, nan ends
    below two values."""
    xs = finite(values)
    if not xs:
        return math.nan, math.nan, math.nan
    m, half = statistics.fmean(xs), ci95_half_width(xs)
    if m == 0:
        return m, 0.0, 0.0
    spread = math.exp(half / m) if math.isfinite(half) else math.nan
    return m, m / spread, m * spread


def difference_ci95(a: Sequence[float], b: Sequence[float]) -> Interval:
    """``mean(a) - mean(b)`` for independent samples with its 95 % interval: the delta method,
    exact for a difference, Student's t with the smaller sample's degrees of freedom (as
    ``log_ratio_ci95``); nan ends unless both have two or more values."""
    import scipy.stats

    xs, ys = finite(a), finite(b)
    if not xs or not ys:
        return math.nan, math.nan, math.nan
    d = statistics.fmean(xs) - statistics.fmean(ys)
    if min(len(xs), len(ys)) < 2:
        return d, math.nan, math.nan
    se = math.sqrt(statistics.variance(xs) / len(xs) + statistics.variance(ys) / len(ys))
    half = float(scipy.stats.t.ppf(0.975, min(len(xs), len(ys)) - 1)) * se
    return d, d - half, d + half


def ratio_ci95(numerator: Sequence[float], denominator: Sequence[float]) -> Interval:
    """``mean(numerator) / mean(denominator)`` of positive samples with its log-scale interval."""
    a, b = finite(numerator), finite(denominator)
    if not a or not b or statistics.fmean(b) == 0:
        return math.nan, math.nan, math.nan
    lo, hi = log_ratio_ci95(a, b)
    return statistics.fmean(a) / statistics.fmean(b), lo, hi


def fmt(s: Interval, digits: int = 2, suffix: str = "", signed: bool = False) -> str:
    """``estimate [lo, hi]`` (the interval left out where it is undefined)."""
    value, lo, hi = s
    if not math.isfinite(value):
        return "-"
    form = f"{{:{'+' if signed else ''}.{digits}f}}"
    text = form.format(value) + suffix
    if math.isfinite(lo) and math.isfinite(hi):
        text += f" [{form.format(lo)}, {form.format(hi)}]"
    return text


def missed(times: Sequence[float | None]) -> int:
    """How many of a result's per-seed times missed the target (a raw file writes them as null)."""
    return sum(1 for t in times if t is None or not math.isfinite(t))


def fmt_speedup(s: Interval, subject: str = "", reference: str = "", times: Sequence[float | None] = ()) -> str:
    """A ``delays_report.speedup`` result: ``ratio x [lo, hi]``, or who missed the target
    (``subject``, on how many of its seeds ``times`` say; else ``reference``)."""
    if s[0] == 0:
        seeds = f" on {missed(times)} of {len(times)} seeds" if times else ""
        return f"{subject or 'the subject'} missed the target{seeds}"
    if not math.isfinite(s[0]):
        return f"{reference or 'the reference'} missed the target"
    return fmt(s, suffix="x")


def direction(s: Interval, above: str, below: str, reference: float = 0.0) -> str:
    """``above`` when the whole interval lies above ``reference``, ``below`` when below it,
    ``not settled`` when it contains it (or has no interval)."""
    _, lo, hi = s
    if math.isfinite(lo) and lo > reference:
        return above
    if math.isfinite(hi) and hi < reference:
        return below
    return NOT_SETTLED


# How the per-cell matrices print a verdict beside its figure.
MARKS = {
    "faster": "▲",
    "more stale": "▲",
    "above SGD": "▲",
    "slower": "▼",
    "less stale": "▼",
    "below SGD": "▼",
    NOT_SETTLED: "○",
}


def marked(figure: str, verdict: str) -> str:
    """``figure`` with its verdict's mark (``MARKS``); a verdict without one is left to the figure."""
    return f"{figure} {MARKS[verdict]}" if verdict in MARKS else figure


def speedup_verdict(s: Interval) -> str:
    """faster / slower / not settled against 1, from a ``delays_report.speedup`` result; not
    judged where either side missed the target on a reported seed (``fmt_speedup`` says who)."""
    if s[0] == 0 or not math.isfinite(s[0]):
        return "not judged"
    return direction(s, "faster", "slower", 1.0)


def claim_verdict(s: Interval, claim: float) -> str:
    """``docs/preregistration.md``'s rule: reproduced when the interval's lower end is at least
    the claimed factor, not reproduced when its upper end is below it, else not settled."""
    value, lo, hi = s
    if value == 0:
        return "not reproduced"
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return NOT_SETTLED
    if lo >= claim:
        return "reproduced"
    return "not reproduced" if hi < claim else NOT_SETTLED


def k_text(k: float) -> str:
    """A delay factor as the grids name it (0, 0.5, 1, ...)."""
    return f"{k:g}"


def table(rows: list[dict[str, Any]]) -> str:
    """A markdown table of ``rows``, their first row's keys in order as the columns; a key's
    text after ``#`` is left out of its header (``verdict#2``: a second column headed verdict)."""
    if not rows:
        return "(no rows)"
    columns = list(rows[0])
    return markdown_table(rows, columns, {c: c.split("#")[0] for c in columns})


def raw_records(raw: pathlib.Path) -> list[dict[str, Any]]:
    """The top-level objects of a raw file: the JSON's one, or every line of a JSON-lines file."""
    if not raw.exists():
        return []
    text = raw.read_text()
    lines = (
        [json.loads(line) for line in text.splitlines() if line.strip()]
        if raw.suffix == ".jsonl"
        else [json.loads(text)]
    )
    return [r for r in lines if isinstance(r, dict)]


def recorded(raw: pathlib.Path, *path: str) -> list[Any]:
    """The distinct values a raw file records at ``run_record.<path>`` (``pdasgd_jax.bench.provenance``:
    commit, machine.cpu_count, ...) or, for the claims' cells, ``provenance.<path>``, in file order."""
    values: list[Any] = []
    for record in raw_records(raw):
        for holder in ("run_record", "provenance"):
            value: Any = record.get(holder)
            for part in path:
                value = value.get(part) if isinstance(value, dict) else None
            if value is not None and value not in values:
                values.append(value)
    return values


@dataclasses.dataclass
class Sources:
    """The (raw file, command, commit) triples the page's rows cite, each under a short key."""

    root: pathlib.Path
    entries: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    _commits: dict[pathlib.Path, str] = dataclasses.field(default_factory=dict)

    def rel(self, path: pathlib.Path) -> str:
        """``path`` relative to the repository root, as the page prints it."""
        return path.relative_to(self.root).as_posix()

    def cite(self, raw: pathlib.Path, command: str, commit: str | None = None) -> str:
        """The key (``S1``, ``S2``, ...) of this raw file produced by ``command`` at ``commit``
        (by default the commits the raw file records, ``recorded``; "not recorded" if none)."""
        if commit is None:
            if raw not in self._commits:
                self._commits[raw] = " + ".join(map(str, recorded(raw, "commit"))) or NOT_RECORDED
            commit = self._commits[raw]
        entry = (self.rel(raw), command, commit)
        if entry not in self.entries:
            self.entries.append(entry)
        return f"S{self.entries.index(entry) + 1}"

    def cores(self) -> dict[str, list[str]]:
        """The core counts the cited raw files record (``run_record.machine.cpu_count``), each
        with the keys of the sources recording it."""
        found: dict[str, list[str]] = {}
        for i, (raw, _, _) in enumerate(self.entries, 1):
            for count in recorded(self.root / raw, "machine", "cpu_count"):
                found.setdefault(str(count), []).append(f"S{i}")
        return found

    def markdown(self, commands: bool = True, only: Collection[int] | None = None) -> str:
        """The sources table: key, raw file, command, commit (without ``commands``: key, raw file
        under ``bench_results/``, commit, ``-`` where none is recorded); with ``only``, the rows
        of those keys alone;
        sources that differ only in the folder of their run (the same command into another
        ``--out``) share one row, the folder written ``<run>`` (the citing table names each run)."""
        groups: dict[tuple[str, str, str], list[int]] = {}
        for i, entry in enumerate(self.entries, 1):
            groups.setdefault(_run_template(*entry), []).append(i)
        rows = []
        shown = None if only is None else set(only)
        for (raw, command, commit), keys in groups.items():
            if shown is not None and shown.isdisjoint(keys):
                continue
            if len(keys) < 3:
                for i in keys if shown is None else [k for k in keys if k in shown]:
                    raw, command, commit = self.entries[i - 1]
                    rows.append(
                        {"source": f"S{i}", "raw file": f"`{raw}`", "command": f"`{command}`", "commit": _short(commit)}
                    )
                continue
            contiguous = keys == list(range(keys[0], keys[-1] + 1))
            name = f"S{keys[0]}-S{keys[-1]}" if contiguous else ", ".join(f"S{i}" for i in keys)
            rows.append({"source": name, "raw file": f"`{raw}`", "command": f"`{command}`", "commit": _short(commit)})
        rows.sort(key=lambda row: int(re.match(r"S(\d+)", row["source"]).group(1)))
        if commands:
            return table(rows)
        return table(
            [
                {
                    "source": row["source"],
                    "raw file (in `bench_results/`)": row["raw file"].replace("`bench_results/", "`"),
                    "commit": "-" if row["commit"] == NOT_RECORDED else row["commit"],
                }
                for row in rows
            ]
        )


def _run_template(raw: str, command: str, commit: str) -> tuple[str, str, str]:
    """``(raw, command, commit)`` with the raw file's folder written ``<run>`` where the command
    writes into that folder; unchanged otherwise."""
    folder = pathlib.PurePosixPath(raw).parent
    if folder.name and command.endswith(f"--out {folder}"):
        return (
            str(folder.parent / "<run>" / pathlib.PurePosixPath(raw).name),
            command.replace(f"--out {folder}", f"--out {folder.parent}/<run>"),
            commit,
        )
    return raw, command, commit


def _short(commit: str) -> str:
    """``commit`` with every full 40-digit hash cut to its first 12 digits."""
    return re.sub(r"\b([0-9a-f]{12})[0-9a-f]{28}\b", r"\1", commit)


def calibration_cache(root: pathlib.Path, fingerprint: str | None) -> str | None:
    """The ``XDG_CACHE_HOME`` (relative to ``root``) that holds the calibration whose fingerprint
    is ``fingerprint``, among those committed under ``bench_results/``; None when none does."""
    if not fingerprint:
        return None
    for path in sorted((root / "bench_results").glob(f"**/pdasgd_jax/calibration-{fingerprint[:24]}.json")):
        return path.parent.parent.relative_to(root).as_posix()
    return None
