"""Run (or read) the inputs and write a report directory: report.md, the PNGs, trace.json and
report.json."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from . import plots
from .compare import calibration_points, load_measured, merge_comparison
from .data import Variant, request_rows, variant_from_result, variants_from_json
from .markdown import page
from .trace import trace_document

__all__ = ["collect", "write_report", "build_report", "FIGURES"]

FIGURES = ("transfer-vs-prompt.png", "tp-heatmap.png", "kv-vs-state.png", "time-breakdown.png",
           "link-utilisation.png", "descriptor-merging.png", "simulated-vs-measured.png")


@contextmanager
def _progress(total: int, label: str) -> Iterator[Callable[[], None]]:
    """A rich progress bar on a terminal (stderr), nothing otherwise (CI logs, pipes)."""
    if total < 2 or not sys.stderr.isatty():
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda: bar.advance(task)


def _inputs(inputs: Sequence[str | Path]) -> list[tuple[str, Path]]:
    """(family, file) for every input: a scenario file, a directory of them (recursively, in
    name order; the family is the file's path below the directory) or a saved JSON result."""
    out: list[tuple[str, Path]] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            files = sorted(path.rglob("*.toml"))
            if not files:
                raise ValueError(f"{path}: no scenario files (*.toml) in this directory")
            out += [(str(f.relative_to(path).with_suffix("")), f) for f in files]
        elif path.is_file():
            out.append((path.stem, path))
        else:
            raise ValueError(f"{path}: no such scenario file, directory or saved result")
    return out


def collect(inputs: Sequence[str | Path], *, timing_only: bool = False) -> list[Variant]:
    """Run every scenario variant of the inputs (saved JSON results are read, not run)."""
    from ..cluster import run_scenario
    from ..scenario import load_scenarios

    jobs: list[tuple[str, Any]] = []
    variants: list[Variant] = []
    for family, path in _inputs(inputs):
        if path.suffix == ".json":
            variants += variants_from_json(path, family=family)
        else:
            jobs += [(family, s) for s in load_scenarios(path)]
    with _progress(len(jobs), "running scenarios") as advance:
        for family, scenario in jobs:
            result = run_scenario(scenario, timing_only=timing_only)
            variants.append(variant_from_result(result, family=family, timing_only=timing_only))
            advance()
    return variants


def _round(x: float) -> float:
    return float(f"{x:.12g}")


def _report_json(title: str, command: str, variants: list[Variant], rows: list[dict[str, Any]],
                 comparison: list[dict[str, Any]], crossover: dict[int, float]) -> dict[str, Any]:
    return {
        "title": title,
        "command": command,
        "variants": [{
            "name": v.name, "family": v.family, "model": v.model, "mode": v.mode,
            "descriptor_merge": v.merge, "prefill_tp": v.prefill_tp, "decode_tp": v.decode_tp,
            "outcome": v.outcome, "expectation_met": v.expectation_met, "verified": v.verified,
            "mismatched_bytes": v.mismatched_bytes, "simulated_seconds": _round(v.sim_seconds),
            "requests": [{
                "index": r["index"], "prompt_tokens": r["prompt_tokens"],
                "prefix_hit_tokens": r["hit_tokens"],
                "effective_prefix_hit_tokens": r["effective_hit_tokens"],
                "descriptors": r["descriptors"],
                "descriptors_posted": r["posted"], "bytes": r["nbytes"],
                "transfers": r["transfers"], "transfer_seconds": _round(r["transfer"]),
                "breakdown_seconds": {k: _round(x) for k, x in r["breakdown"].items()},
            } for r in rows if r["variant"] is v],
        } for v in variants],
        "descriptor_merging": [{k: f[k] for k in ("family", "variants", "modes")}
                               for f in comparison],
        "crossover_tokens": {str(k): _round(x) for k, x in crossover.items()},
    }


def write_report(variants: list[Variant], out: str | Path, *, title: str, command: str,
                 measured: dict[str, Variant] | None = None,
                 calibration_dir: str | Path = "reports/calibration") -> dict[str, Any]:
    """Write report.md, the figures, trace.json and report.json into ``out``; returns what was
    written ({"files": [...], "report": {...}})."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in FIGURES:  # a figure this run does not draw must not survive from an older one
        (out / stale).unlink(missing_ok=True)
    rows = request_rows(variants)
    primary, caption = plots.primary_rows(rows)
    comparison = merge_comparison(variants, measured)
    geometry = next((v.geometry for v in variants if primary and v.model == primary[0]["model"]
                     and v.geometry), {})
    crossover = plots.crossovers(geometry) if geometry.get("is_hybrid") else {}
    cal_dir = Path(calibration_dir)
    calibration = calibration_points(variants, cal_dir)
    figures = {
        "prompt": plots.prompt_sweep(primary, out, caption),
        "heatmap": plots.tp_heatmap(primary, out, caption),
        "kv_state": plots.kv_vs_state(variants, primary, out, caption),
        "breakdown": plots.time_breakdown(primary, out, caption) if primary else None,
        "links": plots.link_utilisation(variants, out),
        "merge": plots.merge_comparison(comparison, out),
        "calibration": plots.simulated_vs_measured(calibration, out),
    }
    trace = trace_document(variants)
    (out / "trace.json").write_text(json.dumps(trace, separators=(",", ":")) + "\n")
    busiest = plots.busiest(variants)
    text = page(title=title, command=command, variants=variants, rows=rows, primary=primary,
                caption=caption, figures=figures, crossover=crossover, geometry=geometry,
                comparison=comparison, measured=bool(measured), calibration=calibration,
                calibration_dir=str(calibration_dir), trace_events=len(trace["traceEvents"]),
                link_variant=busiest.name if busiest else None)
    (out / "report.md").write_text(text)
    data = _report_json(title, command, variants, rows, comparison, crossover)
    (out / "report.json").write_text(json.dumps(data, indent=1) + "\n")
    files = ["report.md", "report.json", "trace.json"] + [f for f in figures.values() if f]
    return {"files": files, "report": data}


def build_report(inputs: Sequence[str | Path], out: str | Path | None = None, *,
                 title: str | None = None, timing_only: bool = False,
                 measured: Sequence[str | Path] = (),
                 calibration_dir: str | Path = "reports/calibration",
                 command: str = "") -> Path:
    """Run or read ``inputs`` and write the report into ``out`` (default
    ``reports/<name of the first input>``). Returns the directory."""
    first = Path(inputs[0])
    name = first.name if first.is_dir() else first.stem
    target = Path(out) if out is not None else Path("reports") / name
    variants = collect(inputs, timing_only=timing_only)
    if title is None:
        names = sorted({v.name.split(" [")[0] for v in variants})
        title = names[0] if len(names) == 1 else f"hkvsim report: {name}"
    write_report(variants, target, title=title,
                 command=command or "hkvsim report " + " ".join(str(i) for i in inputs),
                 measured=load_measured(list(measured)) if measured else None,
                 calibration_dir=calibration_dir)
    return target
