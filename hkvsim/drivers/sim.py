"""The simulated-fabric driver: the coordinator's events and effects on simpy virtual time.

It builds the simulated world (fabric, one agent and one in-process rank per TP rank), then only
moves things between the sans-I/O coordinator (:mod:`hkvsim.pd.coordinator`) and the ranks: calls
are carried out at once (handshakes after their modelled latency), transport activity becomes
rank events, the coordinator's next deadline becomes a simpy timeout. Everything runs in virtual
time, deterministically: the same scenario and seed give the same bytes and the same times.

The simulator also watches what real hardware cannot: every transfer's destination blocks are
checked against the coordinator's block owners when it is posted and when its bytes land (stray
writes, late landings).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import numpy as np
import simpy

from ..connector.worker import ConnectorWorker
from ..fabric import Fabric, load_profile, place_engines
from ..faults import FaultPlan
from ..oracle import OUTSIDE_BLOCKS, Oracle, blocks_touched_set
from ..pd.coordinator import Call, Coordinator
from .base import CoordinatorLoop
from ..pd.cpu import oracle_bytes
from ..pd.deployment import build_deployment
from ..pd.ops import (Connect, ConnectNotifyOnly, Died, OracleWrite, RankError, RankId, Reply,
                      StartRead, StartWrite, Verify)
from ..pd.pool import FREE_BLOCK
from ..pd.rank import RankExecutor
from ..pd.records import RankSetupError, RequestRecord, RunResult
from ..scenario import Scenario
from ..transport.base import TransportError
from ..transport.sim import SimWorld

__all__ = ["SimDriver", "run_scenario"]

log = logging.getLogger("hkvsim.sim")

# A run allocates many short-lived containers (events, messages, per-request records) while
# holding thousands of long-lived ones (requests in flight, their records): with Python's default
# thresholds the cyclic collector re-scans the long-lived ones so often that a run's cost per
# request grew with the requests in flight (+27 % from 16 to 1,024 in flight, all of it
# collection time). Collecting every 100,000 allocations instead keeps it flat; nothing in a run
# depends on when cycles are freed.
_RUN_GC_THRESHOLDS = (100_000, 50, 100)
# runs of at least this many requests keep their retained objects out of the collector's scans
# (setup_frozen); smaller ones retain too little for it to pay for the full collection at the end
# (in a process with a large heap, such as a test session, that collection dominates a small run)
FREEZE_FROM_REQUESTS = 4096


@contextlib.contextmanager
def fewer_collections() -> Iterator[None]:
    """Run the cyclic garbage collector less often inside the block (restored after it)."""
    old = gc.get_threshold()
    gc.set_threshold(*_RUN_GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*old)


def _freeze_survivors(phase: str, info: dict[str, Any]) -> None:
    """gc callback: after a collection of the youngest generation, freeze its survivors."""
    if phase == "stop" and info["generation"] == 0:
        gc.freeze()


@contextlib.contextmanager
def setup_frozen() -> Iterator[None]:
    """Keep objects out of the cyclic collector's scans once they have survived one, inside the
    block: every object alive on entry, and the survivors of each collection of the youngest
    generation, are frozen (``gc.freeze``; back to the oldest generation after the block).

    A run creates all its requests when it starts and keeps every request's record, transfer
    records and link log to its end (~60 tracked objects per request). Without this, each
    collection of the middle generation re-scans every object that survived the youngest
    one since the last: at 100,000 requests two such collections took 7.3 s of a 129 s run
    (~4.8 M objects each). Frozen objects are still freed by reference counting; only cyclic
    garbage among them (a request still in flight at a collection, whose flow's objects refer
    to each other) waits for the unfreeze, and is collected right then (one full collection at
    the block's end: the run's garbage goes, with its finalizers, inside the run, not at
    whatever later moment the next full collection would have come; an in-process vLLM worker's
    ``__del__`` once ran that way inside an unrelated import). Left alone when something else
    has frozen objects (their permanent generation is theirs)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    gc.callbacks.append(_freeze_survivors)
    try:
        yield
    finally:
        gc.callbacks.remove(_freeze_survivors)
        gc.unfreeze()
        gc.collect()


