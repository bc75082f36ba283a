"""Descriptor merging: post fewer descriptors for the same bytes (``[connector] descriptor_merge``).

The reference connector posts one descriptor per (region, kernel block) and per (state
sub-region, slot): a 64k-token KimiLinear request is ~7,000 descriptors per rank, and the
published cliffs (docs/semantics.md §10: 112K descriptors per rank-transfer, posting 57 % of the transfer
time) come from that per-block plan. This module turns a transfer's paired descriptors into a
shorter plan that moves exactly the same (local byte, remote byte) pairs:

``"contiguous"``
    Consecutive pairs whose runs continue each other on **both** sides (``addr[i+1] ==
    addr[i] + len[i]`` locally and remotely, same device) become one longer descriptor. Adjacent
    kernel blocks of one region are contiguous (the MLA view's stride is its block length), so a
    request whose blocks were allocated consecutively collapses to about one descriptor per
    region; equal-TP state sub-regions (conv Q|K|V|recurrent) collapse to one per page.

``"strided"``
    NIXL's strided form (docs/semantics.md §11.3 item 4, NIXL PR #1978): rows ``(addr, len, dev,
    stride, count)`` naming ``count`` runs of ``len`` bytes, ``stride`` apart. The contiguous
    merge runs first; then consecutive rows of equal length whose addresses advance by one
    constant stride on each side (the strides may differ between the sides) become one row.
    This catches what contiguity cannot: head slices of SPLIT attention blocks under
    heterogeneous TP (local stride = block stride, remote stride = slice length) and the 3-read
    conv pattern (remote stride = ``r`` x local size).

Both are pure, vectorised functions of the two (N, 3) arrays; the per-block plan (ids into the
prepared lists, docs/semantics.md §3.4) is computed first exactly as the reference does, so ids,
pairing and every V-rule are untouched. The merged rows are posted through the non-prepped
``Transport.make_xfer`` (NIXL's ``initialize_xfer``). A row never spans two devices, never spans
two registered regions (``regions``: the region index of every descriptor on each side; NIXL
refuses a descriptor that crosses registrations, even where two cache tensors happen to be
adjacent in memory) and never changes which byte goes where; ``expand`` turns any plan back
into per-run (N, 3) descriptors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..transport.base import expand_strided

__all__ = ["MERGE_MODES", "MergedPlan", "merge_contiguous", "merge_strided", "merge_descriptors",
           "merge_with_heads", "expand", "byte_pairs", "region_index", "collapsed_pairs"]

MERGE_MODES = ("off", "contiguous", "strided")


@dataclass(frozen=True, eq=False)
class MergedPlan:
    """A transfer's descriptors after merging: (M, 3) rows, or (M, 5) strided rows."""

    local: np.ndarray
    remote: np.ndarray

    @property
    def strided(self) -> bool:
        return self.local.shape[1] == 5

    @property
    def rows(self) -> int:
        """Descriptors (or strided rows) the plan posts."""
        return int(self.local.shape[0])

    @property
    def runs(self) -> int:
        """Contiguous runs the rows name (a strided row names ``count`` of them)."""
        return int(self.local[:, 4].sum()) if self.strided else self.rows

    @property
    def nbytes(self) -> int:
        if self.strided:
            return int((self.local[:, 1] * self.local[:, 4]).sum())
        return int(self.local[:, 1].sum())


