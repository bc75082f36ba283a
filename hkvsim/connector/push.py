"""Push mode's wire payloads (docs/semantics.md §8.2): decode's block registration and the request ids.

Decode sends ``b"PUSH_REG:" + msgpack(registration)`` to every prefill agent. Decoding is strict
(size limit, exact keys and types); a malformed registration is dropped, never half-applied.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

__all__ = ["PUSH_PREFIX", "PushRegistration", "WriteRequest", "base_request_id"]

PUSH_PREFIX = b"PUSH_REG:"
_MAX_REGISTRATION_BYTES = 1 << 20
_KEYS = {"decode_request_id": str, "decode_engine": str, "decode_tp": int,
         "prefill_engine": str, "blocks": dict, "hit_blocks": int}


def base_request_id(request_id: str) -> str:
    """The id without its random suffix ("req-3-0a1b2c3d" -> "req-3"): the proxy gives prefill
    and decode the same base with different suffixes."""
    base, sep, _ = request_id.rpartition("-")
    return base if sep and base else request_id


@dataclass(frozen=True, kw_only=True)
class PushRegistration:
    """What decode tells prefill so prefill can WRITE into decode's blocks."""

    decode_request_id: str
    decode_engine: str
    decode_tp: int
    prefill_engine: str
    blocks: Mapping[int, np.ndarray]  # group id -> decode's uncached logical ids, in order
    hit_blocks: int  # logical blocks decode holds from its prefix cache

    def encode(self) -> bytes:
        body = {
            "decode_request_id": self.decode_request_id, "decode_engine": self.decode_engine,
            "decode_tp": self.decode_tp, "prefill_engine": self.prefill_engine,
            "blocks": {int(g): [int(b) for b in ids] for g, ids in self.blocks.items()},
            "hit_blocks": self.hit_blocks,
        }
        return PUSH_PREFIX + msgpack.packb(body, use_bin_type=True)

    @classmethod
    def decode(cls, message: bytes) -> PushRegistration | None:
        """The registration in ``message``, or None when it is not a well-formed one."""
        if not message.startswith(PUSH_PREFIX) or len(message) > _MAX_REGISTRATION_BYTES:
            return None
        try:
            body: Any = msgpack.unpackb(message[len(PUSH_PREFIX):], raw=False,
                                        strict_map_key=False, max_array_len=1 << 20)
        except Exception:  # msgpack raises several unrelated types on garbage
            return None
        if not isinstance(body, dict) or set(body) != set(_KEYS):
            return None
        for key, kind in _KEYS.items():
            value = body[key]
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                return None
        blocks: dict[int, np.ndarray] = {}
        for group, ids in body["blocks"].items():
            if (not isinstance(group, int) or isinstance(group, bool) or not isinstance(ids, list)
                    or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0
                               for b in ids)):
                return None
            blocks[group] = np.asarray(ids, dtype=np.int64)
        if body["decode_tp"] < 1 or body["hit_blocks"] < 0:
            return None
        return cls(decode_request_id=body["decode_request_id"],
                   decode_engine=body["decode_engine"], decode_tp=body["decode_tp"],
                   prefill_engine=body["prefill_engine"], blocks=blocks,
                   hit_blocks=body["hit_blocks"])


@dataclass(frozen=True, kw_only=True)
class WriteRequest:
    """What one prefill rank needs to push one request."""

    prefill_request_id: str
    registration: PushRegistration
    prefill_blocks: Mapping[int, np.ndarray]  # group id -> prefill logical ids (clipped)
