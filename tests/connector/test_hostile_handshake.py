"""Hostile handshake payloads (issue #10 item 6): ``ConnectorWorker.connect`` raises
``HandshakeError`` and nothing else, never allocates from an unchecked number, and leaves no list
or agent behind when it refuses; the simulator reports such a payload as a handshake error
naming the rule and the field."""

from __future__ import annotations

import tracemalloc

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hkvsim.cluster import run_scenario
from hkvsim.connector.validate import HandshakeError
from hkvsim.connector.worker import ConnectorWorker
from hkvsim.scenario import parse_scenarios

from . import hostile
from ._helpers import scenario_text


@pytest.fixture(scope="module")
def setups() -> dict[str, hostile.Setup]:
    return {s.name: s for s in hostile.setups()}


def _edit(payload: bytes, **changes) -> bytes:
    outer = msgpack.unpackb(payload, raw=False)
    inner = msgpack.unpackb(outer["metadata"], raw=False)
    for key, change in changes.items():
        inner[key] = change(inner[key]) if callable(change) else change
    outer["metadata"] = msgpack.packb(inner, use_bin_type=True)
    return msgpack.packb(outer, use_bin_type=True)


def _refused(setup: hostile.Setup, payloads: dict[int, bytes]) -> tuple[HandshakeError, int]:
    """connect must refuse with HandshakeError, allocate little, and keep nothing."""
    before = setup.worker.transport.resources()
    tracemalloc.start()
    try:
        with pytest.raises(HandshakeError) as exc:
            setup.worker.connect(setup.remote_engine, payloads)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert setup.worker.transport.resources() == before
    assert not setup.worker.is_connected(setup.remote_engine)
    return exc.value, peak


KIMI_PULL = "tiny-kimi-linear P2->D4 pull"
KIMI_FAN_IN = "tiny-kimi-linear P4->D1 pull"  # decode rank 0 handshakes with 4 prefill ranks


@pytest.mark.parametrize("field,change,needle", [
    ("device_id", -1, "'device_id' must be in [0, 2147483647], got -1"),
    ("base_addrs", lambda v: [2**63] * len(v), "'base_addrs' holds 9223372036854775808"),
    ("base_addrs", lambda v: [2**64 - 1] * len(v), "'base_addrs' holds 18446744073709551615"),
    ("block_strides", lambda v: [2**63] * len(v), "'block_strides' holds 9223372036854775808"),
    ("block_lens", lambda v: [0] * len(v), "'block_lens' holds 0"),
    ("tp_size", 2**40, "'tp_size' must be in [1, 4096], got 1099511627776"),
    ("tp_size", 4097, "'tp_size' must be in [1, 4096], got 4097"),
    ("block_size", 2**20 + 1, "'block_size' must be in [1, 1048576], got 1048577"),
    ("num_blocks", 2**62, "region 0 ends past the address limit"),
    ("region_num_blocks", lambda v: [n + 1 for n in v], "'region_num_blocks' gives region 0"),
    ("mem_type", "dram", "'mem_type' is 'dram'; allowed: DRAM, VRAM"),
    ("logical_block_size", 7, "'logical_block_size' is 7, but block_size"),
])
def test_out_of_range_fields_are_refused_naming_the_field(setups, field, change, needle):
    # before: OverflowError / ValueError out of connect (device_id, addresses, strides), or a
    # tuple of 2^38 target ranks being built (tp_size)
    setup = setups[KIMI_PULL]
    payloads = {**setup.payloads, 0: _edit(setup.payloads[0], **{field: change})}
    error, _ = _refused(setup, payloads)
    assert error.rule in ("V7", "V8") and needle in str(error), str(error)
    assert "remote prefill0 rank 0" in str(error)


def test_region_extent_past_the_address_space_is_refused(setups):
    setup = setups[KIMI_PULL]
    payloads = {**setup.payloads, 0: _edit(setup.payloads[0],
                                                base_addrs=lambda v: [2**63 - 4096] * len(v))}
    error, _ = _refused(setup, payloads)
    assert error.rule == "V8" and "ends past the address limit" in str(error)


