"""What a report is made of: one :class:`Variant` per scenario run, from a live ``RunResult`` or
from a saved ``hkvsim run --json --requests`` output, plus the per-request numbers every
section derives from it (transfer time and its breakdown).

Only plain data lives here (dicts, lists, numbers): no simpy objects, no numpy arrays, so a
variant can be tabulated, plotted and traced the same way whichever way it arrived.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Variant", "variant_from_result", "variants_from_json", "transfer_seconds",
           "breakdown", "PHASES", "request_rows"]

TPS = (1, 2, 4, 8)
# the time breakdown of one request, in plotting order (DOMAIN.md §10: report prep/post and
# transfer separately, as nixlbench does)
PHASES = ("handshake", "post wait", "post", "wire", "notification")


@dataclass(kw_only=True)
class Variant:
    """One scenario variant's run, reduced to what the report needs."""

    name: str  # the full scenario name (with its sweep label)
    family: str  # the input it came from (file stem), groups the merge comparison
    source: str
    sweep_point: dict[str, Any]
    model: str
    mode: str  # pull | push
    merge: str  # descriptor_merge: off | contiguous | strided
    prefill_tp: int | None
    decode_tp: int | None
    profile: str
    outcome: str
    expectation_met: bool
    verified: bool  # bytes moved and checked by the oracle (False: timing only)
    mismatched_bytes: int
    sim_seconds: float
    requests: list[dict[str, Any]]  # RequestRecord.as_dict() of every request
    link_segments: list[dict[str, Any]] = field(default_factory=list)
    geometry: dict[str, Any] = field(default_factory=dict)  # bytes per token / state by TP

    @property
    def label(self) -> str:
        """The sweep label without the merge axis (what pairs the merge modes of a variant)."""
        point = {k: v for k, v in self.sweep_point.items() if k != "connector.descriptor_merge"}
        text = ", ".join(f"{k}={v}" for k, v in point.items())
        return text or self.name.split(" [")[0]

    @property
    def pair(self) -> str:
        return f"P{self.prefill_tp}->D{self.decode_tp}"

    def ok_requests(self) -> list[dict[str, Any]]:
        return [r for r in self.requests if r["status"] == "ok"]

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _geometry(model: Any) -> dict[str, Any]:
    """Bytes of attention KV per token and state per request, per TP the model allows."""
    out: dict[str, Any] = {"is_hybrid": bool(model.is_hybrid), "kv_bytes_per_token": {},
                           "state_bytes_per_request": {}}
    for tp in TPS:
        try:
            model.check_tp(tp)
        except Exception:  # noqa: BLE001 - a TP the model cannot shard is simply left out
            continue
        out["kv_bytes_per_token"][str(tp)] = int(model.kv_bytes_per_token(tp))
        out["state_bytes_per_request"][str(tp)] = int(model.state_bytes_per_request(tp))
    return out


def variant_from_result(result: Any, *, family: str, timing_only: bool = False) -> Variant:
    """A :class:`Variant` from a live ``hkvsim.pd.records.RunResult`` (``timing_only``: it was run
    with ``run_scenario(timing_only=True)``)."""
    from ..results import expectation_problems

    s = result.scenario
    model = result.layouts["decode"].model if result.layouts else s.model_spec()
    segments = [{"link": seg.link, "t_start": seg.t_start, "t_end": seg.t_end,
                 "rate": seg.rate, "capacity": seg.capacity, "flows": seg.flows}
                for seg in result.link_segments]
    return Variant(
        name=s.scenario.name, family=family, source=s.source, sweep_point=dict(s.sweep_point),
        model=model.name, mode=s.connector.mode, merge=s.connector.descriptor_merge,
        prefill_tp=s.prefill.tp, decode_tp=s.decode.tp, profile=s.fabric.profile,
        outcome=result.outcome, expectation_met=not expectation_problems(result),
        verified=bool(s.workload.verify and not timing_only),
        mismatched_bytes=int(result.mismatched_bytes), sim_seconds=float(result.sim_seconds),
        requests=[r.as_dict() for r in result.records], link_segments=segments,
        geometry=_geometry(model))


def _scenario_of(entry: dict[str, Any]) -> Any | None:
    """Reload the scenario a saved result came from (its file and sweep point), if possible."""
    from ..scenario import ScenarioError, load_scenarios

    source = entry.get("source")
    if not source or not Path(source).is_file():
        return None
    try:
        for s in load_scenarios(source):
            if s.sweep_point == entry.get("sweep_point", {}):
                return s
    except ScenarioError:
        return None
    return None


