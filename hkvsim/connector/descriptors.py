"""Descriptor arrays and descriptor ids (docs/semantics.md §3.3-3.4, §5.2-5.4). Vectorised with numpy.

A descriptor list names N (addr, len, device) runs. The order is part of the contract:
attention descriptors region-major, then state descriptors sub-region-major; local and remote
lists pair by descriptor id. Lists are built as affine descriptions (hkvsim.transport.affine:
one segment per region / state sub-region), not (N, 3) arrays: their size does not depend on
num_blocks. Nothing here touches memory; it only computes addresses.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..transport.affine import AffineList
from ..transport.outer import OuterIds
from .metadata import RankMetadata
from .tp import SourcePlan

__all__ = ["DescriptorList", "local_descriptors", "split_descriptors", "sliced_descriptors",
           "remote_descriptors", "remote_list_length", "state_region_indices"]


@dataclass(frozen=True, eq=False)
class DescriptorList:
    """A prepared list's description plus the numbers needed to compute descriptor ids.

    ``affine`` describes the list (one segment per attention region, then one per state
    region and sub-region): addresses are computed from ids on demand and the list costs the
    same whatever ``num_blocks`` is. ``descs`` materialises the (N, 3) rows (tests, small
    lists): O(N)."""

    affine: AffineList
    num_attention_regions: int  # R_fa
    attention_blocks: int  # N_fa: kernel blocks per region (x bsr for a sub-block list)
    num_state_subregions: int  # S * (C + 1)
    state_blocks: int  # N_log: logical blocks per state sub-region

    def __len__(self) -> int:
        return len(self.affine)

    @property
    def descs(self) -> np.ndarray:
        """The (N, 3) uint64 rows (addr, len, device): O(N) memory."""
        return self.affine.materialise()

    @property
    def state_base(self) -> int:
        return self.num_attention_regions * self.attention_blocks

    @functools.cached_property
    def attention_bytes(self) -> int:
        """Bytes of one attention block id across every region (one id per region)."""
        return int(self.affine.length[:self.num_attention_regions].sum())

    @functools.cached_property
    def state_bytes(self) -> int:
        """Bytes of one state slot across every state sub-region."""
        return int(self.affine.length[self.num_attention_regions:].sum())

    @functools.cached_property
    def _region_starts(self) -> np.ndarray:
        return (np.arange(self.num_attention_regions, dtype=np.int64)
                * self.attention_blocks)[:, None]

    @functools.cached_property
    def _subregion_starts(self) -> np.ndarray:
        return (self.state_base + np.arange(self.num_state_subregions, dtype=np.int64)
                * self.state_blocks)[:, None]

    @functools.cached_property
    def region_starts(self) -> np.ndarray:
        """The first id of every attention region (1-D int64)."""
        return np.ascontiguousarray(self._region_starts[:, 0])

    @functools.cached_property
    def subregion_starts(self) -> np.ndarray:
        """The first id of every state sub-region (1-D int64)."""
        return np.ascontiguousarray(self._subregion_starts[:, 0])

    @functools.cached_property
    def _held_cache(self) -> dict[tuple[int, ...], tuple[np.ndarray, int]]:
        return {}

    def held_subregions(self, positions: tuple[int, ...]) -> tuple[np.ndarray, int]:
        """(first ids, bytes of one slot) of the state sub-regions ``positions`` (indices
        into the list's sub-regions, ascending): the sub-regions of the shared tensors that
        hold a layer of a cache group whose group leaves others unused (transfer extent
        "needed"). Made once per list and positions: the same array each time, so a
        transport may remember what it derived from it by its identity."""
        got = self._held_cache.get(positions)
        if got is None:
            q = np.asarray(positions, dtype=np.int64)
            if q.size and (q.min() < 0 or q.max() >= self.num_state_subregions):
                raise ValueError(f"state sub-regions {list(positions)} outside the list's "
                                 f"{self.num_state_subregions}")
            starts = np.ascontiguousarray(self.subregion_starts[q])
            starts.flags.writeable = False
            nbytes = int(self.affine.length[self.num_attention_regions + q].sum())
            got = self._held_cache[positions] = (starts, nbytes)
        return got

    def outer_ids(self, block_ids: np.ndarray | None, slot_ids: np.ndarray | None, *,
                  frozen: bool = False, block_range: bool = False,
                  held: "Sequence[tuple[tuple[int, ...], np.ndarray]]" = ()) -> OuterIds:
        """``attention_ids(block_ids)`` then ``state_ids(slot_ids)`` (None: none), as the
        OuterIds they are: the transport can check them from their structure. ``frozen``: the
        caller never modifies the arrays (see OuterIds). ``block_range``: the caller knows
        ``block_ids`` to be consecutive ids (OuterIds.ranges). ``held``: (sub-region
        positions, slots) moved over those state sub-regions only (transfer extent "needed":
        :meth:`held_subregions`), one more part each, after the rest."""
        if block_ids is not None and slot_ids is not None and not held:  # the common case
            return OuterIds.of_two(self.region_starts, block_ids, self.subregion_starts,
                                   slot_ids, frozen=frozen, first_range=block_range)
        parts = []
        ranges = []
        if block_ids is not None:
            parts.append((self.region_starts, block_ids))
            ranges.append(block_range)
        if slot_ids is not None:
            parts.append((self.subregion_starts, slot_ids))
            ranges.append(False)
        for positions, slots in held:
            parts.append((self.held_subregions(positions)[0], slots))
            ranges.append(False)
        return OuterIds.of_arrays(parts, frozen=frozen, ranges=ranges if block_range else None)

    def held_bytes(self, held: "Sequence[tuple[tuple[int, ...], np.ndarray]]") -> int:
        """Bytes :meth:`outer_ids` names for its ``held`` parts."""
        return sum(slots.size * self.held_subregions(positions)[1]
                   for positions, slots in held)

    def attention_ids(self, block_ids: np.ndarray) -> np.ndarray:
        """ids r*N_fa + k for every attention region r (region-major), k in ``block_ids``."""
        k = np.asarray(block_ids, dtype=np.int64)
        return (self._region_starts + k[None, :]).reshape(-1)

    def state_ids(self, slot_ids: np.ndarray) -> np.ndarray:
        """ids R_fa*N_fa + q*N_log + b for every state sub-region q (q-major), b in ``slot_ids``."""
        b = np.asarray(slot_ids, dtype=np.int64)
        return (self._subregion_starts + b[None, :]).reshape(-1)


def state_region_indices(meta: RankMetadata, state_regions: Sequence[int]) -> np.ndarray:
    return np.asarray(state_regions, dtype=np.int64) if meta.ssm_sizes != (0, 0) else np.zeros(
        0, dtype=np.int64)


class _Part(NamedTuple):
    """Segments of one part of a list (see AffineList): per segment count, base, stride,
    length, sub, sub_stride."""

    counts: np.ndarray
    base: np.ndarray
    stride: np.ndarray
    length: np.ndarray
    sub: np.ndarray
    sub_stride: np.ndarray


def _attention_part(meta: RankMetadata, sub_blocks: int, lens: np.ndarray,
                    offsets: np.ndarray) -> _Part:
    """One segment per region: id k*sub_blocks + s (kernel block k, sub-block s) at
    base + offset + k*stride + s*(block_len/sub_blocks).

    ``lens`` / ``offsets`` are per region (R,) arrays: descriptor length and start offset within
    each (sub-)block.
    """
    r = meta.num_regions
    base = np.asarray(meta.base_addrs, dtype=np.int64) + np.asarray(offsets, dtype=np.int64)
    sub_len = np.asarray(meta.block_lens, dtype=np.int64) // sub_blocks
    return _Part(counts=np.full(r, meta.num_blocks * sub_blocks, np.int64), base=base,
                 stride=np.asarray(meta.block_strides, dtype=np.int64),
                 length=np.broadcast_to(np.asarray(lens, dtype=np.int64), (r,)),
                 sub=np.full(r, sub_blocks, np.int64),
                 sub_stride=sub_len if sub_blocks > 1 else np.zeros(r, np.int64))


def _state_part(meta: RankMetadata, regions: np.ndarray, offsets: np.ndarray,
                sizes: np.ndarray) -> tuple[_Part, int]:
    """State descriptors: for each state region, sub-region j and logical block b (one
    segment per (region, j), ids b)."""
    if regions.size == 0:
        return _NO_PART, 0
    ppl = meta.physical_blocks_per_logical
    n_log = meta.num_blocks // ppl
    page = np.asarray(meta.block_lens, dtype=np.int64)[regions] * ppl  # the unified page
    base = np.asarray(meta.base_addrs, dtype=np.int64)[regions]
    q = offsets.size
    n = regions.size * q
    return _Part(counts=np.full(n, n_log, np.int64),
                 base=(base[:, None] + np.asarray(offsets, np.int64)[None, :]).reshape(-1),
                 stride=np.repeat(page, q), length=np.tile(np.asarray(sizes, np.int64),
                                                           regions.size),
                 sub=np.ones(n, np.int64), sub_stride=np.zeros(n, np.int64)), n_log


_NO_PART = _Part(*(np.zeros(0, dtype=np.int64) for _ in range(6)))


def _assemble(meta: RankMetadata, attention: _Part, attention_blocks: int, state: _Part,
              n_state_sub: int, n_log: int) -> DescriptorList:
    """The list: attention segments then state segments (its description: no rows)."""
    affine = AffineList(**{f: np.concatenate([getattr(attention, f), getattr(state, f)])
                           for f in _Part._fields}, device=meta.device_id)
    return DescriptorList(affine=affine, num_attention_regions=meta.num_regions,
                          attention_blocks=attention_blocks, num_state_subregions=n_state_sub,
                          state_blocks=n_log)


def local_descriptors(meta: RankMetadata, state_regions: Sequence[int], *,
                      sub_blocks: int = 1) -> DescriptorList:
    """The local list (§3.3); ``sub_blocks`` = bsr builds decode's sub-block list."""
    lens = np.asarray(meta.block_lens, dtype=np.int64) // sub_blocks
    attention = _attention_part(meta, sub_blocks, lens, np.zeros(meta.num_regions, np.int64))
    regions = state_region_indices(meta, state_regions)
    sizes = np.asarray(meta.ssm_subregion_sizes, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) if sizes.size else sizes
    state, n_log = _state_part(meta, regions, offsets, sizes)
    return _assemble(meta, attention, meta.num_blocks * sub_blocks, state,
                     regions.size * sizes.size, n_log)


def split_descriptors(meta: RankMetadata, state_regions: Sequence[int], plan: SourcePlan,
                      remote_rank: int, *, sub_blocks: int = 1) -> DescriptorList:
    """Split list for pull source ``remote_rank`` (§5.2): same length and order as the full list.

    REPLICATE attention stays whole; SPLIT attention takes slot/fa_splits of each block; state
    takes chunk p_idx/ssm_splits of each sub-region.
    """
    if remote_rank in plan.attention_sources:
        slot, splits = plan.attention_slot(remote_rank), plan.fa_splits
    else:  # a state-only source: attention ids are never used with this list
        slot, splits = 0, max(plan.fa_splits, 1)
    chunk = plan.state_chunk(remote_rank) if remote_rank in plan.state_sources else 0
    return sliced_descriptors(meta, state_regions, attention_slot=slot, attention_splits=splits,
                              state_chunk=chunk, state_splits=max(plan.ssm_splits, 1),
                              sub_blocks=sub_blocks)


def sliced_descriptors(meta: RankMetadata, state_regions: Sequence[int], *, attention_slot: int,
                       attention_splits: int, state_chunk: int, state_splits: int,
                       sub_blocks: int = 1) -> DescriptorList:
    """The full list with every SPLIT attention block cut to slot/splits and every state
    sub-region cut to chunk/splits (REPLICATE attention stays whole)."""
    is_mla = np.asarray(meta.region_is_mla, dtype=bool)
    block = np.asarray(meta.block_lens, dtype=np.int64) // sub_blocks
    lens = np.where(is_mla, block, block // attention_splits)
    offsets = np.where(is_mla, 0, attention_slot * (block // attention_splits))
    attention = _attention_part(meta, sub_blocks, lens, offsets)
    regions = state_region_indices(meta, state_regions)
    sizes = np.asarray(meta.ssm_subregion_sizes, dtype=np.int64)
    if regions.size:
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        offsets_s = starts + state_chunk * (sizes // state_splits)
        state, n_log = _state_part(meta, regions, offsets_s, sizes // state_splits)
    else:
        state, n_log = _NO_PART, 0
    return _assemble(meta, attention, meta.num_blocks * sub_blocks, state,
                     regions.size * sizes.size, n_log)


def remote_list_length(remote: RankMetadata, local: RankMetadata, state_regions: Sequence[int], *,
                       remote_sub_blocks: int = 1) -> int:
    """How many descriptors :func:`remote_descriptors` will build, without building them (the
    handshake bounds it before allocating anything)."""
    regions = state_region_indices(remote, state_regions).size
    n_log = remote.num_blocks // remote.physical_blocks_per_logical
    return (remote.num_regions * remote.num_blocks * remote_sub_blocks
            + regions * len(local.ssm_subregion_sizes) * n_log)


def remote_descriptors(remote: RankMetadata, local: RankMetadata, state_regions: Sequence[int],
                       plan: SourcePlan, *, bsr: int, remote_sub_blocks: int = 1) -> DescriptorList:
    """The remote list one local rank prepares for one remote rank (§5.3-5.4).

    Pull: the local side is decode and ``bsr`` its block size ratio (a local block is bsr remote
    blocks). Push: the local side is prefill (``bsr`` 1) and each remote decode block is listed
    as ``remote_sub_blocks`` sub-blocks, one per prefill kernel block.
    """
    local_is_mla = np.asarray(local.region_is_mla, dtype=bool)
    len_l = np.asarray(local.block_lens, dtype=np.int64) // bsr
    num_reads = np.where(local_is_mla, 1, max(plan.fa_splits, 1))
    lens = len_l // num_reads
    offsets = np.where(local_is_mla, 0, plan.rank_offset_factor * len_l)
    attention = _attention_part(remote, remote_sub_blocks, lens, offsets)
    regions = state_region_indices(remote, state_regions)
    local_sizes = np.asarray(local.ssm_subregion_sizes, dtype=np.int64)
    if regions.size:
        r = plan.tp_ratio
        if r >= 1:
            off = local.tp_rank % r
            conv_local = local_sizes[:-1]
            cursor = np.concatenate([[0], np.cumsum(conv_local * r)[:-1]]).astype(np.int64)
            conv_offsets = cursor + off * conv_local
            rec_offset = remote.ssm_sizes[0] + off * local_sizes[-1]
            offsets_s = np.concatenate([conv_offsets, [rec_offset]]).astype(np.int64)
            sizes = local_sizes
        else:
            sizes = local_sizes // -r
            offsets_s = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        state, n_log = _state_part(remote, regions, offsets_s, sizes)
    else:
        state, n_log = _NO_PART, 0
    return _assemble(remote, attention, remote.num_blocks * remote_sub_blocks, state,
                     regions.size * local_sizes.size, n_log)
