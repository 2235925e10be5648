"""Writes ``BENCHMARKS.md``, the results page, and its detail pages under ``docs/results/`` from
the raw files in ``bench_results/``.

Every figure on the pages is computed here from a raw file (never typed), with its 95 % interval
recomputed from the per-seed values by one method (``results_common``), a verdict, and a source
key naming the raw file, the command that produced it and the commit it records. Run it after
adding or replacing a raw file; ``--check`` exits with status 1 when any committed page differs
from what this makes (``benchmarks/tests/test_results_page.py`` runs the same check).

The results page keeps one table, or a compact summary table, per question, every row with its
figure, interval (or range), verdict and source key, and stays under ``PAGE_LIMIT`` bytes; what
does not fit goes in full to a detail page under ``docs/results/`` (the documentation site's
Results), linked from its section: the overhead tables (``overheads.md``; the page keeps one row
per question), the device-concurrency map (``concurrency.md``; the page keeps its largest gain),
the staleness tables (``staleness.md``; the page links them), and the current runtime run's
staleness with every run of its protocol (``runtime.md``; the page keeps
their spread). The page's Sources section lists each key with its raw file and commit only: the
commands, long (environment, every flag), are on ``sources.md`` with those of the protocols that
have no raw file yet, one link away. A fleet study's compact table (``benchmarks.fleets.compact``,
its detail page ``benchmarks.fleets.report``), where that module exists and has a raw file,
follows the DaSGD section, its rows citing the raw files as the other tables do.

Usage::

    python -m benchmarks.scripts.make_results_page            # rewrites every page
    python -m benchmarks.scripts.make_results_page --check    # exit 1 if any page is stale
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
from collections.abc import Collection

from benchmarks.scripts import (
    results_accuracy,
    results_cells,
    results_concurrency,
    results_overheads,
    results_runtime,
)
from benchmarks.scripts.results_common import CLAIM_VS_ASYNC, CLAIM_VS_SYNC, Sources, table

try:  # the fleet study's tables, where that module exists
    from benchmarks.fleets import compact as fleets_compact
    from benchmarks.fleets import report as fleets_report
except ImportError:
    fleets_compact = fleets_report = None

REPO = pathlib.Path(__file__).resolve().parents[2]
PAGE = "BENCHMARKS.md"
PAGE_LIMIT = 30 * 1000  # bytes: the page is read whole, on GitHub and in a terminal
COMMAND = "python -m benchmarks.scripts.make_results_page"
# The page as the documentation site links it (the site holds the detail pages, not the page).
PAGE_URL = "https://github.com/pdasgd-jax/pdasgd-jax/blob/main/BENCHMARKS.md"
DETAILS = "docs/results"
# Each detail page under DETAILS: its title, and the heading of the results page it details.
DETAIL_PAGES = {
    "index.md": ("Results in full", ""),
    "overheads.md": ("Overheads in full", "Overheads: runtime throughput and simulator speed"),
    "concurrency.md": ("Device concurrency in full", "device concurrency"),
    "staleness.md": ("Staleness in full", "Staleness"),
    "runtime.md": ("Threaded runtime: every run", "Threaded runtime (wall clock)"),
    "fleets.md": ("Heterogeneous and unreliable fleets in full", "Heterogeneous and unreliable fleets"),
    "sources.md": ("Sources in full", "Sources"),
}


FINDINGS = "docs/archive/review-findings.md"
ACCELERATOR = "Accelerator: MFU and device check"
DEVICE_CHECK = "`make device-check` on a GPU or TPU machine (`bench_results/device_check/README.md`)"
NO_ACCELERATOR = (
    "No accelerator run yet: `bench_results/device_check/` holds no `device_check.json` (the MFU and device check, "
    "`make device-check` on a GPU or TPU machine: `bench_results/device_check/README.md`)"
)
# The open review findings that bound the page's tables, and which tables each bounds.
BOUNDING_FINDINGS = {
    "34": "the headline claims",
    "35": "every virtual-clock table",
    "37": "the threaded runtime",
    "38": "the virtual-clock tables with several devices",
}


def findings(root: pathlib.Path) -> str:
    """``BOUNDING_FINDINGS`` as ``FINDINGS`` states them now: number, finding, status, tables."""
    path = root / FINDINGS
    rows = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] in BOUNDING_FINDINGS:
            rows[cells[0]] = cells
    return "; ".join(
        f"{n} ({_unbracketed(rows[n][3])}): {_unbracketed(rows[n][2])}, bounding {tables}"
        if n in rows
        else f"{n}: not in `{FINDINGS}`"
        for n, tables in BOUNDING_FINDINGS.items()
    )


def _unbracketed(text: str) -> str:
    """``text`` without its parenthetical remarks (the findings table keeps the detail)."""
    return re.sub(r"\s*\([^()]*(\([^()]*\)[^()]*)*\)", "", text)


def anchor(title: str) -> str:
    """GitHub's anchor for a heading ``title`` (MkDocs makes the same of these titles)."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def detail_link(name: str, text: str = "") -> str:
    """A link from the results page to detail page ``name``, a repository path (GitHub renders it)."""
    return f"[{text or f'{DETAILS}/{name}'}]({DETAILS}/{name})"


