"""Merged plans from templates: ``descriptor_merge`` without merging every request again.

A transfer's ids are outer sums (transport/outer.py): per part, row starts (one per region
or state sub-region) plus the request's columns (block ids, slots). Descriptor ``(p, r, j)``
sits at ``at0[r] + col[j] * stride[r]`` on each side, ``length[r]`` bytes long. What merging
(connector/merge.py) decides -- which neighbours join, which rows form strided runs, their
strides and counts -- depends on the columns only through their *pattern* (each column minus
the part's first column), provided that

* every row lies in one registered region per side (its whole segment does), and
* at every boundary between consecutive rows, the rows lie in different regions on one side
  (merging never joins them, whatever the columns), or they belong to the same part and have
  the same stride on each side (their distance then depends on the pattern only).

Under these conditions (checked once per list pair), transfers whose columns have the same
pattern merge into the same rows, each row's addresses shifted by ``first column x its
stride`` (per side). A *template* keeps the rows of the first such transfer -- merged by
connector/merge.py, exactly as without templates -- relative to those shifts, and later
transfers with the pattern get their rows by adding the shifts back (a few numpy calls,
whatever the number of descriptors). The ids are checked from the pattern as well: every
column inside the bounds that keep each row inside its segment (the same range check as the
prepared path's; any other case falls back to the caller's full check, with its messages).
Templates are kept per list pair and pattern, for transfers of up to ``MAX_IDS`` ids, made
the second time a pattern is seen (a transfer whose pattern is new is merged by the caller,
as without templates), and bounded in size (``_MAX_BYTES`` per rank, their keys included).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..transport.affine import AffineList
from ..transport.base import _expand_strided
from ..transport.outer import OuterIds, pair_geometry
from ..transport.planned import PlannedRows
from .merge import merge_with_heads, region_index

__all__ = ["PlanTemplates", "MAX_IDS"]

MAX_IDS = 16384  # transfers with more ids are merged as they come (templates grow with them)
_MAX_BYTES = 8 << 20  # what all templates of a rank hold, keys included; cleared beyond
_MAX_SEEN = 4096  # patterns remembered as seen (by hash: a collision only makes a template early)

# the pattern of the last columns seen (frozen columns: a request's ranks share them): the
# parts of both OuterIds (their columns compared by identity) and the pattern
_LAST_PATTERN: "tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]] | None" = None


class _PairInfo:
    """Per list pair and row starts: whether templates apply, and the per-row facts merging
    needs (regions, strides, the part of every row)."""

    __slots__ = ("pair", "ok", "regions", "strides", "row_part", "row_offset", "templates")

    def __init__(self, pair: Any, local: AffineList, remote: AffineList,
                 local_bases: Any, remote_bases: Any) -> None:
        self.pair = pair  # kept alive: the info is keyed by its id
        self.templates: dict[Any, _Template] = {}
        rows = (pair.local, pair.remote)
        self.row_part = pair.row_part
        sizes = [a.starts.size for a in pair.local]
        self.row_offset = np.concatenate(([0], np.cumsum(sizes)))[:-1].tolist()
        self.strides = (pair.l_stride, pair.r_stride)
        ok = pair.equal and all(a.plain for side in rows for a in side)
        regions = []
        for dl, side, bases in ((local, rows[0], local_bases), (remote, rows[1], remote_bases)):
            seg = np.concatenate([a.seg for a in side])
            first = dl.base[seg]
            last = first + np.maximum(dl.counts[seg] - 1, 0) * dl.stride[seg]
            reg = region_index(bases, first)
            ok = ok and bool(np.array_equal(reg, region_index(bases, last)))
            regions.append(reg)
        self.regions = (regions[0], regions[1])
        if ok and self.row_part.size > 1:
            apart = ((regions[0][1:] != regions[0][:-1]) | (regions[1][1:] != regions[1][:-1]))
            alike = ((self.row_part[1:] == self.row_part[:-1])
                     & (pair.l_stride[1:] == pair.l_stride[:-1])
                     & (pair.r_stride[1:] == pair.r_stride[:-1]))
            ok = bool((apart | alike).all())
        self.ok = ok


class _Template:
    """The merged rows of one pattern, relative to the per-row shifts (see the module
    docstring): ``rows`` (2, M, k) uint64 (both sides; column 0 is rewritten per transfer)
    and, for strided rows, their runs ``runs`` (2, N, 3); ``rel`` (2, M [+ N]) int64: the
    addresses of the rows [and runs] minus their shifts, ``coef`` their strides, ``which``
    the index of their part's first column in the per-transfer list of first columns;
    ``hulls``: per side, per (which, coef) group, the lowest relative address and highest
    relative end; ``spans``: per part and side the pattern's lowest and highest column."""

    __slots__ = ("rows", "runs", "m", "rel", "coef", "which", "hulls", "spans", "devices",
                 "coalescing", "info", "groups", "gidx", "hull_terms", "varying", "buf",
                 "rows_size", "addr_pos", "rel_flat", "gidx_flat", "nbytes")

    def __init__(self, info: _PairInfo, rows: np.ndarray, runs: np.ndarray | None,
                 rel: np.ndarray, coef: np.ndarray, which: np.ndarray,
                 hulls: list[list[tuple[int, int, int, int]]],
                 spans: list[tuple[int, int, int, int]], devices: tuple[int, int],
                 coalescing: tuple[int, list[tuple[tuple[int, ...], ...]]]) -> None:
        self.info = info
        self.rows, self.runs, self.m = rows, runs, rows.shape[1]
        self.rel, self.coef, self.which = rel, coef, which
        self.hulls, self.spans, self.devices = hulls, spans, devices
        self.coalescing = coalescing  # (runs - fixed joins, the other boundaries)
        # the same facts per shift group (distinct (which, coef), both sides): every address
        # is rel + firsts[which] x coef = rel + shift of its group (one shift per group and
        # transfer, in Python ints)
        pairs = sorted(set(zip(which.ravel().tolist(), coef.ravel().tolist())))
        number = {g: i for i, g in enumerate(pairs)}
        self.groups = pairs
        self.gidx = np.array([number[g] for g in zip(which.ravel().tolist(),
                                                      coef.ravel().tolist())],
                             dtype=np.intp).reshape(which.shape)
        self.hull_terms = [(dev, [(number[w, c], lo, hi) for w, c, lo, hi in groups])
                           for dev, groups in zip(devices, hulls)]
        self.varying = [tuple((number[w0, c0], e0, number[w1, c1], a1)
                              for w0, c0, e0, w1, c1, a1 in sides) for sides in coalescing[1]]
        # per transfer, one buffer: ``rows`` then ``runs`` (both sides each, C order), with
        # the address of row / run j of side s (``rel[s, j]`` + shift) at ``addr_pos``, in
        # the order of ``rel.ravel()``
        m, k = rows.shape[1], rows.shape[2]
        self.rows_size = rows.size
        self.buf = (rows.ravel() if runs is None
                    else np.concatenate((rows.ravel(), runs.ravel())))
        pos = [np.arange(m, dtype=np.intp) * k + s * m * k for s in (0, 1)]
        if runs is not None:
            n = runs.shape[1]
            pos = [np.concatenate((pos[s], rows.size + s * n * 3
                                   + np.arange(n, dtype=np.intp) * 3)) for s in (0, 1)]
        self.addr_pos = np.concatenate(pos)
        self.rel_flat = np.ascontiguousarray(rel).ravel()
        self.gidx_flat = np.ascontiguousarray(self.gidx).ravel()
        flat = rows if runs is None else runs
        self.nbytes = int(flat[0, :, 1].astype(np.int64).sum())  # the local side's bytes


