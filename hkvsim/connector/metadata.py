"""Handshake payload: per-rank metadata, compatibility hash, strict msgpack encoding (§4.2-4.3).

The outer struct is ``{compatibility_hash, metadata}``; the hash is compared *before* the inner
metadata is decoded. Decoding is strict: a size limit, a budget on the decoding work (list
entries in all), exact key sets, exact types, and every number inside the range this connector
can use (:data:`LIMITS`), checked before anything is allocated from it. Nothing is ever
unpickled.

Connector version 2 added ``prefix_caching`` (the publishing side's setting), so that rule V4 is
enforced by whichever side validates, whichever side enables prefix caching.
"""

from __future__ import annotations

import hashlib
import json
import reprlib
from dataclasses import asdict, dataclass, fields
from typing import Any

import msgpack

from ..geometry.layout import EngineLayout
from ..transport.base import MEM_TYPES

__all__ = [
    "CONNECTOR_VERSION",
    "LIMITS",
    "MAX_PAYLOAD_BYTES",
    "MetadataError",
    "RankMetadata",
    "compatibility_hash",
    "encode_handshake",
    "decode_handshake",
    "rank_metadata",
]

CONNECTOR_VERSION = "hkvsim-connector/2"  # 2: prefix_caching in the payload
FRAMEWORK_VERSION = "hkvsim/0.1"
MAX_PAYLOAD_BYTES = 1 << 20  # real metadata is ~5-8 KB (docs/semantics.md §10); 1 MiB bounds hostile input


class MetadataError(ValueError):
    """A handshake payload that cannot be decoded or is out of bounds (rule V8), whose
    per-region lists disagree (V7), or whose hash does not match ('hash')."""

    @property
    def rule(self) -> str:
        head = str(self).split(":", 1)[0]
        if head in ("V7", "V8"):
            return head
        return "hash" if "hash mismatch" in str(self) else "V8"

    @property
    def detail(self) -> str:
        """The message without its rule prefix."""
        text = str(self)
        return text.split(": ", 1)[1] if text.startswith(f"{self.rule}: ") else text


@dataclass(frozen=True, kw_only=True)
class RankMetadata:
    """What one rank publishes about its cache (docs/semantics.md §4.2)."""

    engine_id: str
    tp_rank: int
    tp_size: int
    agent_name: str
    agent_metadata: bytes
    device_id: int
    mem_type: str
    num_blocks: int  # kernel-granular, equal on every rank of an engine
    base_addrs: tuple[int, ...]
    block_lens: tuple[int, ...]
    block_strides: tuple[int, ...]
    region_num_blocks: tuple[int, ...]
    region_is_mla: tuple[bool, ...]
    group_ids: tuple[int, ...]
    kv_cache_layout: str
    block_size: int  # kernel tokens
    logical_block_size: int
    attn_backend_name: str
    ssm_sizes: tuple[int, int]  # local (conv_bytes, recurrent_bytes); (0, 0) without state
    ssm_subregion_sizes: tuple[int, ...]  # local conv sub-projection sizes, then recurrent
    physical_blocks_per_logical: int
    num_kv_heads: int  # total KV heads (1 for MLA)
    host_buffer: bool
    prefix_caching: bool  # the publishing engine's setting (rule V4 looks at both sides)

    @property
    def num_regions(self) -> int:
        return len(self.base_addrs)


_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "engine_id": str, "tp_rank": int, "tp_size": int, "agent_name": str,
    "agent_metadata": bytes, "device_id": int, "mem_type": str, "num_blocks": int,
    "base_addrs": list, "block_lens": list, "block_strides": list, "region_num_blocks": list,
    "region_is_mla": list, "group_ids": list, "kv_cache_layout": str, "block_size": int,
    "logical_block_size": int, "attn_backend_name": str, "ssm_sizes": list,
    "ssm_subregion_sizes": list, "physical_blocks_per_logical": int, "num_kv_heads": int,
    "host_buffer": bool, "prefix_caching": bool,
}
_ELEMENT_TYPES = {"region_is_mla": bool, "group_ids": int}