def _intro(root: pathlib.Path, sources: Sources, cited: Collection[int]) -> str:
    """The page's head; its machine line gives the core counts of the sources ``cited`` (the tables')."""
    cores: dict[str, list[str]] = {}
    for count, keys in sources.cores().items():
        if kept := [k for k in keys if int(k[1:]) in cited]:
            cores[count] = kept
    return f"""# Benchmarks

The current results of the study in `benchmarks/`, one table per question, generated by
`{COMMAND}` from the raw files in `bench_results/`, never by hand
(`benchmarks/tests/test_results_page.py` fails when the page differs from what the script makes
of them); its detail pages, generated with it: {detail_link("index.md")}. History and protocol
reviews: `docs/archive/benchmarks-diary.md`, `docs/archive/review-findings.md`; where they
disagree with this page, the page holds.

- **Machine**: {results_runtime.machines(root, cores)}. The virtual-clock tables
  (`delays`, `delays-network`, the claims' cells) are deterministic given their calibration and
  seed; the runtime and throughput tables are wall clock.
- **Terms**: W devices; k the mean injected delay per step in steps' compute; M stages;
  *stronger sync*: sync keeping the first W - b gradients, a cell naming its b (b=W/4:
  `sync-backup`; b=W/8, b=W/2: `-w8`, `-w2`; b=0: plain sync); *best async*: the fastest of
  `asgd`, `asgd-3t` (3 threads per device, as PD-ASGD's F + B), `lpp`, `asgd-3t-rep` (with a
  replica per device); H, d: averaging period and merge delay; MFU: model FLOPs utilisation.
- **Intervals**: 95 %, the delta method over the reported seeds, Student's t at the smaller
  sample's degrees of freedom; log scale for a ratio of means and the mean of a positive
  quantity (`benchmarks.log_ratio_ci95`, as `docs/preregistration.md` fixes), linear for a
  difference of means (accuracy points); recomputed from the raw per-seed values (a row whose raw
  file keeps none says so).
- **Verdicts**: a speedup is *faster* (▲) when its interval lies above 1, *slower* (▼) below,
  *not settled* (○) when it contains 1; differences likewise against 0. A paper's factor is
  *reproduced* in a cell when the interval's lower end reaches it, *not reproduced* when its upper
  end is below it, *not settled* otherwise; over a grid, reproduced if any cell reproduces it,
  not reproduced if every cell does not, else not settled. These are `docs/preregistration.md`'s words, used
  here on exploratory grids (the serial clock, 3 seeds, baselines picked on tuning seeds).
- **Open review findings** (`{FINDINGS}`) {", ".join(BOUNDING_FINDINGS)} bound these tables: what each
  says and bounds, {detail_link("index.md#open-review-findings", f"{DETAILS}/index.md")}.
- **Sources**: a row's keys (S1, ...) name its raw file and the commit the raw file records (-:
  none), in the table at the end; the command that wrote each: {detail_link("sources.md")}.
"""


