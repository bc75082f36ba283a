"""docs/semantics.md §3.1-3.3: registration, the #49762 dual-purpose merge, and the local list built on it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hkvsim.connector.descriptors import local_descriptors
from hkvsim.connector.metadata import rank_metadata
from hkvsim.geometry.layout import (
    TENSOR_ALIGNMENT,
    EngineLayout,
    HMAGroup,
    build_layout,
    register_regions,
)
from hkvsim.geometry.presets import PRESETS, preset
from hkvsim.geometry.specs import GeometryError, MLAAttentionSpec, ModelSpec, kda_state

from ._helpers import BASE, layout, state_regions

# ---------------------------------------------------------------------------------------------
# §3.2 reference test: "Register kda_a.0, mla.0, kda_b.0, ... and expect: MLA flags [True, True];
# group ids [-1, -1]; block_len = unified_page/3 (12-token logical over 4-token kernel block);
# 24 attention descriptors (2 regions x 12); 32 state descriptors (2 regions x 4 sub-regions x 4
# logical blocks), so 56 in total."
#
# Layers (0-based): 0 kda_a.0, 1 mla.0, 2 kda_b.0, 3 kda_a.1, 4 mla.1, 5 kda_b.1.
# Shared tensor 0 = {mla.0, kda_a.0, kda_b.0}, tensor 1 = {mla.1, kda_a.1, kda_b.1}.
MLA_BYTES_PER_TOKEN = 128  # latent 56 + rope 8, bf16
KERNEL_TOKENS, LOGICAL_TOKENS, NUM_LOGICAL = 4, 12, 4
ATTN_PAGE = KERNEL_TOKENS * MLA_BYTES_PER_TOKEN  # 512
UNIFIED_PAGE = LOGICAL_TOKENS * MLA_BYTES_PER_TOKEN  # 1,536
PPL = LOGICAL_TOKENS // KERNEL_TOKENS  # 3
TENSOR_BYTES = NUM_LOGICAL * UNIFIED_PAGE
TENSOR_STRIDE = -(-TENSOR_BYTES // TENSOR_ALIGNMENT) * TENSOR_ALIGNMENT
REFERENCE_WALK = (0, 1, 2, 3, 4, 5)  # kda_a.0, mla.0, kda_b.0, kda_a.1, mla.1, kda_b.1


def _reference_model() -> ModelSpec:
    return ModelSpec(
        name="ref-dual-purpose", architecture="KimiLinearForCausalLM", num_layers=6,
        hidden_size=64,
        attention=MLAAttentionSpec(kv_lora_rank=56, rope_dim=8, backend="triton-mla"),
        attention_layers=(1, 4),
        # conv Q/K/V 16 columns x 3 rows x bf16 = 96 B each, recurrent 2 x 8 x 8 fp32 = 512 B
        state=kda_state(num_heads=2, head_dim=8, conv_kernel=4),
    )


GROUPS = (
    HMAGroup(group_id=0, kind="attention", layers=(1, 4)),
    HMAGroup(group_id=1, kind="state", layers=(0, 3)),  # kda_a
    HMAGroup(group_id=2, kind="state", layers=(2, 5)),  # kda_b
)
TENSOR_LAYERS = ((1, 0, 2), (4, 3, 5))


def _regions(walk, *, first_registration_wins=False):
    return register_regions(
        model=_reference_model(), walk=walk, tensor_layers=TENSOR_LAYERS, groups=GROUPS,
        tensor_stride=TENSOR_STRIDE, tensor_bytes=TENSOR_BYTES, attention_page_bytes=ATTN_PAGE,
        unified_page_bytes=UNIFIED_PAGE, physical_blocks_per_logical=PPL,
        num_logical_blocks=NUM_LOGICAL, first_registration_wins=first_registration_wins)


def _hand_layout(regions, walk) -> EngineLayout:
    model = _reference_model()
    return EngineLayout(
        model=model, tp=1, requested_block_size=KERNEL_TOKENS, kernel_block_size=KERNEL_TOKENS,
        logical_block_size=LOGICAL_TOKENS, physical_blocks_per_logical=PPL,
        num_logical_blocks=NUM_LOGICAL, kv_cache_layout="HND", attention_page_bytes=ATTN_PAGE,
        state_page_bytes=model.state.page_bytes(1), unified_page_bytes=UNIFIED_PAGE,
        groups=GROUPS, tensor_layers=TENSOR_LAYERS, regions=regions, registration_order=walk)


def _meta(lay):
    return rank_metadata(layout=lay, engine_id="ref", tp_rank=0, agent_name="ref.0",
                         agent_metadata=b"", base_addr=BASE)


def test_reference_merge_regions():
    regions = _regions(REFERENCE_WALK)
    assert [r.is_mla for r in regions] == [True, True]
    assert [r.group_id for r in regions] == [-1, -1]
    assert [r.block_len for r in regions] == [UNIFIED_PAGE // 3] * 2 == [512, 512]
    assert [r.stride for r in regions] == [512, 512]  # kernel stride, not the unified page
    assert [r.num_blocks for r in regions] == [12, 12]  # kernel-granular (4 logical x 3)
    assert [r.layers for r in regions] == [(0, 1, 2), (3, 4, 5)]


def test_reference_merge_descriptor_counts():
    regions = _regions(REFERENCE_WALK)
    lay = _hand_layout(regions, REFERENCE_WALK)
    m = _meta(lay)
    assert m.region_is_mla == (True, True)
    assert m.num_blocks == 12
    dl = local_descriptors(m, [0, 1])
    assert dl.num_attention_regions * dl.attention_blocks == 24
    assert dl.num_state_subregions * dl.state_blocks == 32
    assert len(dl) == 56
    descs = dl.descs.astype(np.int64)
    # §3.3 step 1: attention region-major, (base_r + b*stride_r, block_len_r)
    for r in range(2):
        base = BASE + r * TENSOR_STRIDE
        att = descs[r * 12:(r + 1) * 12]
        assert att[:, 0].tolist() == [base + b * 512 for b in range(12)]
        assert set(att[:, 1].tolist()) == {512}
    # §3.3 step 2: state, per region, per sub-region j (Q, K, V, recurrent), per logical block b:
    # (base_s + b*unified_page + offset_j, size_j); sizes 96/96/96/512, offsets 0/96/192/288.
    state = descs[24:]
    expect = []
    for r in range(2):
        base = BASE + r * TENSOR_STRIDE
        for off, size in ((0, 96), (96, 96), (192, 96), (288, 512)):
            for b in range(4):
                expect.append([base + b * 1_536 + off, size])
    assert state[:, :2].tolist() == expect
    # every descriptor lies inside its tensor
    for addr, length in descs[:, :2].tolist():
        t = (addr - BASE) // TENSOR_STRIDE
        assert BASE + t * TENSOR_STRIDE <= addr and addr + length <= (
            BASE + t * TENSOR_STRIDE + TENSOR_BYTES)


@pytest.mark.parametrize("walk", [
    (0, 1, 2, 3, 4, 5), (1, 0, 2, 4, 3, 5), (2, 0, 1, 5, 3, 4), (5, 4, 3, 2, 1, 0),
    (0, 2, 3, 5, 1, 4),
])
def test_reference_merge_is_order_independent(walk):
    assert _regions(walk) == _regions(REFERENCE_WALK)


def test_first_registration_wins_replays_the_bug():
    """§3.2 "Why first-registered-wins is a bug": with a KDA-first walk the KDA view wins.

    This test documents the pre-#49762 behaviour; it asserts the result IS wrong."""
    regions = _regions(REFERENCE_WALK, first_registration_wins=True)
    assert [r.is_mla for r in regions] == [False, False]  # 1. labelled SPLIT
    assert [r.stride for r in regions] == [UNIFIED_PAGE] * 2  # 2. strided by the unified page
    assert [r.num_blocks for r in regions] == [NUM_LOGICAL] * 2  # 3. logical, not kernel
    assert [r.group_id for r in regions] != [-1, -1]
    lay = _hand_layout(regions, REFERENCE_WALK)
    dl = local_descriptors(_meta(lay), [0, 1])
    att = dl.descs[:12].astype(np.int64)
    # 2. attention descriptor k addresses k x unified page: wrong blocks and, beyond
    # num_blocks/ppl = 4, outside the tensor.
    assert att[1, 0] - BASE == UNIFIED_PAGE
    assert (att[4:, 0] + att[4:, 1] > BASE + TENSOR_BYTES).all()
    # With an MLA-first walk the bug is invisible: the result depends on the walk.
    mla_first = _regions((1, 0, 2, 4, 3, 5), first_registration_wins=True)
    assert [r.is_mla for r in mla_first] == [True, True]


