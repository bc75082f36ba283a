"""Lazily committed byte buffers and a vectorised multi-range copy.

Simulated caches are anonymous ``MAP_NORESERVE`` mappings: the OS commits a 4 KiB page only when
it is first written, so a production-size pool (tens of GB of virtual space) costs only the pages
a scenario touches, and every access is a plain numpy slice.
"""

from __future__ import annotations

import mmap

import numpy as np

__all__ = ["lazy_buffer", "copy_ranges", "merge_runs"]

_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)


def lazy_buffer(nbytes: int) -> np.ndarray:
    """A zero-filled uint8 array of ``nbytes`` whose pages are committed on first write."""
    if nbytes <= 0:
        return np.zeros(0, dtype=np.uint8)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
    buf = mmap.mmap(-1, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return np.frombuffer(buf, dtype=np.uint8)


def merge_runs(dst: np.ndarray, src: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, ...]:
    """Merge consecutive ranges that are contiguous on both sides (vectorised)."""
    if dst.size <= 1:
        return dst, src, lengths
    contiguous = (dst[1:] == dst[:-1] + lengths[:-1]) & (src[1:] == src[:-1] + lengths[:-1])
    starts = np.flatnonzero(np.concatenate([[True], ~contiguous]))
    sums = np.add.reduceat(lengths, starts)
    return dst[starts], src[starts], sums


_GATHER_MAX_WORDS = 1 << 22  # 32 MiB of uint64 indices per vectorised batch


def copy_ranges(dst_buf: np.ndarray, dst_off: np.ndarray, src_buf: np.ndarray,
                src_off: np.ndarray, lengths: np.ndarray) -> int:
    """Copy ``lengths[i]`` bytes from src_buf[src_off[i]:] to dst_buf[dst_off[i]:]; returns bytes.

    Contiguous runs are merged first. Large runs are copied as slices (memcpy speed); many small
    8-byte-aligned runs are moved by one vectorised gather/scatter per batch.
    """
    dst_off = np.asarray(dst_off, dtype=np.int64)
    src_off = np.asarray(src_off, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    keep = lengths > 0
    dst_off, src_off, lengths = merge_runs(dst_off[keep], src_off[keep], lengths[keep])
    total = int(lengths.sum())
    if lengths.size == 0:
        return 0
    aligned = not ((dst_off | src_off | lengths) & 7).any()
    if lengths.size > 64 and aligned and total // lengths.size < 16384:
        dst_words = dst_buf[: dst_buf.size // 8 * 8].view(np.uint64)
        src_words = src_buf[: src_buf.size // 8 * 8].view(np.uint64)
        words = lengths // 8
        start = 0
        while start < words.size:
            stop = start + max(1, int(np.searchsorted(np.cumsum(words[start:]), _GATHER_MAX_WORDS)))
            w = words[start:stop]
            run = np.repeat(np.arange(w.size), w)
            within = np.arange(int(w.sum()), dtype=np.int64) - np.repeat(np.cumsum(w) - w, w)
            dst_words[dst_off[start:stop][run] // 8 + within] = src_words[
                src_off[start:stop][run] // 8 + within]
            start = stop
        return total
    for d, s, n in zip(dst_off.tolist(), src_off.tolist(), lengths.tolist()):
        dst_buf[d:d + n] = src_buf[s:s + n]
    return total