def _section(title: str, text: str, body: str, empty: str) -> str:
    return "\n\n".join(part for part in (f"## {title}", text, body or empty) if part) + "\n"


def _grids(root: pathlib.Path, sources: Sources) -> list[results_cells.Grid]:
    """The time-to-target grids that have raw cells: ``delays``, ``delays-network``, the claims'."""
    grids = (
        results_cells.delays_grid(root, sources, "delays"),
        results_cells.delays_grid(root, sources, "delays-network"),
        results_cells.claims_grid(root, sources),
    )
    return [g for g in grids if g is not None]


def _main_page(root: pathlib.Path, sources: Sources, grids: list[results_cells.Grid]) -> str:
    """The results page; cites every source before the detail pages are made of the same keys."""
    parity, parity_ablation = results_accuracy.parity(root, sources)
    claims_accuracy, claims_ablation = results_accuracy.claims_accuracy(root, sources)
    parts: list[str] = []
    parts.append(
        _section(
            "The papers' headline claims",
            f"Exploratory. PD-ASGD's \"up to {CLAIM_VS_SYNC:g}x faster than synchronous data parallel training under "
            f'delays" and "up to {CLAIM_VS_ASYNC:g}x faster than comparable ASGD" (arXiv 2410.05985), '
            "judged over every cell of each grid at W = 4 and 16 with delays (k >= 0.5); the best "
            "cell's speedup is shown, a maximum over noisy cells, biased upwards. Not the "
            "pre-registered test (`docs/preregistration.md`), which has not run.",
            table(results_cells.claims_rows(grids)),
            "No time-to-target raw cells.",
        )
    )
    speedups = "\n\n".join(f"### {g.name}\n\n{g.description}.\n\n{results_cells.speedup_table(g)}" for g in grids)
    concurrency = results_concurrency.concurrency_summary(root, sources)
    if concurrency:
        speedups += (
            f"\n\n### device concurrency\n\n{concurrency}\n\nEvery gain, the fit of PD-ASGD's time and the "
            f"caveats: {detail_link('concurrency.md')}."
        )
    parts.append(
        _section(
            "Speedup of PD-ASGD (time to target)",
            "Mean time to the target of the reference over PD-ASGD's, per cell; the stronger sync is the "
            "fastest synchronous variant (plain, or with W/8, W/4 or W/2 backup workers, where the cell ran them) "
            "and the best "
            "asynchronous baseline the fastest one, both picked on the tuning seeds "
            "(`benchmarks/scripts/delays_report.py`). † names the tuning seeds' pick when it missed "
            "the target on a reported seed and the next candidate is shown instead (a choice made on "
            "reported seeds); ‡ marks a cell where PD-ASGD's or the comparator's rate is untuned or "
            "on the edge of its grid.",
            speedups,
            "No time-to-target raw cells.",
        )
    )
    ablation = table(parity_ablation + claims_ablation) if parity_ablation + claims_ablation else ""
    parts.append(
        _section(
            "Accuracy",
            "Final test accuracy against SGD's at equal examples, in points.\n\n### parity\n\n"
            + (parity or "No raw file.")
            + "\n\n### claims accuracy cells\n\n"
            + (claims_accuracy or "No raw file.")
            + "\n\n### layer-wise against block updates (the paper's ablation)",
            ablation,
            "No raw file.",
        )
    )
    parts.append(
        _section(
            "Staleness",
            "PD-ASGD's mean staleness per applied update (versions) against the cell's best asynchronous "
            "baseline's, with both means, their difference, its interval and mark, per cell of every grid, "
            f"and layer-wise against block updates: {detail_link('staleness.md')}.",
            "",
            "",
        )
    )
    dasgd = "\n\n".join(f"### {g.name}\n\n{t}" for g in grids if (t := results_cells.dasgd_table(g)))
    parts.append(
        _section(
            "DaSGD",
            "DaSGD's time to the target against sync's in the grids that ran it."
            + (
                ""
                if results_runtime.has_raw(root, "overlap")
                else " Whether it hides its all-reduce on real "
                "devices (the `overlap` protocol) has no raw file yet (see below)."
            ),
            dasgd,
            "No raw cells.",
        )
    )
    fleets = fleets_compact.results_section(root, sources) if fleets_compact is not None else None
    parts.append(
        _section(
            "Heterogeneous and unreliable fleets",
            "",
            (fleets or "").strip(),
            f"No raw file covers a fleet size yet (`python -m benchmarks fleets`): {detail_link('fleets.md')}.",
        )
    )
    runtime = results_runtime.runtime_table(root, sources, staleness=False)
    apart = results_runtime.runs_apart(root)
    runs = results_runtime.runs_summary(root, sources)
    parts.append(
        _section(
            "Threaded runtime (wall clock)",
            "The threaded runtime's time to the target against sync under real injected delays in one run, the "
            "current `runtime.json`, and the simulator's prediction of the same configuration; then PD-ASGD's "
            "speedup over every run of this protocol"
            + (
                f", which differ beyond one run's interval at k = {', '.join(apart)}: the current run's interval "
                "does not bound where another run lands."
                if apart
                else "."
            ),
            runtime
            + (
                f"\n\n{runs} Every run, and the staleness each layout measured: {detail_link('runtime.md')}."
                if runs
                else ""
            ),
            "No raw file.",
        )
    )
    parts.append(
        _section(
            "Overheads: runtime throughput and simulator speed",
            "The threaded runtime's and the simulator's speed, one row per question: medians over rounds or "
            "repeats, [min, max] where the raw file keeps no per-seed values (a range, not an interval). Every "
            f"table in full, with its protocol and load: {detail_link('overheads.md')}.",
            results_overheads.summary(root, sources),
            "No raw file.",
        )
    )
    accelerator = results_runtime.device_check_table(root, sources, ("mfu",))
    if accelerator:
        intro = f"{DEVICE_CHECK}; its other parts: "
        parts.append(
            _section(
                ACCELERATOR,
                intro + f"{detail_link('runtime.md#accelerator-device-checks', f'{DETAILS}/runtime.md')}.",
                accelerator,
                "",
            )
        )
    missing = results_runtime.missing_names(root)
    parts.append(
        _section(
            "Not on this page: no raw file yet",
            "" if accelerator else f"{NO_ACCELERATOR}.",
            (
                "Protocols whose figures are not reproducible from the repository until their raw file is "
                f"committed: {', '.join(missing)}; the command that writes each: "
                f"{detail_link('sources.md#no-raw-file-yet', f'{DETAILS}/sources.md')}."
            )
            if missing
            else "",
            "None.",
        )
    )
    # Last: the intro names the sources the tables cite (and cites no other).
    cited = cited_keys("\n".join(parts))
    parts.insert(0, _intro(root, sources, cited))
    keys = (
        f"The keys this page cites; every key, with the command that wrote its raw file: "
        f"{detail_link('sources.md', f'{DETAILS}/sources.md')}."
    )
    parts.append(_section("Sources", keys, sources.markdown(commands=False, only=cited), ""))
    return "\n".join(parts).rstrip() + "\n"


