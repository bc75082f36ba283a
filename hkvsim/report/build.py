"""Run (or read) the inputs and write a report directory: report.md, the PNGs, trace.json and
report.json."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..progress import bar
from . import plots
from .axis import check_axis, compare_along
from .compare import calibration_points, load_measured, merge_comparison
from .csv_export import CSV_NAME, write_requests_csv
from .data import Variant, request_rows, variant_from_result, variants_from_json
from .markdown import page
from .sizing import sizing_rows
from .trace import trace_document

__all__ = ["collect", "write_report", "build_report", "FIGURES"]

# the figure stems a report may write (one input: "stem.png"; several: "stem-<input>.png")
FIGURES = ("transfer-vs-prompt", "tp-heatmap", "kv-vs-state", "time-breakdown",
           "link-utilisation", "descriptor-merging", "simulated-vs-measured", "compare",
           "pd-sizing")


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


def _identity(v: Variant) -> tuple[str, str, str]:
    """What makes a variant one run: its scenario file, sweep point and backend."""
    source = Path(v.source)
    where = str(source.resolve()) if source.is_file() else v.source
    return where, json.dumps(v.sweep_point, sort_keys=True, default=str), v.backend


def collect(inputs: Sequence[str | Path], *, timing_only: bool = False) -> list[Variant]:
    """Run every scenario variant of the inputs (saved JSON results are read, not run). Saved
    results of one sweep (``--shard`` outputs) join one input, in variant order; a variant that
    appears twice (overlapping shards, a file given twice) is an error."""
    from ..cluster import run_scenario
    from ..scenario import load_scenarios

    jobs: list[tuple[str, Any, tuple[int, int]]] = []
    variants: list[Variant] = []
    for family, path in _inputs(inputs):
        if path.suffix == ".json":
            variants += variants_from_json(path)
        else:
            scenarios = load_scenarios(path)
            jobs += [(family, s, (i, len(scenarios))) for i, s in enumerate(scenarios)]
    with bar(len(jobs), "running scenarios") as advance:
        for family, scenario, position in jobs:
            result = run_scenario(scenario, timing_only=timing_only)
            variants.append(variant_from_result(result, family=family, position=position))
            advance()
    seen: dict[tuple[str, str, str], Variant] = {}
    for v in variants:
        key = _identity(v)
        if key in seen:
            raise ValueError(f"variant {v.name!r} ({v.backend}) is in the inputs twice "
                             f"(inputs {seen[key].family!r} and {v.family!r}): give each run "
                             f"once; the shards of one sweep must not overlap")
        seen[key] = v
    order = {f: k for k, f in enumerate(dict.fromkeys(v.family for v in variants))}
    return sorted(variants, key=lambda v: (order[v.family], v.sweep_index))


def _round(x: float | None) -> float | None:
    return None if x is None else float(f"{x:.12g}")


def _verification_counts(variants: list[Variant]) -> dict[str, int]:
    return {k: sum(v.verification == k for v in variants)
            for k in ("verified", "nothing-checked", "timing-only", "failed")}


def _report_json(title: str, command: str, variants: list[Variant], rows: list[dict[str, Any]],
                 comparison: list[dict[str, Any]], crossover: dict[str, dict[int, float]],
                 axis: dict[str, Any] | None, sizing: list[dict[str, Any]]) -> dict[str, Any]:
    share = {(id(r["variant"]), r["index"]): r for r in sizing}
    return {
        "title": title,
        "command": command,
        "expectation_met": all(v.expectation_met for v in variants),
        "verification": _verification_counts(variants),
        "variants": [{
            "name": v.name, "family": v.family, "sweep_index": v.sweep_index,
            "model": v.model, "mode": v.mode,
            "descriptor_merge": v.merge, "prefill_tp": v.prefill_tp, "decode_tp": v.decode_tp,
            "profile": v.profile, "backend": v.backend,
            "outcome": v.outcome, "expectation_met": v.expectation_met,
            "expectation_problems": v.expectation_problems,
            "verification": v.verification, "verified": v.verified,
            "corrupted": v.corrupted, "mismatched_bytes": v.mismatched_bytes,
            "explanations": v.explanations,
            "clock": v.clock, "elapsed_seconds": _round(v.sim_seconds),
            "requests": [{
                "index": r["index"], "prompt_tokens": r["prompt_tokens"],
                "prefix_hit_tokens": r["hit_tokens"],
                "effective_prefix_hit_tokens": r["effective_hit_tokens"],
                "descriptors": r["descriptors"],
                "descriptors_posted": r["posted"], "bytes": r["nbytes"],
                "transfers": r["transfers"], "transfer_seconds": _round(r["transfer"]),
                "breakdown_seconds": {k: _round(x) for k, x in r["breakdown"].items()},
                **({"prefill_seconds": _round(share[(id(v), r["index"])]["prefill_seconds"]),
                    "transfer_share_of_ttft":
                        _round(share[(id(v), r["index"])]["transfer_share"])}
                   if (id(v), r["index"]) in share else {}),
            } for r in rows if r["variant"] is v],
        } for v in variants],
        "descriptor_merging": [{k: f[k] for k in ("family", "variants", "modes")}
                               for f in comparison],
        "comparison": None if axis is None else {
            k: x for k, x in axis.items() if k != "pairs"},
        "crossover_tokens": {family: {str(k): _round(x) for k, x in c.items()}
                             for family, c in crossover.items()},
    }


def _clean(out: Path) -> None:
    """Remove the figures and the CSV of an older report in ``out``: one this run does not
    write must not survive."""
    for stem in FIGURES:
        for old in [out / f"{stem}.png", *out.glob(f"{stem}-*.png")]:
            old.unlink(missing_ok=True)
    (out / CSV_NAME).unlink(missing_ok=True)


def _input_figures(variants: list[Variant], rows: list[dict[str, Any]], out: Path,
                   several: bool) -> list[dict[str, Any]]:
    """Per input (family): its sweep figures and what they show."""
    sections = []
    for family in dict.fromkeys(v.family for v in variants):
        mine = [r for r in rows if r["family"] == family]
        primary, caption = plots.primary_rows(mine)
        suffix = family if several else ""
        model = primary[0]["model"] if primary else None
        geometry = next((v.geometry for v in variants if v.family == family
                         and v.model == model and v.geometry), {})
        fam_variants = [v for v in variants if v.family == family]
        sized = sizing_rows(primary)
        sections.append({
            "family": family, "primary": primary, "caption": caption, "geometry": geometry,
            "crossover": plots.crossovers(geometry) if geometry.get("is_hybrid") else {},
            "others": sorted({r["model"] for r in mine} - ({model} if model else set())),
            "sizing": sized,
            "figures": {
                "prompt": plots.prompt_sweep(primary, out, caption,
                                             plots.figure_name("transfer-vs-prompt", suffix)),
                "heatmap": plots.tp_heatmap(primary, out, caption,
                                            plots.figure_name("tp-heatmap", suffix)),
                "kv_state": plots.kv_vs_state(fam_variants, primary, out, caption,
                                              plots.figure_name("kv-vs-state", suffix)),
                "breakdown": plots.time_breakdown(primary, out, caption,
                                                  plots.figure_name("time-breakdown", suffix))
                if primary else None,
                "sizing": plots.sizing(sized, out, caption,
                                       plots.figure_name("pd-sizing", suffix)),
            },
        })
    return sections


def write_report(variants: list[Variant], out: str | Path, *, title: str, command: str,
                 measured: dict[str, Variant] | None = None,
                 calibration_dir: str | Path = "reports/calibration",
                 compare: str | None = None, csv: bool = False) -> dict[str, Any]:
    """Write report.md, the figures, trace.json and report.json (and requests.csv with
    ``csv``) into ``out``; returns what was written ({"files": [...], "report": {...}}).
    ``compare``: the axis to put side by side (``input``, ``backend`` or a scenario key)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _clean(out)
    if compare is not None:
        check_axis(variants, compare)
    rows = request_rows(variants)
    families = list(dict.fromkeys(v.family for v in variants))
    inputs = _input_figures(variants, rows, out, several=len(families) > 1)
    comparison = merge_comparison(variants, measured)
    axis = compare_along(variants, compare) if compare is not None else None
    calibration = calibration_points(variants, Path(calibration_dir))
    figures = {
        "links": plots.link_utilisation(variants, out),
        "merge": plots.merge_comparison(comparison, out),
        "calibration": plots.simulated_vs_measured(calibration, out),
        "compare": plots.axis_comparison(axis, out) if axis is not None else None,
    }
    trace = trace_document(variants)
    (out / "trace.json").write_text(json.dumps(trace, separators=(",", ":")) + "\n")
    busiest = plots.busiest(variants)
    text = page(title=title, command=command, variants=variants, rows=rows, inputs=inputs,
                figures=figures, comparison=comparison, measured=bool(measured),
                calibration=calibration, calibration_dir=str(calibration_dir),
                trace_events=len(trace["traceEvents"]), axis=axis,
                link_variant=busiest.name if busiest else None, csv=CSV_NAME if csv else None)
    (out / "report.md").write_text(text)
    sizing = [r for section in inputs for r in section["sizing"]]
    crossover = {section["family"]: section["crossover"] for section in inputs
                 if section["crossover"]}
    data = _report_json(title, command, variants, rows, comparison, crossover, axis, sizing)
    (out / "report.json").write_text(json.dumps(data, indent=1) + "\n")
    files = ["report.md", "report.json", "trace.json"]
    if csv:
        files.append(write_requests_csv(variants, out))
    files += [f for f in figures.values() if f]
    files += [f for section in inputs for f in section["figures"].values() if f]
    return {"files": files, "report": data}