MAX_TP = 1 << 12
MAX_DEVICE_ID = (1 << 31) - 1  # a CUDA device ordinal is a C int
MAX_BLOCK_TOKENS = 1 << 20
ADDRESS_LIMIT = 1 << 63  # descriptor math is int64; real virtual addresses are below 2^57
MAX_REGIONS = 1 << 10  # also the longest list msgpack may decode (a region or sub-region each)
MAX_BYTES = 1 << 40  # one block, stride or state sub-region
MAX_LIST_ENTRIES = 1 << 14  # in all the lists of one struct: bounds the decoding work (a 1 MiB
#                             payload of nested one-element lists is ~10^6 objects, ~1 s)
#: field -> (lowest, highest) for every scalar field and for each element of the int lists.
#: Whole-payload limits (region extents, the remote list's length) are checked after these.
LIMITS: dict[str, tuple[int, int]] = {
    "tp_size": (1, MAX_TP), "tp_rank": (0, MAX_TP - 1), "device_id": (0, MAX_DEVICE_ID),
    "num_blocks": (1, ADDRESS_LIMIT - 1), "block_size": (1, MAX_BLOCK_TOKENS),
    "logical_block_size": (1, MAX_BLOCK_TOKENS),
    "physical_blocks_per_logical": (1, MAX_BLOCK_TOKENS), "num_kv_heads": (1, 1 << 20),
    "base_addrs": (0, ADDRESS_LIMIT - 1), "block_lens": (1, MAX_BYTES),
    "block_strides": (1, MAX_BYTES), "region_num_blocks": (0, ADDRESS_LIMIT - 1),
    "ssm_sizes": (0, MAX_BYTES), "ssm_subregion_sizes": (0, MAX_BYTES),
    "group_ids": (-1, MAX_REGIONS - 1),  # -1: a region aliased by layers of several groups
}


def compatibility_hash(layout: EngineLayout, *, mode: str, enforce_version: str = CONNECTOR_VERSION,
                       hma: bool | None = None) -> str:
    """SHA-256 over what must match between P and D (§4.3).

    Deliberately excluded: TP, block size, block count and layout (checked at runtime).
    """
    model = layout.model
    attn = model.attention
    factors = {
        "framework": FRAMEWORK_VERSION,
        "connector": enforce_version,
        "model": model.name,
        "architecture": model.architecture,
        "dtype": model.dtype,
        "num_kv_heads": getattr(attn, "num_kv_heads", 1),
        "head_size": getattr(attn, "head_dim", None) or (attn.kv_lora_rank + attn.rope_dim),  # type: ignore[union-attr]
        "num_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "attention_backend": attn.backend,
        "cache_dtype": getattr(attn, "cache_dtype", None) or attn.dtype,
        "hma": model.is_hybrid if hma is None else hma,
        "transfer_mode": mode,
    }
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()


def rank_metadata(*, layout: EngineLayout, engine_id: str, tp_rank: int, agent_name: str,
                  agent_metadata: bytes, base_addr: int, mem_type: str = "VRAM",
                  device_id: int = 0, host_buffer: bool = False,
                  prefix_caching: bool = False) -> RankMetadata:
    """The metadata a rank publishes, from its layout and the base of its cache allocation."""
    model = layout.model
    sub_sizes = model.state.subregion_sizes(layout.tp) if model.is_hybrid and model.state else ()
    return RankMetadata(
        engine_id=engine_id, tp_rank=tp_rank, tp_size=layout.tp, agent_name=agent_name,
        agent_metadata=agent_metadata, device_id=device_id, mem_type=mem_type,
        num_blocks=layout.num_kernel_blocks,
        base_addrs=tuple(base_addr + r.tensor_offset for r in layout.regions),
        block_lens=tuple(r.block_len for r in layout.regions),
        block_strides=tuple(r.stride for r in layout.regions),
        region_num_blocks=tuple(r.num_blocks for r in layout.regions),
        region_is_mla=tuple(r.is_mla for r in layout.regions),
        group_ids=tuple(r.group_id for r in layout.regions),
        kv_cache_layout=layout.kv_cache_layout, block_size=layout.kernel_block_size,
        logical_block_size=layout.logical_block_size,
        attn_backend_name=model.attention.backend, ssm_sizes=layout.ssm_sizes,
        ssm_subregion_sizes=tuple(sub_sizes),
        physical_blocks_per_logical=layout.physical_blocks_per_logical,
        num_kv_heads=getattr(model.attention, "num_kv_heads", 1), host_buffer=host_buffer,
        prefix_caching=prefix_caching,
    )


