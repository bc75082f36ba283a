"""The P/D request coordinator: every lifecycle rule written once, for every backend.

Sans-I/O, like the connector core below it: no simpy, asyncio, threads or clock. It plays the
scheduler of each engine and the proxy between them -- admission, block allocation, prefill
compute, leases and heartbeats, lazy handshakes, pull and push (registration matching in either
order), notification counting, watchdogs, aborts, the recompute policy, quarantine of blocks a
transfer may still write, TTL eviction and accounting -- and talks to the ranks only through
typed operations (:mod:`hkvsim.pd.ops`).

A driver feeds it inputs and carries out its effects::

    coord = Coordinator(deployment, verify=True)
    coord.set_rank_info(rank, payload=..., agent=..., agent_metadata=...)   # after registration
    coord.start(now)
    loop:
        for effect in coord.take_effects():     # Call(call_id, rank, op) and Posting(request)
            ...carry it out; later: coord.on_reply(Reply(call_id, value | error), now)
        rank events:  coord.on_event(Outcome | Message | Released | Died, now)
        time:         coord.on_timer(now) when now >= coord.next_timer()
    coord.finished(), coord.records, coord.summary()

Internally each request is a flow (:mod:`hkvsim.pd.sched`) that reads top to bottom; where it is
is tracked in an explicit state table (:mod:`hkvsim.pd.state`). Time is whatever ``now`` the
driver passes: simulated seconds on the simulated fabric, wall seconds on real NIXL.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np

from ..connector.blocks import expand_logical, to_sub_blocks
from ..connector.push import PUSH_PREFIX, PushRegistration, WriteRequest, base_request_id
from ..connector.tp import TPError, handshake_targets
from ..connector.worker import ReadRequest, RequestOutcome, parse_notification
from ..workload import hit_rounding_warnings
from .deployment import Deployment, EngineSpec
from .ops import (
    Abort,
    Connect,
    ConnectNotifyOnly,
    Died,
    Evict,
    Message,
    OracleWrite,
    Outcome,
    PostProcess,
    RankError,
    RankEvent,
    RankId,
    RankOp,
    Released,
    Reply,
    SendNotif,
    StartRead,
    StartWrite,
    Verify,
    WriteStale,
)
from .pool import EnginePool, freed_while_reading
from .records import DecodeJob, RequestRecord
from .sched import Flow, Scheduler, Signal
from .state import TERMINAL_STATUS, Phase, check_transition

__all__ = ["Coordinator", "Call", "Posting", "Effect", "COUNTERS"]

log = logging.getLogger("hkvsim.pd")

COUNTERS = ("lease_expiries", "late_notifications", "notifications", "malformed_registrations",
            "notification_failures", "recomputed", "handshakes", "evictions", "late_landings",
            "stray_writes", "quarantined_blocks")
_IN_FLIGHT = -1  # _live entry of a rank whose transfers have not reported an outcome yet


# ---- effects --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Call:
    """Carry out ``op`` on ``rank``; answer with ``Coordinator.on_reply(Reply(call_id, ...))``."""

    call_id: int
    rank: RankId
    op: RankOp


@dataclass(frozen=True)
class Posting:
    """Request ``request`` is about to post its transfers (faults that strike "when the request
    starts moving" -- killing a rank process -- key on this; carry it out before the calls that
    follow it)."""

    request: int


Effect = Union[Call, Posting]


class _Failed(Exception):
    """A step of a request's flow failed on a rank (it died, or could not carry out a call)."""

    def __init__(self, failure_class: str, reason: str) -> None:
        super().__init__(reason)
        self.failure_class, self.reason = failure_class, reason


# ---- per-engine and per-request state -------------------------------------------------------
@dataclass(eq=False)
class _Engine:
    spec: EngineSpec
    pool: EnginePool
    freed: Signal
    payloads: dict[int, bytes] = field(default_factory=dict)
    agents: dict[int, str] = field(default_factory=dict)
    agent_metadata: dict[int, bytes] = field(default_factory=dict)
    connections: dict[str, Signal] = field(default_factory=dict)  # remote -> error | None
    last_used: dict[str, float] = field(default_factory=dict)
    loading: dict[str, tuple[str, str]] = field(default_factory=dict)  # d rid -> p engine, p rid
    heartbeat: bool = False
    dead: dict[int, str] = field(default_factory=dict)  # rank -> why (agent or process)
    # ranks whose process died, not only their agent: they compute nothing any more
    processes_dead: set[int] = field(default_factory=set)

    @property
    def engine_id(self) -> str:
        return self.spec.engine_id

    @property
    def role(self) -> str:
        return self.spec.role

    @property
    def tp(self) -> int:
        return self.spec.tp

    @property
    def layout(self) -> Any:
        return self.spec.layout

    def ranks(self) -> list[RankId]:
        return [(self.engine_id, r) for r in range(self.tp)]


@dataclass(eq=False)
class _Hold:
    """Prefill keeps a finished request's blocks until its notifications arrive or its lease
    (moved by heartbeats) expires."""

    engine: _Engine
    blocks: dict[int, np.ndarray]
    rec: RequestRecord
    deadline: float
    notifications: dict[int, int] = field(default_factory=dict)  # rank -> count
    released: Signal | None = None


@dataclass(eq=False)
class _DecodeWait:
    done: Signal
    outcomes: dict[int, RequestOutcome]
    expected: int


@dataclass(eq=False)
class _PushWait:
    done: Signal  # value: None (complete) or (failure class, reason)
    decode: _Engine
    counts: dict[int, int]


@dataclass(eq=False)
class _Quarantine:
    rec: RequestRecord
    decode: _Engine
    blocks: dict[int, np.ndarray]
    prefill: _Engine
    prefill_request_id: str


@dataclass(eq=False)
class _Request:
    rec: RequestRecord
    phase: Phase = Phase.ARRIVING

    # succeeds (with the reason) when a rank the request is moving bytes with dies
    interrupt: Signal | None = None
    engines: tuple[str, str] = ("", "")

    def enter(self, phase: Phase) -> None:
        check_transition(self.rec.request_id, self.phase, phase)
        self.phase = phase



def _pool(scenario: Any, role: str, instance: int, layout: Any) -> EnginePool:
    """Engine ``instance`` of ``role``'s block pool, its block ids as the scenario asks (a
    warmed pool is churned by a seeded warm-up, one stream per engine)."""
    section = getattr(scenario, role)
    seed = np.random.SeedSequence([scenario.scenario.seed, ROLES_ORDER.index(role), instance])
    return EnginePool(layout, block_ids=section.block_ids, warmup=section.warmup,
                      seed=int(seed.generate_state(1)[0]))


ROLES_ORDER = ("prefill", "decode")