def variants_from_json(path: str | Path, *, family: str | None = None) -> list[Variant]:
    """Variants from a saved ``hkvsim run --json --requests`` output (one scenario, or
    ``{"scenarios": [...]}``). Link segments are not part of that output, so a report built
    from it has no link-utilisation plot. The engine TPs come from re-loading the scenario file
    named in ``source``, else from the sweep point."""
    file = Path(path)
    data = json.loads(file.read_text())
    entries = data["scenarios"] if isinstance(data, dict) and "scenarios" in data else (
        data if isinstance(data, list) else [data])
    out = []
    for entry in entries:
        if "request_details" not in entry:
            raise ValueError(f"{file}: {entry.get('scenario', '?')}: no per-request details; "
                             f"save the run with `hkvsim run --json --requests`")
        s = _scenario_of(entry)
        point = entry.get("sweep_point", {})

        def pick(key: str, default: Any, s: Any = s, point: dict = point) -> Any:
            if key in point:
                return point[key]
            if s is not None:
                section, _, leaf = key.partition(".")
                return getattr(getattr(s, section), leaf)
            return default

        model = None
        if s is not None:
            try:
                model = s.model_spec()
            except Exception:  # noqa: BLE001 - a report without geometry still works
                model = None
        requests = entry["request_details"]
        out.append(Variant(
            name=entry["scenario"], family=family or file.stem, source=entry.get("source", ""),
            sweep_point=dict(point), model=model.name if model else str(pick("model.preset", "?")),
            mode=pick("connector.mode", "pull"), merge=pick("connector.descriptor_merge", "off"),
            prefill_tp=pick("prefill.tp", None), decode_tp=pick("decode.tp", None),
            profile=pick("fabric.profile", "?"), outcome=entry["outcome"],
            expectation_met=bool(entry.get("expectation_met", True)),
            verified=entry["requests"].get("byte_exact") is not None,
            mismatched_bytes=int(entry["requests"].get("mismatched_bytes", 0)),
            sim_seconds=float(entry["time"]["simulated_seconds"]), requests=requests,
            geometry=_geometry(model) if model is not None else {}))
    return out


# ---- per-request numbers -----------------------------------------------------------------------
def transfer_seconds(variant: Variant, req: dict[str, Any]) -> float | None:
    """The request's transfer time: from its first READ/WRITE being submitted to its transfer
    completing on decode (pull: every READ DONE; push: every WRITE notification in). Starting at
    the first post keeps handshakes out in both modes, also the wait of a request queued behind
    another request's in-flight handshake. None for a request that posted nothing (a full prefix
    hit sends a notification only) or never completed its transfer."""
    t = req["times"]
    posted = [x["submitted"] for x in req["telemetry"]]
    if "transfer_done" not in t or not posted:
        return None
    return max(t["transfer_done"] - min(posted), 0.0)


def breakdown(variant: Variant, req: dict[str, Any]) -> dict[str, float]:
    """Seconds per phase of one request, along its critical (last-completing) transfer:
    handshake (first request of a pair only), post wait (queued behind the rank's posting
    thread), post (launch + descriptors x alpha), wire (bytes on the shared links + path latency)
    and notification (data complete -> the peer knows: prefill frees in pull, decode completes
    in push)."""
    t = req["times"]
    out = dict.fromkeys(PHASES, 0.0)
    out["handshake"] = float(t.get("handshake", 0.0))
    tel = [x for x in req["telemetry"] if x.get("completed") is not None]
    if not tel:
        return out
    crit = max(tel, key=lambda x: x["completed"])
    post_end = crit["completed"] - crit["transfer_seconds"]
    post_start = post_end - crit["post_seconds"]
    out["post wait"] = max(0.0, post_start - crit["submitted"])
    out["post"] = crit["post_seconds"]
    out["wire"] = crit["transfer_seconds"]
    end = t.get("prefill_freed") if variant.mode == "pull" else t.get("transfer_done")
    if end is not None:
        out["notification"] = max(0.0, end - crit["completed"])
    return out


def request_rows(variants: list[Variant]) -> list[dict[str, Any]]:
    """One flat row per completed request (the tables and most plots read these)."""
    rows = []
    for v in variants:
        for req in v.ok_requests():
            tt = transfer_seconds(v, req)
            if tt is None:
                continue
            rows.append({
                "variant": v, "family": v.family, "label": v.label, "model": v.model,
                "mode": v.mode, "merge": v.merge, "prefill_tp": v.prefill_tp,
                "decode_tp": v.decode_tp, "pair": v.pair, "index": req["index"],
                "prompt_tokens": req["prompt_tokens"], "hit_tokens": req["prefix_hit_tokens"],
                "effective_hit_tokens": req.get("effective_prefix_hit_tokens"),
                "descriptors": req["descriptors"],
                "posted": sum(x["descriptors"] for x in req["telemetry"]),
                "nbytes": req["nbytes"], "transfers": req["transfers"], "transfer": tt,
                "breakdown": breakdown(v, req)})
    return rows
