"""Handshake payload (docs/semantics.md §4.1-4.3, rule V8): round trip, hash-before-decode, strict fuzzing."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hkvsim.connector.metadata import (
    MAX_PAYLOAD_BYTES,
    MetadataError,
    RankMetadata,
    compatibility_hash,
    decode_handshake,
    encode_handshake,
)

from ._helpers import layout, meta

LAY = layout("kimi-linear-48b", 2, num_blocks=2)
META = meta(LAY, 1, engine="prefill0")
HASH = compatibility_hash(LAY, mode="pull")
PAYLOAD = encode_handshake(META, HASH)
INNER = msgpack.unpackb(msgpack.unpackb(PAYLOAD)["metadata"])


def _types_of(m: RankMetadata) -> dict[str, tuple]:
    """Field -> (type, element types) of a decoded RankMetadata."""
    out = {}
    for f in dataclasses.fields(m):
        v = getattr(m, f.name)
        out[f.name] = (type(v), tuple(sorted({type(x).__name__ for x in v}))
                       if isinstance(v, tuple) else ())
    return out


REFERENCE_TYPES = _types_of(META)


def _outer(inner: object, h: object = HASH) -> bytes:
    return msgpack.packb({"compatibility_hash": h, "metadata": inner}, use_bin_type=True)


def _pack_inner(fields: dict) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


def test_round_trip():
    got = decode_handshake(PAYLOAD, expected_hash=HASH)
    assert got == META
    assert got.block_lens == (73_728,) * 7
    assert got.ssm_sizes == (36_864, 1_048_576)
    assert got.physical_blocks_per_logical == 15
    assert got.num_blocks == 30  # kernel-granular (§4.2)
    # skipping the comparison (enforce_handshake_compat = false) still decodes
    assert decode_handshake(PAYLOAD, expected_hash=None) == META


@pytest.mark.parametrize("model,tp,block", [("tiny-llama", 2, 16), ("deepseek-v3", 1, 64),
                                            ("qwen3-next-80b", 4, 16)])
def test_round_trip_other_models(model, tp, block):
    lay = layout(model, tp, block_size=block, num_blocks=1)
    m = meta(lay, tp - 1)
    h = compatibility_hash(lay, mode="push")
    assert decode_handshake(encode_handshake(m, h), expected_hash=h) == m


def test_hash_checked_before_inner_decode():
    # §4.1: "The hash is checked before the inner metadata is decoded": a payload with a bad
    # hash and garbage inner bytes must report the hash mismatch, not a decode error.
    payload = _outer(b"\xc1\xc1 not msgpack \xff", h="0" * 64)
    with pytest.raises(MetadataError, match="hash mismatch"):
        decode_handshake(payload, expected_hash=HASH)
    # with the right hash the same garbage is a V8 decode error
    with pytest.raises(MetadataError, match="V8") as exc:
        decode_handshake(_outer(b"\xc1\xc1 not msgpack \xff"), expected_hash=HASH)
    assert "hash" not in str(exc.value)


def test_hash_excludes_tp_block_size_and_count():
    # §4.3: TP, block size, block count and layout are deliberately excluded
    a = compatibility_hash(layout("tiny-llama", 1, block_size=16, num_blocks=2), mode="pull")
    b = compatibility_hash(layout("tiny-llama", 4, block_size=64, num_blocks=9,
                                  kv_cache_layout="NHD"), mode="pull")
    assert a == b
    # ... but model and transfer mode are included
    assert a != compatibility_hash(layout("tiny-llama", 1, block_size=16), mode="push")
    assert a != compatibility_hash(layout("tiny-deepseek", 1, block_size=64), mode="pull")


@pytest.mark.parametrize("field,value", [
    ("num_blocks", "30"), ("num_blocks", 30.0), ("num_blocks", True), ("num_blocks", -1),
    ("block_lens", [73_728] * 6 + ["x"]), ("block_lens", 73_728), ("region_is_mla", [1] * 7),
    ("group_ids", [True] * 7), ("agent_metadata", "agent"), ("engine_id", b"prefill0"),
    ("host_buffer", 0), ("ssm_sizes", [1, 2, 3]), ("tp_rank", 2), ("tp_size", 0),
    ("block_size", 0), ("physical_blocks_per_logical", 0), ("block_strides", [73_728] * 6),
    ("base_addrs", [-1] * 7),
])
def test_wrong_field_rejected(field, value):
    inner = dict(INNER, **{field: value})
    with pytest.raises(MetadataError):
        decode_handshake(_outer(_pack_inner(inner)), expected_hash=HASH)


_PER_REGION = ("base_addrs", "block_lens", "block_strides", "region_num_blocks",
               "region_is_mla", "group_ids")


def test_the_smallest_and_largest_legal_values_are_accepted():
    # each bound itself is legal: one region, 1-token blocks (one kernel block per logical
    # block, one block), the last rank of the largest TP; one step past each is refused
    one_region = dict(INNER, **{k: INNER[k][:1] for k in _PER_REGION})
    assert decode_handshake(_outer(_pack_inner(one_region)), expected_hash=HASH
                            ).base_addrs == (INNER["base_addrs"][0],)
    smallest = dict(INNER, block_size=1, logical_block_size=1, physical_blocks_per_logical=1,
                    num_blocks=1, region_num_blocks=[1] * 7, tp_size=4096, tp_rank=4095)
    got = decode_handshake(_outer(_pack_inner(smallest)), expected_hash=HASH)
    assert (got.block_size, got.logical_block_size, got.tp_rank) == (1, 1, 4095)
    no_region = dict(INNER, **{k: [] for k in _PER_REGION})
    with pytest.raises(MetadataError, match="lists 0 regions; allowed: 1 to 1024"):
        decode_handshake(_outer(_pack_inner(no_region)), expected_hash=HASH)
    for field, value in (("tp_size", 4097), ("tp_rank", 4096), ("logical_block_size", 0)):
        with pytest.raises(MetadataError, match=field):
            decode_handshake(_outer(_pack_inner(dict(smallest, **{field: value}))),
                             expected_hash=HASH)


def test_state_sub_region_count_is_bounded_like_the_regions():
    # 1,024 sub-regions at most, as for regions; one more is refused (by the decoder's own
    # list cap first: the field's check behind it is a second line)
    at_cap = dict(INNER, ssm_subregion_sizes=[1] * 1024)
    assert len(decode_handshake(_outer(_pack_inner(at_cap)), expected_hash=HASH
                                ).ssm_subregion_sizes) == 1024
    over = dict(INNER, ssm_subregion_sizes=[1] * 1025)
    with pytest.raises(MetadataError, match="V8: .*1025"):
        decode_handshake(_outer(_pack_inner(over)), expected_hash=HASH)


def test_missing_and_unknown_keys_rejected():
    inner = dict(INNER)
    del inner["ssm_sizes"]
    with pytest.raises(MetadataError, match="ssm_sizes"):
        decode_handshake(_outer(_pack_inner(inner)), expected_hash=HASH)
    with pytest.raises(MetadataError, match="extra"):
        decode_handshake(_outer(_pack_inner(dict(INNER, extra=1))), expected_hash=HASH)
    with pytest.raises(MetadataError):
        decode_handshake(msgpack.packb({"compatibility_hash": HASH, "metadata": PAYLOAD,
                                        "x": 1}), expected_hash=HASH)


def test_oversized_payload_rejected():
    with pytest.raises(MetadataError, match="limit"):
        decode_handshake(PAYLOAD + b"\x00" * (MAX_PAYLOAD_BYTES + 1), expected_hash=HASH)
    big = _outer(b"\x00" * (MAX_PAYLOAD_BYTES + 10))
    with pytest.raises(MetadataError):
        decode_handshake(big, expected_hash=HASH)


def test_not_bytes_rejected():
    for bad in (None, "payload", 3, [PAYLOAD], {"a": 1}):
        with pytest.raises(MetadataError):
            decode_handshake(bad, expected_hash=HASH)  # type: ignore[arg-type]


# ---- fuzzing: only MetadataError, and nothing accepted that is not a well-typed payload --------


def _decode_or_error(payload):
    try:
        got = decode_handshake(payload, expected_hash=HASH)
    except MetadataError:
        return None
    # anything accepted has exactly the field types of a valid payload
    assert _types_of(got) == REFERENCE_TYPES or _same_types_allowing_empty(got)
    assert len(got.ssm_sizes) == 2
    n = got.num_regions
    assert len(got.block_lens) == len(got.block_strides) == len(got.region_is_mla) == n
    assert len(got.region_num_blocks) == len(got.group_ids) == n
    assert 0 <= got.tp_rank < got.tp_size
    return got


def _same_types_allowing_empty(got: RankMetadata) -> bool:
    for name, (typ, elems) in _types_of(got).items():
        ref_typ, ref_elems = REFERENCE_TYPES[name]
        if typ is not ref_typ:
            return False
        if elems and elems != ref_elems:
            return False
    return True


_FUZZ = settings(max_examples=300, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow])


@_FUZZ
@given(st.binary(max_size=2_048))
def test_fuzz_random_bytes(data):
    _decode_or_error(data)


@_FUZZ
@given(st.integers(min_value=0, max_value=len(PAYLOAD) - 1))
def test_fuzz_truncated(n):
    assert _decode_or_error(PAYLOAD[:n]) is None


@_FUZZ
@given(st.integers(min_value=0, max_value=len(PAYLOAD) - 1), st.integers(0, 255))
def test_fuzz_byte_flip(pos, value):
    data = bytearray(PAYLOAD)
    data[pos] = value
    _decode_or_error(bytes(data))


@_FUZZ
@given(st.binary(min_size=1, max_size=64))
def test_fuzz_trailing_bytes(extra):
    assert _decode_or_error(PAYLOAD + extra) is None


_leaf = (st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
         | st.floats(allow_nan=True) | st.text(max_size=8) | st.binary(max_size=8))
_values = st.recursive(_leaf, lambda c: st.lists(c, max_size=4)
                       | st.dictionaries(st.text(max_size=6), c, max_size=4), max_leaves=12)


@_FUZZ
@given(_values)
def test_fuzz_random_outer_structures(value):
    _decode_or_error(msgpack.packb(value, use_bin_type=True))


@_FUZZ
@given(_values)
def test_fuzz_random_inner_structures(value):
    _decode_or_error(_outer(msgpack.packb(value, use_bin_type=True)))


@_FUZZ
@given(st.sampled_from(sorted(INNER)), _values)
def test_fuzz_one_field_replaced(field, value):
    inner = dict(INNER, **{field: value})
    got = _decode_or_error(_outer(_pack_inner(inner)))
    if got is not None:
        # accepted only if the value is well-typed for that field
        ref = getattr(META, field)
        assert type(getattr(got, field)) is type(ref)


@_FUZZ
@given(st.sampled_from(sorted(INNER)), st.sampled_from([None, "s", b"b", 1.5, -3, True, [],
                                                         {}, [[1]], {"a": 1}, [None]]))
def test_fuzz_wrong_typed_field(field, value):
    ref = INNER[field]
    if type(value) is type(ref) and not isinstance(ref, list):
        return
    inner = dict(INNER, **{field: value})
    got = _decode_or_error(_outer(_pack_inner(inner)))
    if got is not None:
        assert type(getattr(got, field)) is type(getattr(META, field))
