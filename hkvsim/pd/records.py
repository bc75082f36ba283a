"""What a run records: one record per request, and the run's result.

Both drivers (simulated fabric, real NIXL) build the same :class:`RunResult`, so
``hkvsim.results.result_json`` gives one JSON shape whatever ran the scenario.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..geometry.layout import EngineLayout
from ..scenario import Scenario

__all__ = ["RequestRecord", "RunResult", "DecodeJob", "RankSetupError"]


class RankSetupError(RuntimeError):
    """A rank's connector could not set itself up (e.g. the transport refused to prepare its
    local descriptor list because it lies outside the memory it registered): the run cannot
    start. Raised by every driver with the rank and the transport's reason, so a connector bug
    that breaks registration fails loudly, the same way on every backend."""


@dataclass(kw_only=True)
class DecodeJob:
    """Decode's side of one request: its blocks, what it loads, and its prefix hit."""

    blocks: dict[int, np.ndarray]  # group id -> every logical block of the request
    load: dict[int, np.ndarray]  # group id -> the uncached blocks the connector fills
    hit_blocks: int
    prompt_tokens: int  # N
    load_tokens: int  # N - 1 with state (decode computes token N itself), else N
    recomputed: bool = False  # kv_load_failure_policy = "recompute" took over
    failure: tuple[str, str] | None = None  # decode could not fill its prefix (a rank failed)


@dataclass(kw_only=True)
class RequestRecord:
    index: int
    request_id: str
    prompt_tokens: int
    prefix_hit_tokens: int  # requested
    arrival: float
    effective_prefix_hit_tokens: int | None = None  # reused: whole decode logical blocks
    prefill_engine: str = ""
    decode_engine: str = ""
    status: str = "pending"  # ok | failed | aborted | pending (hung if pending at the end)
    failure_class: str | None = None
    reason: str | None = None
    descriptors: int = 0
    nbytes: int = 0
    transfers: int = 0
    mismatched_words: int = 0
    mismatches: list[str] = field(default_factory=list)
    freed_by_lease: bool = False
    recovered_from: str | None = None  # failure class recomputed under policy "recompute"
    # requests whose late transfer bytes landed in this request's blocks after it was verified
    overwritten_by: list[int] = field(default_factory=list)
    times: dict[str, float] = field(default_factory=dict)
    # one entry per transfer ("path": a tuple of link names)
    telemetry: list[dict[str, Any]] = field(default_factory=list)

    @property
    def corrupted(self) -> bool:
        """Reported successful with wrong bytes: the oracle found them wrong, or a late
        transfer overwrote them after they were verified."""
        return self.status == "ok" and (self.mismatched_words > 0 or bool(self.overwritten_by))

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(kw_only=True)
class RunResult:
    scenario: Scenario
    records: list[RequestRecord]
    handshake_errors: list[str]
    leaks: dict[str, int]
    counters: dict[str, int]
    sim_seconds: float
    layouts: dict[str, EngineLayout]
    link_segments: list[Any] = field(default_factory=list)  # fabric LinkSegment records
    misplaced_write_reports: list[str] = field(default_factory=list)  # the first few, explained
    warnings: list[str] = field(default_factory=list)  # e.g. prefix hits rounded down
    verified: bool = False  # the oracle checked every completed request's bytes
    backend: str = "sim"  # "sim": sim_seconds is simulated time; any other: wall-clock time
    # whose connector ran, when not hkvsim's own: {"name": "vllm", "version": "0.33.0"}
    implementation: dict[str, str] = field(default_factory=dict)
    # real backends: the ranks' CPU per operation kind and inside post calls, summed
    # (hkvsim/pd/cpu.py; empty on the simulator)
    rank_cpu: dict[str, Any] = field(default_factory=dict)

    @property
    def hung(self) -> int:
        return sum(r.status == "pending" for r in self.records)

    @property
    def failed(self) -> int:
        return sum(r.status == "failed" for r in self.records)

    @property
    def aborted(self) -> int:
        return sum(r.status == "aborted" for r in self.records)

    @property
    def completed(self) -> int:
        return sum(r.status == "ok" for r in self.records)

    @property
    def mismatched_bytes(self) -> int:
        return 8 * sum(r.mismatched_words for r in self.records)

    @property
    def corrupted(self) -> int:
        """Requests the connector reported successful whose bytes are wrong (the oracle found
        them wrong, or a late transfer overwrote them after they were verified)."""
        return sum(r.corrupted for r in self.records)

    @property
    def late_landings(self) -> int:
        """Transfers whose bytes landed in blocks their request did not own at landing time."""
        return int(self.counters.get("late_landings", 0))

    @property
    def stray_writes(self) -> int:
        """Transfers posted into blocks their request did not hold (misaddressed writes)."""
        return int(self.counters.get("stray_writes", 0))

    @property
    def outcome(self) -> str:
        """The worst thing that happened. Silent corruption (a request reported successful with
        wrong bytes, or bytes landing in blocks another request owns) outranks everything: it is
        what this tool exists to catch."""
        if self.corrupted or self.late_landings or self.stray_writes:
            return "corruption"
        return self.outcome_besides_corruption

    @property
    def outcome_besides_corruption(self) -> str:
        """The outcome if wrong bytes were expected (``[expect] byte_exact = false``)."""
        if self.hung:
            return "hang"
        if self.handshake_errors:
            return "handshake-error"
        if self.failed:
            return "request-failure"
        if any(r.freed_by_lease for r in self.records):
            return "lease-expired"
        if any(self.leaks.values()):
            return "leak"
        return "ok"