def _pattern(lo: OuterIds, ro: OuterIds) -> "tuple[Any, ...] | None":
    """(pattern key, first columns [local parts..., remote parts...]) of two OuterIds with
    parts of equal column counts, else None."""
    global _LAST_PATTERN
    lp, rp = lo.parts, ro.parts
    n = len(lp)
    if len(rp) != n:
        return None
    last = _LAST_PATTERN
    if last is not None and len(last[0]) == n and len(last[1]) == n:
        seen_l, seen_r = last[0], last[1]
        for i in range(n):
            if seen_l[i][1] is not lp[i][1] or seen_r[i][1] is not rp[i][1]:
                break
        else:
            return last[2]
    lr, rr = lo.ranges, ro.ranges
    key: list[Any] = [None] * (2 * n)
    firsts: list[int] = [0] * (2 * n)
    for i in range(n):
        a, b = lp[i][1], rp[i][1]
        k = a.size
        if k != b.size:
            return None
        if k <= 16:  # a few columns: Python ints (fewer numpy calls)
            v, w = a.tolist(), b.tolist()
            a0, b0 = v[0], w[0]
            key[i] = tuple(map((-a0).__add__, v))  # (x - a0 for x in v, without a frame)
            key[n + i] = tuple(map((-b0).__add__, w))
        else:  # columns known to be consecutive (OuterIds.ranges) need not be read
            a0, b0 = a.item(0), b.item(0)
            key[i] = ("range", k) if lr is not None and lr[i] else (a - a0).tobytes()
            key[n + i] = ("range", k) if rr is not None and rr[i] else (b - b0).tobytes()
        firsts[i], firsts[n + i] = a0, b0
    got = (tuple(key), firsts)
    if lo.frozen and ro.frozen:  # never modified: remembered by identity (their parts)
        _LAST_PATTERN = (lp, rp, got)
    return got


