"""A Transport wrapper that injects faults into any backend (the real NIXL rank processes use
it; the simulated transport has the same hooks built in, in simulated time).

Supported kinds: ``fail-transfer`` (phase completion / setup / poll), ``stall-transfer`` and
``drop-notification``. A failing or stalled transfer loses its completion notification, as on the
simulator: the peer then frees by lease. A failing transfer (phase completion) is posted, so on a
real backend its bytes move and only its state reads ERR; the simulator moves none. A transfer
whose poll raises (``phase = "poll"``) moved its data, so its peer is told, but only once the
sender has raised and reported it: the notification waits until the rank calls
:meth:`FaultInjectingTransport.send_withheld` after sending what its poll found to the coordinator
(hkvsim/backends/rank.py). Attached to the transfer, or sent as the poll raised, it raced the
sender's failure to the coordinator (a push request then completed on decode or failed, by
scheduling), while on the simulator the failure always comes first. The decision for a transfer is
taken when it is created (its notification names the request), from the scenario's seeded
FaultPlan.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .base import DONE, ERR, PROC, TransportError

__all__ = ["FaultInjectingTransport", "WRAPPABLE_FAULTS"]

WRAPPABLE_FAULTS = ("fail-transfer", "stall-transfer", "drop-notification")


class FaultInjectingTransport:
    """Delegates every call to ``inner``; changes posts, polls and notifications per the plan."""

    def __init__(self, inner: Any, plan: Any, clock: Callable[[], float]) -> None:
        self._inner = inner
        self._plan = plan
        self._clock = clock
        self._pending: dict[int, Any] = {}  # handle -> PostFault decided at creation
        self._failed: dict[int, str] = {}  # handle -> injected failure reason
        self._stall_until: dict[int, float] = {}
        self._poll_raise: set[int] = set()
        self._withheld: dict[int, tuple[str, bytes]] = {}  # handle -> (peer, notification)
        self._due: list[tuple[str, bytes]] = []  # withheld, their poll raised: sent next
        self._dlist_agent: dict[int, str] = {}  # remote descriptor list -> its agent

    def __getattr__(self, name: str) -> Any:  # allocate, register_memory, name, ...
        return getattr(self._inner, name)

    # ---- creation: decide the fault, strip the notification it would lose ------------------
    def prep_xfer_dlist(self, agent: str, descs: Any, **kwargs: Any) -> int:
        handle: int = self._inner.prep_xfer_dlist(agent, descs, **kwargs)
        if agent:
            self._dlist_agent[handle] = agent
        return handle

    def _withhold(self, handle: int, peer: str, notif: bytes) -> None:
        """A poll fault's notification, kept back until the poll raises."""
        if notif and peer:
            self._withheld[handle] = (peer, notif)

    def _decide(self, remote: str, notif: bytes) -> tuple[Any, bytes, bytes]:
        """(fault, the notification the transfer carries, one held back until its poll
        raises)."""
        fault = self._plan.on_post(now=self._clock(), initiator=self._inner.name, remote=remote,
                                   notif=notif)
        if fault is not None and fault.kind == "slow":
            fault = None  # a slow link cannot be imposed on a real one
        if notif and self._plan.on_message(now=self._clock(), src=self._inner.name, dst=remote,
                                           message=notif) == float("inf"):
            notif = b""  # drop-notification: the data moves, the notification never arrives
        if fault is not None and fault.kind == "fail-poll":
            return fault, b"", notif
        if fault is not None and fault.kind in ("fail", "stall"):
            notif = b""
        return fault, notif, b""

    def make_prepped_xfer(self, op: str, local_dlist: int, local_ids: np.ndarray,
                          remote_dlist: int, remote_ids: np.ndarray, notif: bytes = b"") -> int:
        fault, sent, held = self._decide("", notif)
        handle = self._inner.make_prepped_xfer(op, local_dlist, local_ids, remote_dlist,
                                               remote_ids, sent)
        if fault is not None:
            self._pending[handle] = fault
            self._withhold(handle, self._dlist_agent.get(remote_dlist, ""), held)
        return handle

    def make_xfer(self, op: str, local_descs: np.ndarray, remote_agent: str,
                  remote_descs: np.ndarray, notif: bytes = b"") -> int:
        fault, sent, held = self._decide(remote_agent, notif)
        handle = self._inner.make_xfer(op, local_descs, remote_agent, remote_descs, sent)
        if fault is not None:
            self._pending[handle] = fault
            self._withhold(handle, remote_agent, held)
        return handle

    # ---- posting and polling ---------------------------------------------------------------
    def transfer(self, handle: int) -> str:
        fault = self._pending.pop(handle, None)
        if fault is not None and fault.kind == "fail-setup":
            raise TransportError(f"{self._inner.name}: injected failure posting transfer "
                                 f"{handle}", kind="transfer_setup_failed")
        state = self._inner.transfer(handle)
        if fault is None:
            return state
        if fault.kind == "fail":
            self._failed[handle] = "injected transfer failure (state ERR)"
        elif fault.kind == "fail-poll":
            self._poll_raise.add(handle)
        elif fault.kind == "stall":
            self._stall_until[handle] = self._clock() + fault.seconds
            return PROC
        return state

    def check_xfer_state(self, handle: int) -> str:
        state = self._inner.check_xfer_state(handle)
        if handle in self._stall_until:
            if self._clock() < self._stall_until[handle] or state == PROC:
                return PROC
            del self._stall_until[handle]
            self._failed[handle] = "injected stall: the transfer stayed PROC, then failed"
        if handle in self._poll_raise and state != PROC:
            self._poll_raise.discard(handle)
            held = self._withheld.pop(handle, None)
            if held is not None:  # the data moved: the peer hears of it after the failure
                self._due.append(held)
            raise TransportError(f"{self._inner.name}: injected exception polling transfer "
                                 f"{handle}", kind="transfer_exception")
        if handle in self._failed and state in (DONE, ERR):
            return ERR
        return state

    def send_withheld(self) -> int:
        """Send the notifications of transfers whose poll has raised; the rank calls this once it
        has reported that poll's failure, so the coordinator hears of the failure before the
        peer can hear of the data. Returns how many were sent."""
        due, self._due = self._due, []
        for peer, notif in due:
            self._inner.send_notif(peer, notif)
        return len(due)

    def xfer_failure(self, handle: int) -> tuple[str, str] | None:
        if handle in self._failed:
            return ("transfer_failed", self._failed[handle])
        inner = getattr(self._inner, "xfer_failure", None)
        return inner(handle) if inner is not None else None

    def release_xfer_handle(self, handle: int) -> None:
        if handle in self._stall_until:  # still "in flight" as far as the connector knows
            raise TransportError(f"{self._inner.name}: cannot release transfer {handle} while "
                                 f"it is active (DMA may be live)")
        self._inner.release_xfer_handle(handle)
        self._failed.pop(handle, None)
        self._poll_raise.discard(handle)
        self._withheld.pop(handle, None)

    def give_up_stalls(self) -> None:
        """End every injected stall now (at shutdown): the transfers then report ERR."""
        now = self._clock()
        for handle in self._stall_until:
            self._stall_until[handle] = now

    def send_notif(self, agent: str, message: bytes) -> None:
        if self._plan.on_message(now=self._clock(), src=self._inner.name, dst=agent,
                                 message=message) == float("inf"):
            return  # dropped
        self._inner.send_notif(agent, message)
