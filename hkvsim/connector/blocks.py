"""Block-id handling: logical->kernel expansion, block size ratio, pairing (docs/semantics.md §6-7).

Pure, vectorised functions over int64 arrays of block ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["PairingError", "expand_logical", "expand_logical_range", "to_sub_blocks", "AttentionPairing",
           "pair_attention", "pair_attention_ids", "pair_state_slots"]


class PairingError(ValueError):
    """Per-request block lists that cannot be paired (unpairable slots, ppl-difference bound)."""


_INT64 = np.dtype(np.int64)
_OFFSETS: dict[int, np.ndarray] = {}  # ppl -> [0..ppl) (read-only; a handful of ppl per run)


def _offsets(ppl: int) -> np.ndarray:
    got = _OFFSETS.get(ppl)
    if got is None:
        got = np.arange(ppl, dtype=np.int64)
        got.flags.writeable = False
        if len(_OFFSETS) < 256:
            _OFFSETS[ppl] = got
    return got


def expand_logical(logical_ids: np.ndarray, ppl: int) -> np.ndarray:
    """logical * ppl + [0..ppl) for every id, in order (attention groups only). Always a new
    array (callers may keep it as read-only ids of their own)."""
    return expand_logical_range(logical_ids, ppl)[0]


def expand_logical_range(logical_ids: np.ndarray, ppl: int) -> tuple[np.ndarray, bool]:
    """(:func:`expand_logical`, whether the result is known to be consecutive ids
    ``first, first + 1, ...``). Known for up to 64 logical ids, checked exactly; False says
    only "not known" (longer lists are not checked)."""
    ids = logical_ids if (type(logical_ids) is np.ndarray and logical_ids.dtype is _INT64
                          ) else np.asarray(logical_ids, dtype=np.int64)
    if 0 < ids.size <= 64 and ids.ndim == 1:  # consecutive ids (fresh blocks): one range
        v = ids.tolist()
        if v[-1] - v[0] == len(v) - 1 and v == list(range(v[0], v[0] + len(v))):
            return np.arange(v[0] * ppl, (v[-1] + 1) * ppl, dtype=np.int64), True
    if ppl == 1:  # (the common case: the ids themselves, as a new array)
        return ids.reshape(-1).copy(), False
    return (ids.reshape(-1, 1) * ppl + _offsets(ppl)).ravel(), False


def to_sub_blocks(kernel_ids: np.ndarray, bsr: int) -> np.ndarray:
    """Decode kernel block b -> sub-blocks b*bsr + [0..bsr) of decode's sub-block list."""
    return expand_logical(kernel_ids, bsr)


@dataclass(frozen=True, eq=False)
class AttentionPairing:
    local: np.ndarray  # ids in the local list's id space (sub-block ids when bsr > 1)
    remote: np.ndarray


def pair_attention(*, decode_ids: np.ndarray, prefill_ids: np.ndarray, decode_hit_units: int,
                   heterogeneous_ppl: bool, ppl_decode: int, ppl_prefill: int,
                   front_trim_with_prefix: bool = False,
                   end_trim_by_count: bool = False) -> AttentionPairing:
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
    * ``end_trim_by_count`` replays quirk bsr-prefix-end-trim: after a hit, decode's list is
      clipped to prefill's whole list and prefill's is cut to decode's count from its end, which
      with a block size ratio pairs sub-blocks no prefill block fills with earlier blocks.
    """
    local, remote = pair_attention_ids(
        decode_ids, prefill_ids, decode_hit_units=decode_hit_units,
        heterogeneous_ppl=heterogeneous_ppl, ppl_decode=ppl_decode, ppl_prefill=ppl_prefill,
        front_trim_with_prefix=front_trim_with_prefix, end_trim_by_count=end_trim_by_count)
    return AttentionPairing(local=local, remote=remote)


def pair_attention_ids(decode_ids: np.ndarray, prefill_ids: np.ndarray, *,
                       decode_hit_units: int, heterogeneous_ppl: bool, ppl_decode: int,
                       ppl_prefill: int, front_trim_with_prefix: bool = False,
                       end_trim_by_count: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """:func:`pair_attention` as (local, remote) arrays (the connector's per-request path).
    A side that pairs whole is returned as given (no view made)."""
    d = decode_ids if (type(decode_ids) is np.ndarray and decode_ids.dtype is _INT64
                       ) else np.asarray(decode_ids, dtype=np.int64)
    p = prefill_ids if (type(prefill_ids) is np.ndarray and prefill_ids.dtype is _INT64
                        ) else np.asarray(prefill_ids, dtype=np.int64)
    if d.size == 0:  # an empty receive (full hit, or an abort): nothing to pair, notify only
        return d, p[:0]
    if decode_hit_units == 0 or front_trim_with_prefix:
        if heterogeneous_ppl and abs(d.size - p.size) > ppl_decode + ppl_prefill:
            raise PairingError(
                f"ppl-difference bound: decode has {d.size} blocks, prefill {p.size}; the "
                f"difference may be at most ppl_D + ppl_P = {ppl_decode + ppl_prefill}"
            )
        n = min(d.size, p.size)
        return (d if n == d.size else d[:n]), (p if n == p.size else p[:n])
    if heterogeneous_ppl:
        raise PairingError(
            "prefix hit with heterogeneous physical_blocks_per_logical cannot be paired "
            "(disable prefix caching for this pair)"
        )
    if end_trim_by_count:  # quirk bsr-prefix-end-trim: counts, not the hit's position
        d = d[:p.size]
        return d, p[p.size - d.size:]
    start = decode_hit_units
    n = max(0, min(d.size, p.size - start))
    return (d if n == d.size else d[:n]), p[start:start + n]


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
