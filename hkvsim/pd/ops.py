"""What the coordinator asks a rank to do, what it gets back, and what ranks report on their own.

Typed messages, not string dispatch: every operation is a frozen dataclass; a driver hands it to
the rank (in process, or over the side channel to a rank process) and feeds the :class:`Reply`
back to the coordinator. Events a rank raises by itself (a transfer reached a terminal state, a
notification arrived, a handle that could not be released is released now, the rank died) are
:data:`RankEvent` values. ``to_wire`` / ``from_wire`` give the msgpack-safe form (no pickle): the
remote driver sends ``{"op": <name>, ...fields}`` and the rank process rebuilds the same type.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Union

import numpy as np

from ..connector.push import PushRegistration, WriteRequest
from ..connector.worker import ReadRequest, RequestOutcome
from ..transport.base import XferTelemetry

__all__ = ["RankId", "OracleWrite", "WriteStale", "Connect", "ConnectNotifyOnly", "StartRead",
           "StartWrite", "Abort", "SendNotif", "PostProcess", "Verify", "Evict", "RankOp",
           "Reply", "RankError", "Outcome", "Message", "Released", "Died", "RankEvent",
           "op_to_wire", "op_from_wire", "WireError", "outcome_to_wire", "outcome_from_wire",
           "OPS", "reply_value_to_wire", "reply_value_from_wire"]

RankId = tuple[str, int]  # (engine id, tp rank)

_MAX_IDS = 1 << 24


class WireError(ValueError):
    """A message that is not a well-formed operation, reply or event."""


# ---- wire helpers ---------------------------------------------------------------------------
def _ids_out(ids: Any) -> list[int]:
    return [int(i) for i in np.asarray(ids, dtype=np.int64).reshape(-1)]


def _ids_in(value: Any, what: str) -> np.ndarray:
    if not isinstance(value, list) or len(value) > _MAX_IDS:
        raise WireError(f"{what} must be a list of at most {_MAX_IDS} ints")
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
        raise WireError(f"{what} must hold non-negative ints")
    return np.asarray(value, dtype=np.int64)


def _groups_out(groups: Mapping[int, Any]) -> list[list[Any]]:
    return [[int(g), _ids_out(ids)] for g, ids in groups.items()]


def _groups_in(value: Any, what: str) -> dict[int, np.ndarray]:
    if not isinstance(value, list):
        raise WireError(f"{what} must be a list of [group, ids] pairs")
    out: dict[int, np.ndarray] = {}
    for item in value:
        if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], int)
                or isinstance(item[0], bool) or item[0] in out):
            raise WireError(f"{what}: each entry must be a [group, ids] pair with a unique int "
                            f"group")
        out[item[0]] = _ids_in(item[1], f"{what}[{item[0]}]")
    return out


def _range_in(value: Any, what: str) -> tuple[int, int]:
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
            or value[0] > value[1]):
        raise WireError(f"{what} must be [start, stop] with 0 <= start <= stop, got {value!r}")
    return value[0], value[1]


def _opt_int(value: Any, what: str, *, non_negative: bool = False) -> int | None:
    if value is None:
        return None
    if non_negative:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise WireError(f"{what} must be a non-negative int or None, got {value!r}")
    elif not isinstance(value, int) or isinstance(value, bool):
        raise WireError(f"{what} must be an int or None")
    return value


def _typed(value: Any, kind: type, what: str) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise WireError(f"{what} must be {kind.__name__}, got {type(value).__name__}")
    return value


# ---- operations -----------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class OracleWrite:
    """Compute: write the oracle pattern of tokens [start, stop) (and the state after
    ``state_step`` tokens) into the request's blocks."""

    name: ClassVar[str] = "oracle_write"
    request: int
    blocks: Mapping[int, np.ndarray]
    tokens: tuple[int, int]
    state_step: int | None

    def to_wire(self) -> dict[str, Any]:
        return {"request": self.request, "blocks": _groups_out(self.blocks),
                "tokens": list(self.tokens), "state_step": self.state_step}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> OracleWrite:
        return cls(request=_typed(d["request"], int, "request"),
                   blocks=_groups_in(d["blocks"], "blocks"),
                   tokens=_range_in(d["tokens"], "tokens"),
                   state_step=_opt_int(d["state_step"], "state_step"))


