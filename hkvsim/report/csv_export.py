"""``hkvsim report --csv``: one row per request of every variant (requests.csv), for a
spreadsheet or pandas. Times are seconds on the variant's clock; a cell the run does not know is
empty (mismatched words of a timing-only run, the transfer time of a request that moved
nothing)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from .data import PHASES, Variant, breakdown, transfer_seconds

__all__ = ["CSV_NAME", "write_requests_csv"]

CSV_NAME = "requests.csv"

_VARIANT_COLUMNS = ("input", "variant", "sweep_index", "backend", "clock", "model", "profile",
                    "mode", "descriptor_merge", "prefill_tp", "decode_tp", "outcome",
                    "verification", "expectation_met")
_REQUEST_COLUMNS = ("request", "status", "failure_class", "prompt_tokens", "prefix_hit_tokens",
                    "descriptors", "descriptors_posted", "descriptors_coalesced", "bytes", "transfers", "mismatched_words",
                    "transfer_seconds") + tuple(f"{p.replace(' ', '_')}_seconds" for p in PHASES)


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.12g}"
    return value


def coalesced_descriptors(telemetry: list[dict[str, Any]]) -> int | None:
    from ..results import coalesced_descriptors as count

    return count(telemetry)


def write_requests_csv(variants: list[Variant], out: Path) -> str:
    """Write ``out/requests.csv``; returns its name."""
    swept: list[str] = []
    for v in variants:
        swept += [k for k in v.sweep_point if k not in swept]
    with open(out / CSV_NAME, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*_VARIANT_COLUMNS, *swept, *_REQUEST_COLUMNS])
        for v in variants:
            head = [v.family, v.name, v.sweep_index, v.backend, v.clock, v.model, v.profile,
                    v.mode, v.merge, v.prefill_tp, v.decode_tp, v.outcome, v.verification,
                    v.expectation_met] + [v.sweep_point.get(k) for k in swept]
            for r in v.requests:
                phases = breakdown(v, r) if r["status"] == "ok" else {}
                writer.writerow([_cell(x) for x in head + [
                    r["index"], r["status"], r.get("failure_class"), r["prompt_tokens"],
                    r["prefix_hit_tokens"], r["descriptors"],
                    sum(t["descriptors"] for t in r["telemetry"]),
                    coalesced_descriptors(r["telemetry"]), r["nbytes"], r["transfers"],
                    r["mismatched_words"] if v.verified else None,
                    transfer_seconds(v, r) if r["status"] == "ok" else None,
                    *[phases.get(p) for p in PHASES]]])
    return CSV_NAME
