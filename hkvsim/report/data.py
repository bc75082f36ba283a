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

from ..results import PHASES  # the time breakdown of one request: one definition everywhere

__all__ = ["Variant", "variant_from_result", "variants_from_json", "saved_entries",
           "scenario_settings", "transfer_seconds", "breakdown", "PHASES", "request_rows"]

TPS = (1, 2, 4, 8)


_STATE_KINDS = {"kda": "KDA", "gdn": "GDN", "mamba2": "Mamba2", "mamba1": "Mamba"}


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
    # what the oracle says: "verified" (no wrong byte in any completed request, at least one),
    # "failed" (wrong bytes found), "nothing-checked" (it ran, but no request completed) or
    # "timing-only" (it did not run: nothing was checked)
    verification: str
    mismatched_bytes: int | None  # None: not verified
    sim_seconds: float  # elapsed time of the run, on ``clock``
    requests: list[dict[str, Any]]  # RequestRecord.as_dict() of every request
    expectation_problems: list[str] = field(default_factory=list)
    corrupted: int | None = None  # requests reported successful with wrong bytes (None: unknown)
    # why it went wrong, in the run's words: mismatch explanations, failures, handshake errors
    explanations: list[str] = field(default_factory=list)
    backend: str = "sim"
    clock: str = "simulated"  # "simulated" (the simulator) or "wall" (a real backend)
    sweep_index: int = 0
    sweep_variants: int = 1
    settings: dict[str, Any] = field(default_factory=dict)  # every scenario key, dotted
    link_segments: list[dict[str, Any]] = field(default_factory=list)
    geometry: dict[str, Any] = field(default_factory=dict)  # bytes per token / state by TP

    @property
    def verified(self) -> bool:
        """The oracle ran (whatever it found)."""
        return self.verification != "timing-only"

    @property
    def label(self) -> str:
        """The sweep label without the merge axis (what pairs the merge modes of a variant)."""
        return self.label_without("connector.descriptor_merge")

    def label_without(self, *keys: str) -> str:
        """The sweep label without ``keys`` (what pairs variants across a compared axis)."""
        point = {k: v for k, v in self.sweep_point.items() if k not in keys}
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
    """The model's cache kinds (attention MLA or GQA, state KDA / GDN / Mamba), bytes of
    attention KV per token and state per request, per TP the model allows."""
    state = getattr(model, "state", None)
    out: dict[str, Any] = {"is_hybrid": bool(model.is_hybrid), "kv_bytes_per_token": {},
                           "attention_kind": "MLA" if model.is_mla else "GQA",
                           "state_kind": _STATE_KINDS.get(state.kind, state.kind)
                           if model.is_hybrid and state is not None else None,
                           "state_bytes_per_request": {}}
    for tp in TPS:
        try:
            model.check_tp(tp)
        except Exception:  # noqa: BLE001 - a TP the model cannot shard is simply left out
            continue
        out["kv_bytes_per_token"][str(tp)] = int(model.kv_bytes_per_token(tp))
        out["state_bytes_per_request"][str(tp)] = int(model.state_bytes_per_request(tp))
    return out


def _flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def scenario_settings(scenario: Any) -> dict[str, Any]:
    """Every key of a scenario as ``section.key`` (what a compared axis or the sizing view
    reads); faults and the name are left out."""
    data = scenario.to_dict()
    for key in ("faults", "scenario", "sweep_point", "source"):
        data.pop(key, None)
    return _flatten(data)


def _explanations(data: dict[str, Any]) -> list[str]:
    """The first few reasons a run went wrong, from its JSON."""
    out = [f"handshake: {e}" for e in data.get("handshake_errors", [])[:3]]
    out += [f"request {f['request']} failed ({f['class']}): {f['reason']}"
            for f in data.get("failures", [])[:3]]
    out += [f"mismatch: {m}" for m in data.get("mismatches", [])[:8]]
    return out


def _from_json_entry(data: dict[str, Any]) -> dict[str, Any]:
    """The Variant fields a run's JSON (``results.result_json``) carries; older saved results
    (no ``verified`` / ``clock``) are read as they were written."""
    req = data["requests"]
    verified = data.get("verified", req.get("byte_exact") is not None)
    mismatched = req.get("mismatched_bytes") if verified else None
    corrupted = req.get("corrupted")
    if corrupted is None and verified and "request_details" in data:
        corrupted = sum(r["status"] == "ok" and r["mismatched_words"] > 0
                        for r in data["request_details"])
    verification = data.get("verification") or (
        "timing-only" if not verified else "failed" if mismatched
        else "nothing-checked" if not data["requests"].get("completed") else "verified")
    t = data["time"]
    return dict(outcome=data["outcome"], expectation_met=bool(data.get("expectation_met", True)),
                expectation_problems=list(data.get("expectation_problems", [])),
                verification=verification, mismatched_bytes=mismatched, corrupted=corrupted,
                explanations=_explanations(data), backend=data.get("backend", "sim"),
                clock=t.get("clock", "simulated"),
                sim_seconds=float(t.get("elapsed_seconds", t.get("simulated_seconds", 0.0))),
                sweep_index=int(data.get("sweep_index", 0)),
                sweep_variants=int(data.get("sweep_variants", 1)))


