"""The rank operations' wire form (hkvsim/pd/ops.py): what the NIXL driver sends a rank process
over its side channel, as msgpack (never pickle). Every operation and reply value survives the
trip unchanged, and a message that is not exactly one is refused with a WireError naming what is
wrong, before the rank acts on any of it."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest

from hkvsim.connector.push import PushRegistration, WriteRequest
from hkvsim.connector.worker import ReadRequest, RequestOutcome
from hkvsim.pd.ops import (
    OPS,
    Abort,
    Connect,
    ConnectNotifyOnly,
    Evict,
    OracleWrite,
    PostProcess,
    SendNotif,
    StartRead,
    StartWrite,
    Verify,
    WireError,
    WriteStale,
    op_from_wire,
    op_to_wire,
    outcome_from_wire,
    outcome_to_wire,
    reply_value_from_wire,
    reply_value_to_wire,
)
from hkvsim.transport.base import XferTelemetry

BLOCKS = {0: np.array([5, 6, 7]), 3: np.array([40])}
REGISTRATION = PushRegistration(decode_request_id="req-1-00ff", decode_engine="decode0",
                                decode_tp=2, prefill_engine="prefill0",
                                blocks={0: np.array([9, 10])}, hit_blocks=1)
EXAMPLES = [
    OracleWrite(request=3, blocks=BLOCKS, tokens=(0, 700), state_step=700),
    OracleWrite(request=0, blocks={}, tokens=(5, 5), state_step=None),
    WriteStale(request=2, blocks=BLOCKS, tokens=(700, 768)),
    Connect(remote_engine="prefill1", payloads={0: b"\x00meta", 1: b"m1"}),
    ConnectNotifyOnly(remote_engine="decode0", agent_metadata=(b"a0", b"a1")),
    StartRead(request=4, read=ReadRequest(request_id="req-4-aa", prefill_request_id="req-4-bb",
                                          remote_engine="prefill0", prefill_blocks=BLOCKS,
                                          decode_blocks={0: np.array([1, 2, 3])},
                                          decode_hit_blocks=2, prefill_tokens=699)),
    StartWrite(request=1, write=WriteRequest(prefill_request_id="req-1-0a0b",
                                             registration=REGISTRATION, prefill_blocks=BLOCKS)),
    Abort(request_id="req-7", reason="watchdog", failure_class="timeout"),
    SendNotif(agents=("decode0.0", "decode0.1"), message=b"hb", stop_at_failure=True),
    PostProcess(zero=np.array([3, 4]), kernel=np.array([8, 9, 10]), bsr=4),
    Verify(request=5, blocks=BLOCKS, tokens=(0, 700), state_step=700, zero_tail=(700, 768),
           compute=(700, 701), compute_step=701),
    Verify(request=5, blocks=BLOCKS, tokens=(0, 700), state_step=None, zero_tail=None,
           compute=(700, 701), compute_step=None),
    Evict(engine="prefill2"),
]


def _plain(value):
    """A value with numpy arrays and nested dataclasses turned into comparable Python."""
    if isinstance(value, np.ndarray):
        return ("array", str(value.dtype), value.tolist())
    if dataclasses.is_dataclass(value):
        return (type(value).__name__,
                {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)})
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def _trip(message: dict) -> dict:
    return msgpack.unpackb(msgpack.packb(message, use_bin_type=True), raw=False,
                           strict_map_key=False)


def test_every_operation_is_covered_here() -> None:
    assert {type(op) for op in EXAMPLES} == set(OPS.values())


@pytest.mark.parametrize("op", EXAMPLES, ids=lambda op: op.name)
def test_each_operation_survives_the_wire_unchanged(op) -> None:
    back = op_from_wire(_trip({**op_to_wire(op), "seq": 17}))
    assert type(back) is type(op)
    assert _plain(back) == _plain(op)
    # ids come back as int64 arrays, whatever the sender held
    assert all(ids.dtype == np.int64 for ids in (getattr(back, "blocks", None) or {}).values())


def _start_read() -> dict:
    return _trip(op_to_wire(EXAMPLES[5]))


@pytest.mark.parametrize(("change", "message"), [
    (lambda m: m.update(op="start_reed"), "unknown operation 'start_reed'"),
    (lambda m: m.update(op=7), "unknown operation 7"),
    (lambda m: m.update(extra=1), "unexpected field(s) ['extra']"),
    (lambda m: m.pop("decode_hit_blocks"), "missing ['decode_hit_blocks']"),
    (lambda m: m.update(request="4"), "request must be int, got str"),
    (lambda m: m.update(request=True), "request must be int, got bool"),
    (lambda m: m.update(prefill_blocks=[[0, [1]], [0, [2]]]), "unique int group"),
    (lambda m: m.update(prefill_blocks=[[True, [1]]]), "unique int group"),
    (lambda m: m.update(prefill_blocks=[[0, [1], 2]]), "unique int group"),
    (lambda m: m.update(prefill_blocks={0: [1]}), "must be a list of [group, ids] pairs"),
    (lambda m: m.update(decode_blocks=[[0, [1, -2]]]), "decode_blocks[0] must hold non-negative"),
    (lambda m: m.update(decode_blocks=[[0, [1, False]]]), "must hold non-negative ints"),
    (lambda m: m.update(decode_blocks=[[0, "12"]]), "must be a list of at most"),
    (lambda m: m.update(prefill_tokens="699"), "prefill_tokens must be a non-negative int or None"),
    (lambda m: m.update(prefill_tokens=-1), "prefill_tokens must be a non-negative int or None"),
    (lambda m: m.update(prefill_tokens=True), "prefill_tokens must be a non-negative int or None"),
    (lambda m: m.pop("prefill_tokens"), "missing ['prefill_tokens']"),
])
def test_a_malformed_start_read_is_refused_naming_what_is_wrong(change, message) -> None:
    wire = _start_read()
    change(wire)
    with pytest.raises(WireError) as caught:
        op_from_wire(wire)
    assert message in str(caught.value)


@pytest.mark.parametrize(("op", "field", "value", "message"), [
    (EXAMPLES[0], "tokens", [700, 0], "tokens must be [start, stop] with 0 <= start <= stop"),
    (EXAMPLES[0], "tokens", [-1, 5], "0 <= start <= stop"),
    (EXAMPLES[0], "tokens", [1, 2, 3], "0 <= start <= stop"),
    (EXAMPLES[0], "state_step", "7", "state_step must be an int or None"),
    (EXAMPLES[3], "payloads", [[0, "text"]], "payloads must be [rank, bytes] pairs"),
    (EXAMPLES[3], "payloads", {0: b"x"}, "payloads must be [rank, bytes] pairs"),
    (EXAMPLES[4], "agent_metadata", [b"a", "b"], "agent_metadata must be a list of bytes"),
    (EXAMPLES[6], "registration", b"not a registration", "malformed push registration"),
    (EXAMPLES[8], "agents", ["a", 1], "agents must be a list of str"),
    (EXAMPLES[8], "stop_at_failure", 1, "stop_at_failure must be bool"),
    (EXAMPLES[9], "kernel", [1, -1], "kernel must hold non-negative ints"),
    (EXAMPLES[10], "zero_tail", [9, 3], "zero_tail must be [start, stop]"),
])
def test_malformed_fields_are_refused(op, field, value, message) -> None:
    wire = _trip(op_to_wire(op))
    wire[field] = value
    with pytest.raises(WireError) as caught:
        op_from_wire(wire)
    assert message in str(caught.value)


OUTCOME = RequestOutcome(request_id="req-2", ok=False, reason="transfer failed",
                         failure_class="transfer_failed", descriptors=12, nbytes=4096,
                         transfers=2, unreleased=1, telemetry=[
                             XferTelemetry(nbytes=4096, descriptors=12, post_seconds=1e-4,
                                           transfer_seconds=2e-3, submitted=0.5, completed=None,
                                           path=("nvlink", "d0"), coalesced=3,
                                           coalesced_model=3)])


@pytest.mark.parametrize(("op", "value"), [
    (EXAMPLES[5], OUTCOME), (EXAMPLES[5], None), (EXAMPLES[7], OUTCOME),
    (EXAMPLES[8], [("decode0.1", "agent_gone", "no such agent")]),
    (EXAMPLES[10], (3, ["decode0 rank 0, layer 1: 3 words wrong"])),
    (EXAMPLES[3], "V2: block size ratio"), (EXAMPLES[3], None), (EXAMPLES[12], None)])
def test_reply_values_survive_the_wire_unchanged(op, value) -> None:
    back = reply_value_from_wire(op, _trip({"v": reply_value_to_wire(op, value)})["v"])
    assert _plain(back) == _plain(value)


@pytest.mark.parametrize(("op", "data", "message"), [
    (EXAMPLES[8], [["a", "b"]], "send_notif reply must be a list of [agent, kind, reason]"),
    (EXAMPLES[10], [3, ["x", 4]], "verify reply must be [words, [explanations]]"),
    (EXAMPLES[10], ["3", []], "verify reply must be [words, [explanations]]"),
    (EXAMPLES[3], 5, "connect reply must be None or the refusal text"),
    (EXAMPLES[12], "surprise", "evict reply carries no value"),
    (EXAMPLES[5], [1], "outcome must be a map"),
    (EXAMPLES[5], {"request_id": "r"}, "malformed outcome"),
])
def test_malformed_reply_values_are_refused(op, data, message) -> None:
    with pytest.raises(WireError) as caught:
        reply_value_from_wire(op, data)
    assert message in str(caught.value)


def test_an_outcome_keeps_every_field() -> None:
    back = outcome_from_wire(_trip(outcome_to_wire(OUTCOME)))
    assert _plain(back) == _plain(OUTCOME)
