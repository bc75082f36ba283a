"""docs/semantics.md §5.3 remote attention descriptors and the §5.4 KimiLinear state-offset table,
checked on real kimi-linear-48b layouts through remote_descriptors / split_descriptors."""

from __future__ import annotations

import numpy as np

from hkvsim.connector.descriptors import (
    DescriptorList,
    local_descriptors,
    remote_descriptors,
    split_descriptors,
)
from hkvsim.connector.tp import source_plan
from hkvsim.geometry.presets import preset

from ._helpers import layout, meta, state_regions

KIMI = "kimi-linear-48b"
# §2.3: unified page per TP
UNIFIED = {1: 2_211_840, 2: 1_105_920, 4: 589_824, 8: 294_912}


def _state_rows(dl: DescriptorList, m, region: int, block: int, tp: int) -> list[list[int]]:
    """(offset within the page, len) of the 4 sub-regions of ``region`` for logical ``block``."""
    ids = dl.state_ids(np.array([block]))
    per_region = 4  # Q, K, V, recurrent
    rows = dl.descs[ids[region * per_region:(region + 1) * per_region]].astype(np.int64)
    page_start = m.base_addrs[region] + block * UNIFIED[tp]
    return [[int(a) - page_start, int(n)] for a, n in rows[:, :2]]


def _kimi(tp: int, rank: int, engine: str):
    lay = layout(KIMI, tp, block_size=64, num_blocks=4)
    return lay, meta(lay, rank, engine=engine, base=(1 << 40) * (1 + rank) + (
        0 if engine == "p" else 1 << 44))


def test_p1_to_d2_rank1_reads_its_half():
    # §5.4 row 1: P1 -> D2, r = +2, D rank 1 reads (12,288, 12,288), (36,864, 12,288),
    # (61,440, 12,288), (1,122,304, 1,048,576) and lands at 0/12,288/24,576/36,864.
    d_lay, d = _kimi(2, 1, "d")
    _, p = _kimi(1, 0, "p")
    plan = source_plan(preset(KIMI), local_tp=2, remote_tp=1, tp_rank=1)
    assert plan.tp_ratio == 2 and not plan.use_split_handles
    regions = state_regions(d_lay)
    rl = remote_descriptors(p, d, regions, plan, bsr=1)
    ll = local_descriptors(d, regions)
    expected_remote = [[12_288, 12_288], [36_864, 12_288], [61_440, 12_288],
                       [1_122_304, 1_048_576]]
    expected_local = [[0, 12_288], [12_288, 12_288], [24_576, 12_288], [36_864, 1_048_576]]
    for region in (0, 3, 6):
        for block in (0, 1, 3):
            assert _state_rows(rl, p, region, block, 1) == expected_remote
            assert _state_rows(ll, d, region, block, 2) == expected_local


def test_p1_to_d2_rank0_reads_the_first_half():
    # Same rule, off = tp_rank % r = 0: (cursor + 0*s, s), cursor advancing by s*r = 24,576;
    # recurrent at remote conv_bytes (73,728) + 0.
    d_lay, d = _kimi(2, 0, "d")
    _, p = _kimi(1, 0, "p")
    plan = source_plan(preset(KIMI), local_tp=2, remote_tp=1, tp_rank=0)
    rl = remote_descriptors(p, d, state_regions(d_lay), plan, bsr=1)
    assert _state_rows(rl, p, 0, 2, 1) == [[0, 12_288], [24_576, 12_288], [49_152, 12_288],
                                           [73_728, 1_048_576]]


def test_p2_to_d1_from_p_idx_1():
    # §5.4 row 2: P2 -> D1, r = -2, from p_idx 1: remote (0, 12,288), (12,288, 12,288),
    # (24,576, 12,288), (36,864, 1,048,576); local landing 12,288/36,864/61,440/1,122,304.
    d_lay, d = _kimi(1, 0, "d")
    _, p1 = _kimi(2, 1, "p")
    plan = source_plan(preset(KIMI), local_tp=1, remote_tp=2, tp_rank=0)
    assert plan.tp_ratio == -2 and plan.use_split_handles
    assert plan.state_sources == (0, 1) and plan.state_chunk(1) == 1
    regions = state_regions(d_lay)
    rl = remote_descriptors(p1, d, regions, plan, bsr=1)
    sl = split_descriptors(d, regions, plan, 1)
    full = local_descriptors(d, regions)
    assert len(sl) == len(full)  # split list: same length and order as the full list
    expected_remote = [[0, 12_288], [12_288, 12_288], [24_576, 12_288], [36_864, 1_048_576]]
    expected_local = [[12_288, 12_288], [36_864, 12_288], [61_440, 12_288],
                      [1_122_304, 1_048_576]]
    for region in (0, 6):
        for block in (0, 3):
            assert _state_rows(rl, p1, region, block, 2) == expected_remote
            assert _state_rows(sl, d, region, block, 1) == expected_local


