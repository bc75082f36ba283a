"""Handshake payload: per-rank metadata, compatibility hash, strict msgpack encoding (§4.2-4.3).

The outer struct is ``{compatibility_hash, metadata}``; the hash is compared *before* the inner
metadata is decoded. Decoding is strict: a size limit, exact key sets, exact types. Nothing is
ever unpickled.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from typing import Any

import msgpack

from ..geometry.layout import EngineLayout

__all__ = [
    "CONNECTOR_VERSION",
    "MAX_PAYLOAD_BYTES",
    "MetadataError",
    "RankMetadata",
    "compatibility_hash",
    "encode_handshake",
    "decode_handshake",
    "rank_metadata",
]

CONNECTOR_VERSION = "hkvsim-connector/1"
FRAMEWORK_VERSION = "hkvsim/0.1"
MAX_PAYLOAD_BYTES = 1 << 20  # real metadata is ~5-8 KB (DOMAIN.md §10); 1 MiB bounds hostile input


class MetadataError(ValueError):
    """A handshake payload that cannot be decoded (rule V8) or whose hash does not match."""


@dataclass(frozen=True, kw_only=True)
class RankMetadata:
    """What one rank publishes about its cache (DOMAIN.md §4.2)."""

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
    "host_buffer": bool,
}
_ELEMENT_TYPES = {"region_is_mla": bool, "group_ids": int}
_MAX_LIST = 100_000


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
                  device_id: int = 0, host_buffer: bool = False) -> RankMetadata:
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
    )


def encode_handshake(meta: RankMetadata, compat_hash: str) -> bytes:
    inner = msgpack.packb(
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(meta).items()},
        use_bin_type=True,
    )
    return msgpack.packb({"compatibility_hash": compat_hash, "metadata": inner}, use_bin_type=True)


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
                               max_array_len=_MAX_LIST, max_map_len=256)
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise MetadataError(f"V8: cannot decode {what}: {type(exc).__name__}: {exc}") from None


def _check_value(key: str, value: Any) -> Any:
    expected = _FIELD_TYPES[key]
    if expected is int and (not isinstance(value, int) or isinstance(value, bool)):
        raise MetadataError(f"V8: metadata field {key!r} must be an integer, got {value!r:.60}")
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
                    f"V8: metadata field {key!r} must hold {elem.__name__} values, got {item!r:.60}"
                )
        if elem is int and key not in ("group_ids",) and any(v < 0 for v in value):
            raise MetadataError(f"V8: metadata field {key!r} holds a negative value")
        return tuple(value)
    if expected is int and key != "device_id" and value < 0:
        raise MetadataError(f"V8: metadata field {key!r} must be >= 0, got {value}")
    return value


def decode_handshake(payload: bytes, *, expected_hash: str | None) -> RankMetadata:
    """Strictly decode a handshake payload; the hash is checked before the inner metadata.

    ``expected_hash=None`` skips the comparison (``enforce_handshake_compat=false``).
    """
    outer = _unpack(payload, "handshake payload")
    if not isinstance(outer, dict) or set(outer) != {"compatibility_hash", "metadata"}:
        keys = sorted(map(str, outer)) if isinstance(outer, dict) else type(outer).__name__
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
        raise MetadataError(f"V8: inner metadata keys wrong: missing {missing}, unknown {unknown}")
    values = {k: _check_value(k, inner[k]) for k in _FIELD_TYPES}
    n = len(values["base_addrs"])
    for key in ("block_lens", "block_strides", "region_num_blocks", "region_is_mla", "group_ids"):
        if len(values[key]) != n:
            raise MetadataError(
                f"V7: per-region list {key!r} has {len(values[key])} entries for {n} regions"
            )
    if len(values["ssm_sizes"]) != 2:
        raise MetadataError("V8: ssm_sizes must hold exactly (conv_bytes, recurrent_bytes)")
    if values["tp_size"] < 1 or not values["tp_rank"] < values["tp_size"]:
        raise MetadataError(
            f"V8: tp_rank {values['tp_rank']} is not within tp_size {values['tp_size']}"
        )
    if values["block_size"] < 1 or values["physical_blocks_per_logical"] < 1:
        raise MetadataError("V8: block_size and physical_blocks_per_logical must be >= 1")
    known = {f.name for f in fields(RankMetadata)}
    return RankMetadata(**{k: v for k, v in values.items() if k in known})
