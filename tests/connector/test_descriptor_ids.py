"""docs/semantics.md §3.4 descriptor ids (the reference table) and §3.3 list order on real layouts."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hkvsim.connector.descriptors import DescriptorList, local_descriptors
from hkvsim.geometry.presets import preset
from hkvsim.geometry.specs import (
    GQAAttentionSpec,
    ModelSpec,
    gdn_state,
    kda_state,
    mamba1_state,
    mamba2_state,
)

from hkvsim.transport.affine import AffineList

from ._helpers import layout, meta, state_regions


def _list(*, regions: int, n_fa: int, subregions: int, n_log: int) -> DescriptorList:
    n = regions * n_fa + subregions * n_log
    affine = AffineList(counts=[n], base=[0], stride=[1], length=[1], device=0)
    return DescriptorList(affine=affine, num_attention_regions=regions,
                          attention_blocks=n_fa, num_state_subregions=subregions,
                          state_blocks=n_log)


def _ids(dl: DescriptorList, attn, state) -> list[int]:
    return np.concatenate([dl.attention_ids(np.array(attn)),
                           dl.state_ids(np.array(state))]).tolist()


# §3.4 table: | setup | Attn | State | Expected ids |
REFERENCE_ROWS = [
    pytest.param(dict(regions=2, n_fa=100, subregions=4, n_log=100), [3, 5], [1, 2],
                 [3, 5, 103, 105, 201, 202, 301, 302, 401, 402, 501, 502],
                 id="ppl1-N100"),
    pytest.param(dict(regions=2, n_fa=400, subregions=4, n_log=100), [3, 7], [1, 2],
                 [3, 7, 403, 407, 801, 802, 901, 902, 1001, 1002, 1101, 1102],
                 id="ppl4-Nfa400-Nlog100"),
    pytest.param(dict(regions=2, n_fa=400, subregions=4, n_log=100), [3, 5], [1],
                 [3, 5, 403, 405, 801, 901, 1001, 1101],
                 id="bsr4-100-D-blocks"),
]


@pytest.mark.parametrize("shape,attn,state,expected", REFERENCE_ROWS)
def test_reference_descriptor_ids(shape, attn, state, expected):
    dl = _list(**shape)
    assert _ids(dl, attn, state) == expected


def test_attention_ids_are_region_major_and_state_ids_subregion_major():
    dl = _list(regions=3, n_fa=10, subregions=2, n_log=5)
    assert dl.attention_ids(np.array([0, 9])).tolist() == [0, 9, 10, 19, 20, 29]
    assert dl.state_ids(np.array([4])).tolist() == [34, 39]


def test_bsr_sub_block_list_has_nfa_times_bsr_but_nlog_unchanged():
    # §3.4 row 3 through local_descriptors: 100 decode kernel blocks, sub-block list for bsr 4:
    # N_fa = 400, and the ids of sub-blocks 3 and 5 address kernel block 0 sub 3 / block 1 sub 1.
    lay = layout("tiny-llama", 1, block_size=64, num_blocks=100)
    m = meta(lay)
    dl = local_descriptors(m, [], sub_blocks=4)
    assert dl.attention_blocks == 400
    assert len(dl) == 4 * 400
    ids = dl.attention_ids(np.array([3, 5]))
    assert ids.tolist() == [3, 5, 403, 405, 803, 805, 1203, 1205]
    d = dl.descs[ids].astype(np.int64)
    blen, stride = m.block_lens[0], m.block_strides[0]
    assert d[:2, 0].tolist() == [m.base_addrs[0] + 3 * blen // 4,
                                 m.base_addrs[0] + stride + blen // 4]
    assert d[2:4, 0].tolist() == [m.base_addrs[1] + 3 * blen // 4,
                                  m.base_addrs[1] + stride + blen // 4]
    assert set(d[:, 1].tolist()) == {blen // 4}


def test_kimi_linear_ids_on_the_real_list():
    # §3.4: "KimiLinear: R_fa = 7, and the same regions give 28 state sub-regions".
    # TP8 (ppl 4, §2.3), 100 logical blocks: N_fa = 400, N_log = 100 as in table row 2.
    lay = layout("kimi-linear-48b", 8, block_size=64, num_blocks=100)
    m = meta(lay)
    dl = local_descriptors(m, state_regions(lay))
    assert dl.num_attention_regions == 7
    assert dl.attention_blocks == 400
    assert dl.num_state_subregions == 28
    assert dl.state_blocks == 100
    assert len(dl) == 7 * 400 + 28 * 100
    # attention block 7 of region 2 = id 2*400 + 7 = 807: (base_2 + 7 * 73,728, 73,728)
    d = dl.descs.astype(np.int64)
    assert dl.attention_ids(np.array([7]))[2] == 807
    assert d[807, :2].tolist() == [m.base_addrs[2] + 7 * 73_728, 73_728]
    # state: region 1 (q = 4..7), logical block 2; TP8 unified page 294,912, offsets
    # 0/3,072/6,144/9,216, sizes 3,072 x 3 and 262,144 (§2.3 table)
    ids = dl.state_ids(np.array([2]))
    assert ids[4:8].tolist() == [2800 + 4 * 100 + 2, 2800 + 5 * 100 + 2, 2800 + 6 * 100 + 2,
                                 2800 + 7 * 100 + 2]
    got = d[ids[4:8], :2] - np.array([m.base_addrs[1] + 2 * 294_912, 0])
    assert got.tolist() == [[0, 3_072], [3_072, 3_072], [6_144, 3_072], [9_216, 262_144]]


# ---- §3.3: sub-region count per state kind ----------------------------------------------------


def _hybrid(state) -> ModelSpec:
    return ModelSpec(name=f"hybrid-{state.kind}", architecture="Test", num_layers=4,
                     hidden_size=64, attention=GQAAttentionSpec(num_kv_heads=2, head_dim=16),
                     attention_layers=(1, 3), state=state)


@pytest.mark.parametrize("kind,subregions", [("mamba1", 2), ("mamba2", 4), ("gdn", 4),
                                              ("kda", 4)])
def test_state_subregions_per_kind(kind, subregions):
    # §3.3: "GDN, KDA and Mamba2 always have 3 + 1 sub-regions, even with homogeneous TP ...;
    # Mamba1 has 1 + 1."
    state = {
        "mamba1": lambda: mamba1_state(intermediate_size=64, d_state=16, conv_kernel=4),
        "mamba2": lambda: mamba2_state(intermediate_size=64, n_groups=1, d_state=16,
                                       num_heads=4, head_dim=16, conv_kernel=4),
        "gdn": lambda: gdn_state(num_k_heads=2, num_v_heads=4, k_head_dim=16, v_head_dim=16,
                                 conv_kernel=4),
        "kda": lambda: kda_state(num_heads=2, head_dim=16, conv_kernel=4),
    }[kind]()
    lay = layout(_hybrid(state), 1, block_size=16, num_blocks=3)
    dl = local_descriptors(meta(lay), state_regions(lay))
    assert len(lay.regions) == 2
    assert dl.num_state_subregions == 2 * subregions
    assert dl.state_blocks == 3


# ---- property: every attention id addresses the §3.3 formula ----------------------------------


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(["tiny-llama", "tiny-deepseek", "tiny-qwen3-next",
                             "tiny-kimi-linear"]),
       tp=st.sampled_from([1, 2, 4]), bsr=st.sampled_from([1, 2, 4]), data=st.data())
def test_attention_and_state_ids_address_the_reference_formula(name, tp, bsr, data):
    block = preset(name).attention.attention_backend.min_kernel_block
    lay = layout(name, tp, block_size=block, num_blocks=3)
    m = meta(lay)
    dl = local_descriptors(m, state_regions(lay), sub_blocks=bsr)
    n_fa = m.num_blocks * bsr
    k = data.draw(st.integers(0, n_fa - 1), label="sub-block")
    ids = dl.attention_ids(np.array([k]))
    for r, i in enumerate(ids.tolist()):
        assert i == r * n_fa + k
        addr, length = dl.descs[i, :2].astype(np.int64).tolist()
        # (base_r + b*stride_r + s*block_len_r/bsr, block_len_r/bsr), b = k // bsr, s = k % bsr
        assert addr == (m.base_addrs[r] + (k // bsr) * m.block_strides[r]
                        + (k % bsr) * (m.block_lens[r] // bsr))
        assert length == m.block_lens[r] // bsr
    if lay.is_hybrid:
        b = data.draw(st.integers(0, 2), label="logical block")
        sids = dl.state_ids(np.array([b]))
        sizes = lay.model.state.subregion_sizes(tp)
        offsets = lay.model.state.subregion_offsets(tp)
        regions = state_regions(lay)
        assert len(sids) == len(regions) * len(sizes)
        for q, i in enumerate(sids.tolist()):
            s, j = divmod(q, len(sizes))
            addr, length = dl.descs[i, :2].astype(np.int64).tolist()
            # (base_s + b*unified_page + offset_j, size_j); never sub-split by bsr (§5.4)
            assert addr == m.base_addrs[regions[s]] + b * lay.unified_page_bytes + offsets[j]
            assert length == sizes[j]
