"""Oracle verification throughput against a plain numpy copy of the same bytes (issue #7).

One decode rank's cache holds a request written by the oracle; ``Oracle.verify`` checks every
word of its KV and state, and ``np.copyto`` copies exactly the same byte ranges (the request's
kernel blocks of every attention layer and its state pages, located from the layout alone) into
a scratch buffer. Both run interleaved in the same process, best of several rounds each; the
figure is the ratio copy time / verify time. Target: >= 0.5.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from hkvsim.geometry.layout import EngineLayout, build_layout
from hkvsim.geometry.presets import preset
from hkvsim.oracle import Oracle
from hkvsim.transport.memory import lazy_buffer


TARGET = 0.5
RANK, REQUEST = 1, 5


class Case:
    def __init__(self, model: str, tp: int, tokens: int) -> None:
        spec = preset(model)
        probe = build_layout(spec, tp=tp, block_size=64, num_blocks=1)
        n = probe.blocks_for_tokens(tokens)
        self.layout: EngineLayout = build_layout(spec, tp=tp, block_size=64,
                                                 num_blocks=n + len(probe.state_groups) + 2)
        lay = self.layout
        self.tokens = tokens
        self.memory = lazy_buffer(lay.total_bytes)
        self.blocks: dict[int, np.ndarray] = {}
        nxt = 1
        for g in lay.groups:
            k = n if g.kind == "attention" else 1
            self.blocks[g.group_id] = np.arange(nxt, nxt + k, dtype=np.int64)
            nxt += k
        self.state_step = tokens if lay.is_hybrid else None
        self.oracle = Oracle(spec)
        self.oracle.write(self.memory, lay, RANK, REQUEST, blocks=self.blocks,
                          tokens=(0, tokens), state_step=self.state_step)
        self.ranges = self._ranges()
        self.nbytes = sum(b - a for a, b in self.ranges)
        self.scratch = np.empty(max(b - a for a, b in self.ranges), dtype=np.uint8)

    def _ranges(self) -> list[tuple[int, int]]:
        """Byte ranges of the request's data: kernel blocks holding its tokens and its state."""
        lay = self.layout
        out = []
        for g in lay.groups:
            ids = self.blocks[g.group_id]
            for layer in g.layers:
                base = lay.tensor_of_layer(layer) * lay.tensor_stride
                if g.kind == "attention":
                    k0 = int(ids[0]) * lay.physical_blocks_per_logical
                    nk = -(-self.tokens // lay.kernel_block_size)
                    out.append((base + k0 * lay.attention_page_bytes,
                                base + (k0 + nk) * lay.attention_page_bytes))
                else:
                    page = base + int(ids[-1]) * lay.unified_page_bytes
                    out.append((page, page + lay.state_page_bytes))
        return out

    def verify(self) -> int:
        words, _ = self.oracle.verify(self.memory, self.layout, RANK, REQUEST, engine="decode0",
                                      blocks=self.blocks, tokens=(0, self.tokens),
                                      state_step=self.state_step)
        return words

    def copy(self) -> None:
        for a, b in self.ranges:
            np.copyto(self.scratch[: b - a], self.memory[a:b])


def side_by_side(case: Case, rounds: int = 7) -> tuple[float, float]:
    """Best verify and copy times, interleaved round by round."""
    tv = tc = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        assert case.verify() == 0
        t1 = time.perf_counter()
        case.copy()
        t2 = time.perf_counter()
        tv, tc = min(tv, t1 - t0), min(tc, t2 - t1)
    return tv, tc


CASES = [("kimi-linear-48b", 4, 65_536), ("kimi-linear-48b", 8, 65_536),
         ("kimi-linear-48b", 1, 8_192), ("kimi-linear-48b", 4, 1_024),
         ("kimi-linear-48b", 4, 8_192), ("qwen3-next-80b", 4, 16_384),
         ("llama-3.1-8b", 2, 16_384), ("deepseek-v3", 8, 8_192)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model,tp,tokens", CASES, ids=[f"{m}-tp{t}-{n}" for m, t, n in CASES])
def test_verify_vs_numpy_copy(benchmark, figures, known_gap, model: str, tp: int,
                              tokens: int) -> None:
    if tokens <= 1_024:
        known_gap("a 19 MB request sits in the CPU cache, where a numpy copy "
                  "runs at ~19 GB/s; verification writes the expected words and then compares "
                  "(memcmp), ~7.7 GB/s, plus ~40 us of Python per layer")
    case = Case(model, tp, tokens)
    benchmark.pedantic(case.verify, rounds=3, iterations=1)
    tv, tc = side_by_side(case)
    ratio = tc / tv
    figures.add(f"verify/copy: {model} TP{tp} {tokens:,} tokens ({case.nbytes / 1e6:,.0f} MB)",
                ratio, "x copy", target=">= 0.5", met=ratio >= TARGET,
                note=f"verify {case.nbytes / tv / 1e9:.2f} GB/s, copy "
                     f"{case.nbytes / tc / 1e9:.2f} GB/s")
    benchmark.extra_info.update(verify_gbps=case.nbytes / tv / 1e9,
                                copy_gbps=case.nbytes / tc / 1e9, ratio=ratio)
    if figures.enabled:
        assert ratio >= TARGET


def test_verify_finds_a_flipped_word(figures) -> None:
    """The fast path must not hide a mismatch: one flipped word is counted and explained."""
    case = Case("kimi-linear-48b", 4, 8_192)
    a, _ = case.ranges[3]
    case.memory[a + 8 * 1000] ^= 1
    words, found = case.oracle.verify(case.memory, case.layout, RANK, REQUEST, engine="decode0",
                                      blocks=case.blocks, tokens=(0, case.tokens),
                                      state_step=case.state_step)
    assert words == 1 and found and "1 words wrong" in str(found[0])