@dataclass(frozen=True, kw_only=True)
class WriteStale:
    """Fill tokens [start, stop) of the request's attention blocks with an earlier tenant's
    bytes: what a reused block holds where nothing is written (the connector must zero it)."""

    name: ClassVar[str] = "write_stale"
    request: int
    blocks: Mapping[int, np.ndarray]
    tokens: tuple[int, int]

    def to_wire(self) -> dict[str, Any]:
        return {"request": self.request, "blocks": _groups_out(self.blocks),
                "tokens": list(self.tokens)}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> WriteStale:
        return cls(request=_typed(d["request"], int, "request"),
                   blocks=_groups_in(d["blocks"], "blocks"),
                   tokens=_range_in(d["tokens"], "tokens"))


@dataclass(frozen=True, kw_only=True)
class Connect:
    """Handshake with every rank of ``remote_engine`` (payloads by remote rank). Reply value:
    None, or the refusal (the handshake error's text)."""

    name: ClassVar[str] = "connect"
    remote_engine: str
    payloads: Mapping[int, bytes]

    def to_wire(self) -> dict[str, Any]:
        return {"remote_engine": self.remote_engine,
                "payloads": [[int(r), bytes(p)] for r, p in sorted(self.payloads.items())]}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Connect:
        payloads: dict[int, bytes] = {}
        items = d["payloads"]
        if not isinstance(items, list):
            raise WireError("connect: payloads must be [rank, bytes] pairs")
        for item in items:
            if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], int)
                    or isinstance(item[0], bool) or not isinstance(item[1], bytes)):
                raise WireError("connect: payloads must be [rank, bytes] pairs")
            payloads[item[0]] = item[1]
        return cls(remote_engine=_typed(d["remote_engine"], str, "remote_engine"),
                   payloads=payloads)


@dataclass(frozen=True, kw_only=True)
class ConnectNotifyOnly:
    """Push: learn the remote agents only to send them notifications (no descriptors)."""

    name: ClassVar[str] = "connect_notify_only"
    remote_engine: str
    agent_metadata: tuple[bytes, ...]  # one per remote rank, in rank order

    def to_wire(self) -> dict[str, Any]:
        return {"remote_engine": self.remote_engine,
                "agent_metadata": [bytes(m) for m in self.agent_metadata]}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> ConnectNotifyOnly:
        items = d["agent_metadata"]
        if not isinstance(items, list) or not all(isinstance(m, bytes) for m in items):
            raise WireError("connect_notify_only: agent_metadata must be a list of bytes")
        return cls(remote_engine=_typed(d["remote_engine"], str, "remote_engine"),
                   agent_metadata=tuple(items))


@dataclass(frozen=True, kw_only=True)
class StartRead:
    """Pull: post the READs of one request. Reply value: an immediate outcome (a setup failure,
    or nothing to move), or None (it reports an :class:`Outcome` event later)."""

    name: ClassVar[str] = "start_read"
    wire_fields: ClassVar[tuple[str, ...]] = (
        "request", "request_id", "prefill_request_id", "remote_engine", "prefill_blocks",
        "decode_blocks", "decode_hit_blocks", "prefill_tokens")
    request: int  # the workload index the transfers are for
    read: ReadRequest

    def to_wire(self) -> dict[str, Any]:
        r = self.read
        return {"request": self.request, "request_id": r.request_id,
                "prefill_request_id": r.prefill_request_id, "remote_engine": r.remote_engine,
                "prefill_blocks": _groups_out(r.prefill_blocks),
                "decode_blocks": _groups_out(r.decode_blocks),
                "decode_hit_blocks": r.decode_hit_blocks, "prefill_tokens": r.prefill_tokens}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> StartRead:
        return cls(request=_typed(d["request"], int, "request"), read=ReadRequest(
            request_id=_typed(d["request_id"], str, "request_id"),
            prefill_request_id=_typed(d["prefill_request_id"], str, "prefill_request_id"),
            remote_engine=_typed(d["remote_engine"], str, "remote_engine"),
            prefill_blocks=_groups_in(d["prefill_blocks"], "prefill_blocks"),
            decode_blocks=_groups_in(d["decode_blocks"], "decode_blocks"),
            decode_hit_blocks=_typed(d["decode_hit_blocks"], int, "decode_hit_blocks"),
            prefill_tokens=_opt_int(d["prefill_tokens"], "prefill_tokens", non_negative=True)))


