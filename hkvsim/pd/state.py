"""The request state table: where a request's flow is, and which moves are legal.

Two things are tracked apart, as a real engine does:

* the **phase**: where the coordinator's flow for the request is (waiting for blocks, moving
  bytes, releasing blocks, ...). Every move is checked against :data:`TRANSITIONS`; an illegal
  move is a coordinator bug and raises :class:`IllegalTransition`.
* the **status** reported for the request: ``pending`` until the request ends, then exactly one
  of ``ok``, ``failed`` or ``aborted`` (reported once; later failures of the same request are
  not reported again). A request can be reported failed or aborted while its flow still waits
  for transfers that may be writing its blocks (:data:`Phase.RELEASING`).
"""

from __future__ import annotations

from enum import Enum

__all__ = ["Phase", "TRANSITIONS", "IllegalTransition", "check_transition", "TERMINAL_STATUS"]


class Phase(Enum):
    ARRIVING = "arriving"  # before its arrival time
    QUEUED = "queued"  # waiting for a slot (max_inflight)
    PREFILL_BLOCKS = "prefill-blocks"  # waiting for prefill blocks
    PREFILLING = "prefilling"  # prefill ranks compute (write the pattern)
    DECODE_BLOCKS = "decode-blocks"  # waiting for decode blocks
    DECODE_FILL = "decode-fill"  # decode writes its prefix-cache hit
    CONNECTING = "connecting"  # handshake (pull) / notification handshake (push)
    TRANSFERRING = "transferring"  # READs or WRITEs in flight, watchdog armed
    RECOVERING = "recovering"  # policy "recompute": waiting for writers, then recomputing
    FINISHING = "finishing"  # post-process, verify, compute token N
    RELEASING = "releasing"  # decode blocks freed, or quarantined until no transfer can land
    DONE = "done"


P = Phase
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    P.ARRIVING: frozenset({P.QUEUED}),
    P.QUEUED: frozenset({P.PREFILL_BLOCKS}),
    P.PREFILL_BLOCKS: frozenset({P.PREFILLING}),
    P.PREFILLING: frozenset({P.DECODE_BLOCKS, P.DONE}),  # DONE: aborted on prefill
    P.DECODE_BLOCKS: frozenset({P.DECODE_FILL}),
    # a decode rank already dead: RELEASING (fail), or RECOVERING when only its NIXL agent died
    # and the policy recomputes
    P.DECODE_FILL: frozenset({P.CONNECTING, P.RECOVERING, P.RELEASING}),
    # a refused handshake or undelivered push registration fails the request (or recomputes)
    P.CONNECTING: frozenset({P.TRANSFERRING, P.RECOVERING, P.RELEASING}),
    P.TRANSFERRING: frozenset({P.FINISHING, P.RECOVERING, P.RELEASING}),
    P.RECOVERING: frozenset({P.FINISHING, P.RELEASING}),
    P.FINISHING: frozenset({P.RELEASING}),
    P.RELEASING: frozenset({P.DONE}),
    P.DONE: frozenset(),
}

TERMINAL_STATUS = frozenset({"ok", "failed", "aborted"})


class IllegalTransition(RuntimeError):
    """The coordinator tried a move the state table does not allow (a bug, never input)."""


def check_transition(request: str, old: Phase, new: Phase) -> None:
    if new not in TRANSITIONS[old]:
        allowed = ", ".join(sorted(p.value for p in TRANSITIONS[old])) or "none"
        raise IllegalTransition(f"request {request}: {old.value} -> {new.value} is not a legal "
                                f"move; from {old.value}: {allowed}")
