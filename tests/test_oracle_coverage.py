"""The oracle checks the whole window a request owns, and nothing else (issue #10, item 5).

An oracle that checked only part of a state sub-region, or only some token slots, would let a
connector that moves part of the bytes pass. These tests pin the oracle's coverage to numbers that
come from the model geometry alone (bytes per token, state bytes per request), then flip single
words anywhere in that window and require each flip to be reported.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hkvsim.geometry import build_layout, preset
from hkvsim.oracle import (
    _BATCH_WORDS,
    OUTSIDE_BLOCKS,
    Oracle,
    _same,
    blocks_touched,
    blocks_touched_set,
)

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


@pytest.mark.parametrize(("name", "block", "kind"), [("tiny-deepseek", 64, "MLA"),
                                                      ("tiny-llama", 16, "K")])
def test_blocks_read_one_off_are_named_by_the_tokens_they_hold(name, block, kind) -> None:
    # every logical block written one physical block early (block j's tokens at ids[j - 1],
    # block 0's at the last id): the window's first word then holds the second block's first
    # token (`block`) and its last word (token 699) the first block's token 699 % block; the
    # report must say so in tokens, the way a user finds an offset bug
    layout, oracle, _, blocks, _ = _setup(name, 1)
    assert layout.logical_block_size == block
    (group,) = [g.group_id for g in layout.groups if g.kind == "attention"]
    memory = np.zeros(layout.total_bytes, np.uint8)
    oracle.write(memory, layout, 0, 9, blocks={group: np.roll(blocks[group], 1)},
                 tokens=(0, TOKENS), state_step=None)
    bad, found = oracle.verify(memory, layout, 0, 9, engine="d", blocks=blocks,
                               tokens=(0, TOKENS), state_step=None)
    assert bad == TOKENS * layout.model.kv_bytes_per_token(1) // 8  # every word moved
    text = str(found[0])
    assert f"tokens 0..{TOKENS - 1}" in text
    assert f"got the bytes of request#9 layer 0 {kind} tokens {block}..{(TOKENS - 1) % block}" \
        in text, text
    if kind == "K":  # GQA: the first wrong word's token and head, against the one that belongs
        assert (f"first wrong word holds request#9 layer 0 K token {block} head 0 where "
                f"request#9 layer 0 K token 0 head 0 belongs") in text, text


def test_words_left_in_the_tail_are_named_by_what_they_hold() -> None:
    # foreign words in the zeroed tail: found, counted, and the first one's content named (the
    # first wrong word of the first wrong token, not another word of that row)
    layout, oracle, memory, blocks, _ = _setup("tiny-llama", 1)
    tail = (TOKENS, layout.blocks_for_tokens(TOKENS) * layout.logical_block_size)
    stale = memory.copy()
    oracle.write_stale(stale, layout, 0, 4, blocks=blocks, tokens=tail)
    tail_words = np.flatnonzero(stale.view(np.uint64) != memory.view(np.uint64))
    # two neighbouring words of one row: request tag 8 (request#7) layer 3, then tag 6 layer 1
    at = tail_words[len(tail_words) // 2 + 1]
    assert tail_words[len(tail_words) // 2 + 2] == at + 1
    memory.view(np.uint64)[at:at + 2] = [(8 << 48) | (3 << 40), (6 << 48) | (1 << 40)]
    bad, found = oracle.verify_zeros(memory, layout, 0, engine="d", blocks=blocks, tokens=tail)
    assert bad == 2 and len(found) == 1 and found[0].words == 2
    assert found[0].got.startswith("request#7 layer 3"), found[0].got


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


def _padded_layout() -> SimpleNamespace:
    """What the block lookups read of a layout, with alignment padding after each tensor's
    blocks (the presets' tiny layouts have none)."""
    return SimpleNamespace(tensor_bytes=5 * 1000, tensor_stride=8192, unified_page_bytes=1000,
                           num_tensors=3, total_bytes=3 * 8192, num_logical_blocks=5)


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(["tiny-kimi-linear", "tiny-llama", "tiny-qwen3-next", "padded"]),
       tp=st.sampled_from([1, 2]), data=st.data())
def test_blocks_touched_set_names_the_same_blocks(name: str, tp: int, data) -> None:
    """blocks_touched_set (the landing guard's) names the same set of blocks as
    blocks_touched, OUTSIDE_BLOCKS included, for a transfer's runs: mostly a block or a part
    of one (its fast path), sometimes an empty run, a longer run, one into a tensor's padding,
    before the allocation or past it."""
    if name == "padded":
        layout = _padded_layout()
    else:
        model = preset(name)
        layout = build_layout(model, tp=tp, block_size=model.attention.attention_backend
                              .min_kernel_block, num_blocks=5)
    page, n = layout.unified_page_bytes, data.draw(st.integers(1, 8))
    stride, total = layout.tensor_stride, layout.total_bytes
    offs, lens = [], []
    for _ in range(n):
        if data.draw(st.booleans()):  # a block, or a part of one, inside a tensor
            t = data.draw(st.integers(0, layout.num_tensors - 1))
            b = data.draw(st.integers(0, layout.num_logical_blocks - 1))
            lo = data.draw(st.integers(0, page - 1))
            hi = data.draw(st.integers(lo + 1, page))
            offs.append(t * stride + b * page + lo)
            lens.append(hi - lo)
        else:
            offs.append(data.draw(st.integers(-2 * stride, total + 2 * stride)))
            lens.append(data.draw(st.integers(0, 3 * page)))
    off, length = np.array(offs, dtype=np.int64), np.array(lens, dtype=np.int64)
    got = blocks_touched_set(layout, off, length)
    assert sorted(set(got.tolist())) == sorted(set(blocks_touched(layout, off, length)[1]
                                                   .tolist()))


