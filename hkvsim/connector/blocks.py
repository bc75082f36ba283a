"""Block-id handling: logical->kernel expansion, block size ratio, pairing (docs/semantics.md §6-7).

Pure, vectorised functions over int64 arrays of block ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["PairingError", "expand_logical", "to_sub_blocks", "AttentionPairing",
           "pair_attention", "pair_state_slots"]


class PairingError(ValueError):
    """Per-request block lists that cannot be paired (unpairable slots, ppl-difference bound)."""


def expand_logical(logical_ids: np.ndarray, ppl: int) -> np.ndarray:
    """logical * ppl + [0..ppl) for every id, in order (attention groups only)."""
    ids = np.asarray(logical_ids, dtype=np.int64)
    if ppl == 1:  # (the common case: the ids themselves, as a new array)
        return ids.reshape(-1).copy()
    return (ids[:, None] * ppl + np.arange(ppl, dtype=np.int64)[None, :]).reshape(-1)


def to_sub_blocks(kernel_ids: np.ndarray, bsr: int) -> np.ndarray:
    """Decode kernel block b -> sub-blocks b*bsr + [0..bsr) of decode's sub-block list."""
    return expand_logical(kernel_ids, bsr)


@dataclass(frozen=True, eq=False)
class AttentionPairing:
    local: np.ndarray  # ids in the local list's id space (sub-block ids when bsr > 1)
    remote: np.ndarray


def pair_attention(*, decode_ids: np.ndarray, prefill_ids: np.ndarray, decode_hit_units: int,
                   heterogeneous_ppl: bool, ppl_decode: int, ppl_prefill: int,
                   front_trim_with_prefix: bool = False) -> AttentionPairing:
    """Pair decode's uncached (sub-)blocks with prefill's kernel blocks.

    Both lists are in prefill-kernel-block units (decode's as sub-blocks when bsr > 1), in token
    order. ``decode_hit_units`` is the number of prefill-kernel-sized blocks decode already holds
    (prefix-cache hit).

    * No hit: pair from the front; when the ppl differ, both lists are front-trimmed to the
      shorter after asserting |len_D - len_P| <= ppl_D + ppl_P (allocation rounding).
    * Hit, equal ppl: end-trim, i.e. decode's suffix pairs with prefill's blocks from the hit on.
      Implemented as pairing from the hit offset, which equals end-trim whenever decode's list is
      prefill's suffix and stays token-aligned when a block size ratio leaves a partial tail.
    * Hit with heterogeneous ppl is refused at handshake (V4); ``front_trim_with_prefix`` replays
      the bug of front-trimming anyway (prefill's prefix lands in decode's suffix).
    """
    d = np.asarray(decode_ids, dtype=np.int64)
    p = np.asarray(prefill_ids, dtype=np.int64)
    if d.size == 0:  # an empty receive (full hit, or an abort): nothing to pair, notify only
        return AttentionPairing(local=d, remote=p[:0])
    if decode_hit_units == 0 or front_trim_with_prefix:
        if heterogeneous_ppl and abs(d.size - p.size) > ppl_decode + ppl_prefill:
            raise PairingError(
                f"ppl-difference bound: decode has {d.size} blocks, prefill {p.size}; the "
                f"difference may be at most ppl_D + ppl_P = {ppl_decode + ppl_prefill}"
            )
        n = min(d.size, p.size)
        return AttentionPairing(local=d[:n], remote=p[:n])
    if heterogeneous_ppl:
        raise PairingError(
            "prefix hit with heterogeneous physical_blocks_per_logical cannot be paired "
            "(disable prefix caching for this pair)"
        )
    start = decode_hit_units
    n = max(0, min(d.size, p.size - start))
    return AttentionPairing(local=d[:n], remote=p[start:start + n])


def pair_state_slots(decode_slots: np.ndarray, prefill_slots: np.ndarray) -> tuple[np.ndarray,
                                                                                   np.ndarray]:
    """Pair state slots by position (§7): prefill's tail when it has more (placeholders); drop
    decode's extra slot when it has exactly one more; anything else is unpairable."""
    d = np.asarray(decode_slots, dtype=np.int64)
    p = np.asarray(prefill_slots, dtype=np.int64)
    if p.size >= d.size:
        return d, p[p.size - d.size:]
    if d.size == p.size + 1:
        return d[:p.size], p
    raise PairingError(
        f"unpairable SSM state slots: decode {d.size}, prefill {p.size} (decode may hold at most "
        f"one more slot than prefill)"
    )