def cited_keys(text: str) -> set[int]:
    """The source keys ``text`` cites, alone (``S7``) or as ranges (``S3-S5``: 3, 4 and 5)."""
    cited: set[int] = set()
    for first, last in re.findall(r"\bS(\d+)(?:-S(\d+))?\b", text):
        cited.update(range(int(first), int(last or first) + 1))
    return cited


def _detail(name: str, body: str) -> str:
    """Detail page ``name``: its title, where it comes from and the heading it details, ``body``."""
    title, section = DETAIL_PAGES[name]
    if not section:
        return f"# {title}\n\n{body.strip()}\n"
    keys = (
        ""
        if name == "sources.md"
        else " Its intervals and verdicts are the page's; its keys (S1, ...): [sources](sources.md)."
    )
    return (
        f"# {title}\n\nGenerated by `{COMMAND}` from the raw files in `bench_results/` with the results page, "
        f"never by hand: its section [{section}]({PAGE_URL}#{anchor(section)}) in full.{keys}\n\n{body.strip()}\n"
    )


def render_pages(root: pathlib.Path = REPO) -> dict[str, str]:
    """Every generated page, keyed by its path relative to ``root``: the results page, then its
    detail pages, all made of the raw files under ``root / "bench_results"`` with one set of keys."""
    sources = Sources(root)
    grids = _grids(root, sources)
    page = _main_page(root, sources, grids)
    staleness = "\n\n".join(f"## {g.name}\n\n{results_cells.staleness_table(g)}" for g in grids)
    concurrency = results_concurrency.concurrency_table(root, sources)
    runs = results_runtime.runs_table(root, sources)
    layer_block = results_accuracy.staleness_layer_vs_block(root, sources)
    details = {
        "index.md": f"The [results page]({PAGE_URL}) (`{PAGE}`) holds one table per question; these pages, "
        f"generated by `{COMMAND}` from the same raw files with it, hold what does not fit there, each "
        "linked from its section.\n\n"
        + "\n".join(
            f"- [{title}]({name}): the results page's [{section}]({PAGE_URL}#{anchor(section)}) in full."
            for name, (title, section) in DETAIL_PAGES.items()
            if section
        )
        + f"\n\n## Open review findings\n\nThe findings of `{FINDINGS}` that bound the results page's tables: "
        + findings(root)
        + ".",
        "overheads.md": results_overheads.tables(root, sources),
        "concurrency.md": concurrency or "No raw file.",
        "staleness.md": "Mean staleness per applied update (versions) of PD-ASGD, then the cell's best "
        "asynchronous baseline's, then their difference with its interval and mark.\n\n"
        + (staleness or "No raw cells.")
        + (f"\n\n## layer-wise against block updates\n\n{layer_block}" if layer_block else ""),
        "runtime.md": "The current run (`runtime.json`) with the mean staleness τ each layout measured and the "
        "simulator predicted, then PD-ASGD's measured speedup over sync in every run of the current protocol "
        "(those fitting a host model).\n\n"
        + (results_runtime.runtime_table(root, sources) or "No raw file.")
        + "\n\n"
        + (runs or "No raw file.")
        + "\n\n## Accelerator device checks\n\n"
        + (results_runtime.device_check_table(root, sources) or "None yet."),
        "fleets.md": (fleets_report.detail_page(root) if fleets_report is not None else None)
        or "No raw file covers a fleet size yet (`python -m benchmarks fleets` writes one).",
        "sources.md": "Each key's raw file, the command that wrote it and the commit the raw file records.\n\n"
        + sources.markdown()
        + "\n\n## No raw file yet\n\nThe protocols whose raw file is not committed, with the command that "
        "writes it.\n\n" + (results_runtime.missing_table(root) or "None."),
    }
    return {PAGE: page} | {f"{DETAILS}/{name}": _detail(name, body) for name, body in details.items()}


def render(root: pathlib.Path = REPO) -> str:
    """The results page as the raw files under ``root / "bench_results"`` give it."""
    return render_pages(root)[PAGE]


def main(argv: list[str] | None = None) -> int:
    """Writes every page under ``--out`` (default the repository), or checks them with ``--check``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if any page is not what this makes")
    parser.add_argument("--out", default=str(REPO), help="the root the pages are written under")
    args = parser.parse_args(argv)
    pages, out = render_pages(REPO), pathlib.Path(args.out)
    size = len(pages[PAGE].encode())
    too_long = size > PAGE_LIMIT
    if too_long:
        print(f"{PAGE} is {size} bytes, over {PAGE_LIMIT}: move a table to a detail page", file=sys.stderr)
    if args.check:
        stale = [name for name, text in pages.items() if not (out / name).exists() or (out / name).read_text() != text]
        for name in stale:
            print(f"{out / name} is out of date: run {COMMAND}", file=sys.stderr)
        return 1 if stale or too_long else 0
    for name, text in pages.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
        print(f"wrote {out / name} ({len(text.encode())} bytes)")
    return 1 if too_long else 0


if __name__ == "__main__":
    sys.exit(main())