@dataclass(frozen=True, kw_only=True)
class StartWrite:
    """Push: post the WRITEs of one prefill request into a decode registration."""

    name: ClassVar[str] = "start_write"
    wire_fields: ClassVar[tuple[str, ...]] = ("request", "prefill_request_id", "registration",
                                              "prefill_blocks")
    request: int
    write: WriteRequest

    def to_wire(self) -> dict[str, Any]:
        w = self.write
        return {"request": self.request, "prefill_request_id": w.prefill_request_id,
                "registration": w.registration.encode(),
                "prefill_blocks": _groups_out(w.prefill_blocks)}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> StartWrite:
        registration = PushRegistration.decode(_typed(d["registration"], bytes, "registration"))
        if registration is None:
            raise WireError("start_write: malformed push registration")
        return cls(request=_typed(d["request"], int, "request"), write=WriteRequest(
            prefill_request_id=_typed(d["prefill_request_id"], str, "prefill_request_id"),
            registration=registration,
            prefill_blocks=_groups_in(d["prefill_blocks"], "prefill_blocks")))


@dataclass(frozen=True, kw_only=True)
class Abort:
    """Give up on a request's transfers (watchdog, abort). Reply value: its outcome, or None
    when the rank had nothing in flight for it."""

    name: ClassVar[str] = "abort"
    request_id: str
    reason: str
    failure_class: str

    def to_wire(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "reason": self.reason,
                "failure_class": self.failure_class}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Abort:
        return cls(request_id=_typed(d["request_id"], str, "request_id"),
                   reason=_typed(d["reason"], str, "reason"),
                   failure_class=_typed(d["failure_class"], str, "failure_class"))


@dataclass(frozen=True, kw_only=True)
class SendNotif:
    """Send ``message`` to each agent in order (heartbeats, push registrations), stopping at
    the first failure if ``stop_at_failure``. Reply value: the agents it could not be delivered
    to, as (agent, failure class, reason) triples."""

    name: ClassVar[str] = "send_notif"
    agents: tuple[str, ...]
    message: bytes
    stop_at_failure: bool = False

    def to_wire(self) -> dict[str, Any]:
        return {"agents": list(self.agents), "message": bytes(self.message),
                "stop_at_failure": self.stop_at_failure}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> SendNotif:
        agents = d["agents"]
        if not isinstance(agents, list) or not all(isinstance(a, str) for a in agents):
            raise WireError("send_notif: agents must be a list of str")
        return cls(agents=tuple(agents), message=_typed(d["message"], bytes, "message"),
                   stop_at_failure=_typed(d["stop_at_failure"], bool, "stop_at_failure"))


@dataclass(frozen=True, kw_only=True)
class PostProcess:
    """Block size ratio: zero the untransferred sub-blocks, regroup heads (§6)."""

    name: ClassVar[str] = "post_process"
    zero: np.ndarray
    kernel: np.ndarray
    bsr: int

    def to_wire(self) -> dict[str, Any]:
        return {"zero": _ids_out(self.zero), "kernel": _ids_out(self.kernel), "bsr": self.bsr}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> PostProcess:
        return cls(zero=_ids_in(d["zero"], "zero"), kernel=_ids_in(d["kernel"], "kernel"),
                   bsr=_typed(d["bsr"], int, "bsr"))


