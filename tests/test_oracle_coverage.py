"""The oracle checks the whole window a request owns, and nothing else (issue #10, item 5).

An oracle that checked only part of a state sub-region, or only some token slots, would let a
connector that moves part of the bytes pass. These tests pin the oracle's coverage to numbers that
come from the model geometry alone (bytes per token, state bytes per request), then flip single
words anywhere in that window and require each flip to be reported.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hkvsim.geometry import build_layout, preset
from hkvsim.oracle import OUTSIDE_BLOCKS, Oracle, blocks_touched

CASES = [("tiny-kimi-linear", 1), ("tiny-kimi-linear", 4), ("tiny-qwen3-next", 2),
         ("tiny-deepseek", 1), ("tiny-llama", 1), ("tiny-llama", 2)]
TOKENS = 700


def _setup(name: str, tp: int, kv_cache_layout: str = "HND"):
    model = preset(name)
    kernel = model.attention.attention_backend.min_kernel_block
    probe = build_layout(model, tp=tp, block_size=kernel, num_blocks=1)
    n_attention = probe.blocks_for_tokens(TOKENS)
    layout = build_layout(model, tp=tp, block_size=kernel, num_blocks=n_attention + 12,
                          kv_cache_layout=kv_cache_layout)
    # attention blocks in the middle of the pool, one state slot per group near its end
    blocks = {g.group_id: (np.arange(3, 3 + n_attention) if g.kind == "attention"
                           else np.array([n_attention + 4 + g.group_id])) for g in layout.groups}
    memory = np.zeros(layout.total_bytes, np.uint8)
    oracle = Oracle(model)
    hybrid = layout.is_hybrid
    oracle.write(memory, layout, tp - 1, 9, blocks=blocks, tokens=(0, TOKENS),
                 state_step=TOKENS if hybrid else None)
    return layout, oracle, memory, blocks, hybrid


def _verify(oracle, memory, layout, tp, blocks, hybrid):
    return oracle.verify(memory, layout, tp - 1, 9, engine="decode0", blocks=blocks,
                         tokens=(0, TOKENS), state_step=TOKENS if hybrid else None)


@pytest.mark.parametrize(("name", "tp"), CASES)
def test_written_window_is_exactly_the_geometry(name: str, tp: int) -> None:
    """The pattern covers every KV byte of every token and every state byte, no more."""
    layout, _, memory, _, _ = _setup(name, tp)
    model = layout.model
    expected = TOKENS * model.kv_bytes_per_token(tp) + model.state_bytes_per_request(tp)
    words = memory.view(np.uint64)
    assert int(np.count_nonzero(words)) * 8 == expected


@pytest.mark.parametrize(("name", "tp"), CASES)
@settings(max_examples=60, deadline=None)
@given(pick=st.floats(min_value=0.0, max_value=1.0, exclude_max=True),
       bit=st.integers(min_value=0, max_value=63))
def test_every_written_word_is_checked(name: str, tp: int, pick: float, bit: int) -> None:
    layout, oracle, memory, blocks, hybrid = _setup(name, tp)
    words = memory.view(np.uint64)
    footprint = np.flatnonzero(words)
    target = int(footprint[int(pick * footprint.size)])
    words[target] ^= np.uint64(1 << bit)
    bad, found = _verify(oracle, memory, layout, tp, blocks, hybrid)
    assert bad == 1, f"flipped word {target} of {footprint.size} went unnoticed"
    assert found


@pytest.mark.parametrize("name", ["tiny-kimi-linear", "tiny-qwen3-next"])
def test_last_word_of_each_state_subregion_is_checked(name: str) -> None:
    """Flip the first and the last word of every state sub-region of every state layer."""
    layout, oracle, memory, blocks, hybrid = _setup(name, 2)
    state = layout.model.state
    assert state is not None
    ends = []
    offset = 0
    for _, columns in state.conv_subprojections:
        size = columns // layout.tp * state.conv_rows * 2  # bf16 conv
        ends.append((offset, offset + size))
        offset += size
    ends.append((offset, layout.state_page_bytes))
    for group in layout.state_groups:
        slot = int(blocks[group.group_id][-1])
        for layer in group.layers:
            page = layout.tensor_of_layer(layer) * layout.tensor_stride + slot * (
                layout.unified_page_bytes)
            for lo, hi in ends:
                for pos in (page + lo, page + hi - 8):
                    memory[pos] ^= 0x80
                    bad, found = _verify(oracle, memory, layout, 2, blocks, hybrid)
                    memory[pos] ^= 0x80
                    assert bad == 1 and "state" in str(found[0]), (layer, lo, hi, pos)


def test_bytes_outside_the_window_are_not_claimed() -> None:
    """Words of blocks the request does not own are not the oracle's to check."""
    layout, oracle, memory, blocks, hybrid = _setup("tiny-llama", 1)
    outside = layout.tensor_bytes - 8  # last word of tensor 0's last block: not owned
    memory.view(np.uint64)[outside // 8] = 12345
    assert _verify(oracle, memory, layout, 1, blocks, hybrid)[0] == 0


def test_untransferred_tail_must_be_zero() -> None:
    layout, oracle, memory, blocks, _ = _setup("tiny-llama", 1)
    tail = (TOKENS, layout.blocks_for_tokens(TOKENS) * layout.logical_block_size)
    assert tail[0] < tail[1]
    assert oracle.verify_zeros(memory, layout, 0, engine="d", blocks=blocks, tokens=tail)[0] == 0
    oracle.write_stale(memory, layout, 0, 4, blocks=blocks, tokens=tail)
    bad, found = oracle.verify_zeros(memory, layout, 0, engine="d", blocks=blocks, tokens=tail)
    rows = (tail[1] - tail[0]) * layout.model.kv_bytes_per_token(1) // 8
    assert bad == rows
    assert "untransferred tail" in str(found[0]) and "stale bytes" in str(found[0])
    # the stale fill stays inside the tail: the request's own tokens still verify
    assert oracle.verify(memory, layout, 0, 9, engine="d", blocks=blocks, tokens=(0, TOKENS),
                         state_step=None)[0] == 0


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(["tiny-kimi-linear", "tiny-llama", "tiny-qwen3-next"]),
       tp=st.sampled_from([1, 2]), data=st.data())
def test_blocks_touched_matches_a_byte_by_byte_reference(name: str, tp: int, data) -> None:
    """blocks_touched against a reference built from per-byte ownership of tensor views."""
    model = preset(name)
    layout = build_layout(model, tp=tp, block_size=model.attention.attention_backend
                          .min_kernel_block, num_blocks=5)
    owner = np.full(layout.total_bytes, OUTSIDE_BLOCKS, dtype=np.int64)
    for t in range(layout.num_tensors):
        for b in range(layout.num_logical_blocks):
            start = t * layout.tensor_stride + b * layout.unified_page_bytes
            owner[start:start + layout.unified_page_bytes] = b
    off = data.draw(st.integers(0, layout.total_bytes - 1))
    length = data.draw(st.integers(1, 3 * layout.unified_page_bytes))
    run, got = blocks_touched(layout, np.array([off]), np.array([length]))
    span = owner[off:off + length]
    if off + length > layout.total_bytes or (span == OUTSIDE_BLOCKS).any() or (
            off // layout.tensor_stride != (off + length - 1) // layout.tensor_stride):
        assert got.tolist() == [OUTSIDE_BLOCKS]
    else:
        assert got.tolist() == sorted(set(span.tolist()))