def test_p2_to_d1_from_p_idx_0_lands_in_chunk_0():
    d_lay, d = _kimi(1, 0, "d")
    plan = source_plan(preset(KIMI), local_tp=1, remote_tp=2, tp_rank=0)
    sl = split_descriptors(d, state_regions(d_lay), plan, 0)
    # chunk 0 of each local sub-region (offsets 0/24,576/49,152/73,728 from §2.3 TP1)
    assert _state_rows(sl, d, 2, 1, 1) == [[0, 12_288], [24_576, 12_288], [49_152, 12_288],
                                           [73_728, 1_048_576]]


def test_split_list_keeps_mla_blocks_whole():
    # §5.2: REPLICATE (MLA) attention stays whole in every split list; a dual-purpose region
    # mislabelled SPLIT would be head-sliced here.
    d_lay, d = _kimi(1, 0, "d")
    plan = source_plan(preset(KIMI), local_tp=1, remote_tp=2, tp_rank=0)
    full = local_descriptors(d, state_regions(d_lay))
    n_att = full.num_attention_regions * full.attention_blocks
    for p_idx in (0, 1):
        sl = split_descriptors(d, state_regions(d_lay), plan, p_idx)
        assert (sl.descs[:n_att] == full.descs[:n_att]).all()
        assert set(sl.descs[:n_att, 1].tolist()) == {73_728}


def test_remote_mla_attention_descriptors():
    # §5.3 REPLICATE: num_reads 1, offset 0, len = len_L / bsr; addr = base_i + b * stride_i.
    d_lay, d = _kimi(1, 0, "d")
    _, p1 = _kimi(2, 1, "p")
    plan = source_plan(preset(KIMI), local_tp=1, remote_tp=2, tp_rank=0)
    rl = remote_descriptors(p1, d, state_regions(d_lay), plan, bsr=1)
    # remote TP2 has 4 logical x 15 = 60 kernel blocks per region
    assert rl.attention_blocks == 60 and rl.state_blocks == 4
    ids = rl.attention_ids(np.array([0, 59]))
    rows = rl.descs[ids].astype(np.int64)
    expect = []
    for r in range(7):
        expect += [[p1.base_addrs[r], 73_728], [p1.base_addrs[r] + 59 * 73_728, 73_728]]
    assert rows[:, :2].tolist() == expect


def test_remote_gqa_attention_descriptors_heterogeneous_tp_and_bsr():
    # §5.3 SPLIT: offset = rank_offset_factor * len_L/bsr, len = (len_L/bsr)/num_reads.
    # tiny-llama (K = 8 x 16, bf16): D TP2 block 32 <- P TP1 block 16, D rank 1, bsr 2.
    # len_L = 32 tokens x 4 heads x 2 (K,V) x 32 B = 8,192; /bsr = 4,096; factor 1 % 2 = 1.
    # P block_len = 16 tokens x 8 heads x 2 x 32 B = 8,192. So (base + b*8,192 + 4,096, 4,096).
    d_lay = layout("tiny-llama", 2, block_size=32, num_blocks=8)
    p_lay = layout("tiny-llama", 1, block_size=16, num_blocks=8)
    d, p = meta(d_lay, 1), meta(p_lay, 0, base=1 << 44)
    assert d.block_lens[0] == 8_192 and p.block_lens[0] == 8_192
    plan = source_plan(d_lay.model, local_tp=2, remote_tp=1, tp_rank=1)
    rl = remote_descriptors(p, d, [], plan, bsr=2)
    rows = rl.descs[rl.attention_ids(np.array([0, 5]))].astype(np.int64)
    assert rows[:2, :2].tolist() == [[p.base_addrs[0] + 4_096, 4_096],
                                     [p.base_addrs[0] + 5 * 8_192 + 4_096, 4_096]]


def test_split_gqa_attention_slices_by_slot():
    # §5.2 SPLIT attention in split list p_idx: (addr + slot*len/fa_splits, len/fa_splits).
    # tiny-llama D TP1 <- P TP2: fa_splits 2; D block_len 16 tokens x 8 heads x 2 x 32 B = 8,192.
    d_lay = layout("tiny-llama", 1, block_size=16, num_blocks=8)
    d = meta(d_lay)
    plan = source_plan(d_lay.model, local_tp=1, remote_tp=2, tp_rank=0)
    assert plan.attention_sources == (0, 1)
    for p_idx in (0, 1):
        sl = split_descriptors(d, [], plan, p_idx)
        rows = sl.descs[sl.attention_ids(np.array([3]))].astype(np.int64)
        assert rows[0, :2].tolist() == [d.base_addrs[0] + 3 * 8_192 + p_idx * 4_096, 4_096]
    # and the remote list reads P's whole per-rank block: len_L / num_reads = 4,096
    p = meta(layout("tiny-llama", 2, block_size=16, num_blocks=8), 1, base=1 << 44)
    rl = remote_descriptors(p, d, [], plan, bsr=1)
    assert set(rl.descs[:, 1].tolist()) == {4_096}
    assert p.block_lens[0] == 4_096