class PlanTemplates:
    """One rank's templates (see the module docstring)."""

    def __init__(self, *, sightings: int = 2) -> None:
        self.sightings = sightings  # a pattern's template is made when it is seen this often
        self._geometry: dict[Any, Any] = {}  # transport.outer.pair_geometry's cache
        self._infos: dict[int, _PairInfo] = {}
        self._seen: dict[tuple[int, int], int] = {}  # sightings of patterns without a template
        self._stored = 0  # bytes the templates hold

    def plan(self, local: AffineList, lo: OuterIds, remote: AffineList, ro: OuterIds,
             mode: str, local_bases: Any, remote_bases: Any
             ) -> "tuple[PlannedRows, PlannedRows] | None":
        """The merged rows of a transfer (both sides, as PlannedRows), or None when a
        template does not apply (the caller checks and merges the ids itself): ids that are
        not outer sums over these lists, a geometry the conditions exclude, more than
        ``MAX_IDS`` ids, or an id outside its row's segment (the caller's check reports it)."""
        if lo.size > MAX_IDS:
            return None
        pair = pair_geometry(local, lo, remote, ro, self._geometry)
        if pair is None:
            return None
        info = self._infos.get(id(pair))
        if info is None or info.pair is not pair:
            if len(self._infos) >= 4096:
                self._infos.clear()
            info = self._infos[id(pair)] = _PairInfo(pair, local, remote, local_bases,
                                                      remote_bases)
        if not info.ok:
            return None
        pattern = _pattern(lo, ro)
        if pattern is None:
            return None
        key, firsts = pattern
        tkey = (mode, key)
        t = info.templates.get(tkey)
        if t is None:
            # a template is made the second time a pattern is seen (making one costs more
            # than merging as the caller does; a pattern seen once may never come back)
            seen = (id(pair), hash(tkey))
            if self._seen.get(seen, 0) + 1 < self.sightings:
                if len(self._seen) >= _MAX_SEEN:
                    self._seen.clear()
                self._seen[seen] = self._seen.get(seen, 0) + 1
                return None
            if not _inside(pair, lo, ro):
                return None
            t = _build(info, lo, ro, mode, firsts, local.device, remote.device)
            size = (t.rows.nbytes + (0 if t.runs is None else t.runs.nbytes) + 3 * t.rel.nbytes
                    + t.buf.nbytes + t.addr_pos.nbytes
                    + sum(len(k) if isinstance(k, bytes) else 8 * len(k) for k in key))
            if self._stored + size > _MAX_BYTES:  # bounded memory: start again
                for other in self._infos.values():
                    other.templates.clear()
                self._stored = 0
            info.templates[tkey] = t
            self._stored += size
        else:
            n = len(pair.local)
            for p, (a, b) in enumerate(zip(pair.local, pair.remote)):
                lmin, lmax, rmin, rmax = t.spans[p]
                l0, r0 = firsts[p], firsts[n + p]
                if not (a.col_lo <= l0 + lmin and l0 + lmax <= a.col_hi
                        and b.col_lo <= r0 + rmin and r0 + rmax <= b.col_hi):
                    return None
        shifts = [firsts[w] * c for w, c in t.groups]
        hulls = []
        for dev, terms in t.hull_terms:
            g, low, high = terms[0]
            low, high = low + shifts[g], high + shifts[g]
            for g, lo_, hi_ in terms[1:]:
                if lo_ + shifts[g] < low:
                    low = lo_ + shifts[g]
                if hi_ + shifts[g] > high:
                    high = hi_ + shifts[g]
            hulls.append((dev, low, high))
        coalesced = t.coalescing[0]
        for (g0, e0, g1, a1), (h0, f0, h1, b1) in t.varying:  # joins that depend on shifts
            if a1 + shifts[g1] == e0 + shifts[g0]:
                coalesced -= b1 + shifts[h1] == f0 + shifts[h0]
        # the rows [and runs] of both sides, in one buffer: the template's, with every
        # address rewritten (rel + its group's shift)
        buf = t.buf.copy()
        buf[t.addr_pos] = (t.rel_flat + np.array(shifts, dtype=np.int64)[t.gidx_flat]
                           ).view(np.uint64)  # (the same bits as a cast, without one)
        rows = buf[:t.rows_size].reshape(t.rows.shape)
        if t.runs is None:
            return (PlannedRows(rows[0], rows[0], t, hulls[0], coalesced, t.nbytes),
                    PlannedRows(rows[1], rows[1], t, hulls[1]))
        runs = buf[t.rows_size:].reshape(t.runs.shape)
        return (PlannedRows(rows[0], runs[0], t, hulls[0], coalesced, t.nbytes),
                PlannedRows(rows[1], runs[1], t, hulls[1]))


