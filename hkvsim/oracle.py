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

import ctypes
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .geometry.layout import EngineLayout
from .geometry.specs import DTYPE_BYTES, GQAAttentionSpec, ModelSpec

__all__ = ["Mismatch", "Oracle", "encode_words", "describe_word", "tensor_view",
           "blocks_touched", "blocks_touched_set", "OUTSIDE_BLOCKS"]

KIND_MLA, KIND_K, KIND_V, KIND_CONV0, KIND_RECURRENT = 1, 2, 3, 4, 12
# Stale bytes: what a reused block still holds from an earlier request (the reference skips
# allocation-time zeroing, #49612). The simulator writes it where the connector must zero.
KIND_STALE = 15
_POS_BITS = 36
_POS_MASK = (1 << _POS_BITS) - 1
# Fast paths work on batches of about this many words (512 KiB): a batch is read from memory
# once and stays in the CPU cache for the compare (DESIGN principle 4: vectorise). Measured
# best of 2**15..2**18 on the 2-core CI VM (benchmarks/test_verification.py).
_BATCH_WORDS = 1 << 16


def _libc_memcmp() -> Any:
    try:
        fn = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError):  # pragma: no cover - no C library symbols (Windows)
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return fn


_MEMCMP = _libc_memcmp()


def _address(a: np.ndarray) -> int | None:
    """The address of a C-contiguous array's first byte (None: not contiguous, or no memcmp)."""
    if _MEMCMP is None or not a.flags.c_contiguous:
        return None
    return int(a.__array_interface__["data"][0])


def _same(a: np.ndarray, b: np.ndarray, a_addr: int | None = None,
          b_addr: int | None = None) -> bool:
    """Byte-for-byte equality of two equally shaped arrays: libc memcmp when both are
    C-contiguous (about twice numpy's not_equal + any), else numpy. The addresses may be given
    (computed once per layer instead of once per batch)."""
    if a_addr is None:
        a_addr = _address(a)
    if b_addr is None:
        b_addr = _address(b)
    if a_addr is not None and b_addr is not None:
        return _MEMCMP(a_addr, b_addr, a.nbytes) == 0
    return bool(np.array_equal(a, b))


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
               KIND_STALE: "stale bytes",
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


OUTSIDE_BLOCKS = -1  # a byte in a tensor's alignment padding: no logical block owns it


