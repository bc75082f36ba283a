"""The byte oracle: what every cache word *should* hold, from semantic coordinates alone.

Every 8-byte word of a request's KV and state is a pure, invertible function of
(request, layer, kind, position)::

    word = (request_tag << 48) | (layer << 40) | (kind << 36) | position

* MLA latent: position = token * row_words + word-in-row
* GQA K / V:  position = (token * K + global_head) * head_words + word-in-head-row
* conv sub-projection j / recurrent: position = step * global_words + global word index of the
  canonical (TP 1) array; a TP rank holds a contiguous slice of it (DS layout, head-major).

Prefill ranks write the pattern through plain numpy views of *their* tensors; decode's expected
bytes come from *decode's* tensors the same way. This module never looks at descriptors, regions
or connector offsets: the only shared facts are the tensors' shapes and where each tensor starts
in the rank's allocation. A mismatch is decoded back into semantic terms.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .geometry.layout import EngineLayout
from .geometry.specs import DTYPE_BYTES, GQAAttentionSpec, ModelSpec

__all__ = ["Mismatch", "Oracle", "encode_words", "describe_word", "tensor_view"]

KIND_MLA, KIND_K, KIND_V, KIND_CONV0, KIND_RECURRENT = 1, 2, 3, 4, 12
_POS_BITS = 36
_POS_MASK = (1 << _POS_BITS) - 1


def request_tag(request_index: int) -> int:
    return request_index % 0xFFFF + 1


def encode_words(request_index: int, layer: int, kind: int, positions: np.ndarray) -> np.ndarray:
    head = np.uint64((request_tag(request_index) << 48) | (layer << 40) | (kind << _POS_BITS))
    return np.asarray(positions, dtype=np.uint64) | head


def describe_word(word: int) -> str:
    if word == 0:
        return "zeros"
    tag, layer, kind = word >> 48, (word >> 40) & 0xFF, (word >> _POS_BITS) & 0xF
    return f"request#{tag - 1} layer {layer} {_KIND_NAMES.get(kind, f'kind{kind}')}"


_KIND_NAMES = {KIND_MLA: "MLA", KIND_K: "K", KIND_V: "V", KIND_RECURRENT: "recurrent",
               KIND_CONV0: "conv[0]", KIND_CONV0 + 1: "conv[1]", KIND_CONV0 + 2: "conv[2]"}


@dataclass(frozen=True, kw_only=True)
class Mismatch:
    engine: str
    rank: int
    layer: int
    kind: str  # "MLA", "K/V", "conv Q", "recurrent", ...
    where: str  # "tokens 128..191" or "state"
    words: int  # mismatched 8-byte words
    got: str  # what arrived instead, in semantic terms

    def __str__(self) -> str:
        return (f"{self.engine} rank {self.rank}, layer {self.layer} ({self.kind}), {self.where}: "
                f"{self.words} words wrong; got the bytes of {self.got}")


def tensor_view(memory: np.ndarray, layout: EngineLayout, tensor: int) -> np.ndarray:
    """The uint8 bytes of shared tensor ``tensor`` in a rank's allocation."""
    start = tensor * layout.tensor_stride
    return memory[start:start + layout.tensor_bytes]


def _words(view: np.ndarray) -> np.ndarray:
    return view.view(np.uint64)