def encode_handshake(meta: RankMetadata, compat_hash: str) -> bytes:
    inner = msgpack.packb(
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(meta).items()},
        use_bin_type=True,
    )
    return msgpack.packb({"compatibility_hash": compat_hash, "metadata": inner}, use_bin_type=True)


class ListBudget:
    """A msgpack ``list_hook`` that stops decoding once the lists decoded so far hold more than
    ``limit`` entries in all (each list counts its length plus one)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.left = limit

    def __call__(self, items: list) -> list:
        self.left -= len(items) + 1
        if self.left < 0:
            raise ValueError(f"more than {self.limit} list entries in all")
        return items


def _unpack(data: bytes, what: str) -> Any:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MetadataError(f"V8: {what} must be bytes, got {type(data).__name__}")
    if len(data) > MAX_PAYLOAD_BYTES:
        raise MetadataError(
            f"V8: {what} is {len(data)} bytes, over the {MAX_PAYLOAD_BYTES}-byte limit"
        )
    try:
        return msgpack.unpackb(bytes(data), raw=False, strict_map_key=True,
                               max_bin_len=MAX_PAYLOAD_BYTES, max_str_len=1 << 16,
                               max_array_len=MAX_REGIONS, max_map_len=256,
                               list_hook=ListBudget(MAX_LIST_ENTRIES))
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise MetadataError(f"V8: cannot decode {what}: {type(exc).__name__}: {exc}") from None


_SHORT = reprlib.Repr()  # bounded repr for messages: a hostile value may be huge or deep
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict = 2, 4, 4
_SHORT.maxstring = _SHORT.maxother = 40


def _in_range(key: str, value: int) -> None:
    lo, hi = LIMITS[key]
    if not lo <= value <= hi:
        raise MetadataError(f"V8: metadata field {key!r} must be in [{lo}, {hi}], got {value}")


def _check_value(key: str, value: Any) -> Any:
    expected = _FIELD_TYPES[key]
    if expected is int and (not isinstance(value, int) or isinstance(value, bool)):
        raise MetadataError(f"V8: metadata field {key!r} must be an integer, got "
                            f"{_SHORT.repr(value)}")
    if expected is not int and not isinstance(value, expected):
        raise MetadataError(
            f"V8: metadata field {key!r} must be {expected.__name__}, got {type(value).__name__}"
        )
    if expected is list:
        elem = _ELEMENT_TYPES.get(key, int)
        for item in value:
            ok = isinstance(item, elem) if elem is bool else (
                isinstance(item, int) and not isinstance(item, bool))
            if not ok:
                raise MetadataError(
                    f"V8: metadata field {key!r} must hold {elem.__name__} values, got "
                    f"{_SHORT.repr(item)}"
                )
        if elem is int and value:
            lo, hi = LIMITS[key]
            bad = next((v for v in value if not lo <= v <= hi), None)
            if bad is not None:
                raise MetadataError(f"V8: metadata field {key!r} holds {bad}; every entry must "
                                    f"be in [{lo}, {hi}]")
        return tuple(value)
    if expected is int:
        _in_range(key, value)
    return value


def _check_consistency(v: dict[str, Any]) -> None:
    """Cross-field checks on one rank's metadata, all before anything is sized from it."""
    n = len(v["base_addrs"])
    if not 1 <= n <= MAX_REGIONS:
        raise MetadataError(f"V8: metadata field 'base_addrs' lists {n} regions; allowed: 1 to "
                            f"{MAX_REGIONS}")
    for key in ("block_lens", "block_strides", "region_num_blocks", "region_is_mla", "group_ids"):
        if len(v[key]) != n:
            raise MetadataError(
                f"V7: per-region list {key!r} has {len(v[key])} entries for {n} regions"
            )
    if len(v["ssm_sizes"]) != 2:
        raise MetadataError("V8: ssm_sizes must hold exactly (conv_bytes, recurrent_bytes)")
    if v["mem_type"] not in MEM_TYPES:
        raise MetadataError(f"V8: metadata field 'mem_type' is {v['mem_type']!r:.40}; allowed: "
                            f"{', '.join(MEM_TYPES)}")
    if len(v["ssm_subregion_sizes"]) > MAX_REGIONS:
        raise MetadataError(f"V8: metadata field 'ssm_subregion_sizes' lists "
                            f"{len(v['ssm_subregion_sizes'])} sub-regions; at most {MAX_REGIONS}")
    if not v["tp_rank"] < v["tp_size"]:
        raise MetadataError(
            f"V8: tp_rank {v['tp_rank']} is not within tp_size {v['tp_size']}"
        )
    ppl = v["physical_blocks_per_logical"]
    if v["logical_block_size"] != v["block_size"] * ppl:
        raise MetadataError(
            f"V8: metadata field 'logical_block_size' is {v['logical_block_size']}, but "
            f"block_size {v['block_size']} x physical_blocks_per_logical {ppl} is "
            f"{v['block_size'] * ppl}"
        )
    blocks = v["num_blocks"]
    if ppl > blocks:
        raise MetadataError(f"V8: metadata field 'num_blocks' is {blocks}, less than one logical "
                            f"block of {ppl} kernel blocks")
    for i, count in enumerate(v["region_num_blocks"]):  # logical for a state-only view
        if count > blocks:
            raise MetadataError(f"V7: metadata field 'region_num_blocks' gives region {i} "
                                f"{count} blocks, more than num_blocks {blocks}")
    for i, (base, stride) in enumerate(zip(v["base_addrs"], v["block_strides"])):
        if base + blocks * stride > ADDRESS_LIMIT:
            raise MetadataError(
                f"V8: region {i} ends past the address limit: base_addrs {base:#x} + num_blocks "
                f"{blocks} x block_strides {stride} > 2^63"
            )