class Coordinator:
    """One run's request lifecycle (see the module docstring)."""

    def __init__(self, deployment: Deployment, *, verify: bool, faults: Any = None) -> None:
        self.dep = deployment
        self.scenario = deployment.scenario
        self.verify = verify
        self.faults = faults  # hkvsim.faults.FaultPlan: abort-request, expire-lease-early
        self.sched = Scheduler()
        self.engines: dict[str, list[_Engine]] = {
            role: [_Engine(spec=spec, pool=_pool(self.scenario, role, i, spec.layout),
                           freed=self.sched.signal())
                   for i, spec in enumerate(specs)] for role, specs in deployment.engines.items()}
        self._by_id = {e.engine_id: e for es in self.engines.values() for e in es}
        self.records: list[RequestRecord] = []
        self._requests: list[_Request] = []
        self.handshake_errors: list[str] = []
        self.counters: dict[str, int] = {name: 0 for name in COUNTERS}
        self.misplaced_write_reports: list[str] = []
        self._effects: list[Effect] = []
        self._calls: dict[int, Signal] = {}
        self._call_rank: dict[int, RankId] = {}
        self._next_call = 1
        self._slots_free = 0
        self._slot_waiters: list[Signal] = []
        # prefill holds, push bookkeeping, decode waits
        self._holds: dict[tuple[str, str], _Hold] = {}
        self._decode_waiters: dict[str, _DecodeWait] = {}
        self._published: dict[tuple[str, str], tuple[str, dict[int, np.ndarray],
                                                     RequestRecord]] = {}
        self._deferred: dict[tuple[str, str], list[tuple[int, PushRegistration]]] = {}
        self._write_outcomes: dict[tuple[str, str], dict[int, RequestOutcome]] = {}
        self._registration_ids: dict[tuple[str, str], str] = {}
        self._push_waiters: dict[str, _PushWait] = {}
        self._cancelled_pushes: set[str] = set()
        self._writes_pending: dict[str, int] = {}
        # transfers that may still write: (engine, request id) -> rank -> live handles
        self._live: dict[tuple[str, str], dict[int, int]] = {}
        self._quarantine: dict[str, _Quarantine] = {}
        self._activity = self.sched.signal()
        self._started = False
        # called with a request's record when its flow ends (progress reporting)
        self.on_request_end: Callable[[RequestRecord], None] | None = None

    # ---- driver API -----------------------------------------------------------------------
    def set_rank_info(self, rank: RankId, *, payload: bytes, agent: str,
                      agent_metadata: bytes) -> None:
        """What a rank published after registering its memory: its handshake payload and its
        agent's name and metadata."""
        engine = self._by_id[rank[0]]
        engine.payloads[rank[1]] = payload
        engine.agents[rank[1]] = agent
        engine.agent_metadata[rank[1]] = agent_metadata

    def start(self, now: float) -> None:
        """Create the requests (their ids draw from the scenario's generator, after the
        workload) and start their flows."""
        if self._started:
            raise RuntimeError("start() twice")
        self._started = True
        self.sched.advance(now)
        wl = self.scenario.workload
        arrivals = self.scenario.arrival_times(len(self.dep.prompts), self.dep.rng)
        self._slots_free = wl.max_inflight or len(self.dep.prompts)
        for i, (n, hit) in enumerate(zip(self.dep.prompts.tolist(), self.dep.hits.tolist())):
            rec = RequestRecord(index=i, request_id=f"req-{i}-{self._suffix()}",
                                prompt_tokens=int(n), prefix_hit_tokens=int(hit),
                                arrival=float(arrivals[i]))
            self.records.append(rec)
            self._requests.append(_Request(rec=rec))
            self.sched.spawn(self._request(self._requests[-1]), name=rec.request_id)
        self._run()

    def on_reply(self, reply: Reply, now: float) -> None:
        self.on_replies([reply], now)

    def on_replies(self, replies: Iterable[Reply], now: float) -> None:
        """Answers to calls. A batch answered together (in-process ranks answer at once) lets
        the flow that made the calls continue before any other flow runs."""
        self.sched.advance(max(now, self.sched.now))
        for reply in replies:
            signal = self._calls.pop(reply.call_id, None)
            if signal is None:
                if reply.call_id >= self._next_call:
                    raise KeyError(f"reply to unknown call {reply.call_id}")
                continue  # already answered: its rank died first
            del self._call_rank[reply.call_id]
            signal.succeed(reply)
        self._run()

    def on_event(self, event: RankEvent, now: float) -> None:
        self.on_events([event], now)

    def on_events(self, events: Iterable[RankEvent], now: float) -> None:
        """What ranks reported, in the order they reported it."""
        self.sched.advance(max(now, self.sched.now))
        for event in events:
            if isinstance(event, Outcome):
                self._on_outcome(event.rank, event.outcome)
            elif isinstance(event, Message):
                self._on_message(event.rank, event.message)
            elif isinstance(event, Released):
                self._on_released(event.rank, event.request_id)
            elif isinstance(event, Died):
                self._on_died(event.rank, event.reason, process=event.process)
            else:  # pragma: no cover - a driver bug
                raise TypeError(f"unknown rank event {event!r}")
        self._signal_activity()
        self._run()

    def has_effects(self) -> bool:
        """Whether effects wait to be taken (after an input: only then can flows be ready, as
        every input runs the flows until they are blocked by effects or none is ready)."""
        return bool(self._effects)

    def timers_made(self) -> int:
        """How many timers the coordinator has made so far: while unchanged, ``next_timer()``
        can only have moved later (timers only fire or are cancelled)."""
        return self.sched.timers_made

    def run_ready(self) -> None:
        """Let flows that are ready run until they need the driver (calls to carry out). The
        coordinator stops running as soon as a flow makes calls, so a driver that answers at once
        continues that flow first; call this again after carrying out the effects."""
        self._run()

    def on_timer(self, now: float) -> None:
        self.sched.advance(now)
        self._run()

    def next_timer(self) -> float | None:
        return self.sched.next_timer()

    def take_effects(self) -> list[Effect]:
        out, self._effects = self._effects, []
        return out

    @property
    def now(self) -> float:
        return self.sched.now

    def finished(self) -> bool:
        """Every request ended and no flow is left (holds may still wait for their leases)."""
        return self._started and all(r.phase is Phase.DONE for r in self._requests)

    def requests_in(self, phase: Phase) -> int:
        return sum(r.phase is phase for r in self._requests)

    def pending_calls(self) -> int:
        return len(self._calls)

    def engine(self, engine_id: str) -> _Engine:
        return self._by_id[engine_id]

    def all_engines(self) -> list[_Engine]:
        return [e for role in ("prefill", "decode") for e in self.engines[role]]

    def holds(self) -> list[tuple[str, str]]:
        """Prefill holds still waiting for notifications or their lease."""
        return list(self._holds)

    def expire_holds(self) -> None:
        """End every hold now, as if its lease expired at its deadline (a driver in wall-clock
        time uses this once no request can still notify, instead of sleeping out leases)."""
        for key in list(self._holds):
            self._expire(key, at=self._holds[key].deadline)
        self._run()

    def give_up(self, failure_class: str, reason: str) -> None:
        """The driver ends the run early (a deadline, a broken launch): every request not ended
        yet fails with ``reason`` (reported once, like any failure)."""
        for rec in self.records:
            self._fail(rec, failure_class, reason)

    def leaks(self) -> dict[str, int]:
        return {
            "prefill_blocks": sum(e.pool.used for e in self.engines["prefill"]),
            "decode_blocks": sum(e.pool.used for e in self.engines["decode"]),
            "quarantined_blocks": sum(sum(len(b) for b in q.blocks.values())
                                      for q in self._quarantine.values()),
        }

    def warnings(self) -> list[str]:
        """What the run did differently from what the scenario asked (logged once each)."""
        from ..implementations.vllm.run import undriven_abort_warnings  # no vLLM import

        return (hit_rounding_warnings(self.scenario, self.records,
                                      self.dep.engines["decode"][0].layout)
                + undriven_abort_warnings(self.scenario))

    def makespan(self) -> float:
        """Time of the last request event (timers of a finished run are not part of it)."""
        ends = [t for r in self.records for k, t in r.times.items()
                if k in ("done", "prefill_freed", "lease_expired")]
        return float(max(ends, default=0.0))

    def note_misplaced_write(self, owner: int, agent: str, blocks: int, *,
                             victims: Iterable[int], where: list[str], landed: bool) -> None:
        """A transfer for request ``owner`` was posted into (``landed`` False: a stray write) or
        landed in (a late landing) blocks its request does not hold -- what the simulated
        fabric's landing guard sees. Count it; a verified request it hit is corrupted now."""
        self.counters["late_landings" if landed else "stray_writes"] += 1
        verb = "landed in" if landed else "was posted into"
        text = (f"a transfer for request {owner} {verb} {blocks} block(s) of {agent} it does "
                f"not own (held by {', '.join(where)})")
        log.warning("%s: %s", "late landing" if landed else "stray write", text)
        if len(self.misplaced_write_reports) < 16:
            self.misplaced_write_reports.append(text)
        for v in victims:
            victim = self.records[v]
            if victim.status == "ok":  # verified already: the late bytes corrupt it now
                victim.overwritten_by.append(int(owner))
                victim.mismatches.append(f"late landing: {text}")

    # ---- internals: scheduling and calls ----------------------------------------------------
    def _run(self) -> None:
        self.sched.run(until_blocked=self._blocked)

    def _blocked(self) -> bool:
        """Calls wait to be carried out: the driver must act before flows run on."""
        return bool(self._effects)

    def _suffix(self) -> str:
        """A random request-id suffix (the proxy gives P and D different ones), seeded."""
        return f"{int(self.dep.rng.integers(1 << 32)):08x}"

    def _call(self, rank: RankId, op: RankOp) -> Signal:
        call_id = self._next_call
        self._next_call += 1
        signal = self.sched.signal(urgent=True)
        self._calls[call_id] = signal
        self._call_rank[call_id] = rank
        self._effects.append(Call(call_id, rank, op))
        return signal

    def _call_all(self, ranks: Iterable[RankId], op: RankOp) -> Signal:
        return self.sched.all_of([self._call(r, op) for r in ranks], urgent=True)

    def _signal_activity(self) -> None:
        """Wake whatever waits for a transfer to end (recovery waits for its writers)."""
        if not self._activity._waiters:  # nothing waits: the signal stays as it is
            return
        old, self._activity = self._activity, self.sched.signal()
        old.succeed()

    def _alive(self, rank: RankId) -> bool:
        return rank[1] not in self._by_id[rank[0]].dead

    @staticmethod
    def _first_error(replies: Iterable[Reply], what: str) -> tuple[str, str] | None:
        """(failure class, reason) of the first call in ``replies`` a rank could not carry out."""
        for reply in replies:
            if reply.error is not None:
                return reply.error.kind, f"{what}: {reply.error.message}"
        return None

    # ---- the request flow ------------------------------------------------------------------
    def _request(self, req: _Request) -> Flow:
        rec = req.rec
        if rec.arrival > 0:
            yield self.sched.timeout(rec.arrival)
        req.enter(Phase.QUEUED)
        yield self._acquire_slot()
        try:
            yield from self._serve(req)
        finally:
            self._release_slot()
        if self.on_request_end is not None:
            self.on_request_end(rec)

    def _acquire_slot(self) -> Signal:
        signal = self.sched.signal()
        if self._slots_free > 0 and not self._slot_waiters:
            self._slots_free -= 1
            signal.succeed()
        else:
            self._slot_waiters.append(signal)
        return signal

    def _release_slot(self) -> None:
        if self._slot_waiters:
            self._slot_waiters.pop(0).succeed()
        else:
            self._slots_free += 1

    def _serve(self, req: _Request) -> Flow:
        rec = req.rec
        prefills, decodes = self.engines["prefill"], self.engines["decode"]
        prefill, decode = prefills[rec.index % len(prefills)], decodes[rec.index % len(decodes)]
        rec.prefill_engine, rec.decode_engine = prefill.engine_id, decode.engine_id
        req.engines = (prefill.engine_id, decode.engine_id)
        rec.times["start"] = self.now
        abort = self.faults.abort_phase(rec.index) if self.faults is not None else None
        try:
            p_rid, p_blocks = yield from self._prefill(req, prefill,
                                                       finish_normally=abort != "on-prefill")
        except _Failed as failed:
            self._fail(rec, failed.failure_class, failed.reason)
            req.enter(Phase.DONE)
            return
        if abort == "on-prefill":  # prefill finished abnormally: no lease, blocks dropped
            self._abort(rec, abort)
            req.enter(Phase.DONE)
            return
        versions = prefill.pool.versions(p_blocks)
        req.enter(Phase.DECODE_BLOCKS)
        if abort == "before-scheduling":
            job = DecodeJob(blocks={}, load={g.group_id: np.zeros(0, np.int64)
                                             for g in decode.layout.groups},
                            hit_blocks=0, prompt_tokens=rec.prompt_tokens,
                            load_tokens=self.dep.decode_load_tokens(rec.prompt_tokens))
            req.enter(Phase.DECODE_FILL)
        else:
            job = yield from self._decode_allocate(req, decode)
        if abort == "during-handshake":
            job.load = {g: ids[:0] for g, ids in job.load.items()}
        tail = self._zeroed_tail(prefill, decode, job)
        if tail is not None and self.verify:
            # reused blocks hold an earlier tenant's bytes where nothing is transferred (the
            # reference does not zero at allocation): the connector must zero them
            replies = yield self._call_all(decode.ranks(), WriteStale(
                request=rec.index, blocks=job.blocks, tokens=tail))
            job.failure = self._first_error(replies, "decode could not fill its blocks")
        if job.failure is not None:  # decode's prefix fill failed on a rank
            self._fail(rec, *job.failure)
            req.enter(Phase.RELEASING)
            self._release_decode(rec, decode, job.blocks, prefill, p_rid)
            req.enter(Phase.DONE)
            return
        dead = [r for r in range(decode.tp) if r in decode.dead]
        failure: tuple[str, str] | None
        if dead:
            failure = ("remote_disconnect", f"decode rank {decode.engine_id}.{dead[0]} is dead "
                       f"({decode.dead[dead[0]]})")
        else:
            req.enter(Phase.CONNECTING)
            self._start_loading(decode, rec, prefill, p_rid)
            transfer = self._push if self.scenario.connector.mode == "push" else self._pull
            failure = yield from transfer(req, prefill, decode, p_rid, p_blocks, job,
                                          abort_mid_transfer=abort == "mid-transfer")
            decode.loading.pop(rec.request_id, None)
            if failure is None and rec.transfers:
                failure = freed_while_reading(prefill.engine_id, prefill.pool.version,
                                              p_blocks, versions)
        if abort is not None:
            # the empty receive (before scheduling / during the handshake) only notified
            # prefill; an abandoned transfer was waited out before its blocks are freed
            self._abort(rec, abort)
        elif failure is not None:
            recovered = yield from self._recover(req, decode, job, failure, prefill, p_rid)
            if not recovered:
                self._fail(rec, *failure)
        if rec.status == "pending":
            req.enter(Phase.FINISHING)
            yield from self._post_process(prefill, decode, job)
            yield from self._verify_and_compute(rec, decode, job, prefill)
            if rec.status == "pending":
                rec.status = "ok"
                rec.times["done"] = self.now
        req.enter(Phase.RELEASING)
        self._release_decode(rec, decode, job.blocks, prefill, p_rid)
        req.enter(Phase.DONE)

    def _abort(self, rec: RequestRecord, phase: str) -> None:
        if rec.status == "pending":
            rec.status, rec.failure_class = "aborted", f"aborted {phase}"
            rec.times["done"] = self.now

    def _fail(self, rec: RequestRecord, failure_class: str, reason: str) -> None:
        if rec.status == "pending":  # report once
            rec.status, rec.failure_class, rec.reason = "failed", failure_class, reason
            rec.times["done"] = self.now
        assert rec.status in TERMINAL_STATUS

    # ---- blocks -----------------------------------------------------------------------------
    def _allocate(self, engine: _Engine, n_attention: int, owner: int) -> Flow:
        while not engine.pool.can_allocate(n_attention):
            yield engine.freed
        return engine.pool.allocate(n_attention, owner)

    def _free(self, engine: _Engine, blocks: dict[int, np.ndarray], *, stamp: bool = True
              ) -> None:
        engine.pool.free(blocks, stamp=stamp)
        old, engine.freed = engine.freed, self.sched.signal()
        old.succeed()

    # ---- prefill ----------------------------------------------------------------------------
    def _prefill(self, req: _Request, prefill: _Engine, *, finish_normally: bool = True) -> Flow:
        """Allocate, compute (write the pattern) and finish under a lease. Models with state
        compute N-1 tokens (docs/semantics.md §6); the others all N."""
        rec = req.rec
        n_tokens = self.dep.prefill_tokens(rec.prompt_tokens)
        layout = prefill.layout
        req.enter(Phase.PREFILL_BLOCKS)
        p_blocks = yield from self._allocate(prefill, layout.blocks_for_tokens(n_tokens),
                                             rec.index)
        req.enter(Phase.PREFILLING)
        p_rid = f"{base_request_id(rec.request_id)}-{self._suffix()}"
        if self.verify:
            replies = yield self._call_all(prefill.ranks(), OracleWrite(
                request=rec.index, blocks=p_blocks, tokens=(0, n_tokens),
                state_step=n_tokens if layout.is_hybrid else None))
            failure = self._first_error(replies, "prefill could not compute")
            if failure is not None:
                self._free(prefill, p_blocks)
                raise _Failed(*failure)
        if not finish_normally:  # only LENGTH_CAPPED / STOPPED requests get a lease (§8.1)
            self._free(prefill, p_blocks)
            return p_rid, p_blocks
        lease = self.scenario.connector.lease_seconds
        if self.faults is not None:
            lease = self.faults.lease_for(rec.index, lease)
        key = (prefill.engine_id, p_rid)
        hold = _Hold(engine=prefill, blocks=p_blocks, rec=rec, deadline=self.now + lease,
                     released=self.sched.signal())
        self._holds[key] = hold
        self.sched.spawn(self._lease(key, hold), name=f"lease {p_rid}")
        rec.times["prefill_done"] = self.now
        if self.scenario.connector.mode == "push":
            self._publish(prefill, p_rid, p_blocks, rec)
        return p_rid, p_blocks

    def _lease(self, key: tuple[str, str], hold: _Hold) -> Flow:
        """Prefill holds a finished request's blocks until its notifications arrive or the
        lease deadline passes; decode's heartbeats move the deadline (docs/semantics.md §9.1)."""
        assert hold.released is not None
        while True:
            timer = self.sched.at(hold.deadline)
            fired = yield self.sched.any_of([timer, hold.released])
            if fired is hold.released:
                return
            if hold.deadline <= self.now:
                break
        self._expire(key, at=self.now)

    def _expire(self, key: tuple[str, str], *, at: float) -> None:
        hold = self._holds.pop(key, None)
        if hold is None:
            return
        if hold.released is not None:
            hold.released.succeed()
        self.counters["lease_expiries"] += 1
        rec = hold.rec
        rec.freed_by_lease = True
        rec.times["lease_expired"] = at
        log.info("lease expired for %s on %s: freed %d blocks", key[1], key[0],
                 sum(len(b) for b in hold.blocks.values()))
        self._free(hold.engine, hold.blocks)

    def _release_prefill(self, engine: _Engine, p_rid: str, *, stamp: bool = True) -> None:
        """Free a finished request's prefill blocks before its lease expires."""
        hold = self._holds.pop((engine.engine_id, p_rid), None)
        if hold is None:
            return
        if hold.released is not None:
            hold.released.succeed()
        hold.rec.times["prefill_freed"] = self.now
        self._free(engine, hold.blocks, stamp=stamp)

    # ---- decode allocation ------------------------------------------------------------------
    def _decode_allocate(self, req: _Request, decode: _Engine) -> Flow:
        """Allocate decode's blocks for the whole prompt and apply its prefix-cache hit.

        A model with state loads tokens [hit, N-1) and computes token N itself (§6); a model
        without state loads [hit, N), as decode's scheduler matches every prompt token it has not
        cached (it recomputes token N over the same KV). The load list is the uncached blocks up
        to that token; a hit is whole logical blocks of at most N-1 tokens (decode's own cache
        never matches the last one). A hit that covers every token to load is a full hit: for a
        model with state the cached prefix includes the state checkpoint at its end, so nothing
        is transferred (notification only); a model without state always loads token N."""
        rec = req.rec
        layout = decode.layout
        blocks = yield from self._allocate(decode, layout.blocks_for_tokens(rec.prompt_tokens),
                                           rec.index)
        req.enter(Phase.DECODE_FILL)
        load_tokens = self.dep.decode_load_tokens(rec.prompt_tokens)
        hit_blocks = min(rec.prefix_hit_tokens, rec.prompt_tokens - 1) // layout.logical_block_size
        hit_tokens = hit_blocks * layout.logical_block_size
        rec.effective_prefix_hit_tokens = hit_tokens
        full_hit = hit_tokens >= load_tokens
        failure = None
        if self.verify and hit_blocks:
            replies = yield self._call_all(decode.ranks(), OracleWrite(
                request=rec.index, blocks=blocks, tokens=(0, hit_tokens),
                state_step=hit_tokens if full_hit and layout.is_hybrid else None))
            failure = self._first_error(replies, "decode could not load its prefix cache")
        load: dict[int, np.ndarray] = {}
        for group in layout.groups:
            ids = blocks[group.group_id]
            if group.kind == "attention":
                ids = ids[hit_blocks:layout.blocks_for_tokens(load_tokens)]
            elif full_hit:
                ids = ids[:0]
            load[group.group_id] = ids
        return DecodeJob(blocks=blocks, load=load, hit_blocks=hit_blocks,
                         prompt_tokens=rec.prompt_tokens, load_tokens=load_tokens,
                         failure=failure)

    # ---- handshakes -------------------------------------------------------------------------
    def _connect(self, local: _Engine, remote: _Engine, rec: RequestRecord) -> Flow:
        """Lazy handshake of ``local``'s ranks with ``remote`` on first use of the pair
        (decode with prefill in pull; prefill's reverse handshake with decode in push);
        concurrent requests wait for the same one. Returns the refusal, or None."""
        event = local.connections.get(remote.engine_id)
        if event is None:
            yield from self._evict_stale(local)
            event = self.sched.signal()
            local.connections[remote.engine_id] = event
            self.counters["handshakes"] += 1
            start = self.now
            replies = yield self._call_all(local.ranks(), Connect(
                remote_engine=remote.engine_id, payloads=dict(remote.payloads)))
            error = next((r.value if r.error is None else r.error.message
                          for r in replies if r.error is not None or r.value), None)
            if error is not None:
                arrow = "<-" if local.role == "decode" else "->"
                pair = (f"{local.engine_id} {arrow} {remote.engine_id}" if local.role == "decode"
                        else f"{remote.engine_id} <- {local.engine_id} (push)")
                self.handshake_errors.append(f"{pair}: {error}")
            # a push request runs two: decode's notification-only one and prefill's reverse one
            rec.times["handshake"] = rec.times.get("handshake", 0.0) + self.now - start
            event.succeed(error)
        elif not event.triggered:
            yield event
        local.last_used[remote.engine_id] = self.now
        return event.value

    def _evict_stale(self, local: _Engine) -> Flow:
        """Evict remote engines idle past the TTL; checked only when a new handshake starts, so a
        fixed pair never evicts a dead peer (docs/semantics.md §9.4)."""
        ttl = self.scenario.connector.engine_ttl_seconds
        for remote, last in list(local.last_used.items()):
            event = local.connections.get(remote)
            if self.now - last > ttl and event is not None and event.triggered:
                yield self._call_all(local.ranks(), Evict(engine=remote))
                del local.connections[remote], local.last_used[remote]
                self.counters["evictions"] += 1
                log.info("%s evicted idle engine %s", local.engine_id, remote)

    # ---- pull -------------------------------------------------------------------------------
    def _pull(self, req: _Request, prefill: _Engine, decode: _Engine, p_rid: str,
              p_blocks: dict[int, np.ndarray], job: DecodeJob, *,
              abort_mid_transfer: bool = False) -> Flow:
        """Pull (docs/semantics.md §8.1); returns None on success, else (failure class, reason).

        ``abort_mid_transfer``: decode abandons the request right after posting; its handles
        are released only once terminal (DMA may be live), so its blocks wait for them."""
        rec = req.rec
        error = yield from self._connect(decode, prefill, rec)
        if error is not None:
            return ("handshake_failed", error)
        req.enter(Phase.TRANSFERRING)
        read = ReadRequest(request_id=rec.request_id, prefill_request_id=p_rid,
                           remote_engine=prefill.engine_id, prefill_blocks=p_blocks,
                           decode_blocks=job.load, decode_hit_blocks=job.hit_blocks,
                           prefill_tokens=self.dep.prefill_tokens(rec.prompt_tokens))
        rec.times["transfer_start"] = self.now
        wait = _DecodeWait(done=self.sched.signal(), outcomes={}, expected=decode.tp)
        self._decode_waiters[rec.request_id] = wait
        live = self._live.setdefault((decode.engine_id, rec.request_id), {})
        for rank in range(decode.tp):
            live[rank] = _IN_FLIGHT
        req.interrupt = self.sched.signal()
        self._effects.append(Posting(rec.index))
        replies = yield self._call_all(decode.ranks(), StartRead(request=rec.index, read=read))
        for rank, reply in enumerate(replies):
            outcome = self._reply_outcome(reply, rec.request_id)
            if outcome is not None:
                self._set_live(decode.engine_id, rec.request_id, rank, outcome.unreleased)
                self._collect(rec.request_id, rank, outcome)
        if abort_mid_transfer:
            self._abort(rec, "mid-transfer")
        timeout = self.scenario.connector.transfer_timeout_seconds
        timer = self.sched.timeout(timeout)
        # a death already known wins over outcomes it caused (they name NIXL's error, not it)
        fired = yield self.sched.any_of([req.interrupt, wait.done, timer])
        req.interrupt = None
        rec.times["transfer_done"] = self.now
        if fired is not wait.done:
            # the watchdog (a transfer stuck in PROC becomes a failure), or a rank the request
            # moves bytes with died: give up on what is still in flight
            self._decode_waiters.pop(rec.request_id, None)
            alive = [r for r in decode.ranks() if self._alive(r)]
            cause = ("stall", "watchdog") if fired is timer else ("remote_disconnect", fired.value)
            replies = yield self._call_all(alive, Abort(
                request_id=rec.request_id, reason=cause[1], failure_class=cause[0]))
            for (_, rank), reply in zip(alive, replies):
                aborted = self._reply_outcome(reply, rec.request_id)
                if aborted is not None:
                    self._set_live(decode.engine_id, rec.request_id, rank, aborted.unreleased)
                    wait.outcomes.setdefault(rank, aborted)
            self._account(rec, wait.outcomes.values())
            if fired is timer:
                return ("stall", f"transfer still in progress after {timeout:g} s (watchdog)")
            return cause
        self._account(rec, wait.outcomes.values())
        failures = [o for o in wait.outcomes.values() if not o.ok]
        if failures:
            return (failures[0].failure_class or "transfer_failed",
                    failures[0].reason or "transfer failed")
        return None

    def _reply_outcome(self, reply: Reply, request_id: str) -> RequestOutcome | None:
        """A start/abort reply's immediate outcome; a rank that could not carry out the call
        (it died, or raised) gives a failed outcome naming why."""
        if reply.error is not None:
            return RequestOutcome(request_id=request_id, ok=False, reason=reply.error.message,
                                  failure_class=reply.error.kind)
        return reply.value

    def _collect(self, rid: str, rank: int, outcome: RequestOutcome) -> None:
        wait = self._decode_waiters.get(rid)
        if wait is None:
            return
        wait.outcomes[rank] = outcome
        if len(wait.outcomes) == wait.expected:
            del self._decode_waiters[rid]
            wait.done.succeed()

    # ---- push -------------------------------------------------------------------------------
    def _push(self, req: _Request, prefill: _Engine, decode: _Engine, p_rid: str,
              p_blocks: dict[int, np.ndarray], job: DecodeJob, *,
              abort_mid_transfer: bool = False) -> Flow:
        """Push (docs/semantics.md §8.2): decode registers its blocks with every prefill rank; prefill
        matches the registration to its finished request (either order), runs the reverse
        handshake and WRITEs; decode counts max(1, P_TP // D_TP) notifications per rank."""
        rec = req.rec
        first = (decode.engine_id, 0)
        key = f"notify:{prefill.engine_id}"
        event = decode.connections.get(key)
        if event is None:  # decode's notification-only handshake: agents, no descriptors
            event = self.sched.signal()
            decode.connections[key] = event
            start = self.now
            reply = yield self._call(first, ConnectNotifyOnly(
                remote_engine=prefill.engine_id,
                agent_metadata=tuple(prefill.agent_metadata[r] for r in range(prefill.tp))))
            rec.times["handshake"] = rec.times.get("handshake", 0.0) + self.now - start
            event.succeed(None if reply.error is None else reply.error.message)
        elif not event.triggered:
            yield event
        if event.value is not None:
            return ("handshake_failed", f"notification handshake with {prefill.engine_id} "
                    f"failed: {event.value}")
        req.enter(Phase.TRANSFERRING)
        registration = PushRegistration(
            decode_request_id=rec.request_id, decode_engine=decode.engine_id,
            decode_tp=decode.tp, prefill_engine=prefill.engine_id, blocks=job.load,
            hit_blocks=job.hit_blocks)
        rec.times["transfer_start"] = self.now
        wait = _PushWait(done=self.sched.signal(), decode=decode, counts={})
        self._push_waiters[rec.request_id] = wait
        req.interrupt = self.sched.signal()
        self._effects.append(Posting(rec.index))
        reply = yield self._call(first, SendNotif(
            agents=tuple(prefill.agents[r] for r in range(prefill.tp)),
            message=registration.encode(), stop_at_failure=True))
        failed = [(reply.error.kind, reply.error.message)] if reply.error is not None else [
            (kind, text) for _, kind, text in reply.value]
        if failed:
            req.interrupt = None
            self._push_waiters.pop(rec.request_id, None)
            self._cancel_push(prefill, rec.request_id)
            return (failed[0][0], f"push registration not delivered: {failed[0][1]}")
        if abort_mid_transfer:  # decode abandons; prefill's WRITEs still land in its blocks
            self._abort(rec, "mid-transfer")
        timeout = self.scenario.connector.transfer_timeout_seconds
        timer = self.sched.timeout(timeout)
        fired = yield self.sched.any_of([req.interrupt, wait.done, timer])
        req.interrupt = None
        self._push_waiters.pop(rec.request_id, None)
        rec.times["transfer_done"] = self.now
        if fired is not wait.done:
            self._cancel_push(prefill, rec.request_id)
            if fired is timer:
                return ("stall", f"push: no WRITE completed within {timeout:g} s (decode "
                        f"watchdog)")
            return ("remote_disconnect", fired.value)
        if wait.done.value is not None:
            self._cancel_push(prefill, rec.request_id)
        return wait.done.value

    def _publish(self, prefill: _Engine, p_rid: str, p_blocks: dict[int, np.ndarray],
                 rec: RequestRecord) -> None:
        """Push: prefill publishes a finished request; a registration that arrived first waits
        in the deferred inbox."""
        key = (prefill.engine_id, base_request_id(p_rid))
        self._published[key] = (p_rid, p_blocks, rec)
        for rank, registration in self._deferred.pop(key, []):
            self._start_write(prefill, rank, registration, p_rid, p_blocks, rec)

    def _on_registration(self, prefill: _Engine, rank: int, registration: PushRegistration
                         ) -> None:
        """Match by exact request id, then by base id with the random suffix stripped."""
        if registration.decode_request_id in self._cancelled_pushes:
            return  # decode gave up on it: its blocks must not be written any more
        key = (prefill.engine_id, base_request_id(registration.decode_request_id))
        published = self._published.get((prefill.engine_id, registration.decode_request_id),
                                         self._published.get(key))
        if published is None:
            self._deferred.setdefault(key, []).append((rank, registration))
            return
        p_rid, p_blocks, rec = published
        self._start_write(prefill, rank, registration, p_rid, p_blocks, rec)

    def _start_write(self, prefill: _Engine, rank: int, registration: PushRegistration,
                     p_rid: str, p_blocks: dict[int, np.ndarray], rec: RequestRecord) -> None:
        rid = registration.decode_request_id
        self._writes_pending[rid] = self._writes_pending.get(rid, 0) + 1
        self.sched.spawn(self._write(prefill, rank, registration, p_rid, p_blocks, rec),
                         name=f"write {p_rid}.{rank}")

    def _cancel_push(self, prefill: _Engine, decode_request_id: str) -> None:
        """Decode gave up on a push request: registrations for it that prefill has not acted on
        yet are dropped, so no WRITE is posted into blocks decode is about to release."""
        self._cancelled_pushes.add(decode_request_id)
        key = (prefill.engine_id, base_request_id(decode_request_id))
        waiting = [(r, reg) for r, reg in self._deferred.get(key, [])
                   if reg.decode_request_id != decode_request_id]
        if waiting:
            self._deferred[key] = waiting
        else:
            self._deferred.pop(key, None)

    def _write(self, prefill: _Engine, rank: int, registration: PushRegistration, p_rid: str,
               p_blocks: dict[int, np.ndarray], rec: RequestRecord) -> Flow:
        decode = self._by_id[registration.decode_engine]
        rid = registration.decode_request_id
        try:
            error = yield from self._connect(prefill, decode, rec)
            key = (prefill.engine_id, p_rid)
            if error is not None:
                self._push_result(rid, ("handshake_failed", error))
                return
            if rid in self._cancelled_pushes:
                return  # decode gave up while the reverse handshake ran: post nothing
            self._registration_ids[key] = rid
            self._set_live(prefill.engine_id, p_rid, rank, _IN_FLIGHT)
            reply = yield self._call((prefill.engine_id, rank), StartWrite(
                request=rec.index, write=WriteRequest(prefill_request_id=p_rid,
                                                      registration=registration,
                                                      prefill_blocks=p_blocks)))
            self._write_outcomes.setdefault(key, {})
            outcome = self._reply_outcome(reply, p_rid)
            if outcome is not None:
                self._set_live(prefill.engine_id, p_rid, rank, outcome.unreleased)
                self._collect_write(prefill, rank, outcome)
        finally:
            left = self._writes_pending.get(rid, 1) - 1
            if left:
                self._writes_pending[rid] = left
            else:
                self._writes_pending.pop(rid, None)
                self._check_quarantine()
                self._signal_activity()

    def _collect_write(self, prefill: _Engine, rank: int, outcome: RequestOutcome) -> None:
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
        if wait is not None:
            wait.done.succeed(failure)

    def _on_push_notification(self, decode: _Engine, rank: int, rid: str, sender_world: int
                              ) -> bool:
        """Decode counts "{D_request_id}:{P_world_size}"; each rank expects
        max(1, P_TP // D_TP) (docs/semantics.md §8.2)."""
        wait = self._push_waiters.get(rid)
        if wait is None:
            return False
        self.counters["notifications"] += 1
        wait.counts[rank] = wait.counts.get(rank, 0) + 1
        expected = max(1, sender_world // decode.tp)
        if len(wait.counts) == decode.tp and all(v >= expected for v in wait.counts.values()):
            wait.done.succeed(None)
        return True

    # ---- events from ranks ------------------------------------------------------------------
    def _on_outcome(self, rank: RankId, outcome: RequestOutcome) -> None:
        engine = self._by_id[rank[0]]
        self._set_live(engine.engine_id, outcome.request_id, rank[1], outcome.unreleased)
        if engine.role == "decode":
            self._collect(outcome.request_id, rank[1], outcome)
        else:  # push WRITEs
            self._collect_write(engine, rank[1], outcome)
        self._check_quarantine()

    def _on_released(self, rank: RankId, request_id: str) -> None:
        self._set_live(rank[0], request_id, rank[1], 0)
        self._check_quarantine()

    def _on_died(self, rank: RankId, reason: str, *, process: bool) -> None:
        engine = self._by_id[rank[0]]
        engine.dead.setdefault(rank[1], reason)
        if process:
            engine.processes_dead.add(rank[1])
        for req in self._requests:  # requests moving bytes with it fail now, naming the death
            if req.interrupt is not None and rank[0] in req.engines:
                req.interrupt.succeed(reason)
        for key in [k for k in self._live if k[0] == rank[0]]:  # no DMA from a dead process
            self._set_live(key[0], key[1], rank[1], 0)
        # calls the dead rank will never answer
        for call_id, who in list(self._call_rank.items()):
            if who == rank:
                signal = self._calls.pop(call_id)
                del self._call_rank[call_id]
                signal.succeed(Reply(call_id, error=RankError("remote_disconnect", reason)))
        self._check_quarantine()

    def _on_message(self, rank: RankId, message: bytes) -> None:
        engine = self._by_id[rank[0]]
        if engine.role == "decode":
            parsed = parse_notification(message)
            if parsed is None or not self._on_push_notification(engine, rank[1], *parsed):
                self.counters["late_notifications"] += 1
            return
        if message.startswith(b"HB:"):
            self._on_heartbeat(engine, message)
            return
        if message.startswith(PUSH_PREFIX):
            registration = PushRegistration.decode(message)
            if registration is None:
                self.counters["malformed_registrations"] += 1
                log.warning("malformed push registration dropped on %s.%d", *rank)
            else:
                self._on_registration(engine, rank[1], registration)
            return
        parsed = parse_notification(message)
        if parsed is None:
            self.counters["late_notifications"] += 1
            return
        rid, count = parsed
        self.counters["notifications"] += 1
        hold = self._holds.get((engine.engine_id, rid))
        if hold is None:
            self.counters["late_notifications"] += 1
            log.info("notification for unknown request %s on %s.%d ignored", rid, *rank)
            return
        hold.notifications[rank[1]] = hold.notifications.get(rank[1], 0) + 1
        if len(hold.notifications) == engine.tp and all(v >= count for v in
                                                        hold.notifications.values()):
            # No version stamp: a READ's notification is sent only once the READ is DONE (by
            # NIXL, and by the simulated transport), so this free cannot overlap it -- though in
            # wall-clock time it can reach the coordinator before decode's completion report
            # does. Frees that can overlap a transfer (lease expiry) stamp.
            self._release_prefill(engine, rid, stamp=False)

    # ---- heartbeats -------------------------------------------------------------------------
    def _on_heartbeat(self, prefill: _Engine, message: bytes) -> None:
        """'HB:r1,r2,...': each listed lease deadline becomes max(old, now + 2/3 lease)."""
        lease = self.scenario.connector.lease_seconds
        for rid in message[3:].decode(errors="replace").split(","):
            hold = self._holds.get((prefill.engine_id, rid))
            if hold is not None:
                hold.deadline = max(hold.deadline, self.now + 2 * lease / 3)

    def _start_loading(self, decode: _Engine, rec: RequestRecord, prefill: _Engine,
                       p_rid: str) -> None:
        decode.loading[rec.request_id] = (prefill.engine_id, p_rid)
        if not decode.heartbeat:
            decode.heartbeat = True
            self.sched.spawn(self._heartbeats(decode), name=f"heartbeats {decode.engine_id}")

    def _heartbeats(self, decode: _Engine) -> Flow:
        """Decode sends heartbeats every lease/6 for the requests it is still loading."""
        period = self.scenario.connector.lease_seconds / 6
        try:
            while decode.loading:
                yield self.sched.timeout(period)
                by_prefill: dict[str, list[str]] = {}
                for p_engine, p_rid in decode.loading.values():
                    by_prefill.setdefault(p_engine, []).append(p_rid)
                sender = next((r for r in decode.ranks() if self._alive(r)), None)
                if sender is None:
                    return
                for p_engine, rids in by_prefill.items():
                    prefill = self._by_id[p_engine]
                    message = ("HB:" + ",".join(sorted(rids))).encode()
                    reply = yield self._call(sender, SendNotif(
                        agents=tuple(prefill.agents[r] for r in range(prefill.tp)),
                        message=message, stop_at_failure=False))
                    self.counters["notification_failures"] += (
                        prefill.tp if reply.error is not None else len(reply.value))
        finally:
            decode.heartbeat = False

    # ---- recovery, quarantine ---------------------------------------------------------------
    def _recover(self, req: _Request, decode: _Engine, job: DecodeJob,
                 failure: tuple[str, str], prefill: _Engine, p_rid: str) -> Flow:
        """kv_load_failure_policy = "recompute": decode recomputes the request itself. With HMA
        no invalid blocks are reported, and state cannot be re-zeroed, so the whole request is
        recomputed (docs/semantics.md §9.3)."""
        rec = req.rec
        if self.scenario.connector.kv_load_failure_policy != "recompute":
            return False
        if decode.processes_dead:
            # a decode rank whose process died computes nothing; one that lost only its NIXL
            # agent still recomputes (whenever its death reached the coordinator)
            return False
        req.enter(Phase.RECOVERING)
        while self._writers_live(rec, decode, prefill, p_rid):
            # a failed transfer may still write these blocks: recomputing now would be
            # overwritten by its late bytes, so wait until none can land any more
            yield self._activity
        if self.verify:
            layout = decode.layout
            replies = yield self._call_all(decode.ranks(), OracleWrite(
                request=rec.index, blocks=job.blocks, tokens=(0, job.load_tokens),
                state_step=job.load_tokens if layout.is_hybrid else None))
            if self._first_error(replies, "recompute") is not None:
                return False  # a rank could not recompute (its process died): the failure stands
        rec.recovered_from = failure[0]
        self.counters["recomputed"] += 1
        job.recomputed = True
        return True

    def _set_live(self, engine_id: str, request_id: str, rank: int, count: int) -> None:
        key = (engine_id, request_id)
        live = self._live.get(key)
        if count:
            self._live.setdefault(key, {})[rank] = count
        elif live is not None:
            live.pop(rank, None)
            if not live:
                del self._live[key]

    def _writers_live(self, rec: RequestRecord, decode: _Engine, prefill: _Engine,
                      p_rid: str) -> bool:
        """May a transfer still write into this request's decode blocks? Pull: a decode rank
        still holds one of its READs (posted, or given up on but not releasable: DMA may be
        live). Push: a prefill rank still holds one of its WRITEs, or is about to post one."""
        if self.scenario.connector.mode == "push":
            return (self._writes_pending.get(rec.request_id, 0) > 0
                    or (prefill.engine_id, p_rid) in self._live)
        return (decode.engine_id, rec.request_id) in self._live

    def _release_decode(self, rec: RequestRecord, decode: _Engine,
                        blocks: dict[int, np.ndarray], prefill: _Engine, p_rid: str) -> None:
        """Return a finished request's decode blocks to the pool -- unless a transfer may still
        write into them: then they are quarantined until it can no longer (a block under a live
        or unreleased transfer is never reused)."""
        if self._writers_live(rec, decode, prefill, p_rid):
            self._quarantine[rec.request_id] = _Quarantine(
                rec=rec, decode=decode, blocks=blocks, prefill=prefill, prefill_request_id=p_rid)
            self.counters["quarantined_blocks"] += sum(len(b) for b in blocks.values())
            rec.times["quarantined"] = self.now
            log.info("request %s: decode blocks quarantined (a transfer may still write them)",
                     rec.request_id)
            return
        self._free(decode, blocks)

    def _check_quarantine(self) -> None:
        if not self._quarantine:
            return
        for rid, q in list(self._quarantine.items()):
            if not self._writers_live(q.rec, q.decode, q.prefill, q.prefill_request_id):
                del self._quarantine[rid]
                q.rec.times["unquarantined"] = self.now
                self._free(q.decode, q.blocks)

    # ---- finishing --------------------------------------------------------------------------
    def _zeroed_tail(self, prefill: _Engine, decode: _Engine, job: DecodeJob
                     ) -> tuple[int, int] | None:
        """Token slots of decode's loaded blocks that no prefill block fills when decode's kernel
        block spans several prefill blocks (bsr > 1): from the end of the last prefill block
        sent to the end of the loaded blocks. The connector zeroes them after receipt (#49612);
        None when bsr = 1 (whole blocks are sent, nothing is zeroed) or decode holds no blocks
        (a request aborted before decode scheduled it)."""
        if decode.layout.kernel_block_size == prefill.layout.kernel_block_size:
            return None
        if not any(len(ids) for ids in job.blocks.values()):
            return None
        layout = decode.layout
        loaded_end = layout.blocks_for_tokens(job.load_tokens) * layout.logical_block_size
        p_kernel = prefill.layout.kernel_block_size
        sent_end = -(-self.dep.prefill_tokens(job.prompt_tokens) // p_kernel) * p_kernel
        start = max(min(sent_end, loaded_end), job.hit_blocks * layout.logical_block_size)
        return (start, loaded_end) if start < loaded_end else None

    def _post_process(self, prefill: _Engine, decode: _Engine, job: DecodeJob) -> Flow:
        """Block-size-ratio post-processing on every decode rank: zero the untransferred
        sub-block tail, then regroup heads (docs/semantics.md §6)."""
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
            sent = self.dep.prefill_tokens(job.prompt_tokens)
            received = max(0, min(subs.size, -(-sent // p_kernel) - first_sub))
            yield self._call_all(decode.ranks(), PostProcess(zero=subs[received:], kernel=kernel,
                                                             bsr=bsr))

    def _verify_and_compute(self, rec: RequestRecord, decode: _Engine, job: DecodeJob,
                            prefill: _Engine) -> Flow:
        """Check every loaded byte against the oracle (and, with a block size ratio, that the
        untransferred tail was zeroed), then compute token N locally (its KV and the state after
        N tokens)."""
        if not self.verify:
            return
        hybrid = decode.layout.is_hybrid
        tail = None if job.recomputed else self._zeroed_tail(prefill, decode, job)
        replies = yield self._call_all(decode.ranks(), Verify(
            request=rec.index, blocks=job.blocks, tokens=(0, job.load_tokens),
            state_step=job.load_tokens if hybrid else None, zero_tail=tail,
            compute=(rec.prompt_tokens - 1, rec.prompt_tokens),
            compute_step=rec.prompt_tokens if hybrid else None))
        for reply in replies:
            if reply.error is not None:  # a rank that cannot verify: nothing is known good
                self._fail(rec, reply.error.kind, f"verification failed: {reply.error.message}")
                continue
            words, found = reply.value
            rec.mismatched_words += int(words)
            rec.mismatches.extend(str(m) for m in found[: max(0, 8 - len(rec.mismatches))])

    @staticmethod
    def _account(rec: RequestRecord, outcomes: Iterable[RequestOutcome]) -> None:
        for o in outcomes:
            rec.descriptors += o.descriptors
            rec.nbytes += o.nbytes
            rec.transfers += o.transfers
            for t in o.telemetry:
                rec.times["post"] = max(rec.times.get("post", 0.0), t.post_seconds)
                rec.times["wire"] = max(rec.times.get("wire", 0.0), t.transfer_seconds)
                entry = {
                    "nbytes": t.nbytes, "descriptors": t.descriptors, "submitted": t.submitted,
                    "post_seconds": t.post_seconds, "transfer_seconds": t.transfer_seconds,
                    # the path as a tuple: the transport's own (one per route; no copy), so a
                    # long run keeps no list per transfer for the collector to scan
                    "completed": t.completed, "path": tuple(t.path), "coalesced": t.coalesced}
                if t.coalesced_model is not None:  # real backends: the model on the real lists
                    entry["coalesced_model"] = t.coalesced_model
                if t.peer is not None:  # real backends: the remote agent (remote_hold_warnings)
                    entry["peer"] = t.peer
                rec.telemetry.append(entry)

    # ---- helpers for drivers ----------------------------------------------------------------
    @staticmethod
    def handshake_targets(local_tp: int, remote_tp: int, rank: int) -> tuple[int, ...]:
        """Remote ranks a rank's handshake contacts; a non-integral TP ratio still costs one
        metadata fetch (from rank 0) before rule V1 refuses the pair."""
        try:
            return handshake_targets(local_tp, remote_tp, rank)
        except (TPError, ValueError):
            return (0,)

