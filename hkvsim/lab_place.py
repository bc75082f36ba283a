"""Placing one scenario variant's ranks on torchrun's workers (sans-I/O).

Every torchrun worker is a *slot*: its global rank, its node (torchrun's GROUP_RANK), its local
rank and, for a VRAM run, how many CUDA devices its node has and how many workers share one
GPU (``ranks_per_gpu``; 1 in a lab, 2 to put a P rank and a D rank on a one-GPU machine: local
rank *i* then uses GPU *i* // ``ranks_per_gpu``). Engines are packed onto
nodes in order (prefill engines first, then decode, as the deployment lists them); an engine
whose TP fits on one node never straddles two (it moves to the next node instead); ranks of an
engine take consecutive local ranks. A VRAM run uses only slots whose local rank names a GPU
that exists, and a variant that needs more fails with one line saying what it needed and what
the nodes have -- that variant only: the rest of a sweep still runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Slot", "Placed", "PlacementError", "place"]


class PlacementError(ValueError):
    """A variant cannot be placed on the workers torchrun started."""


@dataclass(frozen=True, kw_only=True)
class Slot:
    rank: int  # torchrun global rank
    node: int  # torchrun GROUP_RANK
    local_rank: int
    gpus: int | None  # CUDA devices its node has (None: a DRAM run, no GPU needed)
    ranks_per_gpu: int = 1

    def __post_init__(self) -> None:
        if self.ranks_per_gpu < 1:
            raise PlacementError(f"ranks per GPU must be at least 1, got {self.ranks_per_gpu}")

    @property
    def device(self) -> int:
        """The CUDA device this worker uses on its node."""
        return self.local_rank // self.ranks_per_gpu

    @property
    def usable(self) -> bool:
        return self.gpus is None or self.device < self.gpus


@dataclass(frozen=True, kw_only=True)
class Placed:
    engine: str
    tp_rank: int
    rank: int  # the torchrun global rank that runs it
    node: int
    local_rank: int
    device: int  # its CUDA device on that node (local rank // ranks per GPU)


def place(engines: Sequence[tuple[str, int]], slots: Sequence[Slot]) -> list[Placed]:
    """``engines``: (engine id, TP) in deployment order. Returns one entry per rank, in the
    same order (engine by engine, TP rank by TP rank)."""
    need = sum(tp for _, tp in engines)
    nodes: dict[int, list[Slot]] = {}
    for s in sorted(slots, key=lambda s: (s.node, s.local_rank)):
        if s.usable:
            nodes.setdefault(s.node, []).append(s)
    have = sum(len(v) for v in nodes.values())
    if need > have:
        raise PlacementError(_shortage(need, have, slots))
    free = {n: list(nodes[n]) for n in sorted(nodes)}
    out: list[Placed] = []
    cursor = min(free, default=0)  # the node being filled: earlier nodes are never revisited
    for engine, tp in engines:
        whole = [n for n in free if n >= cursor and len(free[n]) >= tp]
        if whole:  # the first node (from the one being filled) that holds the engine whole
            cursor = whole[0]
            chosen = [free[cursor].pop(0) for _ in range(tp)]
        else:  # larger than any node's free slots: it straddles, in node order
            pool = [s for n in free for s in free[n]]
            chosen = pool[:tp]
            for s in chosen:
                free[s.node].remove(s)
            cursor = chosen[-1].node
        out += [Placed(engine=engine, tp_rank=i, rank=s.rank, node=s.node,
                       local_rank=s.local_rank, device=s.device)
                for i, s in enumerate(chosen)]
    return out


def _shortage(need: int, have: int, slots: Sequence[Slot]) -> str:
    gpu_run = any(s.gpus is not None for s in slots)
    if not gpu_run:
        return (f"the variant needs {need} rank process(es); torchrun started {len(slots)} "
                f"(--nnodes x --nproc-per-node must be at least {need})")
    share = max(s.ranks_per_gpu for s in slots)
    per_node: dict[int, tuple[int, int]] = {}
    for s in slots:
        workers, gpus = per_node.get(s.node, (0, s.gpus or 0))
        per_node[s.node] = (workers + 1, s.gpus or 0)
    nodes = ", ".join(f"node {n}: {w} worker(s), {g} GPU(s)"
                      for n, (w, g) in sorted(per_node.items()))
    if share == 1:
        return (f"the variant needs {need} GPU(s), one per rank; {have} worker(s) have one "
                f"({nodes})")
    return (f"the variant needs {need} rank(s), {share} per GPU; {have} worker(s) have a GPU "
            f"({nodes})")