def _inside(pair: Any, lo: OuterIds, ro: OuterIds) -> bool:
    """Every column inside the bounds that keep its rows inside their segments."""
    for (_, lc), (_, rc), a, b in zip(lo.parts, ro.parts, pair.local, pair.remote):
        if not (a.col_lo <= int(lc.min()) and int(lc.max()) <= a.col_hi
                and b.col_lo <= int(rc.min()) and int(rc.max()) <= b.col_hi):
            return False
    return True


def _build(info: _PairInfo, lo: OuterIds, ro: OuterIds, mode: str, firsts: list[int],
           local_device: int, remote_device: int) -> _Template:
    """Merge this transfer's descriptors (connector/merge.py, every descriptor's row given)
    and keep the result relative to its per-row shifts."""
    pair = info.pair
    n = len(pair.local)
    sides = []
    row_of = []
    for side, (rows, ids, device) in enumerate(((pair.local, lo, local_device),
                                                (pair.remote, ro, remote_device))):
        addrs, lens = [], []
        for p, (r, (_, cols)) in enumerate(zip(rows, ids.parts)):
            addrs.append((r.at0[:, None] + cols[None, :] * r.stride[:, None]).reshape(-1))
            lens.append(np.repeat(r.length, cols.size))
            if side == 0:
                row_of.append(np.repeat(np.arange(r.starts.size) + info.row_offset[p],
                                        cols.size))
        descs = np.empty((sum(a.size for a in addrs), 3), dtype=np.uint64)
        descs[:, 0] = np.concatenate(addrs)
        descs[:, 1] = np.concatenate(lens)
        descs[:, 2] = device
        sides.append(descs)
    row = np.concatenate(row_of)
    regions = (info.regions[0][row], info.regions[1][row])
    plan, heads = merge_with_heads(sides[0], sides[1], mode, regions)
    head_row = row[heads]
    rows = np.stack((plan.local, plan.remote))
    runs = None
    if plan.strided:  # the runs of every row, each with its row's shift
        runs = np.stack(_expand_strided((plan.local, plan.remote)))
        head_row = np.concatenate((head_row, np.repeat(head_row,
                                                       plan.local[:, 4].astype(np.int64))))
        addrs = np.concatenate((rows[:, :, 0], runs[:, :, 0]), axis=1).astype(np.int64)
        ends = runs[:, :, 0] + runs[:, :, 1]
        m_ends = rows.shape[1]  # hulls over the runs only
    else:
        addrs = rows[:, :, 0].astype(np.int64)
        ends = rows[:, :, 0] + rows[:, :, 1]
        m_ends = 0
    part = info.row_part[head_row]
    which = np.stack((part, part + n))
    coef = np.stack((info.strides[0][head_row], info.strides[1][head_row]))
    rel = addrs - np.asarray(firsts, dtype=np.int64)[which] * coef
    hulls = []
    for side in (0, 1):
        w, c, r = which[side, m_ends:], coef[side, m_ends:], rel[side, m_ends:]
        e = ends[side].astype(np.int64) - (addrs[side, m_ends:] - r)
        groups = []
        for key in sorted(set(zip(w.tolist(), c.tolist()))):
            sel = (w == key[0]) & (c == key[1])
            groups.append((key[0], key[1], int(r[sel].min()), int(e[sel].max())))
        hulls.append(groups)
    # NIXL's coalescing of the runs: a join between two runs shifted alike on both sides is
    # the same for every transfer of the template; the others are settled per transfer
    flat = rows if runs is None else runs
    w, c, r = which[:, m_ends:], coef[:, m_ends:], rel[:, m_ends:]
    lens = flat[0, :, 1].astype(np.int64)
    joins = (flat[:, 1:, 0] == flat[:, :-1, 0] + flat[:, :-1, 1]).all(axis=0)
    alike = ((w[:, 1:] == w[:, :-1]) & (c[:, 1:] == c[:, :-1])).all(axis=0)
    fixed = int(flat.shape[1]) - int(np.count_nonzero(joins & alike))
    varying = [tuple((int(w[s_, b]), int(c[s_, b]), int(r[s_, b] + lens[b]), int(w[s_, b + 1]),
                      int(c[s_, b + 1]), int(r[s_, b + 1])) for s_ in (0, 1))
               for b in np.flatnonzero(~alike).tolist()]
    spans = []
    for (_, lc), (_, rc), l0, r0 in zip(lo.parts, ro.parts, firsts[:n], firsts[n:]):
        spans.append((int(lc.min()) - l0, int(lc.max()) - l0, int(rc.min()) - r0,
                      int(rc.max()) - r0))
    return _Template(info, rows, runs, rel, coef, which, hulls, spans,
                     (local_device, remote_device), (fixed, varying))