def decode_handshake(payload: bytes, *, expected_hash: str | None) -> RankMetadata:
    """Strictly decode a handshake payload; the hash is checked before the inner metadata.

    ``expected_hash=None`` skips the comparison (``enforce_handshake_compat=false``).
    """
    outer = _unpack(payload, "handshake payload")
    if not isinstance(outer, dict) or set(outer) != {"compatibility_hash", "metadata"}:
        keys = (_SHORT.repr(sorted(map(str, outer))) if isinstance(outer, dict)
                else type(outer).__name__)
        raise MetadataError(
            f"V8: handshake payload must be a map with keys compatibility_hash, metadata; got {keys}"
        )
    remote_hash = outer["compatibility_hash"]
    if not isinstance(remote_hash, str):
        raise MetadataError("V8: compatibility_hash must be a string")
    if expected_hash is not None and remote_hash != expected_hash:
        raise MetadataError(
            f"compatibility hash mismatch: local {expected_hash[:12]}..., remote "
            f"{remote_hash[:12]}... (model, dtype, backend, layer count or transfer mode differ; "
            f"set enforce_handshake_compat=false to override)"
        )
    inner = _unpack(outer["metadata"], "inner metadata")
    if not isinstance(inner, dict):
        raise MetadataError(f"V8: inner metadata must be a map, got {type(inner).__name__}")
    missing = sorted(set(_FIELD_TYPES) - set(inner))
    unknown = sorted(map(str, set(inner) - set(_FIELD_TYPES)))
    if missing or unknown:
        raise MetadataError(f"V8: inner metadata keys wrong: missing {_SHORT.repr(missing)}, "
                            f"unknown {_SHORT.repr(unknown)}")
    values = {k: _check_value(k, inner[k]) for k in _FIELD_TYPES}
    _check_consistency(values)
    known = {f.name for f in fields(RankMetadata)}
    return RankMetadata(**{k: v for k, v in values.items() if k in known})