@dataclass(frozen=True, kw_only=True)
class Verify:
    """Check the loaded tokens (and the state after ``state_step``), that ``zero_tail`` tokens
    are zero, then compute token N (write ``compute`` tokens and the state after
    ``compute_step``). Reply value: (mismatched words, explanations)."""

    name: ClassVar[str] = "verify"
    request: int
    blocks: Mapping[int, np.ndarray]
    tokens: tuple[int, int]
    state_step: int | None
    zero_tail: tuple[int, int] | None
    compute: tuple[int, int]
    compute_step: int | None

    def to_wire(self) -> dict[str, Any]:
        return {"request": self.request, "blocks": _groups_out(self.blocks),
                "tokens": list(self.tokens), "state_step": self.state_step,
                "zero_tail": None if self.zero_tail is None else list(self.zero_tail),
                "compute": list(self.compute), "compute_step": self.compute_step}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Verify:
        tail = d["zero_tail"]
        return cls(request=_typed(d["request"], int, "request"),
                   blocks=_groups_in(d["blocks"], "blocks"),
                   tokens=_range_in(d["tokens"], "tokens"),
                   state_step=_opt_int(d["state_step"], "state_step"),
                   zero_tail=None if tail is None else _range_in(tail, "zero_tail"),
                   compute=_range_in(d["compute"], "compute"),
                   compute_step=_opt_int(d["compute_step"], "compute_step"))


@dataclass(frozen=True, kw_only=True)
class Evict:
    """Drop a remote engine idle past its TTL (its lists and agents)."""

    name: ClassVar[str] = "evict"
    engine: str

    def to_wire(self) -> dict[str, Any]:
        return {"engine": self.engine}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Evict:
        return cls(engine=_typed(d["engine"], str, "engine"))


RankOp = Union[OracleWrite, WriteStale, Connect, ConnectNotifyOnly, StartRead, StartWrite, Abort,
               SendNotif, PostProcess, Verify, Evict]
OPS: dict[str, type] = {cls.name: cls for cls in (  # type: ignore[attr-defined]
    OracleWrite, WriteStale, Connect, ConnectNotifyOnly, StartRead, StartWrite, Abort, SendNotif,
    PostProcess, Verify, Evict)}


def op_to_wire(op: RankOp) -> dict[str, Any]:
    return {"op": op.name, **op.to_wire()}


def op_from_wire(message: Mapping[str, Any]) -> RankOp:
    """The operation in ``message`` (checked: exact fields, types); WireError otherwise."""
    name = message.get("op")
    cls = OPS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise WireError(f"unknown operation {name!r}")
    names = getattr(cls, "wire_fields", None) or tuple(f.name for f in fields(cls))
    expected = set(names) | {"op", "seq"}
    extra = sorted(set(message) - expected)
    missing = sorted(expected - set(message) - {"seq"})
    if extra or missing:
        raise WireError(f"{name}: unexpected field(s) {extra}, missing {missing}")
    try:
        return cls.from_wire(message)  # type: ignore[no-any-return]
    except KeyError as exc:
        raise WireError(f"{name}: missing field {exc}") from None


# ---- replies --------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankError:
    """Why a rank could not carry out an operation (``kind`` is a failure class)."""

    kind: str
    message: str


@dataclass(frozen=True)
class Reply:
    """The result of one operation: ``value`` on success, ``error`` otherwise."""

    call_id: int
    value: Any = None
    error: RankError | None = None


# ---- events ranks raise ----------------------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    """A request's transfers on this rank reached a terminal state."""

    rank: RankId
    outcome: RequestOutcome


@dataclass(frozen=True)
class Message:
    """A notification (or any message) arrived at this rank's agent."""

    rank: RankId
    message: bytes


@dataclass(frozen=True)
class Released:
    """A handle the rank could not release earlier (DMA may have been live) is released: the
    request's destination blocks may be reused once no other transfer can write them."""

    rank: RankId
    request_id: str


@dataclass(frozen=True)
class Died:
    """The rank is gone (its process exited, or its agent disconnected). ``reason`` is a whole
    sentence naming the rank and how it died; requests that fail because of it quote it.
    ``process``: the rank's process died with it (False: only its NIXL agent did, and the rank
    can still compute, e.g. recompute a request whose load failed)."""

    rank: RankId
    reason: str
    process: bool = True


RankEvent = Union[Outcome, Message, Released, Died]


