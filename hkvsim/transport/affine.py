"""Affine descriptor lists: a prepared list described, not materialised (issue #14 item 1).

A cache's prepared lists are arithmetic: descriptor id ``i`` of region ``r`` sits at
``base_r + (j // sub) * stride_r + (j % sub) * sub_stride_r`` with a fixed length, where ``j``
is ``i``'s position inside its region. Materialised as (N, 3) rows they cost 24 B per
descriptor per list and grow with ``num_blocks`` (one list per rank and per remote rank);
described they are a few numbers per region.

An :class:`AffineList` is a sequence of *segments*, each a run of consecutive ids:
``count`` descriptors of ``length`` bytes on one device, addresses as above. Addresses and
lengths are computed from ids on demand (numpy, vectorised); ``materialise`` gives the (N, 3)
rows (only the real NIXL transport needs them). The transports accept either form in
``prep_xfer_dlist``: an explicit (N, 3) array, or an AffineList.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["AffineList", "PairedRuns"]

_INT64_MAX = (1 << 63) - 1


def _column(values: Sequence[int] | np.ndarray, name: str, size: int) -> np.ndarray:
    arr = np.asarray(values)
    if arr.shape != (size,):
        raise ValueError(f"affine list: {name} must give one value per segment ({size}), got "
                         f"shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"affine list: {name} must be integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > _INT64_MAX):
        raise ValueError(f"affine list: {name} must lie in [0, 2**63), got "
                         f"[{int(arr.min())}, {int(arr.max())}]")
    return np.ascontiguousarray(arr, dtype=np.int64)


class AffineList:
    """A descriptor list as segments of consecutive ids (see the module docstring).

    Segment ``s`` holds ids ``[first[s], first[s + 1])``; id ``first[s] + j`` is the run of
    ``length[s]`` bytes at ``base[s] + (j // sub[s]) * stride[s] + (j % sub[s]) *
    sub_stride[s]`` on ``device``. Every field is a non-negative integer and every address and
    end fits in int64 (checked here), so the arithmetic below cannot overflow.
    """

    __slots__ = ("first", "counts", "base", "stride", "sub", "sub_stride", "length", "device",
                 "_plain", "_uniform_length", "_n", "step_joins")

    def __init__(self, *, counts: Sequence[int] | np.ndarray, base: Sequence[int] | np.ndarray,
                 stride: Sequence[int] | np.ndarray, length: Sequence[int] | np.ndarray,
                 device: int, sub: Sequence[int] | np.ndarray | None = None,
                 sub_stride: Sequence[int] | np.ndarray | None = None) -> None:
        size = int(np.asarray(counts).size)
        self.counts = _column(counts, "counts", size)
        self.base = _column(base, "base", size)
        self.stride = _column(stride, "stride", size)
        self.length = _column(length, "length", size)
        self.sub = (np.ones(size, np.int64) if sub is None else _column(sub, "sub", size))
        self.sub_stride = (np.zeros(size, np.int64) if sub_stride is None
                           else _column(sub_stride, "sub_stride", size))
        if size and int(self.sub.min()) < 1:
            raise ValueError("affine list: sub must be >= 1")
        if not isinstance(device, (int, np.integer)) or not 0 <= int(device) <= _INT64_MAX:
            raise ValueError(f"affine list: device must be a non-negative int, got {device!r}")
        self.device = int(device)
        self.first = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        self._n = int(self.first[-1])
        for s in range(size):
            if self.counts[s] and self._segment_hull(s)[1] > _INT64_MAX:
                raise ValueError(f"affine list: segment {s} ends beyond 2**63")
        self._plain = bool((self.sub == 1).all())
        lengths = {int(v) for v, c in zip(self.length, self.counts) if c}
        self._uniform_length = lengths.pop() if len(lengths) == 1 else None
        self.step_joins = _step_joins(self)

    def __len__(self) -> int:
        return self._n

    @property
    def num_segments(self) -> int:
        return int(self.counts.size)

    # ---- per-id arithmetic (ids must already lie in [0, len)) -----------------------------------
    def segments(self, ids: np.ndarray) -> np.ndarray:
        """The segment of every id."""
        if self.counts.size == 1:
            return np.zeros(ids.shape, dtype=np.int64)
        return np.searchsorted(self.first, ids, side="right") - 1

    def lengths(self, ids: np.ndarray, seg: np.ndarray | None = None) -> np.ndarray:
        """Descriptor lengths (int64) of ``ids``."""
        if self._uniform_length is not None:
            return np.full(ids.shape, self._uniform_length, dtype=np.int64)
        return self.length[self.segments(ids) if seg is None else seg]

    def addresses(self, ids: np.ndarray, seg: np.ndarray | None = None) -> np.ndarray:
        """Descriptor addresses (int64) of ``ids``."""
        s = self.segments(ids) if seg is None else seg
        j = ids - self.first[s]
        if self._plain:
            return self.base[s] + j * self.stride[s]
        sub = self.sub[s]
        return self.base[s] + (j // sub) * self.stride[s] + (j % sub) * self.sub_stride[s]

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """(n, 3) uint64 rows (addr, len, device) of ``ids``."""
        ids = np.asarray(ids, dtype=np.int64)
        seg = self.segments(ids)
        out = np.empty((ids.size, 3), dtype=np.uint64)
        out[:, 0] = self.addresses(ids, seg)
        out[:, 1] = self.lengths(ids, seg)
        out[:, 2] = self.device
        return out

    def segment_rows(self, s: int) -> np.ndarray:
        """(count, 3) rows of segment ``s``."""
        return self.rows(np.arange(self.first[s], self.first[s + 1], dtype=np.int64))

    def materialise(self) -> np.ndarray:
        """The whole list as (N, 3) uint64 rows: O(N) memory (the real NIXL transport)."""
        return self.rows(np.arange(self._n, dtype=np.int64))

    # ---- extents --------------------------------------------------------------------------
    def _segment_hull(self, s: int) -> tuple[int, int]:
        """[lowest address, an upper bound of the highest end) of segment ``s`` (Python ints):
        every field is non-negative, so addresses grow with both j // sub and j % sub."""
        count, sub = int(self.counts[s]), int(self.sub[s])
        lo = int(self.base[s])
        hi = (lo + ((count - 1) // sub) * int(self.stride[s])
              + (min(sub, count) - 1) * int(self.sub_stride[s]) + int(self.length[s]))
        return lo, hi

    def hulls(self) -> list[tuple[int, int, int, int]]:
        """(segment, first id, lo, hi) of every non-empty segment, in id order."""
        return [(s, int(self.first[s]), *self._segment_hull(s))
                for s in range(self.counts.size) if self.counts[s]]

    def zero_length_id(self) -> int | None:
        """The first id whose descriptor has length 0, or None."""
        for s in range(self.counts.size):
            if self.counts[s] and self.length[s] == 0:
                return int(self.first[s])
        return None

    def nbytes(self) -> int:
        """Bytes the whole list names."""
        return int((self.counts * self.length).sum())

    def __repr__(self) -> str:
        return (f"AffineList({self._n} descriptors in {self.counts.size} segments, device "
                f"{self.device})")


def _step_joins(dl: AffineList) -> np.ndarray:
    """Per segment: 1 when every id continues the previous one in memory (addr = previous addr +
    length), 0 when none does, -1 when it depends on the position (sub-blocks)."""
    plain = dl.stride == dl.length
    sub_ok = dl.sub_stride == dl.length
    across_ok = dl.stride - (dl.sub - 1) * dl.sub_stride == dl.length
    multi = dl.sub > 1
    out = np.where(plain, 1, 0)
    out = np.where(multi & sub_ok & across_ok, 1, out)
    out = np.where(multi & (sub_ok != across_ok), -1, out)
    out = np.where(multi & ~sub_ok & ~across_ok, 0, out)
    return out.astype(np.int64)


class PairedRuns:
    """A transfer's paired ids over two affine lists, as *joint runs*: maximal stretches where
    both sides' ids go up by one inside one segment per side. Everything a transport derives
    per descriptor (paired lengths, bytes, NIXL's coalescing, destination runs) is computed
    per run; rows are expanded only when asked for.

    ``ids`` must already be range-checked."""

    __slots__ = ("local", "remote", "li", "ri", "starts", "counts", "lseg", "rseg", "llen",
                 "rlen", "_ends")

    def __init__(self, local: AffineList, li: np.ndarray, remote: AffineList,
                 ri: np.ndarray) -> None:
        self.local, self.remote, self.li, self.ri = local, remote, li, ri
        self._ends: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        n = li.size
        brk = np.empty(n, dtype=bool)
        if n:
            brk[0] = True
            np.not_equal(li[1:] - li[:-1], 1, out=brk[1:])
            brk[1:] |= (ri[1:] - ri[:-1]) != 1
        starts = np.flatnonzero(brk)
        segs = []
        for dl, ids in ((local, li), (remote, ri)):  # a run must not cross a segment boundary
            seg, starts = self._split(dl, ids, brk, starts)
            segs.append(seg)
        if segs[0].size != starts.size:  # the remote side split runs: look the local up again
            segs[0] = local.segments(li[starts])
        self.starts = starts
        counts = np.empty(starts.size, dtype=np.int64)
        if starts.size:
            counts[:-1] = starts[1:] - starts[:-1]
            counts[-1] = n - starts[-1]
        self.counts = counts
        self.lseg, self.rseg = segs
        self.llen = local.length[self.lseg]
        self.rlen = remote.length[self.rseg]

    @staticmethod
    def _split(dl: AffineList, ids: np.ndarray, brk: np.ndarray, starts: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
        """(segment of every run, run starts) once runs crossing a segment of ``dl`` are
        split there (``brk`` is updated)."""
        k = starts.size
        if dl.num_segments == 1 or not k:
            return np.zeros(k, dtype=np.int64), starts
        ends = np.empty(k, dtype=np.int64)
        ends[:-1] = starts[1:] - 1
        ends[-1] = ids.size - 1
        both = np.searchsorted(dl.first, ids[np.concatenate((starts, ends))], side="right") - 1
        s0, s1 = both[:k], both[k:]
        nb = s1 - s0
        if not nb.any():
            return s0, starts
        run = np.repeat(np.arange(k), nb)
        j = np.arange(int(nb.sum())) - np.repeat(np.cumsum(nb) - nb, nb)
        bounds = dl.first[s0[run] + 1 + j]
        brk[starts[run] + (bounds - ids[starts[run]])] = True
        starts = np.flatnonzero(brk)
        return dl.segments(ids[starts]), starts

    def first_length_mismatch(self) -> int | None:
        """Index of the first pair whose lengths differ, or None."""
        bad = np.flatnonzero(self.llen != self.rlen)
        return int(self.starts[bad[0]]) if bad.size else None

    def nbytes(self) -> int:
        return int((self.counts * self.llen).sum())

    def _side(self, side: str) -> tuple[AffineList, np.ndarray, np.ndarray]:
        return ((self.local, self.li, self.lseg) if side == "local"
                else (self.remote, self.ri, self.rseg))

    def _tail_head(self, side: str) -> tuple[np.ndarray, np.ndarray]:
        """Every run's first address, and the end of its last descriptor (cached)."""
        got = self._ends.get(side)
        if got is None:
            dl, ids, seg = self._side(side)
            k = self.starts.size
            at = dl.addresses(ids[np.concatenate((self.starts, self.starts + self.counts - 1))],
                              np.concatenate((seg, seg)))
            got = self._ends[side] = (at[:k], at[k:] + dl.length[seg])
        return got

    def coalesced(self) -> int | None:
        """Descriptors left after NIXL's coalescing (hkvsim.transport.coalesce), or None when
        a run's joins depend on positions inside it (then count from rows)."""
        lj = self.local.step_joins[self.lseg]
        rj = self.remote.step_joins[self.rseg]
        if (lj < 0).any() or (rj < 0).any():
            return None
        n = int(self.li.size)
        if self.starts.size <= 1:
            return n - int(((self.counts - 1) * (lj & rj)).sum())
        inside = int(((self.counts - 1) * (lj & rj)).sum())
        lh, lt = self._tail_head("local")
        rh, rt = self._tail_head("remote")
        between = int(np.count_nonzero((lh[1:] == lt[:-1]) & (rh[1:] == rt[:-1])))
        return n - inside - between

    def rows(self, side: str) -> np.ndarray:
        """(n, 3) uint64 rows of one side ("local" or "remote")."""
        dl, ids, seg = ((self.local, self.li, self.lseg) if side == "local"
                        else (self.remote, self.ri, self.rseg))
        out = np.empty((ids.size, 3), dtype=np.uint64)
        per_id = np.repeat(seg, self.counts)
        out[:, 0] = dl.addresses(ids, per_id)
        out[:, 1] = dl.length[per_id]
        out[:, 2] = dl.device
        return out

    def expand_runs(self, side: str, collapse: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One side's byte runs: (addresses, lengths, run index) int64, one per descriptor,
        except that every joint run flagged in ``collapse`` (contiguous in memory on this side)
        comes as one run of its summed length."""
        dl, ids, seg = self._side(side)
        if collapse.all():
            return (self._tail_head(side)[0], self.counts * dl.length[seg],
                    np.arange(self.starts.size))
        heads = ids[self.starts]
        per = np.where(collapse, 1, self.counts)
        run = np.repeat(np.arange(self.starts.size), per)
        within = np.arange(run.size) - np.repeat(np.cumsum(per) - per, per)
        rseg = seg[run]
        lengths = np.where(collapse, self.counts, 1)[run] * dl.length[rseg]
        return dl.addresses(heads[run] + within, rseg), lengths, run

    def extents(self, side: str) -> tuple[np.ndarray, np.ndarray]:
        """(addresses, lengths) int64 of byte runs covering exactly the bytes one side's
        descriptors name, each inside one segment: a joint run whose ids are contiguous in
        memory on that side is one run, any other is one run per descriptor."""
        dl, seg = (self.local, self.lseg) if side == "local" else (self.remote, self.rseg)
        addrs, lengths, _ = self.expand_runs(side, dl.step_joins[seg] == 1)
        return addrs, lengths