def blocks_touched(layout: EngineLayout, offsets: np.ndarray, lengths: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Every logical block the byte runs [offset, offset + length) of a rank's allocation touch.

    Returns (run index, logical block id) pairs, one per (run, block); a run that touches bytes
    outside every tensor's blocks (alignment padding, past the allocation) yields
    ``OUTSIDE_BLOCKS``; an empty run touches nothing. Derived from the allocation's tensor layout alone (tensor i starts at
    i * tensor_stride; within a tensor, logical block b is the b-th unified page), never from
    descriptors or regions."""
    off = np.asarray(offsets, dtype=np.int64)
    end = off + np.asarray(lengths, dtype=np.int64) - 1
    stride, tensor, page = layout.tensor_stride, layout.tensor_bytes, layout.unified_page_bytes
    total = layout.num_tensors * stride

    def block(pos: np.ndarray) -> np.ndarray:
        within = pos % stride
        out = within // page
        out[(pos < 0) | (pos >= total) | (within >= tensor)] = OUTSIDE_BLOCKS
        return out

    first, last = block(off), block(end)
    same_tensor = (off // stride) == (end // stride)
    bad = (first == OUTSIDE_BLOCKS) | (last == OUTSIDE_BLOCKS) | ~same_tensor
    first[bad], last[bad] = OUTSIDE_BLOCKS, OUTSIDE_BLOCKS
    span = np.where(end < off, 0, last - first + 1)
    run = np.repeat(np.arange(off.size, dtype=np.int64), span)
    within = np.arange(int(span.sum()), dtype=np.int64) - np.repeat(np.cumsum(span) - span, span)
    return run, np.repeat(first, span) + within


def blocks_touched_set(layout: EngineLayout, offsets: np.ndarray, lengths: np.ndarray
                       ) -> np.ndarray:
    """The logical blocks the byte runs touch, each at least once and in no particular order:
    the set of :func:`blocks_touched`'s blocks (``OUTSIDE_BLOCKS`` included), for a caller that
    needs only which blocks (the landing guard). Runs that are all non-empty, inside one
    tensor's blocks and span at most two blocks (a transfer's descriptors: a block or a part
    of one) are answered by their first and last blocks, in fewer array passes; anything else
    is :func:`blocks_touched`'s answer."""
    off = np.asarray(offsets, dtype=np.int64)
    length = np.asarray(lengths, dtype=np.int64)
    if off.size == 0:
        return np.zeros(0, dtype=np.int64)
    end = off + length
    end -= 1
    stride, page = layout.tensor_stride, layout.unified_page_bytes
    t0, w0 = np.divmod(off, stride)
    t1, w1 = np.divmod(end, stride)
    first = w0 // page
    last = w1 // page
    # plain runs: non-empty, not before the allocation nor past it, every byte inside one
    # tensor's blocks (not in its alignment padding), at most two blocks long
    tensor = layout.tensor_bytes
    plain = (length.min() > 0 and off.min() >= 0 and end.max() < layout.total_bytes
             and w0.max() < tensor and w1.max() < tensor and np.array_equal(t0, t1))
    if plain:
        span = last - first
        if span.max() <= 1:
            return np.concatenate((first, last)) if span.any() else first
    return blocks_touched(layout, off, length)[1]


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
        if layout.kv_cache_layout == "HND":  # per kernel block: (heads, tokens, K|V, row)
            return words.reshape(n_kernel, heads, kt, 2, self.row_words)
        return words.reshape(n_kernel, kt, heads, 2, self.row_words)  # (tokens, heads, K|V, row)

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
        return (kernel, slice(None), row)  # HND: numpy puts the indexed axes first

    # ---- state ---------------------------------------------------------------------------
    def _state_parts(self, layout: EngineLayout) -> list[tuple[int, int, int, int]]:
        """(kind, local byte offset in the page, local words, canonical words) per sub-region."""
        cache = self.__dict__.setdefault("_parts_by_tp", {})
        if layout.tp not in cache:
            cache[layout.tp] = self._compute_state_parts(layout)
        return cache[layout.tp]

    def _compute_state_parts(self, layout: EngineLayout) -> list[tuple[int, int, int, int]]:
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

    # ---- fast paths ----------------------------------------------------------------------
    # Within one kernel block the pattern is affine in the block's first token tb: every word is
    # template[w] + tb * words_per_token (positions stay below 2**36, so the OR in encode_words
    # is an addition). Full blocks are written and checked in batches against that template;
    # tokens of partial blocks use the per-token path. A batch of consecutive kernel blocks is a
    # plain slice (no gather). Any mismatch sends the layer to the per-token path, which counts
    # and explains it exactly as before. Nothing here uses connector offsets: only the tensor
    # views and the token -> (kernel block, row) map above.
    def _full_blocks(self, layout: EngineLayout, ids: np.ndarray, tokens: tuple[int, int]
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(kernel blocks wholly inside [start, stop), their first tokens, the other tokens)."""
        t0, t1 = tokens
        kt = layout.kernel_block_size
        lo, hi = -(-t0 // kt) * kt, (t1 // kt) * kt
        if hi <= lo:
            return (np.zeros(0, np.int64), np.zeros(0, np.int64),
                    np.arange(t0, t1, dtype=np.int64))
        starts = np.arange(lo, hi, kt, dtype=np.int64)
        kernel, _ = self._token_rows(layout, ids, starts)
        rest = np.concatenate([np.arange(t0, lo, dtype=np.int64),
                               np.arange(hi, t1, dtype=np.int64)])
        return kernel, starts, rest

    def _block_template(self, layout: EngineLayout, rank: int, request: int, layer: int
                        ) -> tuple[np.ndarray, int]:
        """A block's words for first token 0 (in the block view's order) and words per token."""
        kt = layout.kernel_block_size
        first = self._attention_expected(layout, rank, request, layer,
                                         np.arange(kt, dtype=np.int64))
        if self.model.attention.is_mla:
            return first.reshape(-1), self.row_words
        if layout.kv_cache_layout == "HND":  # (tokens, heads, 2, row) -> (heads, tokens, 2, row)
            first = first.transpose(1, 0, 2, 3)
        return np.ascontiguousarray(first).reshape(-1), (
            self.model.attention.num_kv_heads * self.row_words)  # type: ignore[union-attr]

    def _batches(self, kernel: np.ndarray, block_words: int):
        """(slice start or None, index array, batch start) per batch of kernel blocks."""
        per = max(1, _BATCH_WORDS // block_words)
        for s in range(0, kernel.size, per):
            ks = kernel[s:s + per]
            if ks.size == 1 or (np.diff(ks) == 1).all():
                yield int(ks[0]), ks, s
            else:
                yield None, ks, s

    def _affine_ok(self, layout: EngineLayout, tokens: tuple[int, int], per_token: int,
                   template: np.ndarray) -> bool:
        top = (tokens[1] + layout.kernel_block_size) * per_token + template.size
        return top < (1 << _POS_BITS)

    def _write_attention(self, memory: np.ndarray, layout: EngineLayout, rank: int,
                         request: int, layer: int, ids: np.ndarray, tokens: tuple[int, int]
                         ) -> None:
        view = self._attention_block_view(memory, layout, layer)
        template, per_token = self._block_template(layout, rank, request, layer)
        kernel, starts, rest = self._full_blocks(layout, ids, tokens)
        if not self._affine_ok(layout, tokens, per_token, template):
            kernel, rest = kernel[:0], np.arange(*tokens, dtype=np.int64)
        flat = view.reshape(view.shape[0], -1)
        offsets = starts.astype(np.uint64) * np.uint64(per_token)
        for first, ks, s in self._batches(kernel, template.size):
            off = offsets[s:s + ks.size, None]
            if first is not None:
                np.add(template, off, out=flat[first:first + ks.size])
            else:
                flat[ks] = template + off
        if rest.size:
            k, row = self._token_rows(layout, ids, rest)
            view[self._attention_access(view, layout, k, row)] = self._attention_expected(
                layout, rank, request, layer, rest)

    def _attention_matches(self, memory: np.ndarray, layout: EngineLayout, rank: int,
                           request: int, layer: int, ids: np.ndarray, tokens: tuple[int, int]
                           ) -> bool:
        """True when every word of the layer's tokens is right (fast); False means: look
        closer (there is a mismatch, or the fast path does not apply)."""
        view = self._attention_block_view(memory, layout, layer)
        template, per_token = self._block_template(layout, rank, request, layer)
        if not self._affine_ok(layout, tokens, per_token, template):
            return False
        kernel, starts, rest = self._full_blocks(layout, ids, tokens)
        flat = view.reshape(view.shape[0], -1)
        per = max(1, _BATCH_WORDS // template.size)
        rows = min(per, max(kernel.size, 1))
        # expected words of a batch; consecutive batches differ by one constant (their first
        # tokens are consecutive multiples of the kernel block), so it is shifted, not rebuilt
        want = self._want(rows * template.size).reshape(rows, template.size)
        step = np.uint64(layout.kernel_block_size * per_token)
        np.add(template, (np.arange(rows, dtype=np.uint64) * step)[:, None], out=want)
        if kernel.size:
            want += np.uint64(int(starts[0]) * per_token)
        shift = np.uint64(rows) * step
        flat_addr, want_addr = _address(flat), _address(want)
        row_bytes = template.size * 8
        for first, ks, s in self._batches(kernel, template.size):
            if s:
                want += shift
            if first is not None:
                ok = _same(flat[first:first + ks.size], want[:ks.size],
                           None if flat_addr is None else flat_addr + first * row_bytes,
                           want_addr)
            else:
                ok = _same(flat[ks], want[:ks.size], None, want_addr)
            if not ok:
                return False
        if rest.size:
            k, row = self._token_rows(layout, ids, rest)
            got = view[self._attention_access(view, layout, k, row)]
            if (got != self._attention_expected(layout, rank, request, layer, rest)).any():
                return False
        return True

    def _ramp(self) -> np.ndarray:
        ramp = getattr(self, "_ramp_words", None)
        if ramp is None:
            ramp = self._ramp_words = np.arange(_BATCH_WORDS, dtype=np.uint64)
        return ramp

    def _state_head(self, request: int, layer: int, kind: int, start: int, n: int) -> int | None:
        """encode_words' header + start, when start + n stays below 2**36 (else None)."""
        if start + n >= 1 << _POS_BITS:
            return None
        return (request_tag(request) << 48) | (layer << 40) | (kind << _POS_BITS) | start

    def _state_write(self, words: np.ndarray, head: int) -> None:
        ramp = self._ramp()
        for i in range(0, words.size, ramp.size):
            seg = words[i:i + ramp.size]
            np.add(ramp[:seg.size], np.uint64(head + i), out=seg)

    def _want(self, n: int) -> np.ndarray:
        """A reusable buffer for expected words (never larger than one batch)."""
        buf = getattr(self, "_want_words", None)
        if buf is None or buf.size < n:
            buf = self._want_words = np.empty(max(n, _BATCH_WORDS), dtype=np.uint64)
        return buf[:n]

    def _state_page_matches(self, page: np.ndarray, parts: list[tuple[int, int, int]]) -> bool:
        """Check a page's contiguous sub-regions at once: ``parts`` = (byte offset, words,
        header + first position) in page order, with no gap between them."""
        ramp = self._ramp()
        want = self._want(_BATCH_WORDS)
        words = _words(page[parts[0][0]:parts[-1][0] + parts[-1][1] * 8])
        words_addr, want_addr = _address(words), _address(want)
        cursor = fill = 0
        for _, n, head in parts:
            i = 0
            while i < n:
                take = min(n - i, want.size - fill)
                np.add(ramp[:take], np.uint64(head + i), out=want[fill:fill + take])
                fill += take
                i += take
                if fill == want.size:
                    if not _same(words[cursor:cursor + fill], want,
                                 None if words_addr is None else words_addr + cursor * 8,
                                 want_addr):
                        return False
                    cursor, fill = cursor + fill, 0
        return fill == 0 or _same(words[cursor:cursor + fill], want[:fill],
                                  None if words_addr is None else words_addr + cursor * 8,
                                  want_addr)

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
                    self._write_attention(memory, layout, rank, request, layer, ids, tokens)
                elif state_step is not None and ids.size:
                    page = self._state_page(memory, layout, layer, int(ids[-1]))
                    for kind, offset, n_local, n_global in self._state_parts(layout):
                        start = state_step * n_global + rank * n_local
                        words = _words(page[offset:offset + n_local * 8])
                        head = self._state_head(request, layer, kind, start, n_local)
                        if head is not None:
                            self._state_write(words, head)
                            continue
                        pos = start + np.arange(n_local)
                        words[:] = encode_words(request, layer, kind, pos)

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
                    if toks.size == 0 or self._attention_matches(memory, layout, rank, request,
                                                                 layer, ids, tokens):
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
                    parts = self._state_parts(layout)
                    heads = [self._state_head(request, layer, kind, state_step * n_global
                                              + rank * n_local, n_local)
                             for kind, _, n_local, n_global in parts]
                    if None not in heads and self._state_page_matches(
                            page, [(p[1], p[2], h) for p, h in zip(parts, heads)]):
                        continue
                    for kind, offset, n_local, n_global in parts:
                        start = state_step * n_global + rank * n_local
                        got = _words(page[offset:offset + n_local * 8])
                        pos = start + np.arange(n_local)
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

    def write_stale(self, memory: np.ndarray, layout: EngineLayout, rank: int, request: int, *,
                    blocks: Mapping[int, np.ndarray], tokens: tuple[int, int]) -> None:
        """Fill the attention rows of tokens [start, stop) of the request's blocks with stale
        bytes (an earlier tenant's data) -- what a reused block holds where nothing is written."""
        toks = np.arange(*tokens, dtype=np.int64)
        if toks.size == 0:
            return
        for group in layout.attention_groups:
            ids = np.asarray(blocks.get(group.group_id, ()), dtype=np.int64)
            for layer in group.layers:
                view = self._attention_block_view(memory, layout, layer)
                k, row = self._token_rows(layout, ids, toks)
                want = self._attention_expected(layout, rank, request, layer, toks)
                view[self._attention_access(view, layout, k, row)] = (
                    want & np.uint64(~(0xF << _POS_BITS) & 0xFFFFFFFFFFFFFFFF)
                    | np.uint64(KIND_STALE << _POS_BITS))

    def verify_zeros(self, memory: np.ndarray, layout: EngineLayout, rank: int, *, engine: str,
                     blocks: Mapping[int, np.ndarray], tokens: tuple[int, int], limit: int = 8
                     ) -> tuple[int, list[Mismatch]]:
        """Check that the attention rows of tokens [start, stop) of the request's blocks are
        zero (the untransferred tail the connector must zero after a block-size-ratio READ)."""
        toks = np.arange(*tokens, dtype=np.int64)
        total, found = 0, []
        if toks.size == 0:
            return 0, []
        for group in layout.attention_groups:
            ids = np.asarray(blocks.get(group.group_id, ()), dtype=np.int64)
            for layer in group.layers:
                view = self._attention_block_view(memory, layout, layer)
                k, row = self._token_rows(layout, ids, toks)
                got = view[self._attention_access(view, layout, k, row)]
                bad = got != 0
                if bad.any():
                    total += int(bad.sum())
                    if len(found) < limit:
                        per_token = bad.reshape(bad.shape[0], -1).any(axis=1)
                        idx = np.flatnonzero(per_token)
                        first = int(got.reshape(got.shape[0], -1)[idx[0]][
                            np.flatnonzero(bad.reshape(bad.shape[0], -1)[idx[0]])[0]])
                        found.append(Mismatch(
                            engine=engine, rank=rank, layer=layer,
                            kind=("MLA" if self.model.attention.is_mla else "K/V")
                            + " untransferred tail",
                            where=f"tokens {int(toks[idx[0]])}..{int(toks[idx[-1]])} "
                                  f"(must be zeroed)",
                            words=int(bad.sum()), got=describe_word(first)))
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