def test_a_swollen_block_count_is_refused_before_its_list_is_built(setups):
    # The 595-byte payload: num_blocks x100,000 made connect() build a 0.9 GB list.
    # Scaled with every region's count, it passes the per-payload checks and meets the limit on
    # the remote list's length (64 x the rank's own list, at least 65,536 descriptors).
    setup = setups[KIMI_PULL]
    payloads = {rank: _edit(payload, num_blocks=lambda n: n * 100_000,
                            region_num_blocks=lambda v: [n * 100_000 for n in v])
                for rank, payload in setup.payloads.items()}  # every rank, so V7 agrees
    error, peak = _refused(setup, payloads)
    blocks = hostile.msgpack.unpackb(hostile.msgpack.unpackb(setup.payloads[0])["metadata"])[
        "num_blocks"] * 100_000
    assert error.rule == "V8" and f"num_blocks {blocks} would make a remote descriptor list" in str(
        error), str(error)
    assert peak < 4 << 20


def test_a_wide_and_deep_list_bomb_stops_decoding_early(setups):
    # 1000 entries of 400 nested one-element lists (~400 KB, 400,000 lists): msgpack's
    # per-list length limit does not stop it; the budget on list entries in all does
    setup = setups[KIMI_PULL]
    bomb = b"\xdc\x03\xe8" + (b"\x91" * 400 + b"\x01") * 1000
    payload = hostile._with_raw(*hostile._split(setup.payloads[0]), "group_ids", bomb)
    error, peak = _refused(setup, {**setup.payloads, 0: payload})
    assert error.rule == "V8" and "list entries in all" in str(error), str(error)
    assert peak < 8 << 20


def test_tp_size_must_agree_with_the_rank_that_sent_it(setups):
    setup = setups[KIMI_FAN_IN]
    payloads = {**setup.payloads, 2: _edit(setup.payloads[2], tp_size=8, tp_rank=7)}
    error, _ = _refused(setup, payloads)
    assert error.rule == "V8" and "rank 2 has tp_rank 7" in str(error)
    payloads = {**setup.payloads, 2: _edit(setup.payloads[2], tp_size=8)}
    error, _ = _refused(setup, payloads)
    assert error.rule == "V8" and "tp_size differs across remote ranks" in str(error)


def test_a_late_refusal_leaves_no_list_or_agent_of_the_ranks_that_passed(setups):
    # Decode rank 0 sets up prefill ranks 0..3 in order; rank 3's refusal used to leave the
    # agents and remote lists of ranks 0..2 behind. V6 (a validation rule) ...
    setup = setups[KIMI_FAN_IN]
    assert setup.targets == (0, 1, 2, 3)
    payloads = {**setup.payloads, 3: _edit(setup.payloads[3],
                                                block_lens=lambda v: [n // 2 for n in v])}
    error, _ = _refused(setup, payloads)
    assert error.rule == "V6", str(error)
    # ... and a remote list the transport refuses (outside the memory rank 3 registered)
    payloads = {**setup.payloads, 3: _edit(setup.payloads[3],
                                                base_addrs=lambda v: [a + (1 << 36) for a in v])}
    error, _ = _refused(setup, payloads)
    assert error.rule == "V8" and "remote prefill0 rank 3: preparing the remote list" in str(
        error) and "outside the memory remote agent prefill0.3 has registered" in str(error)
    # the clean payloads still connect afterwards, and evicting returns everything
    before = setup.worker.transport.resources()
    setup.worker.connect(setup.remote_engine, setup.payloads)
    setup.worker.evict(setup.remote_engine)
    assert setup.worker.transport.resources() == before


def test_campaign_of_10000_hostile_payloads(setups):
    """>= 10,000 structured mutations through connect(): HandshakeError or a clean connection,
    each call under 1 s and 64 MB (tracemalloc peak), the transport unchanged afterwards."""
    result = hostile.run_campaign(10_000, seed=10, setups_=list(setups.values()))
    assert result.problems == [], "\n".join(result.problems[:20])
    assert result.cases == 10_000
    assert result.refused + result.accepted == result.cases
    assert result.accepted > 0  # harmless mutations connect (and are evicted)
    assert {"V7", "V8", "hash"} <= set(result.rules), result.rules
    assert result.worst_seconds < hostile.TIME_LIMIT_S
    assert result.worst_bytes < hostile.MEMORY_LIMIT


_FIELDS = hostile.SCALARS + hostile.INT_LISTS + hostile.BOOL_LISTS + hostile.STRINGS + [
    "agent_metadata", "host_buffer", "prefix_caching"]
_ANY = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats() | st.text(max_size=8) | st.binary(max_size=16),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=4), inner,
                                                                  max_size=3),
    max_leaves=10)


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(_FIELDS), value=_ANY,
       which=st.sampled_from(sorted(hostile.DEPLOYMENTS)))
