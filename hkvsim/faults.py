"""Fault injection for the simulated fabric (``[[faults]]`` in a scenario).

Each fault targets a request (by index), a rank (``engine`` and/or ``rank``), a time window
(from ``at_seconds``, ``window_seconds`` long; open-ended without it) or a probability; every
random choice comes from a generator seeded by the scenario seed and the fault's position, so a
scenario reproduces the same faults bit for bit. ``duration_seconds`` is only ever the delay,
stall or lease of the kinds below; a target a kind does not use is refused when the scenario is
read (:class:`hkvsim.scenario.Fault`).

=====================  ==========================================================================
kind                   effect
=====================  ==========================================================================
drop-notification      a transfer-completion / notification-only message is lost
delay-notification     it arrives ``duration_seconds`` late (default 1 s)
fail-transfer          the transfer ends in ERR (phase "completion", default), posting it raises
                       ("setup": transfer_setup_failed) or polling it raises ("poll":
                       transfer_exception)
stall-transfer         the transfer stays PROC for ``duration_seconds`` (default: forever for the
                       connector; the transport gives up after 10x the transfer timeout), then ERR
disconnect-peer        the targeted rank's agent dies (at ``at_seconds``, or when the targeted
                       request posts to it): posts raise, in-flight transfers end in ERR
kill-rank              the same, and the rank's process dies with it: the simulator refuses every
                       later call to the rank (no recompute there); the real backend kills it
slow-link              transfers of the targeted rank / window move at bandwidth / ``factor``
expire-lease-early     prefill's lease for the targeted request expires after
                       ``duration_seconds`` (default 0): prefill frees while decode reads
abort-request          the request is aborted at ``phase`` (handled by the cluster)
=====================  ==========================================================================
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["FaultPlan", "PostFault", "request_index"]

_REQUEST = re.compile(r"req-(\d+)-")


def request_index(text: str) -> int | None:
    """The workload index in a request id or a '{request_id}:{n}' notification."""
    m = _REQUEST.search(text)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class PostFault:
    kind: str  # "fail" | "fail-setup" | "fail-poll" | "stall" | "slow"
    seconds: float = 0.0  # stall duration
    factor: float = 1.0  # slow-link divisor


class FaultPlan:
    """Decides, deterministically, which transport events a scenario's faults hit."""

    def __init__(self, faults: Sequence[Any], *, seed: int, transfer_timeout: float) -> None:
        self.faults = list(faults)
        self._rngs = [np.random.default_rng([seed, i]) for i in range(len(self.faults))]
        self.transfer_timeout = transfer_timeout
        self.injected: dict[str, int] = {}

    def count(self, kind: str) -> None:
        """One more injection of ``kind`` (reported as the counter ``fault:KIND``)."""
        self.injected[kind] = self.injected.get(kind, 0) + 1

    def _hits(self, i: int, *, now: float, request: int | None, agents: Sequence[str]) -> bool:
        f = self.faults[i]
        if f.request is not None and f.request != request:
            return False
        if f.engine is not None or f.rank is not None:
            if not any(_agent_matches(a, f.engine, f.rank) for a in agents):
                return False
        if f.at_seconds is not None:
            end = f.at_seconds + (f.window_seconds or float("inf"))
            if not f.at_seconds <= now < end:
                return False
        if f.probability is not None:
            return bool(self._rngs[i].random() < f.probability)
        return True

    def on_post(self, *, now: float, initiator: str, remote: str, notif: bytes
                ) -> PostFault | None:
        request = request_index(notif.decode(errors="replace"))
        for i, f in enumerate(self.faults):
            if f.kind not in ("fail-transfer", "stall-transfer", "slow-link"):
                continue
            if not self._hits(i, now=now, request=request, agents=(initiator, remote)):
                continue
            self.count(f.kind)
            if f.kind == "fail-transfer":
                return PostFault({"setup": "fail-setup", "poll": "fail-poll"}.get(
                    f.phase or "completion", "fail"))
            if f.kind == "stall-transfer":
                return PostFault("stall", seconds=f.duration_seconds or 10 * self.transfer_timeout)
            return PostFault("slow", factor=f.factor or 10.0)
        return None

    def on_message(self, *, now: float, src: str, dst: str, message: bytes) -> float | None:
        """None: deliver now; a number: deliver after that many seconds; inf: drop."""
        if message.startswith(b"PUSH_REG:") or message.startswith(b"HB:"):
            return None
        request = request_index(message.decode(errors="replace"))
        for i, f in enumerate(self.faults):
            if f.kind not in ("drop-notification", "delay-notification"):
                continue
            if not self._hits(i, now=now, request=request, agents=(src, dst)):
                continue
            self.count(f.kind)
            return float("inf") if f.kind == "drop-notification" else (f.duration_seconds or 1.0)
        return None

    def peers_to_kill(self, *, now: float, request: int | None, initiator: str, remote: str
                      ) -> list[tuple[str, str]]:
        """(agent, fault kind) of each agent that dies when ``request`` posts from
        ``initiator`` to ``remote``: ``kill-rank`` kills the rank's process with it,
        ``disconnect-peer`` only its agent."""
        dead = []
        for i, f in enumerate(self.faults):
            if f.kind not in ("disconnect-peer", "kill-rank") or f.at_seconds is not None:
                continue
            if f.request is not None and f.request != request:
                continue
            if f.engine is None and f.rank is None:
                target = remote  # a request-targeted disconnect: the peer it talks to dies
            elif _agent_matches(remote, f.engine, f.rank):
                target = remote
            elif _agent_matches(initiator, f.engine, f.rank):
                target = initiator
            else:
                continue
            if f.probability is not None and not self._rngs[i].random() < f.probability:
                continue
            dead.append((target, f.kind))
        return dead

    def timed_deaths(self, agents: Sequence[str]) -> list[tuple[float, str, str]]:
        """(time, agent, fault kind) of each timed death (see peers_to_kill)."""
        out = []
        for f in self.faults:
            if f.kind in ("disconnect-peer", "kill-rank") and f.at_seconds is not None:
                out.extend((f.at_seconds, a, f.kind) for a in agents
                           if _agent_matches(a, f.engine, f.rank))
        return out

    def abort_phase(self, request: int) -> str | None:
        """Where the request is aborted, if an abort-request fault targets it."""
        for i, f in enumerate(self.faults):
            if f.kind == "abort-request" and (f.request is None or f.request == request):
                if f.probability is not None and not self._rngs[i].random() < f.probability:
                    continue
                self.count(f.kind)
                return f.phase or "mid-transfer"
        return None

    def lease_for(self, request: int, default: float) -> float:
        for i, f in enumerate(self.faults):
            if f.kind == "expire-lease-early" and (f.request is None or f.request == request):
                if f.probability is not None and not self._rngs[i].random() < f.probability:
                    continue
                self.count(f.kind)
                return f.duration_seconds or 0.0
        return default


def _agent_matches(agent: str, engine: str | None, rank: int | None) -> bool:
    name, _, r = agent.rpartition(".")
    return (engine is None or name == engine) and (rank is None or str(rank) == r)
