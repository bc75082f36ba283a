"""Descriptor arrays and descriptor ids (docs/semantics.md §3.3-3.4, §5.2-5.4). Vectorised with numpy.

A descriptor list is an (N, 3) uint64 array of (addr, len, device). The order is part of the
contract: attention descriptors region-major, then state descriptors sub-region-major; local and
remote lists pair by descriptor id. Nothing here touches memory; it only computes addresses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .metadata import RankMetadata
from .tp import SourcePlan

__all__ = ["DescriptorList", "local_descriptors", "split_descriptors", "sliced_descriptors",
           "remote_descriptors", "remote_list_length", "state_region_indices"]


@dataclass(frozen=True, eq=False)
class DescriptorList:
    """A prepared-list's content plus the numbers needed to compute descriptor ids."""

    descs: np.ndarray  # (N, 3) uint64: addr, len, device
    num_attention_regions: int  # R_fa
    attention_blocks: int  # N_fa: kernel blocks per region (x bsr for a sub-block list)
    num_state_subregions: int  # S * (C + 1)
    state_blocks: int  # N_log: logical blocks per state sub-region

    def __len__(self) -> int:
        return int(self.descs.shape[0])

    @property
    def state_base(self) -> int:
        return self.num_attention_regions * self.attention_blocks

    def attention_ids(self, block_ids: np.ndarray) -> np.ndarray:
        """ids r*N_fa + k for every attention region r (region-major), k in ``block_ids``."""
        k = np.asarray(block_ids, dtype=np.int64)
        regions = np.arange(self.num_attention_regions, dtype=np.int64)[:, None]
        return (regions * self.attention_blocks + k[None, :]).reshape(-1)

    def state_ids(self, slot_ids: np.ndarray) -> np.ndarray:
        """ids R_fa*N_fa + q*N_log + b for every state sub-region q (q-major), b in ``slot_ids``."""
        b = np.asarray(slot_ids, dtype=np.int64)
        q = np.arange(self.num_state_subregions, dtype=np.int64)[:, None]
        return (self.state_base + q * self.state_blocks + b[None, :]).reshape(-1)


def state_region_indices(meta: RankMetadata, state_regions: Sequence[int]) -> np.ndarray:
    return np.asarray(state_regions, dtype=np.int64) if meta.ssm_sizes != (0, 0) else np.zeros(
        0, dtype=np.int64)


def _stack(addr: np.ndarray, length: np.ndarray, device: int) -> np.ndarray:
    out = np.empty((addr.size, 3), dtype=np.uint64)
    out[:, 0] = addr.reshape(-1)
    out[:, 1] = np.broadcast_to(length, addr.shape).reshape(-1)
    out[:, 2] = device
    return out


def _attention_part(meta: RankMetadata, sub_blocks: int, lens: np.ndarray,
                    offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(R, N_fa, sub_blocks) addresses, and lengths broadcastable to them, for the attention part.

    ``lens`` / ``offsets`` are per region (R,) arrays: descriptor length and start offset within
    each (sub-)block.
    """
    base = np.asarray(meta.base_addrs, dtype=np.int64)[:, None, None]
    stride = np.asarray(meta.block_strides, dtype=np.int64)[:, None, None]
    blocks = np.arange(meta.num_blocks, dtype=np.int64)[None, :, None]
    sub = np.arange(sub_blocks, dtype=np.int64)[None, None, :]
    sub_len = (np.asarray(meta.block_lens, dtype=np.int64) // sub_blocks)[:, None, None]
    # the small terms first, so that only one array of the full size is allocated
    addr = blocks * stride + (base + sub * sub_len + offsets[:, None, None])
    return addr, np.asarray(lens, dtype=np.int64)[:, None, None]


def _state_part(meta: RankMetadata, regions: np.ndarray, offsets: np.ndarray,
                sizes: np.ndarray) -> tuple[tuple[np.ndarray, np.ndarray], int]:
    """State descriptors: for each state region, sub-region j and logical block b."""
    if regions.size == 0:
        return _NO_PART, 0
    ppl = meta.physical_blocks_per_logical
    n_log = meta.num_blocks // ppl
    page = np.asarray(meta.block_lens, dtype=np.int64)[regions] * ppl  # the unified page
    base = np.asarray(meta.base_addrs, dtype=np.int64)[regions]
    blocks = np.arange(n_log, dtype=np.int64)
    addr = blocks[None, None, :] * page[:, None, None] + (base[:, None, None]
                                                          + offsets[None, :, None])
    return (addr, np.asarray(sizes, dtype=np.int64)[None, :, None]), n_log


_NO_PART = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))


def _assemble(meta: RankMetadata, attention: tuple[np.ndarray, np.ndarray], attention_blocks: int,
              state: tuple[np.ndarray, np.ndarray], n_state_sub: int, n_log: int
              ) -> DescriptorList:
    """The (N, 3) list: attention rows then state rows, written in place (no intermediate
    (N, 2) arrays: lists reach millions of rows at production num_blocks)."""
    n_att, n_state = attention[0].size, state[0].size
    descs = np.empty((n_att + n_state, 3), dtype=np.uint64)
    for start, (addr, length) in ((0, attention), (n_att, state)):
        if addr.size:
            rows = descs[start:start + addr.size]
            rows[:, 0] = addr.reshape(-1)
            rows[:, 1] = np.broadcast_to(length, addr.shape).reshape(-1)
    descs[:, 2] = meta.device_id
    return DescriptorList(descs=descs, num_attention_regions=meta.num_regions,
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