def build_report(inputs: Sequence[str | Path], out: str | Path | None = None, *,
                 title: str | None = None, timing_only: bool = False,
                 measured: Sequence[str | Path] = (),
                 calibration_dir: str | Path = "reports/calibration",
                 command: str = "", compare: str | None = None,
                 csv: bool = False) -> tuple[Path, dict[str, Any]]:
    """Run or read ``inputs`` and write the report into ``out`` (default
    ``reports/<name of the first input>``). Returns the directory and report.json's content.
    Several inputs are compared side by side (``compare = "input"``) unless ``compare`` names
    another axis."""
    first = Path(inputs[0])
    name = first.name if first.is_dir() else first.stem
    target = Path(out) if out is not None else Path("reports") / name
    variants = collect(inputs, timing_only=timing_only)
    if not variants:
        raise ValueError(f"{', '.join(map(str, inputs))}: no variant to report (an empty shard?)")
    if compare is None and len(inputs) > 1 and len({v.family for v in variants}) > 1:
        compare = "input"
    if title is None:
        names = sorted({v.name.split(" [")[0] for v in variants})
        title = names[0] if len(names) == 1 else f"hkvsim report: {name}"
    written = write_report(variants, target, title=title,
                           command=command or "hkvsim report " + " ".join(str(i) for i in inputs),
                           measured=load_measured(list(measured)) if measured else None,
                           calibration_dir=calibration_dir, compare=compare, csv=csv)
    return target, written["report"]
