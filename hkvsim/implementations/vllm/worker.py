"""vLLM's connector worker behind the surface of hkvsim's :class:`ConnectorWorker`.

:class:`hkvsim.pd.rank.RankExecutor` drives a rank through a handful of worker calls (connect,
start_read, poll, take_messages, abort, ...). This class answers them with vLLM's own pull
worker (built by :class:`.engine.VllmHarness`), so the same coordinator, simulated fabric and
oracle run vLLM's connector:

- ``connect``: vLLM's own handshake (``_ensure_handshake`` -> ``_nixl_handshake``), its socket
  answered from the peer ranks' handshake payloads (vLLM's own metadata, published by
  :meth:`handshake_payload` and delivered by the coordinator, in this process or across
  processes); a failure is the Connect's error, naming vLLM's file:line.
- ``start_read``: one ``start_load_kv`` for the request; the transfers vLLM posts during it are
  the request's (descriptor and byte counts from their telemetry).
- ``poll``: ``get_finished``; a received request is ok unless vLLM reported load errors for its
  blocks; an exception inside vLLM fails the rank's in-flight requests with vLLM's file:line.
- prefill side: notifications are handed to the coordinator unparsed, as hkvsim's own worker
  does (the coordinator plays vLLM's scheduler: it holds the blocks until they arrive).
- push: ``start_write`` has vLLM's push worker post the WRITEs (``_do_start_push_kv``); a
  request is done when vLLM lists it as done sending. Registrations and the counting of WRITE
  notifications stay the coordinator's: both sides hand it their raw notifications.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
import logging
from typing import Any

import numpy as np

from ...connector.validate import HandshakeError
from ...connector.worker import ConnectorSettings, ReadRequest, RequestOutcome
from ...geometry.layout import EngineLayout
from ...scenario import ScenarioError
from ...transport.base import Memory, Transport
from .agent import NixlAgentError
from .engine import VllmFailure, VllmHarness, VllmRank, vllm_failure

__all__ = ["VllmConnectorWorker"]

log = logging.getLogger("hkvsim.vllm")


@dataclass
class _Flight:
    outcome: RequestOutcome
    handles: list[int] = field(default_factory=list)
    local_blocks: set[int] = field(default_factory=set)


class VllmConnectorWorker:
    """One rank whose connector is vLLM's (pull or push)."""

    def __init__(self, *, harness: VllmHarness, engine_id: str, role: str, tp_rank: int,
                 layout: EngineLayout, transport: Transport, settings: ConnectorSettings,
                 device_id: int = 0) -> None:
        if settings.mode not in ("pull", "push"):
            raise HandshakeError("V1", f"implementation 'vllm': mode {settings.mode!r} is not "
                                       f"driven (allowed: pull, push)")
        self.push = settings.mode == "push"
        self.harness, self.engine_id, self.role, self.tp_rank = harness, engine_id, role, tp_rank
        self.layout, self.model, self.transport = layout, layout.model, transport
        self.settings, self.device_id = settings, device_id
        self.memory: Memory | None = None
        self.vllm: VllmRank | None = None
        self._in_flight: dict[str, _Flight] = {}
        self._zombies: dict[str, list[int]] = {}  # ended requests -> their live transfers
        # push, prefill: requests vLLM has not listed as sent whose WRITEs vLLM has all
        # released (reported once through take_released: nothing of theirs can write now)
        self._spent: set[str] = set()
        self._notify_agents: set[str] = set()  # push, decode: added here, removed at shutdown
        self.notification_failures = 0

    # ---- registration and handshake -------------------------------------------------------
    def register(self, mem_type: str = "VRAM") -> Memory:
        # vLLM registers the CPU tensors it is given as DRAM of device 0, whatever the fabric's
        # memory is
        self.memory = self.transport.allocate(self.layout.total_bytes, mem_type="DRAM",
                                              device_id=0)
        try:
            self.vllm = self.harness.add_rank(self.engine_id, self.layout, self.tp_rank,
                                              self.transport, self.memory, self.role)
        except VllmFailure as exc:  # vLLM refused to build this rank: the run cannot start
            raise ScenarioError(f"{self.engine_id} rank {self.tp_rank}: {exc}",
                                source=self.harness.source,
                                key="connector.implementation") from None
        if not self.push and self.role == "prefill":
            # vLLM reads only notifications take_messages has seen (and registered the request
            # for): on real NIXL one arriving in between would reach vLLM for a request it does
            # not know yet, and vLLM drops it ("unrecognized request")
            self.vllm.agent.gate_notifs = True
        return self.memory

    def handshake_payload(self) -> bytes:
        """vLLM's own handshake metadata of this rank (what its zmq listener would answer),
        carried to the peers by hkvsim's coordinator."""
        assert self.vllm is not None
        return self.vllm.handshake_payload()

    def connect(self, remote_engine: str, payloads: Mapping[int, bytes]) -> None:
        """vLLM's handshake with ``remote_engine``, answered from the payloads its ranks
        published through the coordinator (on either backend)."""
        assert self.vllm is not None
        remote_tp = len(payloads)
        worker = self.vllm.worker
        self.harness.deliver_handshake(remote_engine, dict(payloads))
        try:
            fut = worker._ensure_handshake(remote_engine, remote_engine, 5600, remote_tp)
            if fut is not None:
                fut.result()
        except Exception as exc:
            raise HandshakeError("vLLM", str(vllm_failure(exc))) from None
        if remote_engine not in worker._remote_agents:
            raise HandshakeError("vLLM", f"vLLM's handshake with {remote_engine} failed (its "
                                         f"log names the cause)")

    def connect_notify_only(self, agent_metadata: Any) -> None:
        """Push, decode: prefill's agents, to send it hkvsim's registrations (notifications
        only; vLLM's decode worker needs no descriptors of prefill in push)."""
        for blob in agent_metadata:
            self._notify_agents.add(self.transport.add_remote_agent(blob))

    # ---- push (prefill side) ---------------------------------------------------------------
    def start_write(self, req: Any) -> RequestOutcome | None:
        """vLLM's prefill push worker WRITEs the request into decode's registered blocks."""
        assert self.vllm is not None
        reg = req.registration
        outcome = RequestOutcome(request_id=req.prefill_request_id, ok=False)
        if reg.hit_blocks and not any(len(b) for b in reg.blocks.values()):
            # vLLM's decode never registers a full prefix-cache hit in push (its push scheduler
            # stages no registration without external tokens), so its prefill never WRITEs it;
            # hkvsim's coordinator registers it for a notification-only completion
            outcome.reason = ("implementation 'vllm': push after a full decode prefix-cache hit "
                              "is not driven (vLLM's decode registers no such request, so no "
                              "vLLM WRITE or notification exists to run; partial hits are "
                              "driven)")
            outcome.failure_class = "transfer_setup_failed"
            return outcome
        groups = sorted(set(req.prefill_blocks) | set(reg.blocks))
        local = tuple([int(b) for b in req.prefill_blocks.get(g, ())] for g in groups)
        remote = tuple([int(b) for b in reg.blocks.get(g, ())] for g in groups)
        agent = self.vllm.agent
        before = agent.created_handles()
        failure = self.harness.start_push(self.vllm, req.prefill_request_id, reg.decode_engine,
                                          reg.decode_request_id, local, remote)
        flight = _Flight(outcome=outcome, handles=agent.created_handles()[len(before):])
        if failure is not None:
            outcome.reason, outcome.failure_class = str(failure), failure.kind
            return outcome
        self._in_flight[req.prefill_request_id] = flight
        if not flight.handles:
            return self._end(req.prefill_request_id)
        return None

    def is_connected(self, engine: str) -> bool:
        return self.vllm is not None and engine in self.vllm.worker._remote_agents

    # ---- pull -----------------------------------------------------------------------------
    def start_read(self, req: ReadRequest) -> RequestOutcome | None:
        assert self.vllm is not None
        outcome = RequestOutcome(request_id=req.request_id, ok=False)
        groups = sorted(set(req.decode_blocks) | set(req.prefill_blocks))
        local = tuple([int(b) for b in req.decode_blocks.get(g, ())] for g in groups)
        if not any(local):
            # nothing to read (a full prefix hit, or decode gave up before reading): vLLM's
            # scheduler then hands its worker no groups at all, not an empty list per group (a
            # full hit: (); a request aborted before it was scheduled: []), and 0.26.0's worker
            # recognises only that shape as "notify prefill, read nothing"
            local = ()
        remote = tuple([int(b) for b in req.prefill_blocks.get(g, ())] for g in groups)
        agent = self.vllm.agent
        before = agent.created_handles()
        failure = self.harness.start_load(self.vllm, req.request_id, req.prefill_request_id,
                                          req.remote_engine, local, remote,
                                          prefill_tokens=req.prefill_tokens)
        flight = _Flight(outcome=outcome, handles=agent.created_handles()[len(before):],
                         local_blocks={b for g in local for b in g})
        if failure is not None:
            outcome.reason, outcome.failure_class = str(failure), failure.kind
            return outcome
        self._in_flight[req.request_id] = flight
        if not local:
            # vLLM's scheduler does not wait for a request with nothing to load (no external
            # tokens: it is not an async load); its worker only notified prefill (0.26.0 never
            # lists it as received, 0.33.0 does, after the fact)
            return self._end(req.request_id)
        return None

    def poll(self, finished: Any = None) -> list[RequestOutcome]:
        """``finished`` (the transport's finished handles, from event-driven drivers) is not
        needed: vLLM's get_finished() asks its agent about every transfer it holds."""
        del finished
        if not self._in_flight and not self._zombies:
            return []
        assert self.vllm is not None
        try:
            sending, recving = self.vllm.worker.get_finished()
            bad = set(self.vllm.worker.get_block_ids_with_load_errors())
        except Exception as exc:
            failure = vllm_failure(exc)
            return [self._end(rid, failure=failure) for rid in list(self._in_flight)]
        if self.push:  # prefill: vLLM lists a request done sending once its WRITEs completed
            # and counts it failed (not done) once they all ended and one ended in ERR, as its
            # checks saw them (its own record of the failure, _send_failures, is emptied in the
            # same call that fills it once the last WRITE ended)
            # A state check that raised counts as an end in ERR: vLLM handles both alike
            # (_handle_failed_transfer), and the check raised before vLLM saw a state
            agent = self.vllm.agent

            def ended(h: int) -> str | None:
                return agent.ended_as(h) or ("ERR" if agent.poll_failure(h) else None)

            failed = set(getattr(self.vllm.worker, "_send_failures", ()))
            failed |= {rid for rid, f in self._in_flight.items() if f.handles
                       and all(ended(h) for h in f.handles)
                       and any(ended(h) == "ERR" for h in f.handles)}
            # a request vLLM lists as sent although a WRITE of it did not end DONE (0.26.0 lists
            # one whose WRITE ended in ERR) completed no transfer: no telemetry
            out = [self._end(rid, completed=self._all_done(rid))
                   for rid in sorted(set(sending or ()) & set(self._in_flight))]
            out += [self._end(rid, failure=VllmFailure(
                        where="push WRITE", what="vLLM recorded the request's WRITE as failed",
                        kind=self._failure_kind(rid)))
                    for rid in sorted(failed & set(self._in_flight))]
            return out
        out = []
        for rid in sorted(set(recving or ()) & set(self._in_flight)):
            flight = self._in_flight[rid]
            lost = sorted(flight.local_blocks & bad)
            posts = [f for f in map(self.vllm.agent.post_failure, flight.handles) if f]
            if posts:  # a READ vLLM could not post: the failure NIXL raised is the cause
                kind, what = posts[0]
                out.append(self._end(rid, failure=VllmFailure(
                    where="transfer", what=f"vLLM could not post a READ: {what}", kind=kind)))
            elif lost:
                out.append(self._end(rid, failure=VllmFailure(
                    where="get_block_ids_with_load_errors",
                    what=f"vLLM reported load errors for blocks {lost[:8]}",
                    kind=self._failure_kind(rid))))
            else:
                out.append(self._end(rid))
        return out

    def _end(self, rid: str, failure: VllmFailure | None = None, *, completed: bool = True
             ) -> RequestOutcome:
        """The request's outcome: ok unless ``failure``; its transfers' telemetry only when it
        ``completed`` (as hkvsim's worker). vLLM's transfers of it that may still move bytes
        (posted, handle not yet released by vLLM) are counted as ``unreleased`` and watched
        until vLLM releases them (:meth:`take_released`): the coordinator must not reuse or
        recompute into blocks they may still write."""
        flight = self._in_flight.pop(rid)
        self._spent.discard(rid)
        out = flight.outcome
        assert self.vllm is not None
        agent = self.vllm.agent
        posted = self._posted(flight.handles)
        tel = [t for t in map(agent.telemetry_of, posted) if t is not None]
        out.transfers = len(posted)  # as hkvsim's worker: a post that raised moved nothing
        out.descriptors = sum(t.descriptors for t in tel)
        out.nbytes = sum(t.nbytes for t in tel)
        if failure is None:
            out.ok = True
            if completed:
                out.telemetry = tel
        else:
            out.reason, out.failure_class = str(failure), failure.kind
        live = [h for h in posted if agent.is_live(h)]
        if live:
            self._zombies[rid] = live
        out.unreleased = len(live)
        return out

    def _posted(self, handles: list[int]) -> list[int]:
        """The transfers whose post did not raise (as hkvsim's worker: one that raised moved
        nothing)."""
        assert self.vllm is not None
        return [h for h in handles if self.vllm.agent.post_failure(h) is None]

    def _all_done(self, rid: str) -> bool:
        """Did every transfer vLLM posted for the request end DONE, as its checks saw them?"""
        assert self.vllm is not None
        ended_as = self.vllm.agent.ended_as
        return all(ended_as(h) == "DONE" for h in self._posted(self._in_flight[rid].handles))

    def _failure_kind(self, rid: str) -> str:
        """hkvsim's failure class for a request vLLM failed, from what NIXL told vLLM about its
        transfers (vLLM's log names the same failure_type): a post that raised ->
        its class (transfer_setup_failed, remote_disconnect), a state check that raised ->
        transfer_exception, else transfer_failed (a transfer ended in ERR)."""
        assert self.vllm is not None
        agent = self.vllm.agent
        handles = self._in_flight[rid].handles
        for found in (agent.post_failure, agent.poll_failure):
            kinds = [f[0] for f in map(found, handles) if f]
            if kinds:
                return kinds[0]
        return "transfer_failed"

    def abort(self, rid: str, reason: str, failure_class: str) -> RequestOutcome | None:
        if rid not in self._in_flight:
            return None
        out = self._end(rid, completed=False)
        out.ok, out.reason, out.failure_class = False, reason, failure_class
        return out

    def in_flight(self) -> int:
        return len(self._in_flight)

    def pending_releases(self) -> int:
        return sum(len(h) for h in self._zombies.values())

    def take_released(self) -> list[str]:
        """Requests that ended with transfers still live, once vLLM has released the last of
        them (vLLM keeps polling them in its get_finished: :meth:`poll` goes on calling it).
        Push, prefill: also a request vLLM has not listed as sent yet whose WRITEs vLLM has
        all released (vLLM posts a request's WRITEs in one call, so none is to come): no
        transfer of it can write into decode's blocks any more, so the coordinator need not
        keep them. vLLM 0.30.0 releases every finished WRITE and never lists its request as
        sent; decode reuses those blocks, as decode's scheduler would."""
        if not self._zombies and not (self.push and len(self._spent) < len(self._in_flight)):
            return []
        assert self.vllm is not None
        is_live = self.vllm.agent.is_live
        out = []
        if self.push:
            for rid, flight in self._in_flight.items():
                if rid not in self._spent and not any(map(is_live, flight.handles)):
                    self._spent.add(rid)
                    out.append(rid)
        for rid, handles in list(self._zombies.items()):
            handles = [h for h in handles if is_live(h)]
            if handles:
                self._zombies[rid] = handles
            else:
                del self._zombies[rid]
                out.append(rid)
        return out

    def take_messages(self) -> list[bytes]:
        """Prefill: vLLM's own worker counts the read notifications and says when a request's
        blocks may go (``get_finished``'s done-sending set, by its release's rule); each such
        request becomes one ``"{request}:1"`` message for the coordinator, which frees the
        blocks once every prefill rank has sent its. Other messages (heartbeats) pass as they
        came. Decode: nothing (vLLM's decode worker reads its own notifications)."""
        if self.vllm is None:
            return []
        if self.push:  # push: hkvsim's coordinator runs registration and counting
            try:
                got = self.vllm.agent.get_new_notifs()
            except NixlAgentError:
                return []
            return [m for messages in got.values() for m in messages]
        if self.role == "decode":
            return []
        agent = self.vllm.agent
        try:
            peeked = agent.peek_notifs()
        except NixlAgentError:
            return []
        passed: list[bytes] = []
        for message in (m for messages in peeked.values() for m in messages):
            if message.startswith(b"HB:"):
                passed.append(message)
                continue
            rid = message.decode(errors="replace").rpartition(":")[0]
            if rid:
                self.harness.expect_send(self.vllm, rid)
        try:
            sending, _recving = self.vllm.worker.get_finished()
        except Exception as exc:
            log.warning("vLLM's prefill get_finished failed on %s.%d: %s", self.engine_id,
                        self.tp_rank, vllm_failure(exc))
            return passed
        return passed + [f"{rid}:1".encode() for rid in sorted(sending or ())]

    # ---- post-processing and eviction ------------------------------------------------------
    def zero_sub_blocks(self, sub_block_ids: np.ndarray, bsr: int) -> None:
        """Nothing: what happens to decode sub-blocks that received nothing is vLLM's own
        business (its release's ``get_finished``); hkvsim's oracle judges the bytes it left."""
        return None

    def regroup_heads(self, kernel_blocks: np.ndarray, bsr: int) -> None:
        """Nothing: vLLM's ``get_finished`` post-processes received blocks itself (0.33.0
        permutes bsr remote HND blocks into one local block); the oracle checks the result."""
        return None

    def evict(self, engine: str) -> None:
        return None

    def shutdown(self) -> None:
        """vLLM's own shutdown: it releases its lists and agents and deregisters its memory
        (what it leaves behind shows up as the run's after-shutdown leak)."""
        if self.vllm is not None:
            self.harness.shutdown_rank(self.vllm)
        for agent in sorted(self._notify_agents):
            self.transport.remove_remote_agent(agent)
        self._notify_agents.clear()