def test_reference_merge_through_build_layout():
    # The same structure through build_layout (triton-mla, 16-token kernel, ppl 3): the sorted
    # walk registers KDA layer 0 before MLA layer 1.
    m = _reference_model()
    # make the state page need 3 kernel pages of 16 x 128 = 2,048 B: 4,096 < page <= 6,144
    m = dataclasses.replace(m, state=kda_state(num_heads=4, head_dim=16, conv_kernel=4))  # 5,248 B
    lay = build_layout(m, tp=1, block_size=16, num_blocks=4)
    assert lay.physical_blocks_per_logical == 3
    assert [r.is_mla for r in lay.regions] == [True, True]
    assert [r.group_id for r in lay.regions] == [-1, -1]
    assert [r.block_len for r in lay.regions] == [lay.unified_page_bytes // 3] * 2
    dl = local_descriptors(_meta(lay), state_regions(lay))
    assert len(dl) == 24 + 32 == 56
    bug = build_layout(m, tp=1, block_size=16, num_blocks=4, first_registration_wins=True)
    assert [r.is_mla for r in bug.regions] == [False, False]


def test_kimi_first_registration_wins_bug():
    # §3.2: "KimiLinear's KDA layer 1 precedes MLA layer 4, so the KDA view won".
    bug = layout("kimi-linear-48b", 2, first_registration_wins=True)
    assert [r.is_mla for r in bug.regions] == [False] * 7
    assert {r.stride for r in bug.regions} == {1_105_920}  # TP2 unified page (§2.3)
    assert {r.num_blocks for r in bug.regions} == {4}  # logical
    good = layout("kimi-linear-48b", 2)
    assert [r.is_mla for r in good.regions] == [True] * 7


# ---------------------------------------------------------------------------------------------
# Property: "The result must be order-independent; test with permuted layer orders." (§3.2)


def _valid_combos():
    combos = []
    for name in sorted(PRESETS):
        for tp in (1, 2, 4, 8):
            try:
                preset(name).check_tp(tp)
            except GeometryError:
                continue
            combos.append((name, tp))
    return combos


def _block(name):
    return preset(name).attention.attention_backend.min_kernel_block


def test_every_preset_accepts_some_tp():
    names = {n for n, _ in _valid_combos()}
    assert names == set(PRESETS)


@pytest.mark.parametrize("name,tp", _valid_combos())
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_registration_walk_permutations_give_identical_regions(name, tp, data):
    m = preset(name)
    walk = data.draw(st.permutations(range(m.num_layers)), label="walk")
    ref = build_layout(m, tp=tp, block_size=_block(name), num_blocks=2)
    got = build_layout(m, tp=tp, block_size=_block(name), num_blocks=2, registration_order=walk)
    assert got.regions == ref.regions


@pytest.mark.parametrize("name,tp", _valid_combos())
def test_named_registration_orders_give_identical_regions(name, tp):
    m = preset(name)
    ref = build_layout(m, tp=tp, block_size=_block(name), num_blocks=2)
    for order in ("state-first", "attention-first"):
        got = build_layout(m, tp=tp, block_size=_block(name), num_blocks=2,
                           registration_order=order)
        assert got.regions == ref.regions
    # the merged result: every region of an MLA model is MLA; a hybrid's regions are shared (-1)
    if m.is_mla:
        assert all(r.is_mla for r in ref.regions)
    if m.is_hybrid:
        assert all(r.group_id == -1 for r in ref.regions)
        assert {r.block_len for r in ref.regions} == {ref.attention_page_bytes}
