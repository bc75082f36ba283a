"""The P/D run loop on the simulated fabric: workload, engines, ranks, driving the connector.

Requests arrive; prefill allocates blocks, writes the oracle pattern (N-1 tokens for models with
state) and finishes under a lease; decode allocates, handshakes lazily with the prefill engine,
and every decode rank pulls through the connector core; prefill frees on the expected
notifications (or the lease); decode verifies every byte against the oracle, computes token N and
frees. Everything runs in simpy virtual time, deterministically.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import simpy

from .connector.blocks import expand_logical, to_sub_blocks
from .connector.quirks import check_quirks
from .connector.tp import TPError
from .connector.validate import HandshakeError
from .connector.worker import ConnectorSettings, ConnectorWorker, ReadRequest, RequestOutcome
from .fabric import Fabric, load_profile, place_engines
from .geometry.layout import EngineLayout, build_layout
from .geometry.presets import preset
from .geometry.specs import GeometryError, ModelSpec
from .oracle import Oracle
from .scenario import Scenario
from .transport.sim import SimWorld

__all__ = ["RequestRecord", "RunResult", "Engine", "Cluster", "engine_layout", "run_scenario"]

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
class RequestRecord:
    index: int
    request_id: str
    prompt_tokens: int
    prefix_hit_tokens: int
    arrival: float
    prefill_engine: str = ""
    decode_engine: str = ""
    status: str = "pending"  # ok | failed | pending (hung if still pending at the end)
    failure_class: str | None = None
    reason: str | None = None
    descriptors: int = 0
    nbytes: int = 0
    transfers: int = 0
    mismatched_words: int = 0
    mismatches: list[str] = field(default_factory=list)
    freed_by_lease: bool = False
    times: dict[str, float] = field(default_factory=dict)

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

    @property
    def hung(self) -> int:
        return sum(r.status == "pending" for r in self.records)

    @property
    def failed(self) -> int:
        return sum(r.status == "failed" for r in self.records)

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
        self.records: list[RequestRecord] = []
        self.handshake_errors: list[str] = []
        self.counters = {"lease_expiries": 0, "late_notifications": 0, "notifications": 0}
        self._pending_notifs: dict[tuple[str, str], dict[int, int]] = {}
        self._prefill_held: dict[tuple[str, str], tuple[Engine, dict[int, np.ndarray],
                                                        RequestRecord]] = {}
        self._decode_waiters: dict[str, tuple[simpy.Event, dict[int, RequestOutcome], int]] = {}
        self._leases: dict[tuple[str, str], simpy.Process] = {}
        for role in ("prefill", "decode"):
            section = getattr(scenario, role)
            settings = ConnectorSettings(mode=conn.mode, quirks=self.quirks,
                                         prefix_caching=section.prefix_caching,
                                         host_buffer=conn.host_buffer,
                                         enforce_handshake_compat=conn.enforce_handshake_compat)
            for i in range(section.instances):
                probe = engine_layout(self.model, section, num_blocks=1,
                                      registration_order=conn.registration_order,
                                      quirks=self.quirks)
                blocks = section.num_blocks or self._default_blocks(probe, role, section.instances)
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
    def _default_blocks(self, layout: EngineLayout, role: str, instances: int) -> int:
        """Enough logical blocks for the engine's share of concurrently live requests."""
        live = self.scenario.workload.max_inflight or len(self.prompts)
        longest = int(self.prompts.max())
        per_request = layout.blocks_for_tokens(longest) + len(layout.state_groups)
        share = -(-min(live, len(self.prompts)) // instances)
        return max(1, share * per_request)

    def transfer_tokens(self, prompt: int) -> int:
        """Tokens prefill computes and transfers: N-1 for models with state (§6), else N."""
        return prompt - 1 if self.hybrid else prompt

    # ---- run -------------------------------------------------------------------------------
    def run(self) -> RunResult:
        wl = self.scenario.workload
        if wl.arrival == "poisson":
            gaps = self.rng.exponential(1.0 / float(wl.rate), size=len(self.prompts))
            arrivals = np.cumsum(gaps) - gaps[0]
        else:
            arrivals = np.zeros(len(self.prompts))
        slots = simpy.Resource(self.env, capacity=wl.max_inflight or len(self.prompts))
        for i, (n, hit) in enumerate(zip(self.prompts.tolist(), self.hits.tolist())):
            rec = RequestRecord(index=i, request_id=f"req-{i}", prompt_tokens=int(n),
                                prefix_hit_tokens=int(hit), arrival=float(arrivals[i]))
            self.records.append(rec)
            self.env.process(self._request(rec, slots))
        self.env.run()
        leaks = {
            "prefill_blocks": sum(e.allocator.used for e in self.engines["prefill"]),
            "decode_blocks": sum(e.allocator.used for e in self.engines["decode"]),
            "open_handles": sum(w.transport.open_handles() for es in self.engines.values()
                                for e in es for w in e.workers),
        }
        layouts = {role: es[0].layout for role, es in self.engines.items()}
        return RunResult(scenario=self.scenario, records=self.records,
                         handshake_errors=self.handshake_errors, leaks=leaks,
                         counters=self.counters, sim_seconds=self._makespan(), layouts=layouts)

    def _makespan(self) -> float:
        """Simulated time of the last request event (a cancelled lease timer still sits in the
        event queue, so ``env.now`` after draining it would overstate the run)."""
        ends = [t for r in self.records for k, t in r.times.items()
                if k in ("done", "prefill_freed", "lease_expired")]
        return float(max(ends, default=0.0))

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

    def _free(self, engine: Engine, blocks: dict[int, np.ndarray]) -> None:
        for ids in blocks.values():
            engine.allocator.free(ids)
        old, engine.freed = engine.freed, self.env.event()
        old.succeed()

    def _request(self, rec: RequestRecord, slots: simpy.Resource) -> Generator:
        yield self.env.timeout(rec.arrival)
        with slots.request() as slot:
            yield slot
            yield from self._serve(rec)

    def _serve(self, rec: RequestRecord) -> Generator:
        env = self.env
        prefill = self.engines["prefill"][rec.index % len(self.engines["prefill"])]
        decode = self.engines["decode"][rec.index % len(self.engines["decode"])]
        rec.prefill_engine, rec.decode_engine = prefill.engine_id, decode.engine_id
        rec.times["start"] = env.now
        n_tokens = self.transfer_tokens(rec.prompt_tokens)
        p_layout, d_layout = prefill.layout, decode.layout
        # ---- prefill: allocate, compute (write the pattern), finish under a lease
        p_blocks = yield from self._allocate(prefill, p_layout.blocks_for_tokens(n_tokens))
        p_rid = f"{rec.request_id}-p"
        if prefill.oracle is not None:
            for w in prefill.workers:
                assert w.memory is not None
                prefill.oracle.write(w.memory.array, p_layout, w.tp_rank, rec.index, blocks=p_blocks,
                                  tokens=(0, n_tokens),
                                  state_step=n_tokens if self.hybrid else None)
        key = (prefill.engine_id, p_rid)
        self._prefill_held[key] = (prefill, p_blocks, rec)
        self._pending_notifs[key] = {}
        self._leases[key] = env.process(self._lease(key, rec))
        rec.times["prefill_done"] = env.now
        # ---- decode: allocate (full prompt), prefix hit, handshake, pull
        d_blocks = yield from self._allocate(decode, d_layout.blocks_for_tokens(rec.prompt_tokens))
        hit_blocks = min(rec.prefix_hit_tokens // d_layout.logical_block_size,
                         d_layout.blocks_for_tokens(n_tokens))
        hit_tokens = hit_blocks * d_layout.logical_block_size
        if decode.oracle is not None and hit_blocks:
            for w in decode.workers:
                assert w.memory is not None
                decode.oracle.write(w.memory.array, d_layout, w.tp_rank, rec.index, blocks=d_blocks,
                                  tokens=(0, hit_tokens), state_step=None)
        error = yield from self._connect(decode, prefill, rec)
        if error is not None:
            self._fail(rec, "handshake_failed", error)
            self._free(decode, d_blocks)
            return
        transfer_blocks = {}
        for group in d_layout.groups:
            ids = d_blocks[group.group_id]
            if group.kind == "attention":
                ids = ids[hit_blocks:d_layout.blocks_for_tokens(n_tokens)]
            transfer_blocks[group.group_id] = ids
        read = ReadRequest(request_id=rec.request_id, prefill_request_id=p_rid,
                           remote_engine=prefill.engine_id, prefill_blocks=p_blocks,
                           decode_blocks=transfer_blocks, decode_hit_blocks=hit_blocks)
        rec.times["transfer_start"] = env.now
        done = env.event()
        outcomes: dict[int, RequestOutcome] = {}
        self._decode_waiters[rec.request_id] = (done, outcomes, decode.tp)
        for w in decode.workers:
            immediate = w.start_read(read)
            if immediate is not None:
                self._collect(rec.request_id, w.tp_rank, immediate)
        yield done
        rec.times["transfer_done"] = env.now
        failures = [o for o in outcomes.values() if not o.ok]
        for o in outcomes.values():
            rec.descriptors += o.descriptors
            rec.nbytes += o.nbytes
            rec.transfers += o.transfers
            for t in o.telemetry:
                rec.times["post"] = max(rec.times.get("post", 0.0), t.post_seconds)
                rec.times["wire"] = max(rec.times.get("wire", 0.0), t.transfer_seconds)
        if failures:
            self._fail(rec, failures[0].failure_class or "transfer_failed",
                       failures[0].reason or "transfer failed")
            self._free(decode, d_blocks)
            return
        self._post_process(decode, read, d_blocks, n_tokens, hit_blocks)
        if decode.oracle is not None:
            for w in decode.workers:
                assert w.memory is not None
                words, found = decode.oracle.verify(
                    w.memory.array, d_layout, w.tp_rank, rec.index, engine=decode.engine_id,
                    blocks=d_blocks, tokens=(0, n_tokens),
                    state_step=n_tokens if self.hybrid else None)
                rec.mismatched_words += words
                rec.mismatches.extend(str(m) for m in found[: 8 - len(rec.mismatches)])
            # decode computes token N locally (its KV and the state after N tokens)
            for w in decode.workers:
                assert w.memory is not None
                decode.oracle.write(w.memory.array, d_layout, w.tp_rank, rec.index,
                                    blocks=d_blocks, tokens=(n_tokens, rec.prompt_tokens),
                                  state_step=rec.prompt_tokens if self.hybrid else None)
        rec.status = "ok"
        rec.times["done"] = env.now
        self._free(decode, d_blocks)

    def _post_process(self, decode: Engine, read: ReadRequest, d_blocks: dict[int, np.ndarray],
                      n_tokens: int, hit_blocks: int) -> None:
        """Block-size-ratio post-processing on every decode rank: zero the untransferred
        sub-block tail, then regroup heads (DOMAIN.md §6)."""
        layout = decode.layout
        first = decode.workers[0].remote_info(read.remote_engine)
        if not first or first[0].bsr == 1 or not self.verify:
            return
        bsr = first[0].bsr
        ppl = layout.physical_blocks_per_logical
        p_kernel = layout.kernel_block_size // bsr
        for group in layout.attention_groups:
            ids = read.decode_blocks[group.group_id]
            kernel = expand_logical(ids, ppl)
            subs = to_sub_blocks(kernel, bsr)
            first_sub = hit_blocks * ppl * bsr
            received = max(0, -(-n_tokens // p_kernel) - first_sub)
            for w in decode.workers:
                w.zero_sub_blocks(subs[received:], bsr)
                w.regroup_heads(kernel, bsr)

    def _lease(self, key: tuple[str, str], rec: RequestRecord) -> Generator:
        try:
            yield self.env.timeout(self.scenario.connector.lease_seconds)
        except simpy.Interrupt:  # freed by its notifications first
            return
        self._leases.pop(key, None)
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

    def _connect(self, decode: Engine, prefill: Engine, rec: RequestRecord
                 ) -> Generator[Any, Any, str | None]:
        """Lazy handshake on first use of a pair; concurrent requests wait for the same one."""
        event = decode.connections.get(prefill.engine_id)
        if event is None:
            event = self.env.event()
            decode.connections[prefill.engine_id] = event
            start = self.env.now
            latencies = [self.fabric.handshake((decode.engine_id, w.tp_rank),
                                               (prefill.engine_id, t))
                         for w in decode.workers for t in self._targets(w, prefill.tp)]
            yield simpy.AllOf(self.env, latencies)
            payloads = prefill.payloads()
            error = None
            try:
                for w in decode.workers:
                    w.connect(prefill.engine_id, payloads)
            except (HandshakeError, GeometryError) as exc:
                error = str(exc)
                self.handshake_errors.append(f"{decode.engine_id} <- {prefill.engine_id}: {error}")
            rec.times["handshake"] = self.env.now - start
            event.succeed(error)
        elif not event.triggered:
            yield event
        return event.value

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
        if engine.role == "decode":
            for outcome in worker.poll():
                self._collect(outcome.request_id, worker.tp_rank, outcome)
            return
        for rid, count in worker.take_notifications():
            self.counters["notifications"] += 1
            key = (engine.engine_id, rid)
            pending = self._pending_notifs.get(key)
            if pending is None:
                self.counters["late_notifications"] += 1
                log.info("notification for unknown request %s on %s ignored", rid, worker.transport.name)
                continue
            pending[worker.tp_rank] = pending.get(worker.tp_rank, 0) + 1
            expected = count
            if len(pending) == engine.tp and all(v >= expected for v in pending.values()):
                held = self._prefill_held.pop(key, None)
                self._pending_notifs.pop(key, None)
                lease = self._leases.pop(key, None)
                if lease is not None and lease.is_alive:
                    lease.interrupt()
                if held is not None:
                    _, blocks, rec = held
                    rec.times["prefill_freed"] = self.env.now
                    self._free(engine, blocks)


def run_scenario(scenario: Scenario, *, timing_only: bool = False) -> RunResult:
    """Run one scenario on the simulated fabric (``timing_only``: move no bytes, verify none)."""
    return Cluster(scenario, timing_only=timing_only).run()