class Oracle:
    """Writes and checks the semantic pattern for one model."""

    def __init__(self, model: ModelSpec) -> None:
        self.model = model
        attn = model.attention
        self.row_bytes = attn.bytes_per_token(1) if attn.is_mla else (
            attn.head_dim * DTYPE_BYTES[attn.dtype])  # type: ignore[union-attr]
        if self.row_bytes % 8:
            raise ValueError(f"attention rows of {self.row_bytes} B are not 8-byte aligned")
        self.row_words = self.row_bytes // 8

    # ---- attention -----------------------------------------------------------------------
    def _token_rows(self, layout: EngineLayout, logical_ids: np.ndarray, tokens: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
        """(kernel block, row within it) for each absolute token position."""
        logical = np.asarray(logical_ids, dtype=np.int64)[tokens // layout.logical_block_size]
        within = tokens % layout.logical_block_size
        kernel = logical * layout.physical_blocks_per_logical + within // layout.kernel_block_size
        return kernel, within % layout.kernel_block_size

    def _attention_block_view(self, memory: np.ndarray, layout: EngineLayout, layer: int
                              ) -> np.ndarray:
        t = layout.tensor_of_layer(layer)
        view = tensor_view(memory, layout, t)
        n_kernel = layout.num_kernel_blocks
        page = layout.attention_page_bytes
        words = _words(view[: n_kernel * page])
        kt = layout.kernel_block_size
        if self.model.attention.is_mla:
            return words.reshape(n_kernel, kt, self.row_words)
        heads = self.model.attention.heads_per_rank(layout.tp)
        if layout.kv_cache_layout == "HND":
            return words.reshape(n_kernel, heads, 2, kt, self.row_words)
        return words.reshape(n_kernel, kt, heads, 2, self.row_words)

    def _attention_expected(self, layout: EngineLayout, rank: int, request: int, layer: int,
                            tokens: np.ndarray) -> np.ndarray:
        """Expected words, shaped (tokens, row) for MLA or (tokens, heads, 2, row) for GQA."""
        rw = self.row_words
        w = np.arange(rw, dtype=np.int64)
        if self.model.attention.is_mla:
            return encode_words(request, layer, KIND_MLA, tokens[:, None] * rw + w[None, :])
        attn = self.model.attention
        assert isinstance(attn, GQAAttentionSpec)
        heads = attn.heads_per_rank(layout.tp)
        first = attn.first_head(layout.tp, rank)
        h = np.arange(first, first + heads, dtype=np.int64)
        pos = (tokens[:, None, None] * attn.num_kv_heads + h[None, :, None]) * rw + w[None, None, :]
        k = encode_words(request, layer, KIND_K, pos)
        v = encode_words(request, layer, KIND_V, pos)
        return np.stack([k, v], axis=2)  # (tokens, heads, 2, row)

    def _attention_access(self, block_view: np.ndarray, layout: EngineLayout, kernel: np.ndarray,
                          row: np.ndarray) -> tuple:
        if self.model.attention.is_mla or layout.kv_cache_layout == "NHD":
            return (kernel, row)
        return (kernel, slice(None), slice(None), row)

    # ---- state ---------------------------------------------------------------------------
    def _state_parts(self, layout: EngineLayout) -> list[tuple[int, int, int, int]]:
        """(kind, local byte offset in the page, local words, canonical words) per sub-region."""
        state = self.model.state
        assert state is not None
        tp = layout.tp
        parts = []
        offset = 0
        row = state.conv_rows * DTYPE_BYTES[state.conv_dtype]
        for j, (_, columns) in enumerate(state.conv_subprojections):
            local = columns // tp * row
            parts.append((KIND_CONV0 + j, offset, local // 8, columns * row // 8))
            offset += local
        head_bytes = int(np.prod(state.recurrent_head_shape)) * DTYPE_BYTES[state.recurrent_dtype]
        local = state.recurrent_heads // tp * head_bytes
        parts.append((KIND_RECURRENT, offset, local // 8, state.recurrent_heads * head_bytes // 8))
        return parts

    def _state_page(self, memory: np.ndarray, layout: EngineLayout, layer: int, slot: int
                    ) -> np.ndarray:
        view = tensor_view(memory, layout, layout.tensor_of_layer(layer))
        page = layout.unified_page_bytes
        return view[slot * page:(slot + 1) * page]

    # ---- public --------------------------------------------------------------------------
    def write(self, memory: np.ndarray, layout: EngineLayout, rank: int, request: int, *,
              blocks: Mapping[int, np.ndarray], tokens: tuple[int, int],
              state_step: int | None) -> None:
        """Write the pattern for tokens [start, stop) and (if given) the state after
        ``state_step`` tokens into the request's blocks (group id -> logical ids)."""
        toks = np.arange(*tokens, dtype=np.int64)
        for group in layout.groups:
            ids = np.asarray(blocks.get(group.group_id, ()), dtype=np.int64)
            for layer in group.layers:
                if group.kind == "attention":
                    if toks.size == 0:
                        continue
                    view = self._attention_block_view(memory, layout, layer)
                    kernel, row = self._token_rows(layout, ids, toks)
                    view[self._attention_access(view, layout, kernel, row)] = (
                        self._attention_expected(layout, rank, request, layer, toks))
                elif state_step is not None and ids.size:
                    page = self._state_page(memory, layout, layer, int(ids[-1]))
                    for kind, offset, n_local, n_global in self._state_parts(layout):
                        pos = state_step * n_global + rank * n_local + np.arange(n_local)
                        _words(page[offset:offset + n_local * 8])[:] = encode_words(
                            request, layer, kind, pos)

    def verify(self, memory: np.ndarray, layout: EngineLayout, rank: int, request: int, *,
               engine: str, blocks: Mapping[int, np.ndarray], tokens: tuple[int, int],
               state_step: int | None, limit: int = 8) -> tuple[int, list[Mismatch]]:
        """Compare a rank's cache with the pattern. Returns (mismatched words, explanations)."""
        toks = np.arange(*tokens, dtype=np.int64)
        total = 0
        found: list[Mismatch] = []
        for group in layout.groups:
            ids = np.asarray(blocks.get(group.group_id, ()), dtype=np.int64)
            for layer in group.layers:
                if group.kind == "attention":
                    if toks.size == 0:
                        continue
                    view = self._attention_block_view(memory, layout, layer)
                    kernel, row = self._token_rows(layout, ids, toks)
                    got = view[self._attention_access(view, layout, kernel, row)]
                    want = self._attention_expected(layout, rank, request, layer, toks)
                    bad = got != want
                    if bad.any():
                        n = int(bad.sum())
                        total += n
                        if len(found) < limit:
                            found.append(self._explain_tokens(engine, rank, layer, toks, got, bad,
                                                              want))
                elif state_step is not None and ids.size:
                    page = self._state_page(memory, layout, layer, int(ids[-1]))
                    for kind, offset, n_local, n_global in self._state_parts(layout):
                        pos = state_step * n_global + rank * n_local + np.arange(n_local)
                        got = _words(page[offset:offset + n_local * 8])
                        bad = got != encode_words(request, layer, kind, pos)
                        if bad.any():
                            n = int(bad.sum())
                            total += n
                            if len(found) < limit:
                                first = int(got[np.flatnonzero(bad)[0]])
                                found.append(Mismatch(
                                    engine=engine, rank=rank, layer=layer,
                                    kind=_KIND_NAMES[kind] + " state",
                                    where=f"state after {state_step} tokens", words=n,
                                    got=self._describe_state(first, n_global)))
        return total, found

    def _explain_tokens(self, engine: str, rank: int, layer: int, toks: np.ndarray,
                        got: np.ndarray, bad: np.ndarray, want: np.ndarray) -> Mismatch:
        per_token = bad.reshape(bad.shape[0], -1).any(axis=1)
        idx = np.flatnonzero(per_token)
        # first contiguous run of bad tokens
        breaks = np.flatnonzero(np.diff(idx) != 1)
        run = idx[: breaks[0] + 1] if breaks.size else idx
        first_tok, last_tok = int(toks[run[0]]), int(toks[run[-1]])
        flat_first = got.reshape(got.shape[0], -1)[run[0]]
        flat_last = got.reshape(got.shape[0], -1)[run[-1]]
        kind = "MLA" if self.model.attention.is_mla else "K/V"
        where = f"tokens {first_tok}..{last_tok}"
        extra = f" (and {idx.size - run.size} more tokens)" if idx.size > run.size else ""
        got_text = self._describe_rows(int(flat_first[0]), int(flat_last[0]))
        if not self.model.attention.is_mla:  # name the first wrong head / K-or-V word exactly
            flat_bad = bad.reshape(-1)
            first_bad = int(np.flatnonzero(flat_bad)[0])
            got_text += (f"; first wrong word holds {self._locate(int(got.reshape(-1)[first_bad]))}"
                         f" where {self._locate(int(want.reshape(-1)[first_bad]))} belongs")
        return Mismatch(engine=engine, rank=rank, layer=layer, kind=kind, where=where + extra,
                        words=int(bad.sum()), got=got_text)

    def _locate(self, word: int) -> str:
        """A GQA word's full coordinates: request, layer, K or V, token and head."""
        if word == 0:
            return "zeros"
        pos = word & _POS_MASK
        k = getattr(self.model.attention, "num_kv_heads", 1)
        row, _ = divmod(pos, self.row_words)
        token, head = divmod(row, k)
        return f"{describe_word(word)} token {token} head {head}"

    def _token_of(self, word: int) -> int:
        pos = word & _POS_MASK
        kind = (word >> _POS_BITS) & 0xF
        if kind == KIND_MLA:
            return pos // self.row_words
        k = getattr(self.model.attention, "num_kv_heads", 1)
        return pos // self.row_words // k

    def _describe_rows(self, first: int, last: int) -> str:
        if first == 0 and last == 0:
            return "zeros (nothing arrived)"
        if first == 0 or last == 0:
            return f"{describe_word(first or last)} mixed with zeros"
        return f"{describe_word(first)} tokens {self._token_of(first)}..{self._token_of(last)}"

    @staticmethod
    def _describe_state(word: int, n_global: int) -> str:
        if word == 0:
            return "zeros (state never arrived)"
        pos = word & _POS_MASK
        return f"{describe_word(word)} state after {pos // n_global} tokens (word {pos % n_global})"
