"""The oracle: independent of the connector, and explains mismatches in semantic terms."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np

from hkvsim.geometry import build_layout, preset
from hkvsim.oracle import Oracle


def _layout(name: str, tp: int = 1, blocks: int = 8):
    model = preset(name)
    return build_layout(model, tp=tp, block_size=model.attention.attention_backend
                        .min_kernel_block, num_blocks=blocks)


def test_oracle_never_imports_the_connector() -> None:
    tree = ast.parse(Path(__file__).resolve().parents[1].joinpath("hkvsim/oracle.py").read_text())
    modules = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any("connector" in m or "transport" in m for m in modules), modules


def test_written_pattern_verifies_and_every_word_is_distinct() -> None:
    layout = _layout("tiny-kimi-linear")
    memory = np.zeros(layout.total_bytes, np.uint8)
    oracle = Oracle(layout.model)
    blocks = {g.group_id: np.array([3, 1] if g.kind == "attention" else [4 + g.group_id])
              for g in layout.groups}
    oracle.write(memory, layout, 0, 7, blocks=blocks, tokens=(0, 1000), state_step=1000)
    words, found = oracle.verify(memory, layout, 0, 7, engine="d", blocks=blocks,
                                 tokens=(0, 1000), state_step=1000)
    assert (words, found) == (0, [])
    nonzero = memory.view(np.uint64)[memory.view(np.uint64) != 0]
    assert np.unique(nonzero).size == nonzero.size  # provenance words never repeat


def test_swapped_kernel_blocks_are_explained_by_token_range() -> None:
    layout = _layout("tiny-deepseek")
    memory = np.zeros(layout.total_bytes, np.uint8)
    oracle = Oracle(layout.model)
    blocks = {0: np.array([0, 1, 2])}
    oracle.write(memory, layout, 0, 4, blocks=blocks, tokens=(0, 192), state_step=None)
    page = layout.attention_page_bytes
    t0 = layout.tensor_stride * layout.tensor_of_layer(2)
    a = memory[t0:t0 + page].copy()
    memory[t0:t0 + page] = memory[t0 + page:t0 + 2 * page]
    memory[t0 + page:t0 + 2 * page] = a
    words, found = oracle.verify(memory, layout, 0, 4, engine="decode0", blocks=blocks,
                                 tokens=(0, 192), state_step=None)
    assert words == 2 * page // 8
    (m,) = found
    text = str(m)
    assert text.startswith("decode0 rank 0, layer 2 (MLA), tokens 0..127")
    assert "got the bytes of request#4 layer 2 MLA tokens 64..63" in text


def test_zeroed_state_is_reported_as_never_arrived() -> None:
    layout = _layout("tiny-qwen3-next", tp=2)
    memory = np.zeros(layout.total_bytes, np.uint8)
    oracle = Oracle(layout.model)
    blocks = {g.group_id: np.array([0] if g.kind == "attention" else [1 + g.group_id])
              for g in layout.groups}
    oracle.write(memory, layout, 1, 0, blocks=blocks, tokens=(0, 10), state_step=None)
    words, found = oracle.verify(memory, layout, 1, 0, engine="decode0", blocks=blocks,
                                 tokens=(0, 10), state_step=10)
    assert words > 0
    assert "state after 10 tokens" in str(found[0]) and "state never arrived" in str(found[0])