def test_blocks_touched_set_of_runs_over_two_blocks() -> None:
    """Runs across a block boundary name both blocks (the fast path's last blocks); a run
    across three blocks names the middle one too; an empty run names nothing."""
    layout = build_layout(preset("tiny-llama"), tp=1, block_size=preset("tiny-llama").attention
                          .attention_backend.min_kernel_block, num_blocks=5)
    page = layout.unified_page_bytes
    two = blocks_touched_set(layout, np.array([page // 2, 2 * page]), np.array([page, page]))
    assert sorted(set(two.tolist())) == [0, 1, 2]
    three = blocks_touched_set(layout, np.array([page // 2]), np.array([2 * page]))
    assert sorted(set(three.tolist())) == [0, 1, 2]
    empty = blocks_touched_set(layout, np.array([page, 3 * page]), np.array([0, page]))
    assert sorted(set(empty.tolist())) == [3]
    # from tensor 0's last block into tensor 1's first (no padding between them)
    across = blocks_touched_set(layout, np.array([layout.tensor_stride - page // 2]),
                                np.array([page]))
    assert across.tolist() == [OUTSIDE_BLOCKS]
    padded = _padded_layout()  # into a tensor's padding, past the allocation, before it
    for off, length in ((4500, 1000), (3 * 8192 + 10, 100), (-100, 50)):
        got = blocks_touched_set(padded, np.array([1000, off]), np.array([1000, length]))
        assert sorted(set(got.tolist())) == [OUTSIDE_BLOCKS, 1]


@pytest.mark.parametrize("limit", [1, 8])
def test_explanations_stop_at_the_limit_when_every_state_word_is_wrong(limit: int) -> None:
    # a hybrid whose state never arrived: every state sub-region of every layer is wrong, and
    # all are counted, but at most `limit` explanations come back (the attention is right)
    layout, oracle, memory, blocks, hybrid = _setup("tiny-kimi-linear", 1)
    assert hybrid
    state_groups = [g.group_id for g in layout.groups if g.kind != "attention"]
    fresh = np.zeros_like(memory)
    attention_only = {g: ids for g, ids in blocks.items() if g not in state_groups}
    oracle.write(fresh, layout, 0, 9, blocks=attention_only, tokens=(0, TOKENS),
                 state_step=None)
    bad, found = oracle.verify(fresh, layout, 0, 9, engine="d", blocks=blocks,
                               tokens=(0, TOKENS), state_step=TOKENS, limit=limit)
    assert bad * 8 == layout.model.state_bytes_per_request(1)
    assert len(found) == limit and all("state" in m.kind for m in found)


def test_a_run_just_past_the_allocation_lands_outside_every_block() -> None:
    """The allocation's last byte is inside the last block; a run starting one byte later is
    outside it (the fast path's bound is the last byte, not one past it)."""
    layout = build_layout(preset("tiny-llama"), tp=1, block_size=preset("tiny-llama").attention
                          .attention_backend.min_kernel_block, num_blocks=5)
    total, page = layout.total_bytes, layout.unified_page_bytes
    last = layout.num_logical_blocks - 1
    inside = blocks_touched_set(layout, np.array([total - page]), np.array([page]))
    assert inside.tolist() == [last]
    for length in (1, page):
        past = blocks_touched_set(layout, np.array([total]), np.array([length]))
        assert past.tolist() == [OUTSIDE_BLOCKS], length


def test_state_page_check_sees_a_wrong_last_word_after_a_whole_batch() -> None:
    """The state-page fast check compares in batches of _BATCH_WORDS words; a sub-region one
    word longer than a batch leaves a one-word remainder, which must be compared too."""
    oracle = Oracle(preset("tiny-kimi-linear"))
    n, head = _BATCH_WORDS + 1, 5 << 40
    page = (np.arange(n, dtype=np.uint64) + np.uint64(head)).view(np.uint8)
    assert oracle._state_page_matches(page, [(0, n, head)])
    page.view(np.uint64)[-1] ^= np.uint64(1)
    assert not oracle._state_page_matches(page, [(0, n, head)])


def test_byte_comparison_of_strided_views_compares_their_elements() -> None:
    """A strided view is not contiguous memory: comparing it byte-range-wise (memcmp from its
    first element) would read the skipped elements and miss a difference further on."""
    a = np.zeros((4, 6), dtype=np.uint64)
    b = a.copy()
    b[3, 0] = 1  # inside the [:, ::2] view, past its first nbytes of memory
    assert not _same(a[:, ::2], b[:, ::2])
    b[3, 0], b[0, 1] = 0, 7  # only a skipped element differs
    assert _same(a[:, ::2], b[:, ::2])