class _SimLoop(CoordinatorLoop):
    """The coordinator loop of the simulated fabric: every input it is fed is one of the
    coordinator's (``start``, ``on_replies``, ``on_events``, ``on_timer``), each of which runs
    the ready flows until they are blocked by effects or none is left. So after an input
    without effects there is nothing to run or carry out, and the pump returns at once (most
    rank events: a request's first 7 of 8 READ completions and its notifications)."""

    def _pump(self) -> None:
        if self.coord.has_effects():
            super()._pump()


def _process_killed(rank: RankId) -> str:
    """Why a rank whose process a kill-rank fault killed answers nothing."""
    return f"{rank[0]} rank {rank[1]} died: its process was killed"


class SimDriver:
    """Runs one scenario on the simulated fabric."""

    def __init__(self, scenario: Scenario, *, timing_only: bool = False,
                 progress: Callable[[RequestRecord], None] | None = None) -> None:
        self.scenario = scenario
        self.dep = build_deployment(scenario)
        self.verify = scenario.workload.verify and not timing_only
        self.progress = progress
        self.env = simpy.Environment()
        profile = load_profile(scenario.fabric.profile, overrides=dict(scenario.fabric.overrides))
        self.profile = profile
        specs = [(e.engine_id, e.role, e.tp) for e in self.dep.all_engines()]
        self.fabric = Fabric(self.env, profile, place_engines(profile, specs))
        self.world = SimWorld(self.env, self.fabric, move_bytes=self.verify)
        # whether oracle work costs CPU (verified runs, host path, a profile that measured it),
        # and the coordinator's CPU per call (host path; 0: calls reach their ranks at once)
        self._oracle_costs_cpu = (self.verify and profile.host_cores is not None
                                  and profile.oracle_core_bandwidth is not None)
        self._coordinator_call = profile.coordinator_call if profile.host_cores is not None else 0.0
        faults = None
        if scenario.faults:
            faults = FaultPlan(scenario.faults, seed=scenario.scenario.seed,
                               transfer_timeout=scenario.connector.transfer_timeout_seconds)
            self.world.faults = faults
        self.coord = Coordinator(self.dep, verify=self.verify, faults=faults)
        self.coord.on_request_end = progress
        self.ranks: dict[RankId, RankExecutor] = {}
        self._agent_rank: dict[str, RankId] = {}
        self._base: dict[RankId, int] = {}
        self.implementation: dict[str, str] = {}
        make_worker: Callable[..., Any] = ConnectorWorker
        if scenario.connector.implementation == "vllm":
            from ..implementations.vllm.run import vllm_worker_factory

            make_worker, self.implementation = vllm_worker_factory(
                self.dep, now=lambda: self.env.now, moves_bytes=self.world.move_bytes)
        for spec in self.dep.all_engines():
            settings = self.dep.settings[spec.role]
            oracle = Oracle(spec.layout.model) if self.verify else None
            for r in range(spec.tp):
                rank = (spec.engine_id, r)
                transport = self.world.create_agent(f"{spec.engine_id}.{r}", rank)
                worker = make_worker(engine_id=spec.engine_id, role=spec.role, tp_rank=r,
                                     layout=spec.layout, transport=transport,
                                     settings=settings, device_id=r)
                try:
                    memory = worker.register(mem_type=profile.memory)
                except TransportError as exc:  # as a NIXL rank process fails at setup
                    raise RankSetupError(f"rank setup failed: {spec.engine_id} rank {r}: "
                                         f"{type(exc).__name__}: {exc}") from None
                self.ranks[rank] = RankExecutor(rank, worker, oracle)
                self._agent_rank[transport.name] = rank
                self._base[rank] = memory.base_addr
                self.coord.set_rank_info(rank, payload=worker.handshake_payload(),
                                         agent=transport.name,
                                         agent_metadata=transport.get_agent_metadata())
                self.world.on_activity(transport.name,
                                       partial(self._on_activity, self.ranks[rank]))
        self.world.landing_guard = self._on_landing
        self.world.on_death = self._on_death
        # host path with the peers' poll periods: when each rank was last woken by a message
        # from the coordinator (its loop calls into NIXL then, and every poll period after)
        self._woken: dict[RankId, float] | None = None
        if profile.peer_poll_idle and profile.host_cores is not None:
            self._woken = dict.fromkeys(self.ranks, 0.0)
            self.world.peer_progress = self._peer_progress
        self.loop = _SimLoop(self.coord, self._carry_out, self._after_input)
        self._timer_at: float | None = None
        self._timers_seen = -1  # coord.timers_made() when the timer was last checked
        self._timer_gen = 0
        # landing guard: per engine, the last (offsets, lengths, blocks, outside) it derived
        self._last_touched: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, bool]] = {}
        # ... and per (engine, runs token, side, first address in the allocation) the blocks
        self._touched_runs: dict[tuple[Any, ...], tuple[Any, np.ndarray, bool]] = {}
        # ... and per (blocks, owner) the pool's owner epoch when they were last all the
        # owner's: a request's ranks land on the same blocks, checked once per owner change
        self._owned: dict[tuple[int, Any], tuple[np.ndarray, Any, int]] = {}

    # ---- the run --------------------------------------------------------------------------
    def run(self) -> RunResult:
        faults = self.world.faults
        if faults is not None:
            for at, agent, kind in faults.timed_deaths(list(self._agent_rank)):
                self.env.process(self._kill_at(at, agent, kind))
        with fewer_collections():
            self._deliver(lambda: self.coord.start(self.env.now))
            big = len(self.coord.records) >= FREEZE_FROM_REQUESTS
            with setup_frozen() if big else contextlib.nullcontext():
                self.env.run()
            # the link log's segments become LinkSegment records (tracked by the collector)
            # here, after the run's collections and under its thresholds
            segments = self.fabric.link_segments()
        return self._result(segments)

    def _kill_at(self, at: float, agent: str, kind: str) -> Any:
        yield self.env.timeout(at)
        log.warning("fault: agent %s dies at t=%.6f s (%s)", agent, self.env.now, kind)
        self.world.kill(agent, fault=kind)

    # ---- moving things between the coordinator and the ranks -----------------------------------
    def _deliver(self, feed: Callable[[], None]) -> None:
        self.loop.deliver(feed)

    def _carry_out(self, effects: list[Any]) -> None:
        replies = []
        for effect in effects:
            if not isinstance(effect, Call):
                continue  # Posting: the simulator injects its faults inside the transport
            if self._coordinator_call:
                self.env.process(self._after_coordinator_work(effect))
                continue
            reply = self._start(effect)
            if reply is not None:
                replies.append(reply)
        if replies:
            self.coord.on_replies(replies, self.env.now)

    def _start(self, call: Call) -> Reply | None:
        """Carry out ``call`` on its rank: its reply now, or None when a handshake's latency or
        (host path, verified) the oracle's CPU delays it (the reply is delivered later)."""
        if isinstance(call.op, (Connect, ConnectNotifyOnly)):
            self.env.process(self._after_handshake_latency(call))
            return None
        if self._oracle_costs_cpu and isinstance(call.op, (OracleWrite, Verify)):
            self.env.process(self._after_oracle_work(call))
            return None
        return self._execute(call)

    def _after_input(self) -> None:
        self._arm_timer()

    def _peer_progress(self, agent: str, after: float, *, median: bool = False) -> float:
        """When the rank of ``agent`` is expected to have called into NIXL at or after
        ``after``, as known now: when a message from the coordinator woke it after ``after``;
        otherwise at its loop's next poll, every ``peer_poll_busy`` with transfers in flight and
        ``peer_poll_idle`` otherwise, at an unknown phase: the poll falls uniformly in
        [after, after + period], and the expected time of max(now, that poll) is returned (an
        expected value, not a draw: runs stay deterministic and free of a phase grid).
        ``median``: the median of that time instead, for an either-or decision (whether the
        rank's own poll right now sees the transfer complete: it does when the remote more
        likely than not has polled since ``after``; the mean is then a hair after now)."""
        assert self._woken is not None
        rank = self._agent_rank[agent]
        if self._woken[rank] > after:  # woken after the post: it progressed then
            return self._woken[rank]
        period = (self.profile.peer_poll_busy if self.ranks[rank].busy()
                  else self.profile.peer_poll_idle)
        now, end = self.env.now, after + period
        if now <= after:
            return after + period / 2
        if median:
            return now if now - after >= period / 2 else after + period / 2
        if now >= end:
            return now
        return now + (end - now) ** 2 / (2 * period)

    def _execute(self, call: Call) -> Reply:
        killed = self.world.killed_processes  # empty but in kill-rank runs: no name built
        if killed and f"{call.rank[0]}.{call.rank[1]}" in killed:
            # a killed rank process answers nothing, as on real NIXL: a call made before the
            # coordinator has heard of the death (its Died event is queued behind the reply
            # that reported it), e.g. a recompute on decode, must not run there
            return Reply(call.call_id, error=RankError("remote_disconnect",
                                                       _process_killed(call.rank)))
        if self._woken is not None:
            self._woken[call.rank] = self.env.now
        op = call.op
        owner = op.request if isinstance(op, (StartRead, StartWrite)) else None
        self.world.post_owner = owner
        try:
            return Reply(call.call_id, value=self.ranks[call.rank].execute(op))
        except TransportError as exc:
            return Reply(call.call_id, error=RankError(exc.kind, str(exc)))
        finally:
            self.world.post_owner = None

    def _after_coordinator_work(self, call: Call) -> Any:
        """Host path with the coordinator's CPU modelled: the call reaches its rank once the
        coordinator has spent its CPU on it (after its earlier calls), then runs as usual."""
        yield self.fabric.coordinator_work(self._coordinator_call)
        reply = self._start(call)
        if reply is not None:
            self._deliver(lambda: self.coord.on_replies([reply], self.env.now))

    def _after_oracle_work(self, call: Call) -> Any:
        """A verified run on a host-path profile: the oracle's fill or check is CPU work on the
        rank's thread and a core of its node (it runs now; its reply waits for the work)."""
        reply = self._execute(call)
        layout = self.ranks[call.rank].worker.layout
        yield self.fabric.cpu_work(
            call.rank, self.fabric.profile.oracle_time(oracle_bytes(layout, call.op.blocks)))
        if self._woken is not None:  # its loop (and its NIXL polls) resume after the work
            self._woken[call.rank] = self.env.now
        self._deliver(lambda: self.coord.on_replies([reply], self.env.now))

    def _after_handshake_latency(self, call: Call) -> Any:
        """A handshake costs the metadata fetches from every remote rank it contacts."""
        engine_id, rank = call.rank
        op = call.op
        if isinstance(op, Connect):
            remote = self.dep.engine(op.remote_engine)
            local_tp = self.dep.engine(engine_id).tp
            targets = Coordinator.handshake_targets(local_tp, remote.tp, rank)
        else:
            assert isinstance(op, ConnectNotifyOnly)
            remote = self.dep.engine(op.remote_engine)
            targets = tuple(range(remote.tp))
        yield simpy.AllOf(self.env, [self.fabric.handshake(call.rank, (remote.engine_id, t))
                                     for t in targets])
        self._deliver(lambda: self.coord.on_replies([self._execute(call)], self.env.now))

    def _on_activity(self, executor: RankExecutor) -> None:
        """A transfer of, or a message to, the rank completed: poll it (the sans-I/O core is
        driven from here, as the engine's step loop drives the reference connector)."""
        events = executor.poll(executor.worker.transport.take_finished())
        if events:
            self.loop.deliver(partial(self.coord.on_events, events, self.env.now))

    def _on_death(self, agent: str) -> None:
        rank = self._agent_rank[agent]
        process = agent in self.world.killed_processes
        reason = (_process_killed(rank) if process
                  else f"{rank[0]} rank {rank[1]} died: agent {agent} disconnected")
        self._deliver(lambda: self.coord.on_events([Died(rank, reason, process=process)],
                                                   self.env.now))

    def _arm_timer(self) -> None:
        made = self.coord.timers_made()
        if self._timer_at is not None and made == self._timers_seen:
            # no timer made since the last check: the next deadline can only be later than
            # then, so the armed timer (at or before it) still comes first
            return
        self._timers_seen = made
        deadline = self.coord.next_timer()
        if deadline is None or (self._timer_at is not None and self._timer_at <= deadline):
            return
        self._timer_at = deadline
        self._timer_gen += 1
        gen = self._timer_gen
        self.env.timeout(max(0.0, deadline - self.env.now)).callbacks.append(
            lambda _: self._on_timer(gen))

    def _on_timer(self, gen: int) -> None:
        if gen != self._timer_gen:
            return  # superseded by an earlier deadline
        self._timer_at = None
        self._deliver(lambda: self.coord.on_timer(self.env.now))

    # ---- the landing guard ----------------------------------------------------------------
    def _on_landing(self, agent: str, addrs: np.ndarray | None, lengths: np.ndarray | None,
                    owner: Any, landed: bool, memo: dict[str, Any] | None = None) -> bool:
        """A transfer is posted, or its bytes land: every destination block must belong to the
        request the transfer was posted for. At posting, anything else is a stray write (the
        connector aimed at blocks its request does not hold); at landing, a late landing (bytes
        in a block freed, maybe reused, since). Returns True when something was flagged."""
        if owner is None:
            return False
        if memo is not None and "blocks" in memo:  # landing: the blocks derived at posting
            passed = memo.get("passed")
            if passed is not None and passed[1] == passed[0].owner_epoch:
                return False  # every block was the owner's, and no owner changed since
            blocks, outside, engine = memo["blocks"], memo["outside"], memo["engine"]
        else:
            rank = self._agent_rank[agent]
            engine = self.coord.engine(rank[0])
            # which blocks the runs touch is fixed; only their owners change
            blocks, outside = self._touched(
                rank, engine.layout, addrs, lengths, None if memo is None else memo.get("runs"),
                None if memo is None else memo.get("extents"))
            if memo is not None:
                memo["blocks"], memo["outside"], memo["engine"] = blocks, outside, engine
        pool = engine.pool
        if not outside:  # the common case: every block touched belongs to the request
            key = (id(blocks), owner)
            seen = self._owned.get(key)
            if (seen is not None and seen[0] is blocks and seen[1] is pool
                    and seen[2] == pool.owner_epoch):
                if memo is not None:  # its landing passes at once while no owner changes
                    memo["passed"] = (pool, seen[2])
                return False  # checked since the pool's owners last changed
            if not (pool.owner_view[blocks] != owner).any():
                if len(self._owned) >= 256:
                    self._owned.clear()
                self._owned[key] = (blocks, pool, pool.owner_epoch)  # keeps blocks alive
                if memo is not None:
                    memo["passed"] = (pool, pool.owner_epoch)
                return False
        owners = np.where(blocks == OUTSIDE_BLOCKS, OUTSIDE_BLOCKS - 1,
                          pool.owner_view[np.maximum(blocks, 0)])
        bad = owners != owner
        if not bad.any():
            return False
        where = [f"request {v}" for v in sorted({int(v) for v in owners[bad] if v >= 0})]
        if (owners[bad] == FREE_BLOCK).any():
            where.append("the free pool")
        if (blocks[bad] == OUTSIDE_BLOCKS).any():
            where.append("bytes outside every block")
        self.coord.note_misplaced_write(
            int(owner), agent, int(np.unique(blocks[bad & (blocks >= 0)]).size),
            victims=sorted({int(v) for v in owners[bad] if v >= 0}), where=where, landed=landed)
        return True

    def _touched(self, rank: RankId, layout: Any, addrs: np.ndarray | None,
                 lengths: np.ndarray | None, runs: Any = None,
                 extents: Callable[[], Any] | None = None) -> tuple[np.ndarray, bool]:
        """(blocks the byte runs at ``addrs`` in a rank's allocation touch, whether any byte
        lies outside every block). The ranks of an engine share its layout, so the same runs
        touch the same blocks on each: the last answer per engine is reused when the runs are
        equal (a request's transfers to the ranks of one engine come one after another).
        ``runs``: the transport's (token, side, shift) for the runs (equal tokens and sides:
        equal runs minus shift), which names equal offsets without comparing them; then
        ``addrs`` and ``lengths`` may be None and ``extents()`` gives them."""
        engine_id = rank[0]
        if runs is not None:
            key = (engine_id, id(runs[0]), runs[1], runs[2] - self._base[rank])
            got = self._touched_runs.get(key)
            if got is not None and got[0] is runs[0]:
                return got[1], got[2]
            if addrs is None:  # the transport gives them when asked
                addrs, lengths = extents()
            blocks, outside = self._touched(rank, layout, addrs, lengths)
            if len(self._touched_runs) >= 256:
                self._touched_runs.clear()
            self._touched_runs[key] = (runs[0], blocks, outside)  # keeps the token alive
            return blocks, outside
        offsets = addrs - self._base[rank]
        last = self._last_touched.get(engine_id)
        if (last is not None and last[0].shape == offsets.shape
                and bool((last[0] == offsets).all()) and bool((last[1] == lengths).all())):
            return last[2], last[3]
        blocks = blocks_touched_set(layout, offsets, lengths)
        outside = bool(blocks.size) and int(blocks.min()) == OUTSIDE_BLOCKS
        self._last_touched[engine_id] = (offsets, lengths, blocks, outside)
        return blocks, outside

    # ---- the result -----------------------------------------------------------------------
    def _result(self, link_segments: list[Any]) -> RunResult:
        coord = self.coord
        workers = [ex.worker for ex in self.ranks.values()]
        counters = dict(coord.counters)
        counters["notification_failures"] += sum(w.notification_failures for w in workers)
        counters["dropped_messages"] = self.world.dropped_messages
        faults = self.world.faults
        if faults is not None:
            counters["faults_injected"] = sum(faults.injected.values())
            for kind, n in sorted(faults.injected.items()):
                counters[f"fault:{kind}"] = n
        pools = coord.leaks()
        leaks = {"prefill_blocks": pools["prefill_blocks"],
                 "decode_blocks": pools["decode_blocks"],
                 "open_handles": sum(w.transport.open_handles() for w in workers),
                 "quarantined_blocks": pools["quarantined_blocks"]}
        for w in workers:  # clean shutdown (§9.4): everything released, memory deregistered
            w.shutdown()
        leftover: dict[str, int] = {}
        for w in workers:
            for k, v in w.transport.resources().items():
                leftover[k] = leftover.get(k, 0) + v
        leaks["after_shutdown"] = sum(leftover.values())
        if leaks["after_shutdown"]:
            log.warning("resources left after shutdown: %s", leftover)
        layouts = {role: es[0].layout for role, es in self.dep.engines.items()}
        return RunResult(scenario=self.scenario, records=coord.records,
                         misplaced_write_reports=coord.misplaced_write_reports,
                         handshake_errors=coord.handshake_errors, leaks=leaks, counters=counters,
                         sim_seconds=coord.makespan(), layouts=layouts, warnings=coord.warnings(),
                         verified=self.verify, implementation=dict(self.implementation),
                         link_segments=link_segments)


def run_scenario(scenario: Scenario, *, timing_only: bool = False,
                 progress: Callable[[RequestRecord], None] | None = None) -> RunResult:
    """Run one scenario on the simulated fabric (``timing_only``: move no bytes, verify none;
    ``progress`` is called with each request's record as its serving ends)."""
    driver = SimDriver(scenario, timing_only=timing_only, progress=progress)
    try:
        return driver.run()
    finally:
        # vLLM's own workers end here, whether the run returned or raised: shut down once and
        # their finalizers left with nothing to do, not at a later collection
        if driver.implementation:
            from ..implementations.vllm.engine import release_workers

            del driver
            release_workers()