def variant_from_result(result: Any, *, family: str, position: tuple[int, int] = (0, 1)
                        ) -> Variant:
    """A :class:`Variant` from a live ``hkvsim.pd.records.RunResult`` (``position``: its index in
    its file's sweep, and the number of variants)."""
    from ..results import result_json

    s = result.scenario
    model = result.layouts["decode"].model if result.layouts else s.model_spec()
    segments = [{"link": seg.link, "t_start": seg.t_start, "t_end": seg.t_end,
                 "rate": seg.rate, "capacity": seg.capacity, "flows": seg.flows}
                for seg in result.link_segments]
    return Variant(
        name=s.scenario.name, family=family, source=s.source, sweep_point=dict(s.sweep_point),
        model=model.name, mode=s.connector.mode, merge=s.connector.descriptor_merge,
        prefill_tp=s.prefill.tp, decode_tp=s.decode.tp, profile=s.fabric.profile,
        requests=[r.as_dict() for r in result.records], link_segments=segments,
        geometry=_geometry(model), settings=scenario_settings(s),
        **_from_json_entry(result_json(result, position=position)))


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


def saved_entries(path: str | Path) -> list[dict[str, Any]]:
    """The run JSON objects of a saved ``hkvsim run|sweep --json --requests`` output (one
    object, or the ``{"scenarios": [...]}`` envelope of a sweep or a shard)."""
    file = Path(path)
    try:
        data = json.loads(file.read_text())
    except ValueError as exc:
        raise ValueError(f"{file}: not a saved hkvsim result (invalid JSON: {exc})") from None
    entries = data["scenarios"] if isinstance(data, dict) and "scenarios" in data else (
        data if isinstance(data, list) else [data])
    for entry in entries:
        if not isinstance(entry, dict) or "requests" not in entry or "outcome" not in entry:
            raise ValueError(f"{file}: not a saved `hkvsim run --json` result")
        if "request_details" not in entry:
            raise ValueError(f"{file}: {entry.get('scenario', '?')}: no per-request details; "
                             f"save the run with `hkvsim run --json --requests` (or sweep)")
    return entries


def variants_from_json(path: str | Path, *, family: str | None = None) -> list[Variant]:
    """Variants from a saved ``hkvsim run|sweep --json --requests`` output. Link segments are
    not part of that output, so a report built from it has no link-utilisation plot. The engine
    TPs come from re-loading the scenario file named in ``source``, else from the sweep point.
    ``family`` defaults to the stem of the scenario file the run came from (so the shards of
    one sweep form one input), with the backend appended for a real backend's run."""
    file = Path(path)
    out = []
    for entry in saved_entries(file):
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
        fields = _from_json_entry(entry)
        source = entry.get("source", "")
        name = family or (Path(source).stem if source else file.stem)
        if fields["backend"] != "sim" and family is None:
            name += f" ({fields['backend']})"
        out.append(Variant(
            name=entry["scenario"], family=name, source=source,
            sweep_point=dict(point), model=model.name if model else str(pick("model.preset", "?")),
            mode=pick("connector.mode", "pull"), merge=pick("connector.descriptor_merge", "off"),
            prefill_tp=pick("prefill.tp", None), decode_tp=pick("decode.tp", None),
            profile=pick("fabric.profile", "?"), requests=entry["request_details"],
            settings=scenario_settings(s) if s is not None else dict(point),
            geometry=_geometry(model) if model is not None else {}, **fields))
    return out


# ---- per-request numbers -----------------------------------------------------------------------
def transfer_seconds(variant: Variant, req: dict[str, Any]) -> float | None:
    """The request's own transfer time (:func:`hkvsim.results.transfer_span`): from its first
    READ/WRITE starting to post to its transfer completing on decode; queueing for a slot, for
    blocks, for a handshake or behind other requests' posts is not counted. None for a request
    that posted nothing (a full prefix hit sends a notification only) or never completed."""
    from ..results import transfer_span

    return transfer_span(req["times"], req["telemetry"])


def breakdown(variant: Variant, req: dict[str, Any]) -> dict[str, float]:
    """Seconds per phase of one request (:func:`hkvsim.results.phases`, the definition every
    command shares)."""
    from ..results import phases

    return phases(req["times"], req["telemetry"], variant.mode)


def _coalesced(req: dict[str, Any]) -> int | None:
    from ..results import coalesced_descriptors

    return coalesced_descriptors(req["telemetry"])


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
                "coalesced": _coalesced(req),
                "nbytes": req["nbytes"], "transfers": req["transfers"], "transfer": tt,
                "breakdown": breakdown(v, req)})
    return rows