# ---- outcomes on the wire --------------------------------------------------------------------
def outcome_to_wire(outcome: RequestOutcome) -> dict[str, Any]:
    return {
        "request_id": outcome.request_id, "ok": bool(outcome.ok), "reason": outcome.reason,
        "failure_class": outcome.failure_class, "descriptors": int(outcome.descriptors),
        "nbytes": int(outcome.nbytes), "transfers": int(outcome.transfers),
        "unreleased": int(outcome.unreleased),
        "telemetry": [{"nbytes": int(t.nbytes), "descriptors": int(t.descriptors),
                       "post_seconds": float(t.post_seconds),
                       "transfer_seconds": float(t.transfer_seconds),
                       "submitted": float(t.submitted),
                       "completed": None if t.completed is None else float(t.completed),
                       "path": [str(p) for p in t.path],
                       "coalesced": None if t.coalesced is None else int(t.coalesced),
                       "coalesced_model": None if t.coalesced_model is None
                       else int(t.coalesced_model),
                       "peer": None if t.peer is None else str(t.peer)}
                      for t in outcome.telemetry],
    }


def outcome_from_wire(data: Any) -> RequestOutcome:
    if not isinstance(data, dict):
        raise WireError("outcome must be a map")
    try:
        telemetry = [XferTelemetry(nbytes=int(t["nbytes"]), descriptors=int(t["descriptors"]),
                                   post_seconds=float(t["post_seconds"]),
                                   transfer_seconds=float(t["transfer_seconds"]),
                                   submitted=float(t["submitted"]),
                                   completed=None if t["completed"] is None
                                   else float(t["completed"]),
                                   path=tuple(str(p) for p in t["path"]),
                                   coalesced=None if t.get("coalesced") is None
                                   else int(t["coalesced"]),
                                   coalesced_model=None if t.get("coalesced_model") is None
                                   else int(t["coalesced_model"]),
                                   peer=None if t.get("peer") is None else str(t["peer"]))
                     for t in data["telemetry"]]
        return RequestOutcome(request_id=str(data["request_id"]), ok=bool(data["ok"]),
                              reason=data["reason"], failure_class=data["failure_class"],
                              descriptors=int(data["descriptors"]), nbytes=int(data["nbytes"]),
                              transfers=int(data["transfers"]),
                              unreleased=int(data.get("unreleased", 0)), telemetry=telemetry)
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"malformed outcome: {exc}") from None



# ---- reply values on the wire ----------------------------------------------------------------
_OUTCOME_REPLIES = (StartRead, StartWrite, Abort)


def reply_value_to_wire(op: RankOp, value: Any) -> Any:
    """The msgpack-safe form of ``op``'s reply value."""
    if isinstance(op, _OUTCOME_REPLIES):
        return None if value is None else outcome_to_wire(value)
    if isinstance(op, SendNotif):
        return [[str(a), str(k), str(t)] for a, k, t in value]
    if isinstance(op, Verify):
        words, found = value
        return [int(words), [str(m) for m in found]]
    if isinstance(op, Connect):
        return None if value is None else str(value)
    return None


def reply_value_from_wire(op: RankOp, data: Any) -> Any:
    """``op``'s reply value from its wire form (WireError when it is not one)."""
    if isinstance(op, _OUTCOME_REPLIES):
        return None if data is None else outcome_from_wire(data)
    if isinstance(op, SendNotif):
        if not isinstance(data, list) or not all(
                isinstance(x, list) and len(x) == 3 and all(isinstance(v, str) for v in x)
                for x in data):
            raise WireError("send_notif reply must be a list of [agent, kind, reason]")
        return [tuple(x) for x in data]
    if isinstance(op, Verify):
        if (not isinstance(data, list) or len(data) != 2 or not isinstance(data[0], int)
                or not isinstance(data[1], list) or not all(isinstance(m, str) for m in data[1])):
            raise WireError("verify reply must be [words, [explanations]]")
        return data[0], list(data[1])
    if isinstance(op, Connect):
        if data is not None and not isinstance(data, str):
            raise WireError("connect reply must be None or the refusal text")
        return data
    if data is not None:
        raise WireError(f"{op.name} reply carries no value")
    return None