def test_any_value_in_any_field_is_a_handshake_error_or_harmless(setups, field, value, which):
    model, p_tp, d_tp, mode = which
    setup = setups[f"{model} P{p_tp}->D{d_tp} {mode}"]
    rank = setup.targets[-1]
    payloads = {**setup.payloads, rank: _edit(setup.payloads[rank], **{field: value})}
    before = setup.worker.transport.resources()
    try:
        setup.worker.connect(setup.remote_engine, payloads)
    except HandshakeError:
        assert setup.worker.transport.resources() == before
        return
    setup.worker.evict(setup.remote_engine)
    assert setup.worker.transport.resources() == before


# ---- the simulator's view: a handshake-error outcome naming the rule and the field -----------
@pytest.mark.parametrize("field,value,needle", [
    ("device_id", -1, "V8: remote prefill0 rank 0: metadata field 'device_id'"),
    ("block_strides", [2**63] * 3, "V8: remote prefill0 rank 0: metadata field 'block_strides'"),
    ("tp_size", 2**40, "V8: remote prefill0 rank 0: metadata field 'tp_size'"),
    ("num_blocks", 2**40, "V7: num_blocks differs across remote ranks of 'prefill0'"),
    ("mem_type", "dram", "V8: remote prefill0 rank 0: metadata field 'mem_type'"),
])
def test_the_simulator_reports_a_hostile_payload_as_a_handshake_error(monkeypatch, field, value,
                                                                       needle):
    honest = ConnectorWorker.handshake_payload

    def hostile_payload(self):
        payload = honest(self)
        if self.role == "prefill" and self.tp_rank == 0:
            payload = _edit(payload, **{field: value})
        return payload

    monkeypatch.setattr(ConnectorWorker, "handshake_payload", hostile_payload)
    (scenario,) = parse_scenarios(scenario_text(model="tiny-kimi-linear", p_tp=2, d_tp=4,
                                                requests=2))
    result = run_scenario(scenario)
    assert result.outcome == "handshake-error"
    assert result.handshake_errors and needle in result.handshake_errors[0], result.handshake_errors
    assert all(r.failure_class == "handshake_failed" for r in result.records)


def test_a_refused_handshake_keeps_the_agents_another_engine_uses(setups):
    """A payload naming agents this worker already talks to (the same prefill ranks announced
    again under another engine id: a restarted router, or a hostile peer) and then refused must
    not remove those agents: the engine that owns them keeps transferring."""
    setup = setups[KIMI_FAN_IN]
    setup.worker.connect(setup.remote_engine, setup.payloads)
    try:
        connected = setup.worker.transport.resources()
        payloads = {rank: _edit(payload, engine_id="impostor")
                    for rank, payload in setup.payloads.items()}
        payloads[3] = _edit(payloads[3], base_addrs=lambda v: [a + (1 << 36) for a in v])
        with pytest.raises(HandshakeError) as exc:
            setup.worker.connect("impostor", payloads)
        assert exc.value.rule == "V8" and "preparing the remote list" in str(exc.value)
        assert setup.worker.transport.resources() == connected
        assert setup.worker.is_connected(setup.remote_engine)
        assert not setup.worker.is_connected("impostor")
    finally:
        setup.worker.evict(setup.remote_engine)
