"""The P/D run loop on the simulated fabric: workload, engines, ranks, driving the connector.

Requests arrive; prefill allocates blocks, writes the oracle pattern (N-1 tokens for models with
state) and finishes under a lease; decode allocates (applying its prefix hit) and the connector
core moves the blocks: in pull every decode rank handshakes lazily and READs; in push decode
registers its blocks and prefill, after its reverse handshake, WRITEs. Prefill frees on the
expected notifications (or its WRITEs completing, or the lease); decode verifies every byte
against the oracle, computes token N and frees. Faults (hkvsim/faults.py), leases, heartbeats,
watchdogs, aborts and the recompute policy all act here. Everything runs in simpy virtual time,
deterministically: the same scenario and seed give the same bytes and the same times.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import simpy

from .connector.blocks import expand_logical, to_sub_blocks
from .connector.push import PUSH_PREFIX, PushRegistration, WriteRequest, base_request_id
from .connector.quirks import check_quirks
from .connector.tp import TPError
from .connector.validate import HandshakeError
from .transport.base import TransportError
from .connector.worker import (
    ConnectorSettings,
    ConnectorWorker,
    ReadRequest,
    RequestOutcome,
    parse_notification,
)
from .fabric import Fabric, load_profile, place_engines
from .faults import FaultPlan
from .geometry.layout import EngineLayout, build_layout
from .geometry.presets import preset
from .geometry.specs import GeometryError, ModelSpec
from .oracle import Oracle
from .scenario import Scenario
from .transport.sim import SimWorld

__all__ = ["BlockAllocator", "RequestRecord", "RunResult", "Engine", "Cluster", "engine_layout",
           "default_num_blocks", "freed_while_reading", "run_scenario"]

log = logging.getLogger("hkvsim.cluster")


class BlockAllocator:
    """A deterministic free list of logical block ids shared by every HMA group of an engine."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> np.ndarray:
        if n > len(self._free):
            raise MemoryError(f"need {n} blocks, {len(self._free)} free of {self.num_blocks}")
        return np.array([self._free.popleft() for _ in range(n)], dtype=np.int64)

    def free(self, ids: np.ndarray) -> None:
        self._free.extend(int(i) for i in ids)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self._free)


