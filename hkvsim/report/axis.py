"""Side-by-side comparison of variants along one axis: the input they came from, the backend
that ran them, or any scenario key (``connector.mode``, ``connector.descriptor_merge``, a future
implementation key...). Nothing here knows what an axis means: a variant's value on the axis is
read from its settings, and variants are paired across values by everything else that was swept.

The first value seen is the baseline; every other value is compared with it request by request
(same variant label, same request index), so a ratio is never taken between different
workloads.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from .data import Variant, transfer_seconds

__all__ = ["PSEUDO_AXES", "axis_value", "check_axis", "compare_along"]

# axes that are not scenario keys
PSEUDO_AXES = ("input", "backend")


def axis_value(variant: Variant, axis: str) -> Any:
    if axis == "input":
        return variant.family
    if axis == "backend":
        return variant.backend
    return variant.settings.get(axis)


def check_axis(variants: list[Variant], axis: str) -> None:
    """Raise ValueError (one line) when ``axis`` is not something these variants have."""
    if axis in PSEUDO_AXES or any(axis in v.settings for v in variants):
        return
    varying = sorted({k for v in variants for k in v.sweep_point})
    raise ValueError(f"--compare {axis!r}: not a key of these scenarios; allowed: "
                     f"{', '.join(PSEUDO_AXES + tuple(varying))} or any other dotted scenario "
                     f"key (section.key)")


def _match_key(variant: Variant, axis: str) -> tuple:
    """What pairs variants across the axis: the sweep point without the axis (and the input,
    unless the input is the axis)."""
    point = tuple(sorted((k, repr(v)) for k, v in variant.sweep_point.items() if k != axis))
    return point if axis == "input" else (variant.family, *point)


def _label(variant: Variant, axis: str) -> str:
    point = {k: v for k, v in variant.sweep_point.items() if k != axis}
    text = ", ".join(f"{k}={v}" for k, v in point.items()) or "(no sweep)"
    return text if axis == "input" else f"{variant.family}: {text}"


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def compare_along(variants: list[Variant], axis: str) -> dict[str, Any]:
    """The comparison along ``axis``: its values (baseline first), one row per matched variant
    label with each value's outcome, verification, mean transfer time and descriptors posted,
    and per value the geometric mean over matched requests of its transfer time / the
    baseline's."""
    values: list[Any] = []
    rows: dict[tuple, dict[str, Any]] = {}
    for v in variants:
        value = axis_value(v, axis)
        if value not in values:
            values.append(value)
        key = _match_key(v, axis)
        row = rows.setdefault(key, {"label": _label(v, axis), "cells": {}})
        if str(value) in row["cells"]:  # two variants on one cell: not comparable side by side
            row["ambiguous"] = True
            continue
        times = {r["index"]: transfer_seconds(v, r) for r in v.ok_requests()}
        times = {i: t for i, t in times.items() if t is not None}
        row["cells"][str(value)] = {
            "variant": v.name, "outcome": v.outcome, "verification": v.verification,
            "expectation_met": v.expectation_met, "requests_ok": len(v.ok_requests()),
            "requests": len(v.requests),
            "transfer_seconds_mean": _mean(list(times.values())),
            "descriptors_posted": sum(sum(t["descriptors"] for t in r["telemetry"])
                                      for r in v.ok_requests()),
            "_times": times,
        }
    names = [str(x) for x in values]
    base = names[0] if names else None
    ratios: dict[str, list[float]] = defaultdict(list)
    pairs: dict[str, list[tuple[float, float]]] = defaultdict(list)
    out_rows = []
    for row in rows.values():
        cells = row["cells"]
        if base in cells:
            for name in names[1:]:
                if name not in cells:
                    continue
                for i, t0 in cells[base]["_times"].items():
                    t1 = cells[name]["_times"].get(i)
                    if t1 is not None and t0 > 0:
                        ratios[name].append(t1 / t0)
                        pairs[name].append((t0, t1))
        for c in cells.values():
            c.pop("_times")
        out_rows.append({"label": row["label"], "ambiguous": row.get("ambiguous", False),
                         "cells": cells})
    return {
        "axis": axis, "values": names, "baseline": base, "rows": out_rows,
        "matched_requests": {n: len(ratios[n]) for n in names[1:]},
        "geomean_ratio": {n: _geomean(ratios[n]) for n in names[1:]},
        "pairs": {n: pairs[n] for n in names[1:]},
    }
