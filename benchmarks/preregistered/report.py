"""``preregistered.md``: the claims' verdicts, then every cell on every curve (PD-ASGD's speedup
over each baseline with its interval and verdict) and every algorithm's tuned rate and times."""

from __future__ import annotations

import math
from typing import Any

from benchmarks.preregistered import settings
from pdasgd_jax.compare import markdown_table


def _num(x: float | None, digits: int = 3) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.{digits}g}"


def _interval(i: list[float] | None) -> str:
    return "-" if i is None else f"[{_num(i[0])}, {_num(i[1])}]"


def _row_name(r: dict[str, Any]) -> str:
    judged = "judged" if r["judged"] else "not judged"
    return f"cell {r['cell']} ({_delays(r)}), {r['kind']} curve `{r['device_concurrency']}` ({judged})"


def _delays(r: dict[str, Any]) -> str:
    per = "one draw per PD-ASGD job" if r["delay_per"] == "job" else "after each worker operation"
    return f"Exp({r['k']:g} x step compute) {per}"


def comparisons_table(r: dict[str, Any]) -> str:
    """PD-ASGD against each baseline of each claim on one row."""
    level = f"{settings.LEVEL * 100:g} %"
    pd_mean = r["algos"][settings.PDASGD]["mean"]
    lines = []
    for c in r["claims"].values():
        for b, vs in c["vs"].items():
            why = vs["pdasgd_censored"] and f"PD-ASGD {vs['pdasgd_censored']}"
            why = why or (vs["baseline_censored"] and f"{b} {vs['baseline_censored']}")
            lines.append(
                {
                    "claim": f"{c['factor']:g}x",
                    "baseline": b,
                    "baseline mean (s)": _num(r["algos"][b]["mean"]),
                    "PD-ASGD mean (s)": _num(pd_mean),
                    "speedup": _num(vs["ratio"]),
                    "interval": _interval(vs["interval"]),
                    "censored": why or "-",
                    "cell verdict": c["verdict"],
                }
            )
    columns = list(lines[0])
    return markdown_table(lines, columns, {"interval": f"{level} interval"})


def algos_table(r: dict[str, Any]) -> str:
    """Every algorithm's tuned rate, schedule, flags and reported times on one row."""
    lines = []
    for algo, c in r["algos"].items():
        schedule = c.get("schedule")
        lines.append(
            {
                "algorithm": algo,
                "rate": _num(c["lr"], 4),
                "schedule": "-" if not schedule else f"H={schedule[0]} d={schedule[1]}",
                "flags": ", ".join(f for f in ("untuned", "edge") if c.get(f)) or "-",
                "mean (s)": _num(c["mean"]),
                "times (s)": ", ".join(_num(t) for t in c["times"]),
            }
        )
    return markdown_table(lines, list(lines[0]))


def markdown(results: dict[str, Any]) -> str:
    """The report of ``run_cells``' results (raw, or read back from the JSON)."""
    pre = results["preregistration"]
    s = results["run"]
    out = [f"## Pre-registered headline cells{' (quick: a smoke run, judges nothing)' if results['quick'] else ''}", ""]
    out.append(
        f"Follows `{pre['path']}` (sha256 {pre['sha256'][:12]}, commit {pre['commit']}): W = {s['workers']}, "
        f"{s['epochs']:g} epochs, reported seeds {s['seeds']}, tuning seeds {s['tuning_seeds'] or 'none (one rate)'}; "
        f"speedup = baseline's mean time to target / PD-ASGD's, interval at {settings.LEVEL * 100:g} % "
        "(delta method on the log ratio, Student's t at the smaller sample's degrees of freedom)."
    )
    out.append("")
    measured = results["measured_curve"]
    if measured is None:
        out += [
            "**No accelerator-measured device curve is committed** (`bench_results/preregistered/device-curve.json`):"
            " no cell is judged. The rows below are the serial device and the what-if curves, never judged.",
            "",
        ]
    else:
        m = measured["machine"]
        out += [f"Judged curve: `{measured['curve']}` measured on {m.get('device_kind')} ({m.get('backend')}).", ""]
    claims = [
        {
            "claim": c["text"],
            "factor": f"{c['factor']:g}x",
            "cells": ", ".join(f"{k}: {v}" for k, v in c["cells"].items()) or "-",
            "verdict": c["verdict"],
        }
        for c in results["claims"].values()
    ]
    out += [markdown_table(claims, ["claim", "factor", "cells", "verdict"]), ""]
    for r in results["rows"]:
        out += [f"### {_row_name(r)}", "", comparisons_table(r), "", algos_table(r), ""]
    return "\n".join(out).rstrip()