def default_num_blocks(layout: EngineLayout, prompts: np.ndarray, *, max_inflight: int | None,
                       instances: int) -> int:
    """Enough logical blocks for an engine's share of the concurrently live requests (the
    default when a scenario gives no num_blocks; both backends size pools this way)."""
    live = max_inflight or len(prompts)
    per_request = layout.blocks_for_tokens(int(prompts.max())) + len(layout.state_groups)
    share = -(-min(live, len(prompts)) // instances)
    return max(1, share * per_request)


def freed_while_reading(engine_id: str, block_version: np.ndarray,
                        blocks: dict[int, np.ndarray], versions: dict[int, np.ndarray]
                        ) -> tuple[str, str] | None:
    """The early-free race (DOMAIN.md §9.5 scenario 10): prefill freed (and maybe reused)
    blocks before decode finished reading them. Detected by version stamps, so it is a failure
    even when the stale bytes happen to still be right."""
    for group, ids in blocks.items():
        changed = ids[block_version[ids] != versions[group]]
        if changed.size:
            return ("freed_while_reading",
                    f"prefill {engine_id} freed blocks {changed[:8].tolist()} of group {group} "
                    f"while they were being transferred (lease expired early)")
    return None


def engine_model(model: ModelSpec, section: Any) -> ModelSpec:
    """The model an engine section runs: [model], or its own preset, with its backend and
    cache dtype overrides applied."""
    if section.preset is not None:
        model = preset(section.preset)
    attention = model.attention
    if section.attention_backend is not None:
        attention = dataclasses.replace(attention, backend=section.attention_backend)
    if section.cache_dtype is not None:
        if attention.is_mla:
            attention = dataclasses.replace(
                attention, cache_dtype=None if section.cache_dtype == attention.dtype
                else section.cache_dtype)
        elif section.cache_dtype == "fp8_ds_mla":
            raise GeometryError("cache_dtype 'fp8_ds_mla' is only for MLA models")
        else:
            attention = dataclasses.replace(attention, dtype=section.cache_dtype)
    return model if attention == model.attention else dataclasses.replace(model,
                                                                          attention=attention)


def engine_layout(model: ModelSpec, section: Any, *, num_blocks: int,
                  registration_order: str, quirks: frozenset[str]) -> EngineLayout:
    """The layout an engine section describes (block_size None = the backend's smallest)."""
    model = engine_model(model, section)
    block = section.block_size or model.attention.attention_backend.min_kernel_block
    return build_layout(model, tp=section.tp, block_size=block, num_blocks=num_blocks,
                        kv_cache_layout=section.kv_cache_layout,
                        registration_order=registration_order,
                        first_registration_wins="first-registration-mla-flag" in quirks)


@dataclass(kw_only=True)
class DecodeJob:
    """Decode's side of one request: its blocks, what it loads, and its prefix hit."""

    blocks: dict[int, np.ndarray]  # group id -> every logical block of the request
    load: dict[int, np.ndarray]  # group id -> the uncached blocks the connector fills
    hit_blocks: int
    load_tokens: int  # N - 1: decode computes token N itself
    recomputed: bool = False  # kv_load_failure_policy = "recompute" took over


@dataclass(kw_only=True)
class _PushWait:
    done: simpy.Event  # succeeds with None (complete) or (failure class, reason)
    decode: "Engine"
    counts: dict[int, int]


@dataclass(kw_only=True)
class RequestRecord:
    index: int
    request_id: str
    prompt_tokens: int
    prefix_hit_tokens: int
    arrival: float
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
    times: dict[str, float] = field(default_factory=dict)
    telemetry: list[dict[str, Any]] = field(default_factory=list)  # one entry per transfer

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
    verified: bool = False  # the oracle checked every completed request's bytes
    backend: str = "sim"  # "sim": sim_seconds is simulated time; any other: wall-clock time

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
        """Requests the connector reported successful whose bytes are wrong."""
        return sum(r.status == "ok" and r.mismatched_words > 0 for r in self.records)

    @property
    def outcome(self) -> str:
        if self.hung:
            return "hang"
        if self.handshake_errors:
            return "handshake-error"
        if self.failed:
            return "request-failure"
        if self.corrupted:
            return "corruption"
        if any(r.freed_by_lease for r in self.records):
            return "lease-expired"
        if any(self.leaks.values()):
            return "leak"
        return "ok"


class Engine:
    """One engine instance: its layout, its ranks' workers and memory, its block pool."""

    def __init__(self, *, world: SimWorld, engine_id: str, role: str, layout: EngineLayout,
                 settings: ConnectorSettings) -> None:
        self.engine_id = engine_id
        self.role = role
        self.layout = layout
        self.allocator = BlockAllocator(layout.num_logical_blocks)
        self.workers: list[ConnectorWorker] = []
        for rank in range(layout.tp):
            transport = world.create_agent(f"{engine_id}.{rank}", (engine_id, rank))
            worker = ConnectorWorker(engine_id=engine_id, role=role, tp_rank=rank, layout=layout,
                                     transport=transport, settings=settings, device_id=rank)
            worker.register(mem_type=world.fabric.profile.memory)
            self.workers.append(worker)
        self.freed = world.env.event()
        self.connections: dict[str, simpy.Event] = {}
        self.oracle = Oracle(layout.model) if world.move_bytes else None
        # version stamp per logical block, bumped on every free: a transfer that reads blocks
        # whose version changed under it read freed (maybe reused) memory
        self.block_version = np.zeros(layout.num_logical_blocks, dtype=np.int64)
        self.loading: dict[str, tuple[str, str]] = {}  # decode rid -> (prefill engine, p rid)
        self.heartbeat: simpy.Process | None = None
        self.last_used: dict[str, float] = {}  # remote engine -> last handshake use

    @property
    def tp(self) -> int:
        return self.layout.tp

    def payloads(self) -> dict[int, bytes]:
        return {w.tp_rank: w.handshake_payload() for w in self.workers}


class Cluster:
    """Builds engines from a scenario and runs its workload on the simulated fabric."""

    def __init__(self, scenario: Scenario, *, timing_only: bool = False) -> None:
        self.scenario = scenario
        self.model = scenario.model_spec()
        self.quirks = check_quirks(list(scenario.connector.quirks))
        self.env = simpy.Environment()
        self.verify = scenario.workload.verify and not timing_only
        self.rng = np.random.default_rng(scenario.scenario.seed)
        self.prompts, self.hits = scenario.request_lengths(self.rng)
        profile = load_profile(scenario.fabric.profile, overrides=dict(scenario.fabric.overrides))
        self.profile = profile
        self.hybrid = self.model.is_hybrid
        conn = scenario.connector
        self.engines: dict[str, list[Engine]] = {"prefill": [], "decode": []}
        specs = []
        for role in ("prefill", "decode"):
            section = getattr(scenario, role)
            for i in range(section.instances):
                specs.append((f"{role}{i}", role, section.tp))
        placement = place_engines(profile, specs)
        self.fabric = Fabric(self.env, profile, placement)
        self.world = SimWorld(self.env, self.fabric, move_bytes=self.verify)
        if scenario.faults:
            self.world.faults = FaultPlan(scenario.faults, seed=scenario.scenario.seed,
                                          transfer_timeout=conn.transfer_timeout_seconds)
        self.records: list[RequestRecord] = []
        self.handshake_errors: list[str] = []
        self.counters = {"lease_expiries": 0, "late_notifications": 0, "notifications": 0,
                         "malformed_registrations": 0, "notification_failures": 0,
                         "recomputed": 0, "handshakes": 0, "evictions": 0}
        self._pending_notifs: dict[tuple[str, str], dict[int, int]] = {}
        self._prefill_held: dict[tuple[str, str], tuple[Engine, dict[int, np.ndarray],
                                                        RequestRecord]] = {}
        self._decode_waiters: dict[str, tuple[simpy.Event, dict[int, RequestOutcome], int]] = {}
        self._leases: dict[tuple[str, str], simpy.Process] = {}
        self._lease_deadline: dict[tuple[str, str], float] = {}
        # push mode
        self._published: dict[tuple[str, str], tuple[str, dict[int, np.ndarray],
                                                     RequestRecord]] = {}
        self._deferred: dict[tuple[str, str], list[tuple[int, PushRegistration]]] = {}
        self._write_outcomes: dict[tuple[str, str], dict[int, RequestOutcome]] = {}
        self._registration_ids: dict[tuple[str, str], str] = {}
        self._push_waiters: dict[str, _PushWait] = {}
        for role in ("prefill", "decode"):
            section = getattr(scenario, role)
            settings = ConnectorSettings(mode=conn.mode, quirks=self.quirks,
                                         prefix_caching=section.prefix_caching,
                                         host_buffer=conn.host_buffer,
                                         enforce_handshake_compat=conn.enforce_handshake_compat,
                                         descriptor_merge=conn.descriptor_merge)
            for i in range(section.instances):
                probe = engine_layout(self.model, section, num_blocks=1,
                                      registration_order=conn.registration_order,
                                      quirks=self.quirks)
                blocks = section.num_blocks or default_num_blocks(
                    probe, self.prompts, max_inflight=self.scenario.workload.max_inflight,
                    instances=section.instances)
                layout = engine_layout(self.model, section, num_blocks=blocks,
                                       registration_order=conn.registration_order,
                                       quirks=self.quirks)
                engine = Engine(world=self.world, engine_id=f"{role}{i}", role=role,
                                layout=layout, settings=settings)
                self.engines[role].append(engine)
                for worker in engine.workers:
                    self.world.on_activity(worker.transport.name,
                                           lambda e=engine, w=worker: self._on_activity(e, w))

    # ---- sizing ----------------------------------------------------------------------------
    def prefill_tokens(self, prompt: int) -> int:
        """Tokens prefill computes: N-1 for models with state (§6), else N (quirk
        phantom-token: N for every model)."""
        return prompt - 1 if self.hybrid and "phantom-token" not in self.quirks else prompt

    def _suffix(self) -> str:
        """A random request-id suffix (the proxy gives P and D different ones), seeded."""
        return f"{int(self.rng.integers(1 << 32)):08x}"

    # ---- run -------------------------------------------------------------------------------
    def run(self, progress: Callable[[RequestRecord], None] | None = None) -> RunResult:
        """Run the workload; ``progress`` (optional) is called with each request's record as
        its serving ends (a request still pending then is reported hung at the end)."""
        self._on_request_end = progress
        wl = self.scenario.workload
        if wl.arrival == "poisson":
            gaps = self.rng.exponential(1.0 / float(wl.rate), size=len(self.prompts))
            arrivals = np.cumsum(gaps) - gaps[0]
        else:
            arrivals = np.zeros(len(self.prompts))
        slots = simpy.Resource(self.env, capacity=wl.max_inflight or len(self.prompts))
        if self.world.faults is not None:
            agents = [w.transport.name for es in self.engines.values() for e in es
                      for w in e.workers]
            for at, agent in self.world.faults.timed_deaths(agents):
                self.env.process(self._kill_at(at, agent))
        for i, (n, hit) in enumerate(zip(self.prompts.tolist(), self.hits.tolist())):
            rec = RequestRecord(index=i, request_id=f"req-{i}-{self._suffix()}",
                                prompt_tokens=int(n),
                                prefix_hit_tokens=int(hit), arrival=float(arrivals[i]))
            self.records.append(rec)
            self.env.process(self._request(rec, slots))
        self.env.run()
        workers = [w for es in self.engines.values() for e in es for w in e.workers]
        self.counters["notification_failures"] += sum(w.notification_failures for w in workers)
        self.counters["dropped_messages"] = self.world.dropped_messages
        if self.world.faults is not None:
            self.counters["faults_injected"] = sum(self.world.faults.injected.values())
            for kind, n in sorted(self.world.faults.injected.items()):
                self.counters[f"fault:{kind}"] = n
        leaks = {
            "prefill_blocks": sum(e.allocator.used for e in self.engines["prefill"]),
            "decode_blocks": sum(e.allocator.used for e in self.engines["decode"]),
            "open_handles": sum(w.transport.open_handles() for es in self.engines.values()
                                for e in es for w in e.workers),
        }
        for w in workers:  # clean shutdown (§9.4): everything released, memory deregistered
            w.shutdown()
        leftover: dict[str, int] = {}
        for w in workers:
            for k, v in w.transport.resources().items():
                leftover[k] = leftover.get(k, 0) + v
        leaks["after_shutdown"] = sum(leftover.values())
        if leaks["after_shutdown"]:
            log.warning("resources left after shutdown: %s", leftover)
        layouts = {role: es[0].layout for role, es in self.engines.items()}
        return RunResult(scenario=self.scenario, records=self.records,
                         handshake_errors=self.handshake_errors, leaks=leaks,
                         counters=self.counters, sim_seconds=self._makespan(), layouts=layouts,
                         link_segments=self.fabric.link_segments(), verified=self.verify)

    def _makespan(self) -> float:
        """Simulated time of the last request event (a cancelled lease timer still sits in the
        event queue, so ``env.now`` after draining it would overstate the run)."""
        ends = [t for r in self.records for k, t in r.times.items()
                if k in ("done", "prefill_freed", "lease_expired")]
        return float(max(ends, default=0.0))

    def _kill_at(self, at: float, agent: str) -> Generator:
        yield self.env.timeout(at)
        log.warning("fault: agent %s dies at t=%.6f s", agent, self.env.now)
        self.world.kill(agent)
        if self.world.faults is not None:
            self.world.faults.injected["disconnect-peer"] = self.world.faults.injected.get(
                "disconnect-peer", 0) + 1

    def _allocate(self, engine: Engine, n_attention: int) -> Generator[Any, Any,
                                                                        dict[int, np.ndarray]]:
        layout = engine.layout
        need = n_attention * len(layout.attention_groups) + len(layout.state_groups)
        while not engine.allocator.can_allocate(need):
            yield engine.freed
        blocks: dict[int, np.ndarray] = {}
        for group in layout.groups:
            n = n_attention if group.kind == "attention" else 1
            blocks[group.group_id] = engine.allocator.allocate(n)
        return blocks

    def _free(self, engine: Engine, blocks: dict[int, np.ndarray], *, stamp: bool = True
              ) -> None:
        """Return blocks to the pool. ``stamp`` bumps their versions, so a transfer still
        moving them is caught; only push's own completion (its WRITEs are DONE) skips it."""
        for ids in blocks.values():
            engine.allocator.free(ids)
            if stamp:
                engine.block_version[ids] += 1
        old, engine.freed = engine.freed, self.env.event()
        old.succeed()

    def _request(self, rec: RequestRecord, slots: simpy.Resource) -> Generator:
        yield self.env.timeout(rec.arrival)
        with slots.request() as slot:
            yield slot
            yield from self._serve(rec)
        if self._on_request_end is not None:
            self._on_request_end(rec)

    def _serve(self, rec: RequestRecord) -> Generator:
        env = self.env
        prefill = self.engines["prefill"][rec.index % len(self.engines["prefill"])]
        decode = self.engines["decode"][rec.index % len(self.engines["decode"])]
        rec.prefill_engine, rec.decode_engine = prefill.engine_id, decode.engine_id
        rec.times["start"] = env.now
        abort = self.world.faults.abort_phase(rec.index) if self.world.faults else None
        p_rid, p_blocks = yield from self._prefill(rec, prefill,
                                                   finish_normally=abort != "on-prefill")
        if abort == "on-prefill":  # prefill finished abnormally: no lease, blocks dropped
            self._abort(rec, abort)
            return
        versions = {g: prefill.block_version[ids].copy() for g, ids in p_blocks.items()}
        if abort == "before-scheduling":
            job = DecodeJob(blocks={}, load={g.group_id: np.zeros(0, np.int64)
                                             for g in decode.layout.groups},
                            hit_blocks=0, load_tokens=rec.prompt_tokens - 1)
        else:
            job = yield from self._decode_allocate(rec, decode)
        if abort == "during-handshake":
            job.load = {g: ids[:0] for g, ids in job.load.items()}
        dead = [w.transport.name for w in decode.workers
                if not self.world.is_alive(w.transport.name)]
        if dead:
            failure: tuple[str, str] | None = ("remote_disconnect",
                                               f"decode rank {dead[0]} is dead")
        else:
            self._start_loading(decode, rec, prefill, p_rid)
            transfer = self._push if self.scenario.connector.mode == "push" else self._pull
            failure = yield from transfer(rec, prefill, decode, p_rid, p_blocks, job,
                                          abort_mid_transfer=abort == "mid-transfer")
            decode.loading.pop(rec.request_id, None)
            if failure is None and rec.transfers:
                failure = freed_while_reading(prefill.engine_id, prefill.block_version,
                                              p_blocks, versions)
        if abort is not None:
            # the empty receive (before scheduling / during the handshake) only notified
            # prefill; an abandoned transfer was waited out before its blocks are freed
            self._abort(rec, abort)
        elif failure is not None and not self._recover(rec, decode, job, failure):
            self._fail(rec, *failure)
        if rec.status == "pending":
            self._post_process(prefill, decode, job)
            self._verify_and_compute(rec, decode, job)
            rec.status = "ok"
            rec.times["done"] = env.now
        self._free(decode, job.blocks)

    def _abort(self, rec: RequestRecord, phase: str) -> None:
        if rec.status == "pending":
            rec.status, rec.failure_class = "aborted", f"aborted {phase}"
            rec.times["done"] = self.env.now

    def _recover(self, rec: RequestRecord, decode: Engine, job: "DecodeJob",
                 failure: tuple[str, str]) -> bool:
        """kv_load_failure_policy = "recompute": decode recomputes the request itself. With HMA
        no invalid blocks are reported, and state cannot be re-zeroed, so the whole request is
        recomputed (DOMAIN.md §9.3)."""
        if self.scenario.connector.kv_load_failure_policy != "recompute":
            return False
        if any(not self.world.is_alive(w.transport.name) for w in decode.workers):
            return False  # a dead decode rank cannot recompute anything
        rec.recovered_from = failure[0]
        self.counters["recomputed"] += 1
        if decode.oracle is not None:
            layout = decode.layout
            for w in decode.workers:
                assert w.memory is not None
                decode.oracle.write(w.memory.array, layout, w.tp_rank, rec.index,
                                    blocks=job.blocks, tokens=(0, job.load_tokens),
                                    state_step=job.load_tokens if layout.is_hybrid else None)
        job.recomputed = True
        return True

    def _prefill(self, rec: RequestRecord, prefill: Engine, *, finish_normally: bool = True
                 ) -> Generator[Any, Any, tuple[str, dict[int, np.ndarray]]]:
        """Allocate, compute (write the pattern) and finish under a lease. Models with state
        compute N-1 tokens (DOMAIN.md §6); the others all N."""
        n_tokens = self.prefill_tokens(rec.prompt_tokens)
        layout = prefill.layout
        p_blocks = yield from self._allocate(prefill, layout.blocks_for_tokens(n_tokens))
        p_rid = f"{base_request_id(rec.request_id)}-{self._suffix()}"
        if prefill.oracle is not None:
            for w in prefill.workers:
                assert w.memory is not None
                prefill.oracle.write(w.memory.array, layout, w.tp_rank, rec.index,
                                     blocks=p_blocks, tokens=(0, n_tokens),
                                     state_step=n_tokens if layout.is_hybrid else None)
        key = (prefill.engine_id, p_rid)
        if not finish_normally:  # only LENGTH_CAPPED / STOPPED requests get a lease (§8.1)
            self._free(prefill, p_blocks)
            return p_rid, p_blocks
        self._prefill_held[key] = (prefill, p_blocks, rec)
        self._pending_notifs[key] = {}
        lease = self.scenario.connector.lease_seconds
        if self.world.faults is not None:
            lease = self.world.faults.lease_for(rec.index, lease)
        self._lease_deadline[key] = self.env.now + lease
        self._leases[key] = self.env.process(self._lease(key, rec))
        rec.times["prefill_done"] = self.env.now
        if self.scenario.connector.mode == "push":
            self._publish(prefill, p_rid, p_blocks, rec)
        return p_rid, p_blocks

    def _decode_allocate(self, rec: RequestRecord, decode: Engine
                         ) -> Generator[Any, Any, "DecodeJob"]:
        """Allocate decode's blocks for the whole prompt and apply its prefix-cache hit.

        Decode loads tokens [hit, N-1) and computes token N itself (§6): its load list is the
        uncached blocks up to N-1 tokens, a hit of whole logical blocks. A hit that covers all
        N-1 tokens is a full hit; for models with state the cached prefix includes the state
        checkpoint at its end, so nothing is transferred (notification only).
        """
        layout = decode.layout
        blocks = yield from self._allocate(decode, layout.blocks_for_tokens(rec.prompt_tokens))
        load_tokens = rec.prompt_tokens - 1
        hit_blocks = min(rec.prefix_hit_tokens, load_tokens) // layout.logical_block_size
        hit_tokens = hit_blocks * layout.logical_block_size
        full_hit = hit_tokens >= load_tokens
        if decode.oracle is not None and hit_blocks:
            for w in decode.workers:
                assert w.memory is not None
                decode.oracle.write(w.memory.array, layout, w.tp_rank, rec.index, blocks=blocks,
                                    tokens=(0, hit_tokens),
                                    state_step=hit_tokens if full_hit and layout.is_hybrid
                                    else None)
        load: dict[int, np.ndarray] = {}
        for group in layout.groups:
            ids = blocks[group.group_id]
            if group.kind == "attention":
                ids = ids[hit_blocks:layout.blocks_for_tokens(load_tokens)]
            elif full_hit:
                ids = ids[:0]
            load[group.group_id] = ids
        return DecodeJob(blocks=blocks, load=load, hit_blocks=hit_blocks,
                         load_tokens=load_tokens)

    def _pull(self, rec: RequestRecord, prefill: Engine, decode: Engine, p_rid: str,
              p_blocks: dict[int, np.ndarray], job: "DecodeJob", *,
              abort_mid_transfer: bool = False) -> Generator[Any, Any, tuple[str, str] | None]:
        """Pull (DOMAIN.md §8.1); returns None on success, else (failure class, reason).

        ``abort_mid_transfer``: decode abandons the request right after posting; its handles
        are released only once terminal (DMA may be live), so its blocks wait for them."""
        env = self.env
        error = yield from self._connect(decode, prefill, rec)
        if error is not None:
            return ("handshake_failed", error)
        read = ReadRequest(request_id=rec.request_id, prefill_request_id=p_rid,
                           remote_engine=prefill.engine_id, prefill_blocks=p_blocks,
                           decode_blocks=job.load, decode_hit_blocks=job.hit_blocks)
        rec.times["transfer_start"] = env.now
        done = env.event()
        outcomes: dict[int, RequestOutcome] = {}
        self._decode_waiters[rec.request_id] = (done, outcomes, decode.tp)
        for w in decode.workers:
            immediate = w.start_read(read)
            if immediate is not None:
                self._collect(rec.request_id, w.tp_rank, immediate)
        if abort_mid_transfer:
            self._abort(rec, "mid-transfer")
        timeout = self.scenario.connector.transfer_timeout_seconds
        yield done | env.timeout(timeout)
        rec.times["transfer_done"] = env.now
        if not done.triggered:  # the watchdog: a transfer stuck in PROC becomes a failure
            self._decode_waiters.pop(rec.request_id, None)
            for w in decode.workers:
                aborted = w.abort(rec.request_id, "watchdog", "stall")
                if aborted is not None:
                    outcomes.setdefault(w.tp_rank, aborted)
            self._account(rec, outcomes.values())
            return ("stall", f"transfer still in progress after {timeout:g} s (watchdog)")
        self._account(rec, outcomes.values())
        failures = [o for o in outcomes.values() if not o.ok]
        if failures:
            return (failures[0].failure_class or "transfer_failed",
                    failures[0].reason or "transfer failed")
        return None

    def _push(self, rec: RequestRecord, prefill: Engine, decode: Engine, p_rid: str,
              p_blocks: dict[int, np.ndarray], job: "DecodeJob", *,
              abort_mid_transfer: bool = False) -> Generator[Any, Any, tuple[str, str] | None]:
        """Push (DOMAIN.md §8.2): decode registers its blocks with every prefill rank; prefill
        matches the registration to its finished request (either order), runs the reverse
        handshake and WRITEs; decode counts max(1, P_TP // D_TP) notifications per rank."""
        env = self.env
        first = decode.workers[0]
        event = decode.connections.get(f"notify:{prefill.engine_id}")
        if event is None:  # decode's notification-only handshake: agents, no descriptors
            event = env.event()
            decode.connections[f"notify:{prefill.engine_id}"] = event
            yield simpy.AllOf(env, [self.fabric.handshake((decode.engine_id, 0),
                                                          (prefill.engine_id, t.tp_rank))
                                    for t in prefill.workers])
            first.connect_notify_only([w.transport.get_agent_metadata()
                                       for w in prefill.workers])
            event.succeed(None)
        elif not event.triggered:
            yield event
        registration = PushRegistration(
            decode_request_id=rec.request_id, decode_engine=decode.engine_id,
            decode_tp=decode.tp, prefill_engine=prefill.engine_id, blocks=job.load,
            hit_blocks=job.hit_blocks)
        rec.times["transfer_start"] = env.now
        done = env.event()
        self._push_waiters[rec.request_id] = _PushWait(done=done, decode=decode, counts={})
        message = registration.encode()
        for w in prefill.workers:
            try:
                first.transport.send_notif(w.transport.name, message)
            except TransportError as exc:
                self._push_waiters.pop(rec.request_id, None)
                return (exc.kind, f"push registration not delivered: {exc}")
        if abort_mid_transfer:  # decode abandons; prefill's WRITEs still land in its blocks
            self._abort(rec, "mid-transfer")
        timeout = env.timeout(self.scenario.connector.transfer_timeout_seconds)
        yield done | timeout
        self._push_waiters.pop(rec.request_id, None)
        rec.times["transfer_done"] = env.now
        if not done.triggered:
            return ("stall", f"push: no WRITE completed within "
                    f"{self.scenario.connector.transfer_timeout_seconds:g} s (decode watchdog)")
        return done.value

    def _publish(self, prefill: Engine, p_rid: str, p_blocks: dict[int, np.ndarray],
                 rec: RequestRecord) -> None:
        """Push: prefill publishes a finished request; a registration that arrived first waits
        in the deferred inbox."""
        key = (prefill.engine_id, base_request_id(p_rid))
        self._published[key] = (p_rid, p_blocks, rec)
        for rank, registration in self._deferred.pop(key, []):
            self.env.process(self._write(prefill, rank, registration, p_rid, p_blocks, rec))

    def _on_registration(self, prefill: Engine, rank: int, registration: "PushRegistration"
                         ) -> None:
        """Match by exact request id, then by base id with the random suffix stripped."""
        key = (prefill.engine_id, base_request_id(registration.decode_request_id))
        published = self._published.get((prefill.engine_id, registration.decode_request_id),
                                         self._published.get(key))
        if published is None:
            self._deferred.setdefault(key, []).append((rank, registration))
            return
        p_rid, p_blocks, rec = published
        self.env.process(self._write(prefill, rank, registration, p_rid, p_blocks, rec))

    def _write(self, prefill: Engine, rank: int, registration: "PushRegistration", p_rid: str,
               p_blocks: dict[int, np.ndarray], rec: RequestRecord) -> Generator:
        decode = next(e for e in self.engines["decode"]
                      if e.engine_id == registration.decode_engine)
        error = yield from self._connect(prefill, decode, rec)
        key = (prefill.engine_id, p_rid)
        if error is not None:
            self._push_result(registration.decode_request_id, ("handshake_failed", error))
            return
        worker = prefill.workers[rank]
        self._registration_ids[key] = registration.decode_request_id
        outcome = worker.start_write(WriteRequest(prefill_request_id=p_rid,
                                                  registration=registration,
                                                  prefill_blocks=p_blocks))
        self._write_outcomes.setdefault(key, {})
        if outcome is not None:
            self._collect_write(prefill, rank, outcome)

    def _collect_write(self, prefill: Engine, rank: int, outcome: RequestOutcome) -> None:
        """Prefill is done with a request when every rank's WRITEs are DONE (or one failed)."""
        key = (prefill.engine_id, outcome.request_id)
        outcomes = self._write_outcomes.setdefault(key, {})
        outcomes[rank] = outcome
        published = self._published.get((prefill.engine_id, base_request_id(outcome.request_id)))
        if published is not None:
            self._account(published[2], [outcome])
        failed = [o for o in outcomes.values() if not o.ok]
        reg_id = self._registration_ids.get(key)
        if failed and reg_id is not None:
            self._push_result(reg_id, (failed[0].failure_class or "transfer_failed",
                                       failed[0].reason or "WRITE failed"))
        if len(outcomes) < prefill.tp:
            return
        del self._write_outcomes[key]
        self._published.pop((prefill.engine_id, base_request_id(outcome.request_id)), None)
        self._registration_ids.pop(key, None)
        if not failed:  # every WRITE is DONE: free without waiting for the lease
            self._release_prefill(prefill, outcome.request_id, stamp=False)

    def _push_result(self, decode_request_id: str, failure: tuple[str, str] | None) -> None:
        wait = self._push_waiters.get(decode_request_id)
        if wait is not None and not wait.done.triggered:
            wait.done.succeed(failure)

    @staticmethod
    def _account(rec: RequestRecord, outcomes: Any) -> None:
        for o in outcomes:
            rec.descriptors += o.descriptors
            rec.nbytes += o.nbytes
            rec.transfers += o.transfers
            for t in o.telemetry:
                rec.times["post"] = max(rec.times.get("post", 0.0), t.post_seconds)
                rec.times["wire"] = max(rec.times.get("wire", 0.0), t.transfer_seconds)
                rec.telemetry.append({
                    "nbytes": t.nbytes, "descriptors": t.descriptors, "submitted": t.submitted,
                    "post_seconds": t.post_seconds, "transfer_seconds": t.transfer_seconds,
                    "completed": t.completed, "path": list(t.path)})

    def _verify_and_compute(self, rec: RequestRecord, decode: Engine, job: "DecodeJob") -> None:
        """Check every loaded byte against the oracle, then compute token N locally (its KV and
        the state after N tokens)."""
        if decode.oracle is None:
            return
        layout = decode.layout
        hybrid = layout.is_hybrid
        for w in decode.workers:
            assert w.memory is not None
            words, found = decode.oracle.verify(
                w.memory.array, layout, w.tp_rank, rec.index, engine=decode.engine_id,
                blocks=job.blocks, tokens=(0, job.load_tokens),
                state_step=job.load_tokens if hybrid else None)
            rec.mismatched_words += words
            rec.mismatches.extend(str(m) for m in found[: max(0, 8 - len(rec.mismatches))])
        for w in decode.workers:
            assert w.memory is not None
            decode.oracle.write(w.memory.array, layout, w.tp_rank, rec.index, blocks=job.blocks,
                                tokens=(job.load_tokens, rec.prompt_tokens),
                                state_step=rec.prompt_tokens if hybrid else None)

    def _post_process(self, prefill: Engine, decode: Engine, job: "DecodeJob") -> None:
        """Block-size-ratio post-processing on every decode rank: zero the untransferred
        sub-block tail, then regroup heads (DOMAIN.md §6)."""
        layout = decode.layout
        bsr = layout.kernel_block_size // prefill.layout.kernel_block_size
        if bsr == 1 or not self.verify or job.recomputed:
            return
        ppl = layout.physical_blocks_per_logical
        p_kernel = prefill.layout.kernel_block_size
        for group in layout.attention_groups:
            kernel = expand_logical(job.load[group.group_id], ppl)
            subs = to_sub_blocks(kernel, bsr)
            first_sub = job.hit_blocks * ppl * bsr
            received = max(0, min(subs.size, -(-self.prefill_tokens_for(prefill, job) // p_kernel)
                                  - first_sub))
            for w in decode.workers:
                w.zero_sub_blocks(subs[received:], bsr)
                w.regroup_heads(kernel, bsr)

    def prefill_tokens_for(self, prefill: Engine, job: "DecodeJob") -> int:
        return self.prefill_tokens(job.load_tokens + 1)

    def _lease(self, key: tuple[str, str], rec: RequestRecord) -> Generator:
        """Prefill holds a finished request's blocks until its notifications arrive or the
        lease deadline passes; decode's heartbeats move the deadline (DOMAIN.md §9.1)."""
        while True:
            wait = self._lease_deadline[key] - self.env.now
            try:
                yield self.env.timeout(max(0.0, wait))
            except simpy.Interrupt:  # freed by its notifications first
                return
            if self._lease_deadline.get(key, 0.0) <= self.env.now:
                break
        self._leases.pop(key, None)
        self._lease_deadline.pop(key, None)
        held = self._prefill_held.pop(key, None)
        if held is None:
            return
        engine, blocks, _ = held
        self.counters["lease_expiries"] += 1
        rec.freed_by_lease = True
        rec.times["lease_expired"] = self.env.now
        log.info("lease expired for %s on %s: freed %d blocks", key[1], key[0],
                 sum(len(b) for b in blocks.values()))
        self._pending_notifs.pop(key, None)
        self._free(engine, blocks)

    def _on_heartbeat(self, prefill: Engine, message: bytes) -> None:
        """'HB:r1,r2,...': each listed lease deadline becomes max(old, now + 2/3 lease)."""
        lease = self.scenario.connector.lease_seconds
        for rid in message[3:].decode(errors="replace").split(","):
            key = (prefill.engine_id, rid)
            if key in self._lease_deadline:
                self._lease_deadline[key] = max(self._lease_deadline[key],
                                                self.env.now + 2 * lease / 3)

    def _heartbeats(self, decode: Engine) -> Generator:
        """Decode sends heartbeats every lease/6 for the requests it is still loading."""
        period = self.scenario.connector.lease_seconds / 6
        while decode.loading:
            yield self.env.timeout(period)
            by_prefill: dict[str, list[str]] = {}
            for p_engine, p_rid in decode.loading.values():
                by_prefill.setdefault(p_engine, []).append(p_rid)
            sender = next((w for w in decode.workers if self.world.is_alive(w.transport.name)),
                          None)
            if sender is None:
                return
            for p_engine, rids in by_prefill.items():
                message = ("HB:" + ",".join(sorted(rids))).encode()
                for p in self._engine(p_engine).workers:
                    try:
                        sender.transport.send_notif(p.transport.name, message)
                    except TransportError:
                        self.counters["notification_failures"] += 1
        decode.heartbeat = None

    def _engine(self, engine_id: str) -> Engine:
        return next(e for es in self.engines.values() for e in es if e.engine_id == engine_id)

    def _start_loading(self, decode: Engine, rec: RequestRecord, prefill: Engine,
                       p_rid: str) -> None:
        decode.loading[rec.request_id] = (prefill.engine_id, p_rid)
        if decode.heartbeat is None:
            decode.heartbeat = self.env.process(self._heartbeats(decode))

    def _connect(self, local: Engine, remote: Engine, rec: RequestRecord
                 ) -> Generator[Any, Any, str | None]:
        """Lazy handshake of ``local``'s ranks with ``remote`` on first use of the pair
        (decode with prefill in pull; prefill's reverse handshake with decode in push);
        concurrent requests wait for the same one. Returns the refusal, or None."""
        event = local.connections.get(remote.engine_id)
        if event is None:
            self._evict_stale(local)
            event = self.env.event()
            local.connections[remote.engine_id] = event
            self.counters["handshakes"] += 1
            start = self.env.now
            latencies = [self.fabric.handshake((local.engine_id, w.tp_rank),
                                               (remote.engine_id, t))
                         for w in local.workers for t in self._targets(w, remote.tp)]
            yield simpy.AllOf(self.env, latencies)
            payloads = remote.payloads()
            error = None
            try:
                for w in local.workers:
                    w.connect(remote.engine_id, payloads)
            except (HandshakeError, GeometryError) as exc:
                error = str(exc)
                arrow = "<-" if local.role == "decode" else "->"
                pair = (f"{local.engine_id} {arrow} {remote.engine_id}" if local.role == "decode"
                        else f"{remote.engine_id} <- {local.engine_id} (push)")
                self.handshake_errors.append(f"{pair}: {error}")
            rec.times["handshake"] = self.env.now - start
            event.succeed(error)
        elif not event.triggered:
            yield event
        local.last_used[remote.engine_id] = self.env.now
        return event.value

    def _evict_stale(self, local: Engine) -> None:
        """Evict remote engines idle past the TTL; checked only when a new handshake starts, so a
        fixed pair never evicts a dead peer (DOMAIN.md §9.4)."""
        ttl = self.scenario.connector.engine_ttl_seconds
        for remote, last in list(local.last_used.items()):
            event = local.connections.get(remote)
            if self.env.now - last > ttl and event is not None and event.triggered:
                for w in local.workers:
                    w.evict(remote)
                del local.connections[remote], local.last_used[remote]
                self.counters["evictions"] += 1
                log.info("%s evicted idle engine %s", local.engine_id, remote)

    @staticmethod
    def _targets(worker: ConnectorWorker, remote_tp: int) -> tuple[int, ...]:
        """Remote ranks a handshake contacts; a non-integral TP ratio still costs one metadata
        fetch (from rank 0) before rule V1 refuses the pair in ``connect``."""
        try:
            return worker.targets(remote_tp)
        except TPError:
            return (0,)

    def _fail(self, rec: RequestRecord, failure_class: str, reason: str) -> None:
        if rec.status == "pending":  # report once
            rec.status, rec.failure_class, rec.reason = "failed", failure_class, reason
            rec.times["done"] = self.env.now

    def _collect(self, rid: str, rank: int, outcome: RequestOutcome) -> None:
        waiter = self._decode_waiters.get(rid)
        if waiter is None:
            return
        done, outcomes, expected = waiter
        outcomes[rank] = outcome
        if len(outcomes) == expected:
            del self._decode_waiters[rid]
            done.succeed()

    def _on_activity(self, engine: Engine, worker: ConnectorWorker) -> None:
        """A transfer of, or a message to, ``worker`` completed: poll it (the sans-I/O core is
        driven from here, as the engine's step loop drives the reference connector)."""
        if engine.role == "decode":
            for outcome in worker.poll():
                self._collect(outcome.request_id, worker.tp_rank, outcome)
            for message in worker.take_messages():
                parsed = parse_notification(message)
                if parsed is None or not self._on_push_notification(engine, worker.tp_rank,
                                                                    *parsed):
                    self.counters["late_notifications"] += 1
            return
        for outcome in worker.poll():  # push WRITEs
            self._collect_write(engine, worker.tp_rank, outcome)
        for message in worker.take_messages():
            if message.startswith(b"HB:"):
                self._on_heartbeat(engine, message)
                continue
            if message.startswith(PUSH_PREFIX):
                registration = PushRegistration.decode(message)
                if registration is None:
                    self.counters["malformed_registrations"] += 1
                    log.warning("malformed push registration dropped on %s", worker.transport.name)
                else:
                    self._on_registration(engine, worker.tp_rank, registration)
                continue
            parsed = parse_notification(message)
            if parsed is None:
                self.counters["late_notifications"] += 1
                continue
            rid, count = parsed
            self.counters["notifications"] += 1
            key = (engine.engine_id, rid)
            pending = self._pending_notifs.get(key)
            if pending is None:
                self.counters["late_notifications"] += 1
                log.info("notification for unknown request %s on %s ignored", rid,
                         worker.transport.name)
                continue
            pending[worker.tp_rank] = pending.get(worker.tp_rank, 0) + 1
            if len(pending) == engine.tp and all(v >= count for v in pending.values()):
                self._release_prefill(engine, rid)

    def _on_push_notification(self, decode: Engine, rank: int, rid: str, sender_world: int
                              ) -> bool:
        """Decode counts "{D_request_id}:{P_world_size}"; each rank expects
        max(1, P_TP // D_TP) (DOMAIN.md §8.2)."""
        wait = self._push_waiters.get(rid)
        if wait is None:
            return False
        self.counters["notifications"] += 1
        wait.counts[rank] = wait.counts.get(rank, 0) + 1
        expected = max(1, sender_world // decode.tp)
        if len(wait.counts) == decode.tp and all(v >= expected for v in wait.counts.values()):
            if not wait.done.triggered:
                wait.done.succeed(None)
        return True

    def _release_prefill(self, engine: Engine, p_rid: str, *, stamp: bool = True) -> None:
        """Free a finished request's prefill blocks before its lease expires."""
        key = (engine.engine_id, p_rid)
        held = self._prefill_held.pop(key, None)
        self._pending_notifs.pop(key, None)
        lease = self._leases.pop(key, None)
        if lease is not None and lease.is_alive:
            lease.interrupt()
        if held is not None:
            _, blocks, rec = held
            rec.times["prefill_freed"] = self.env.now
            self._free(engine, blocks, stamp=stamp)


def run_scenario(scenario: Scenario, *, timing_only: bool = False,
                 progress: Callable[[RequestRecord], None] | None = None) -> RunResult:
    """Run one scenario on the simulated fabric (``timing_only``: move no bytes, verify none;
    ``progress``: called with each request's record as its serving ends)."""
    return Cluster(scenario, timing_only=timing_only).run(progress)
