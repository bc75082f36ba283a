"""``hkvsim plan``: the resolved deployment, its handshake verdict and the per-request transfer
plan, without moving a byte (the connector runs on the simulated fabric in timing-only mode).

Each request shows its prefix hit as requested (``prefix_hit_tokens``) and as reused
(``effective_prefix_hit_tokens``: whole logical blocks of decode); ``warnings`` says when the two
differ."""

from __future__ import annotations

from typing import Any

from .drivers.sim import SimDriver
from .results import coalesced_descriptors, posted_descriptors, request_timing
from .scenario import Scenario

__all__ = ["plan_scenario"]


def plan_scenario(scenario: Scenario) -> dict[str, Any]:
    driver = SimDriver(scenario, timing_only=True)
    result = driver.run()
    sides: dict[str, Any] = {}
    for role, engines in driver.dep.engines.items():
        layout = engines[0].layout
        summary = layout.summary()
        summary["model"] = layout.model.name
        summary["instances"] = len(engines)
        summary["regions"] = [
            {k: r[k] for k in ("is_mla", "block_len", "stride", "num_blocks", "group_id",
                               "layers")}
            for r in summary["regions"]]
        sides[role] = summary
    requests = []
    for r in result.records:
        entry: dict[str, Any] = {
            "index": r.index, "prompt_tokens": r.prompt_tokens,
            "prefix_hit_tokens": r.prefix_hit_tokens,
            "effective_prefix_hit_tokens": r.effective_prefix_hit_tokens,
            "descriptors": r.descriptors,
            "descriptors_posted": posted_descriptors(r.telemetry),
            "descriptors_coalesced": coalesced_descriptors(r.telemetry),
            "bytes": r.nbytes, "transfers": r.transfers, "status": r.status,
        }
        timing = request_timing(r.times, r.telemetry, scenario.connector.mode)
        if timing["transfer_seconds"] is not None:
            # the same definition as run/sweep/report: first post -> transfer done, handshake
            # apart (results.request_timing)
            entry["predicted_transfer_seconds"] = timing["transfer_seconds"]
            entry["predicted_phases"] = timing["phases"]
        if r.reason:
            entry["error"] = r.reason
        requests.append(entry)
    return {
        "scenario": scenario.scenario.name,
        "source": scenario.source,
        "sweep_point": scenario.sweep_point,
        "model": driver.dep.model.name,
        "mode": scenario.connector.mode,
        "fabric": driver.profile.name,
        "prefill": sides["prefill"],
        "decode": sides["decode"],
        "handshake": {"ok": not result.handshake_errors,
                      "error": result.handshake_errors[0] if result.handshake_errors else None},
        "requests": requests,
        "warnings": list(result.warnings),
    }
