"""Cross-variant comparisons: descriptor merging (reference per-block plan vs merged plans) and
simulated vs measured (calibration data, NIXL-backend runs).

Measured data plugs in through saved ``hkvsim run --json --requests`` outputs of the *same*
scenario files run on a real backend: variants are matched by scenario name (which carries the
sweep label, ``connector.descriptor_merge`` included), requests by index. That is the hook for
the NIXL backend (issue #5): no format of its own is needed.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from .data import Variant, transfer_seconds, variants_from_json

__all__ = ["merge_comparison", "load_measured", "calibration_points", "MERGE_ORDER"]

MERGE_ORDER = ("off", "contiguous", "strided")


def _totals(v: Variant) -> dict[str, Any]:
    reqs = [r for r in v.ok_requests() if transfer_seconds(v, r) is not None]
    posts = []
    for r in reqs:
        done = [t for t in r["telemetry"] if t.get("completed") is not None]
        posts.append(max((t["post_seconds"] for t in done), default=0.0))
    return {
        "requests": len(reqs),
        "reference": sum(r["descriptors"] for r in reqs),
        "posted": sum(sum(t["descriptors"] for t in r["telemetry"]) for r in reqs),
        "coalesced": _coalesced(reqs),
        "transfers": sum(r["transfers"] for r in reqs),
        "nbytes": sum(r["nbytes"] for r in reqs),
        "transfer_seconds": sum(transfer_seconds(v, r) or 0.0 for r in reqs),
        "post_seconds": sum(posts),
        "byte_exact": v.verified and v.mismatched_bytes == 0 and v.outcome == "ok",
        "verified": v.verified,
    }


def _coalesced(reqs: list[dict[str, Any]]) -> int | None:
    from ..results import coalesced_descriptors

    counts = [coalesced_descriptors(r["telemetry"]) for r in reqs]
    return None if any(c is None for c in counts) else sum(c for c in counts if c is not None)


def _sum(values: list[Any]) -> Any:
    return None if any(v is None for v in values) else sum(values)


def merge_comparison(variants: list[Variant],
                     measured: dict[str, Variant] | None = None) -> list[dict[str, Any]]:
    """Per family: the reference plan's descriptors and, per merge mode, the descriptors posted,
    bytes, simulated transfer time (and measured time where a matching measured variant exists).

    Only variants that ran in every merge mode present in their family, completed every request
    and met their expectation are compared, so the modes cover the same requests."""
    by_family: dict[str, dict[str, dict[str, Variant]]] = defaultdict(lambda: defaultdict(dict))
    for v in variants:
        by_family[v.family][v.label][v.merge] = v
    out = []
    for family in sorted(by_family):
        labels = by_family[family]
        modes = [m for m in MERGE_ORDER if any(m in ms for ms in labels.values())]
        if len(modes) < 2 or "off" not in modes:
            continue
        complete = {lab: ms for lab, ms in sorted(labels.items())
                    if all(m in ms for m in modes)
                    and all(ms[m].outcome == "ok" and ms[m].expectation_met for m in modes)}
        if not complete:
            continue
        totals: dict[str, dict[str, Any]] = {}
        for m in modes:
            per = [_totals(ms[m]) for ms in complete.values()]
            totals[m] = {k: _sum([p[k] for p in per]) for k in
                         ("requests", "reference", "posted", "coalesced", "transfers", "nbytes",
                          "transfer_seconds", "post_seconds")}
            totals[m]["verified_variants"] = sum(p["verified"] for p in per)
            totals[m]["byte_exact_variants"] = sum(p["byte_exact"] for p in per)
            if measured is not None:
                got = [measured.get(ms[m].name) for ms in complete.values()]
                if got and all(g is not None for g in got):
                    totals[m]["measured_seconds"] = sum(
                        _totals(g)["transfer_seconds"] for g in got if g is not None)
        rows = []
        for lab, ms in complete.items():
            row = {"label": lab, "model": ms["off"].model, "mode": ms["off"].mode,
                   "pair": ms["off"].pair}
            for m in modes:
                t = _totals(ms[m])
                row[m] = {"posted": t["posted"], "reference": t["reference"],
                          "coalesced": t["coalesced"],
                          "transfer_seconds": t["transfer_seconds"]}
            rows.append(row)
        out.append({"family": family, "modes": totals, "variants": len(complete),
                    "rows": rows})
    return out


def load_measured(paths: list[str | Path]) -> dict[str, Variant]:
    """Measured variants by scenario name, from saved ``hkvsim run --json --requests`` outputs
    of a real backend."""
    found: dict[str, Variant] = {}
    for p in paths:
        for v in variants_from_json(p):
            found[v.name] = v
    return found


def calibration_points(variants: list[Variant], directory: Path) -> list[dict[str, Any]]:
    """Simulated vs measured transfer times from ``directory`` (``reports/calibration/``), for
    the fabric profiles this report's variants use, and only those: a point tests the profile
    that predicted it, so a CPU-loopback calibration says nothing about an H200 profile and is
    left out of an H200 report. Every point carries that ``profile``.

    Accepted files (``*.json``):

    * ``{"points": [{"label", "simulated_seconds", "measured_seconds", ...}]}``: points that
      carry their own simulated value (``hkvsim calibrate``); they test the profile named by
      the file's ``"profile_name"``, else by the file's name (``cpu-ucx-loopback.json``);
    * a saved ``hkvsim run --json --requests`` output of a real backend: each request is
      matched by (scenario name, request index) to this report's simulated run of the same
      scenario, which tests that scenario's profile.
    """
    if not directory.is_dir():
        return []
    sims = {v.name: v for v in variants if v.backend == "sim"}
    profiles = {v.profile for v in sims.values()}
    points: list[dict[str, Any]] = []
    for file in sorted(directory.glob("*.json")):
        try:
            data = json.loads(file.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("points"), list):
            named = data.get("profile_name")
            profile = named if isinstance(named, str) and named else file.stem
            if profile not in profiles:
                continue
            for p in data["points"]:
                if isinstance(p, dict) and p.get("simulated_seconds") and p.get(
                        "measured_seconds"):
                    points.append({**p, "source": file.name, "profile": profile,
                                   "transport": str(data.get("transport", "?"))})
            continue
        try:
            measured = variants_from_json(file)
        except (KeyError, ValueError, TypeError):
            continue
        for m in measured:
            sim = sims.get(m.name)
            if sim is None or m.backend == "sim":
                continue
            sreqs = {r["index"]: r for r in sim.ok_requests()}
            for r in m.ok_requests():
                s = sreqs.get(r["index"])
                ts, tm = (transfer_seconds(sim, s) if s else None), transfer_seconds(m, r)
                if ts and tm:
                    points.append({"source": file.name, "transport": m.backend,
                                   "profile": sim.profile,
                                   "label": f"{m.name} #{r['index']}",
                                   "simulated_seconds": ts, "measured_seconds": tm,
                                   "descriptors": r["descriptors"], "nbytes": r["nbytes"]})
    return points
