"""Max-min fair sharing over path groups, with a served-bytes clock per path (no simpy here).

Flows that cross the same links always receive the same max-min fair rate, so rates are
computed per *path group* (weighted by its number of flows), never per flow. Each group keeps:

* ``rate``: what each of its flows receives now (bytes/s);
* ``served``: a clock of the bytes each of its flows has received since the group last emptied
  (advanced by ``rate * dt`` whenever the fabric moves time forward);
* a heap of its flows' *finish values*: ``served`` at the flow's start plus its size. A flow
  is done when the clock reaches its finish value, so the earliest finish of a group is its heap
  top, and a flow start or end costs O(log n) in its group's heap.

Rates are recomputed over the G active groups and the L links they cross (progressive filling),
O(G * L) per flow start or end, whatever the number n of flows in flight.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from typing import Any

__all__ = ["PathGroup", "max_min_rates"]

# The clock is rebased (every finish value shifted down) once it passes this many bytes, so that
# finish values keep their absolute precision in arbitrarily long runs (ulp at 2**32 is 1e-6 B).
_REBASE_AT = float(2**32)


class PathGroup:
    """The flows in flight on one path (a tuple of links)."""

    __slots__ = ("links", "n", "rate", "served", "heap", "due_limit", "index")

    def __init__(self, links: tuple[Any, ...], index: int = 0) -> None:
        self.links = links
        self.index = index  # its owner's number for it (the fabric: creation order)
        self.n = 0
        self.rate = 0.0
        self.served = 0.0
        self.heap: list[tuple[float, int, int, Any]] = []  # (finish value, fid, nbytes, token)
        self.due_limit = -math.inf

    def push(self, fid: int, nbytes: int, token: Any) -> None:
        """A flow of ``nbytes`` starts now (the clock must have been advanced to now)."""
        if self.served > _REBASE_AT:
            shift = self.served
            self.heap = [(f - shift, i, b, t) for f, i, b, t in self.heap]  # order preserved
            self.served = 0.0
        heapq.heappush(self.heap, (self.served + nbytes, fid, nbytes, token))
        self.n += 1

    def pop_done(self, done_rel: float, out: list[tuple[int, Any]]) -> None:
        """Remove the flows that are due (finish value within ``due_limit``) or have less than
        ``done_rel`` of their bytes left; append ``(fid, token)`` of each to ``out``."""
        heap = self.heap
        while heap:
            finish, fid, nbytes, token = heap[0]
            if finish > self.due_limit and finish - self.served > done_rel * nbytes:
                break
            heapq.heappop(heap)
            self.n -= 1
            out.append((fid, token))

    def reset(self) -> None:
        """The group emptied: restart its clock at zero (keeps finish values precise)."""
        self.rate = 0.0
        self.served = 0.0
        self.due_limit = -math.inf


def max_min_rates(groups: Iterable[PathGroup]) -> None:
    """Set ``rate`` of every group with flows to its max-min fair per-flow rate.

    Progressive filling: repeatedly take the link with the smallest fair share (remaining
    capacity / unfrozen flows on it; ties to the link seen first, links seen in group order),
    freeze every unfrozen group on it at that share and remove ``share * flows`` from every link
    the group crosses. Links only need ``capacity`` and ``groups`` attributes.
    """
    cap: dict[Any, float] = {}
    unfrozen: dict[Any, int] = {}
    for g in groups:
        if not g.n:
            continue
        for link in g.links:
            if link not in cap:
                cap[link] = link.capacity
                unfrozen[link] = 0
            unfrozen[link] += g.n
    frozen: set[int] = set()
    while unfrozen:
        best: Any = None
        best_share = math.inf
        for link, n in unfrozen.items():
            share = cap[link] / n
            if share < best_share:
                best, best_share = link, share
        for g in best.groups:
            if not g.n or id(g) in frozen:
                continue
            frozen.add(id(g))
            g.rate = best_share
            used = best_share * g.n
            for link in g.links:
                cap[link] -= used
                left = unfrozen[link] - g.n
                if left:
                    unfrozen[link] = left
                else:
                    del unfrozen[link]