def _pairs(local: np.ndarray, remote: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    lo = np.asarray(local, dtype=np.uint64)
    re = np.asarray(remote, dtype=np.uint64)
    if lo.ndim != 2 or lo.shape[1] != 3 or re.shape != lo.shape:
        raise ValueError(f"expected two (N, 3) descriptor arrays of equal shape, got {lo.shape} "
                         f"and {re.shape}")
    if not np.array_equal(lo[:, 1], re[:, 1]):
        i = int(np.flatnonzero(lo[:, 1] != re[:, 1])[0])
        raise ValueError(f"descriptor pair {i} has local length {int(lo[i, 1])} but remote "
                         f"length {int(re[i, 1])}")
    return lo, re


Regions = tuple[np.ndarray, np.ndarray] | None


def _same_region(regions: Regions, n: int) -> np.ndarray | bool:
    """Whether descriptor i and i+1 lie in the same registered region on both sides."""
    if regions is None:
        return True
    lr, rr = (np.asarray(r) for r in regions)
    if lr.shape != (n,) or rr.shape != (n,):
        raise ValueError(f"regions must give one index per descriptor on each side ({n})")
    return (lr[1:] == lr[:-1]) & (rr[1:] == rr[:-1])


def _contiguous_starts(lo: np.ndarray, re: np.ndarray, regions: Regions) -> np.ndarray:
    """Index of the first pair of every contiguous run (see merge_contiguous)."""
    if lo.shape[0] <= 1:
        return np.arange(lo.shape[0])
    lens = lo[:, 1]
    joins = ((lo[1:, 0] == lo[:-1, 0] + lens[:-1]) & (re[1:, 0] == re[:-1, 0] + lens[:-1])
             & (lo[1:, 2] == lo[:-1, 2]) & (re[1:, 2] == re[:-1, 2])
             & _same_region(regions, lo.shape[0]))
    return np.flatnonzero(np.concatenate(([True], ~joins)))


def merge_contiguous(local: np.ndarray, remote: np.ndarray, regions: Regions = None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Merge consecutive pairs that are contiguous on both sides (and on one device and in one
    registered region per side).

    Returns new (M, 3) uint64 arrays, M <= N; order is kept (row k starts where the first pair
    it absorbed started).
    """
    lo, re = _pairs(local, remote)
    return _joined(lo, re, _contiguous_starts(lo, re, regions))


def _joined(lo: np.ndarray, re: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows of checked pairs ``lo``/``re`` with every contiguous run (``starts``: its first
    pair) joined into its first row."""
    if starts.size == lo.shape[0]:
        return lo.copy(), re.copy()
    merged = np.add.reduceat(lo[:, 1], starts)
    out_l, out_r = lo[starts], re[starts]
    out_l[:, 1] = merged
    out_r[:, 1] = merged
    return out_l, out_r


def _strided_runs(l_addr: np.ndarray, r_addr: np.ndarray, lens: np.ndarray, l_dev: np.ndarray,
                  r_dev: np.ndarray, same_region: np.ndarray | bool = True
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Greedy left-to-right arithmetic runs: (first row, row count) of every run of >= 2 rows.

    A run is consecutive rows of equal, non-zero length on one device per side whose addresses
    advance by one constant stride >= the length on each side (no overlap).
    """
    dl = np.diff(l_addr.astype(np.int64))
    dr = np.diff(r_addr.astype(np.int64))
    n0 = lens[:-1].astype(np.int64)
    valid = ((lens[1:] == lens[:-1]) & (lens[:-1] > 0) & (dl >= n0) & (dr >= n0)
             & (l_dev[1:] == l_dev[:-1]) & (r_dev[1:] == r_dev[:-1]) & same_region)
    if not valid.any():
        empty = np.zeros(0, np.int64)
        return empty, empty
    # maximal segments of equal, valid deltas ("delta runs"); delta i joins rows i and i+1
    same = np.zeros(valid.size, dtype=bool)
    same[1:] = valid[1:] & valid[:-1] & (dl[1:] == dl[:-1]) & (dr[1:] == dr[:-1])
    starts = np.flatnonzero(valid & ~same)
    # a delta run starting at delta a continues while ``same`` holds; it joins rows a..a+length
    seg_id = np.cumsum(valid & ~same) - 1
    run_len = np.bincount(seg_id[valid], minlength=starts.size)
    firsts: list[int] = []
    counts: list[int] = []
    consumed = -1  # last row taken by the previous run
    for a, m in zip(starts.tolist(), run_len.tolist()):
        first = a + 1 if a <= consumed else a  # its first row already ends the previous run
        last = a + m  # row index of the run's last row
        if last - first < 1:
            continue
        firsts.append(first)
        counts.append(last - first + 1)
        consumed = last
    return np.asarray(firsts, np.int64), np.asarray(counts, np.int64)


def merge_strided(local: np.ndarray, remote: np.ndarray, regions: Regions = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Contiguous merge, then strided rows: returns two (M, 5) uint64 arrays of
    (addr, len, dev, stride, count); a row with count 1 has stride = len."""
    lo, re = _pairs(local, remote)
    out_l, out_r, _ = _strided(lo, re, regions)
    return out_l, out_r


def _strided(lo: np.ndarray, re: np.ndarray, regions: Regions
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`merge_strided` of checked pairs, and the index of every row's first pair."""
    starts = _contiguous_starts(lo, re, regions)
    cl, cr = _joined(lo, re, starts)
    m = cl.shape[0]
    row_regions = None if regions is None else (np.asarray(regions[0])[starts],
                                                np.asarray(regions[1])[starts])
    firsts, counts = (_strided_runs(cl[:, 0], cr[:, 0], cl[:, 1], cl[:, 2], cr[:, 2],
                                    _same_region(row_regions, m)) if m > 1
                      else (np.zeros(0, np.int64), np.zeros(0, np.int64)))
    # a row heads its plan row unless a strided run took it after its first row (the runs
    # do not overlap: _strided_runs takes them left to right)
    head = np.ones(m, dtype=bool)
    for f, c in zip(firsts.tolist(), counts.tolist()):
        head[f + 1:f + c] = False
    rows = np.flatnonzero(head)
    count = np.ones(rows.size, dtype=np.uint64)
    pos = np.searchsorted(rows, firsts)
    count[pos] = counts.astype(np.uint64)
    out = []
    for side in (cl, cr):
        r = np.empty((rows.size, 5), dtype=np.uint64)
        r[:, :3] = side[rows]
        r[:, 3] = side[rows, 1]
        if firsts.size:
            r[pos, 3] = side[firsts + 1, 0] - side[firsts, 0]
        r[:, 4] = count
        out.append(r)
    return out[0], out[1], starts[rows]


def merge_descriptors(local: np.ndarray, remote: np.ndarray, mode: str,
                      regions: Regions = None) -> MergedPlan:
    """The plan a transfer posts under ``descriptor_merge = mode`` (``regions``: the registered
    region of every descriptor on each side; rows never span two)."""
    if mode == "contiguous":
        return MergedPlan(*merge_contiguous(local, remote, regions))
    if mode == "strided":
        return MergedPlan(*merge_strided(local, remote, regions))
    if mode == "off":
        lo, re = _pairs(local, remote)
        return MergedPlan(lo.copy(), re.copy())
    raise ValueError(f"unknown descriptor_merge {mode!r}; allowed: {', '.join(MERGE_MODES)}")


def merge_with_heads(local: np.ndarray, remote: np.ndarray, mode: str, regions: Regions = None
                     ) -> tuple[MergedPlan, np.ndarray]:
    """:func:`merge_descriptors`, and the index (into ``local``/``remote``) of the first pair
    of every row of the plan (connector/templates.py: which row of the ids it came from)."""
    lo, re = _pairs(local, remote)
    if mode == "strided":
        out_l, out_r, heads = _strided(lo, re, regions)
        return MergedPlan(out_l, out_r), heads
    if mode == "contiguous":
        starts = _contiguous_starts(lo, re, regions)
        return MergedPlan(*_joined(lo, re, starts)), starts
    if mode == "off":
        return MergedPlan(lo.copy(), re.copy()), np.arange(lo.shape[0])
    raise ValueError(f"unknown descriptor_merge {mode!r}; allowed: {', '.join(MERGE_MODES)}")


def region_index(bases: "np.ndarray | list[int]", addrs: np.ndarray) -> np.ndarray:
    """The registered region each address falls in, given every region's base address (regions
    are disjoint, so a region extends at most to the next base)."""
    b = np.sort(np.asarray(bases, dtype=np.uint64))
    return np.searchsorted(b, np.asarray(addrs, dtype=np.uint64), side="right")


def collapsed_pairs(pairs: Any, local_bases: Sequence[int], remote_bases: Sequence[int]
                    ) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """A transfer's (local rows, remote rows, regions) ready for :func:`merge_descriptors`, with
    every run of pairs that the contiguous merge would join anyway given as one row.

    ``pairs``: a checked transfer (hkvsim.transport.base.CheckedPairs). Over affine lists, a
    joint run of consecutive ids whose descriptors follow each other in memory on both sides
    (segment stride = length) and stay in one registered region on each side (region of its
    first and of its last descriptor equal: region_index grows with the address) is a chain the
    contiguous merge joins link by link; it becomes one row of the summed length, without
    computing its descriptors' addresses. Merging the result gives the very rows merging the
    per-descriptor rows gives (both merges start with the contiguous one)."""
    runs = pairs.runs
    if runs is None:
        lo, re = pairs.rows("local"), pairs.rows("remote")
        return lo, re, (region_index(local_bases, lo[:, 0]), region_index(remote_bases, re[:, 0]))
    starts, counts = runs.starts, runs.counts
    last = starts + counts - 1
    k = starts.size
    sides = []
    for dl, ids, seg, bases in ((runs.local, runs.li, runs.lseg, local_bases),
                                (runs.remote, runs.ri, runs.rseg, remote_bases)):
        at = dl.addresses(ids[np.concatenate((starts, last))], np.concatenate((seg, seg)))
        reg = region_index(bases, at)
        sides.append((dl, reg[:k], (dl.step_joins[seg] == 1) & (reg[:k] == reg[k:])))
    collapse = (sides[0][2] & sides[1][2]) | (counts == 1)  # one descriptor: its own row
    out = []
    for (dl, reg, _), side, bases in ((sides[0], "local", local_bases),
                                      (sides[1], "remote", remote_bases)):
        addrs, lengths, _ = runs.expand_runs(side, collapse)
        rows = np.empty((addrs.size, 3), dtype=np.uint64)
        rows[:, 0] = addrs
        rows[:, 1] = lengths
        rows[:, 2] = dl.device
        out.append((rows, reg if addrs.size == k else region_index(bases, addrs)))
    return out[0][0], out[1][0], (out[0][1], out[1][1])


def expand(rows: np.ndarray) -> np.ndarray:
    """Per-run (N, 3) descriptors of a plan's rows ((N, 3) rows are returned as they are)."""
    arr = np.asarray(rows, dtype=np.uint64)
    return expand_strided(arr) if arr.shape[1] == 5 else arr


def byte_pairs(local: np.ndarray, remote: np.ndarray) -> np.ndarray:
    """Every (local byte address, remote byte address) pair a plan moves, sorted, as an (B, 2)
    array (a multiset: a byte moved twice appears twice). For tests; O(bytes)."""
    lo, re = expand(local), expand(remote)
    lens = lo[:, 1].astype(np.int64)
    run = np.repeat(np.arange(lens.size), lens)
    within = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    pairs = np.stack([lo[run, 0].astype(np.int64) + within,
                      re[run, 0].astype(np.int64) + within], axis=1)
    order = np.lexsort((pairs[:, 1], pairs[:, 0]))
    return pairs[order]
