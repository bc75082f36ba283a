"""A rank that carries out the coordinator's operations: its connector, its memory, the oracle.

One implementation for every driver: the simulated fabric runs it in process; a real-NIXL rank
process runs the same class behind the side channel. It imports neither simpy nor the simulated
fabric. Memory access goes through :meth:`RankExecutor.access` so a rank whose cache lives in
VRAM can stage it through host memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..connector.validate import HandshakeError
from ..geometry.specs import GeometryError
from ..transport.base import TransportError
from .ops import (
    Abort,
    Connect,
    ConnectNotifyOnly,
    Evict,
    Message,
    OracleWrite,
    Outcome,
    PostProcess,
    RankEvent,
    RankId,
    RankOp,
    Released,
    SendNotif,
    StartRead,
    StartWrite,
    Verify,
    WriteStale,
)

__all__ = ["RankExecutor"]


class RankExecutor:
    """Executes :mod:`hkvsim.pd.ops` operations on one rank's connector worker."""

    def __init__(self, rank: RankId, worker: Any, oracle: Any | None) -> None:
        self.rank = rank
        self.worker = worker  # a ConnectorWorker (or an implementation with its surface)
        self.oracle = oracle  # None: timing only, no pattern written or checked
        self._handlers: dict[type, Callable[[Any], Any]] = {
            OracleWrite: self._oracle_write, WriteStale: self._write_stale,
            Connect: self._connect, ConnectNotifyOnly: self._connect_notify_only,
            StartRead: self._start_read, StartWrite: self._start_write, Abort: self._abort,
            SendNotif: self._send_notif, PostProcess: self._post_process, Verify: self._verify,
            Evict: self._evict,
        }

    # ---- memory ---------------------------------------------------------------------------
    def access(self, write: bool, fn: Callable[[np.ndarray], Any]) -> Any:
        """Run ``fn`` on the rank's cache bytes (a host view; overridden for VRAM)."""
        assert self.worker.memory is not None
        return fn(self.worker.memory.array)

    # ---- operations -----------------------------------------------------------------------
    def execute(self, op: RankOp) -> Any:
        """Carry out ``op``; returns its reply value. A transport error propagates (the caller
        turns it into an error reply)."""
        return self._handlers[type(op)](op)

    def _oracle_write(self, op: OracleWrite) -> None:
        if self.oracle is None:
            return
        layout = self.worker.layout
        self.access(True, lambda arr: self.oracle.write(
            arr, layout, self.rank[1], op.request, blocks=op.blocks, tokens=op.tokens,
            state_step=op.state_step))

    def _write_stale(self, op: WriteStale) -> None:
        if self.oracle is None:
            return
        layout = self.worker.layout
        self.access(True, lambda arr: self.oracle.write_stale(
            arr, layout, self.rank[1], op.request, blocks=op.blocks, tokens=op.tokens))

    def _connect(self, op: Connect) -> str | None:
        try:
            self.worker.connect(op.remote_engine, op.payloads)
        except (HandshakeError, GeometryError) as exc:
            return str(exc)
        return None

    def _connect_notify_only(self, op: ConnectNotifyOnly) -> None:
        self.worker.connect_notify_only(list(op.agent_metadata))

    def _start_read(self, op: StartRead) -> Any:
        return self.worker.start_read(op.read)

    def _start_write(self, op: StartWrite) -> Any:
        return self.worker.start_write(op.write)

    def _abort(self, op: Abort) -> Any:
        return self.worker.abort(op.request_id, op.reason, op.failure_class)

    def _send_notif(self, op: SendNotif) -> list[tuple[str, str, str]]:
        failures: list[tuple[str, str, str]] = []
        for agent in op.agents:
            try:
                self.worker.transport.send_notif(agent, op.message)
            except TransportError as exc:
                failures.append((agent, exc.kind, str(exc)))
                if op.stop_at_failure:
                    break
        return failures

    def _post_process(self, op: PostProcess) -> None:
        def run(_arr: np.ndarray) -> None:
            self.worker.zero_sub_blocks(op.zero, op.bsr)
            self.worker.regroup_heads(op.kernel, op.bsr)

        self.access(True, run)

    def _verify(self, op: Verify) -> tuple[int, list[str]]:
        if self.oracle is None:
            return 0, []
        layout, rank = self.worker.layout, self.rank[1]
        engine = self.rank[0]

        def run(arr: np.ndarray) -> tuple[int, list[str]]:
            words, found = self.oracle.verify(arr, layout, rank, op.request, engine=engine,
                                              blocks=op.blocks, tokens=op.tokens,
                                              state_step=op.state_step)
            if op.zero_tail is not None:
                zero_words, zero_found = self.oracle.verify_zeros(
                    arr, layout, rank, engine=engine, blocks=op.blocks, tokens=op.zero_tail)
                words += zero_words
                found = found + zero_found
            self.oracle.write(arr, layout, rank, op.request, blocks=op.blocks,
                              tokens=op.compute, state_step=op.compute_step)
            return int(words), [str(m) for m in found[:8]]

        return self.access(True, run)

    def _evict(self, op: Evict) -> None:
        self.worker.evict(op.engine)

    # ---- events ---------------------------------------------------------------------------
    def poll(self, finished: list[int] | None = None) -> list[RankEvent]:
        """What happened on this rank since the last poll: transfers that reached a terminal
        state, messages that arrived, handles released late (in that order). ``finished``: the
        transfer handles that reached a terminal state, when the transport tells (else every
        request in flight is checked)."""
        worker, rank = self.worker, self.rank
        outcomes = worker.poll(finished)
        messages = worker.take_messages()
        released = worker.take_released()
        events: list[RankEvent] = [Outcome(rank, o) for o in outcomes] if outcomes else []
        if messages:
            events += [Message(rank, m) for m in messages]
        if released:
            events += [Released(rank, rid) for rid in released]
        return events

    def busy(self) -> bool:
        return bool(self.worker.in_flight() or self.worker.pending_releases())
