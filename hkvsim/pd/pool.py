"""An engine's block pool: the free list, who owns each block, and version stamps.

Pure bookkeeping, shared by every driver: the coordinator allocates and frees; the simulated
fabric's landing guard reads ``owner_view`` (and ``owner_epoch``) to flag bytes that land in a
block their request does not own any more; ``version`` catches prefill blocks freed while a
transfer still reads them.

Block ids come in two flavours (``[prefill]``/``[decode]`` ``block_ids``):

* ``"fresh"``: a new engine's free queue (ids ascending) and requests freed in block order, so
  a short workload gets runs of consecutive ids;
* ``"warmed"``: vLLM's free-block queue after a while: allocation pops from the head, a
  finished request's blocks go to the tail *tail block first* (vLLM frees in reverse so that a
  prefix-cached request's last blocks are evicted first), group by group, and the queue has
  been churned by ``warmup`` synthetic requests of random sizes that finish in random order
  (seeded). Prefix-cache hits that pull a cached block back out of the middle of the queue are
  not modelled. Ids then come in short and descending runs, which NIXL cannot coalesce.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..geometry.layout import EngineLayout

__all__ = ["BLOCK_IDS", "FREE_BLOCK", "BlockAllocator", "EnginePool", "blocks_per_request",
           "default_num_blocks", "engine_pool_blocks", "freed_while_reading"]

FREE_BLOCK = -1  # EnginePool.owner of a block in the free pool
BLOCK_IDS = ("fresh", "warmed")


class BlockAllocator:
    """A deterministic free queue of logical block ids shared by every HMA group of an engine:
    allocation from the head, frees to the tail; ``tail_first`` frees a request's ids in
    reverse (vLLM's order).

    The queue is a numpy ring buffer (4 B per block, allocation and free vectorised): a pool of
    131k blocks per engine costs 0.5 MiB, not the 5 MiB a deque of Python ints does."""

    def __init__(self, num_blocks: int, *, tail_first: bool = False) -> None:
        self.num_blocks = num_blocks
        self.tail_first = tail_first
        self._ring = np.arange(num_blocks, dtype=np.int32 if num_blocks < 2**31 else np.int64)
        self._head = 0
        self._count = num_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= self._count

    def _positions(self, start: int, n: int) -> np.ndarray | slice:
        cap = self._ring.size
        start %= cap if cap else 1
        return slice(start, start + n) if start + n <= cap else (
            (start + np.arange(n)) % cap)

    def allocate(self, n: int) -> np.ndarray:
        if n > self._count:
            raise MemoryError(f"need {n} blocks, {self._count} free of {self.num_blocks}")
        out = self._ring[self._positions(self._head, n)].astype(np.int64)
        self._head = (self._head + n) % max(self._ring.size, 1)
        self._count -= n
        return out

    def free(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        if self.tail_first:
            ids = ids[::-1]
        if self._count + ids.size > self._ring.size:  # more frees than blocks: grow the ring
            order = self.free_order()
            self._ring = np.empty(self._count + ids.size, dtype=np.int64)
            self._ring[:order.size] = order
            self._head = 0
        self._ring[self._positions(self._head + self._count, ids.size)] = ids
        self._count += int(ids.size)

    def free_order(self) -> np.ndarray:
        """The free queue, head first (what the next allocations get)."""
        return self._ring[self._positions(self._head, self._count)].astype(np.int64)

    @property
    def used(self) -> int:
        return self.num_blocks - self._count


class EnginePool:
    """One engine's blocks: allocation per HMA group, owners, version stamps."""

    def __init__(self, layout: EngineLayout, *, block_ids: str = "fresh", warmup: int = 0,
                 seed: int = 0) -> None:
        if block_ids not in BLOCK_IDS:
            raise ValueError(f"block_ids {block_ids!r}; allowed: {', '.join(BLOCK_IDS)}")
        if warmup < 0 or (warmup and block_ids != "warmed"):
            raise ValueError(f"warmup = {warmup}: allowed only >= 1 with block_ids 'warmed'")
        self.layout = layout
        self.block_ids = block_ids
        self.allocator = BlockAllocator(layout.num_logical_blocks,
                                        tail_first=block_ids == "warmed")
        # the request (index) each logical block is allocated to, FREE_BLOCK when in the pool
        # (``owner``; ``owner_view`` reads it without counting as a change)
        self._owner = np.full(layout.num_logical_blocks, FREE_BLOCK, dtype=np.int64)
        self.owner_view = self._owner.view()
        self.owner_view.flags.writeable = False
        # bumped whenever owners may have changed: a reader may keep what it derived from
        # owner_view while the epoch stays the same
        self.owner_epoch = 0
        # bumped on every free: a transfer that reads blocks whose version changed under it
        # read freed (maybe reused) memory
        self.version = np.zeros(layout.num_logical_blocks, dtype=np.int64)
        if warmup:
            self._warm_up(warmup, np.random.default_rng(seed))

    @property
    def owner(self) -> np.ndarray:
        """Who owns each logical block (writable: whoever takes the array may change owners,
        so taking it bumps ``owner_epoch``)."""
        self.owner_epoch += 1
        return self._owner

    def _warm_up(self, requests: int, rng: np.random.Generator) -> None:
        """Churn the free queue with ``requests`` synthetic requests: each takes 1 to half the
        pool's attention blocks (uniform); before each allocation, and whenever the pool is
        short, a random live request finishes. Everything is freed at the end (random order),
        so the workload starts with an empty, shuffled pool."""
        live: list[dict[int, np.ndarray]] = []
        top = max(1, (self.layout.num_logical_blocks - len(self.layout.state_groups))
                  // max(1, len(self.layout.attention_groups)) // 2)
        for _ in range(requests):
            n = int(rng.integers(1, top, endpoint=True))
            if live and rng.random() < 0.5:
                self.free(live.pop(int(rng.integers(len(live)))), stamp=False)
            while not self.can_allocate(n) and live:
                self.free(live.pop(int(rng.integers(len(live)))), stamp=False)
            if self.can_allocate(n):
                live.append(self.allocate(n, FREE_BLOCK))
        for i in rng.permutation(len(live)):
            self.free(live[int(i)], stamp=False)

    def blocks_needed(self, n_attention: int) -> int:
        layout = self.layout
        return n_attention * len(layout.attention_groups) + len(layout.state_groups)

    def can_allocate(self, n_attention: int) -> bool:
        return self.allocator.can_allocate(self.blocks_needed(n_attention))

    def allocate(self, n_attention: int, owner: int) -> dict[int, np.ndarray]:
        """``n_attention`` blocks in every attention group and one slot per state group."""
        blocks: dict[int, np.ndarray] = {}
        for group in self.layout.groups:
            n = n_attention if group.kind == "attention" else 1
            blocks[group.group_id] = self.allocator.allocate(n)
            self._owner[blocks[group.group_id]] = owner
        self.owner_epoch += 1
        return blocks

    def free(self, blocks: dict[int, np.ndarray], *, stamp: bool = True) -> None:
        """Return blocks to the pool. ``stamp`` bumps their versions, so a transfer still moving
        them is caught; only push's own completion (its WRITEs are DONE) skips it."""
        for ids in blocks.values():
            self.allocator.free(ids)
            self._owner[ids] = FREE_BLOCK
            if stamp:
                self.version[ids] += 1
        self.owner_epoch += 1

    def versions(self, blocks: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        return {g: self.version[ids].copy() for g, ids in blocks.items()}

    @property
    def used(self) -> int:
        return self.allocator.used


def blocks_per_request(layout: EngineLayout, tokens: int) -> int:
    """Logical blocks one request of ``tokens`` tokens takes from an engine's pool: its
    attention blocks in every attention group plus one state slot per state group."""
    return (layout.blocks_for_tokens(tokens) * len(layout.attention_groups)
            + len(layout.state_groups))


def default_num_blocks(layout: EngineLayout, prompts: np.ndarray, *, max_inflight: int | None,
                       instances: int) -> int:
    """Enough logical blocks for an engine's share of the concurrently live requests (the
    default when a scenario gives no num_blocks; both backends size pools this way)."""
    live = max_inflight or len(prompts)
    per_request = blocks_per_request(layout, int(prompts.max()))
    share = -(-min(live, len(prompts)) // instances)
    return max(1, share * per_request)


def engine_pool_blocks(scenario: Any, role: str, probe: EngineLayout, prompts: np.ndarray,
                       *, prefill_tokens: int) -> int:
    """The logical block count of one engine of ``role``: ``[role] num_blocks``, or a default
    sized for its share of the live requests. A pool that cannot hold the largest request is
    refused here (a run would wait for blocks forever): the error names the key, the value and
    the minimum the workload needs. ``prefill_tokens`` is the largest request's token count on
    the prefill side (prefill computes N-1 tokens for models with state)."""
    section = getattr(scenario, role)
    tokens = prefill_tokens if role == "prefill" else int(prompts.max())
    minimum = blocks_per_request(probe, tokens)
    if section.num_blocks is None:
        return max(minimum, default_num_blocks(probe, prompts,
                                               max_inflight=scenario.workload.max_inflight,
                                               instances=section.instances))
    if section.num_blocks < minimum:
        from ..scenario import ScenarioError

        raise ScenarioError(
            f"{section.num_blocks} logical block(s) cannot hold the largest request "
            f"({int(prompts.max())}-token prompt: {tokens} tokens on {role} need {minimum} "
            f"blocks of {probe.logical_block_size} tokens across "
            f"{len(probe.attention_groups)} attention and {len(probe.state_groups)} state "
            f"group(s)); allowed: >= {minimum}", source=scenario.where,
            key=f"{role}.num_blocks")
    return section.num_blocks


def freed_while_reading(engine_id: str, block_version: np.ndarray,
                        blocks: dict[int, np.ndarray], versions: dict[int, np.ndarray]
                        ) -> tuple[str, str] | None:
    """The early-free race (docs/semantics.md §9.5 scenario 10): prefill freed (and maybe reused)
    blocks before decode finished reading them. Detected by version stamps, so it is a failure
    even when the stale bytes happen to still be right."""
    for group, ids in blocks.items():
        changed = ids[block_version[ids] != versions[group]]
        if changed.size:
            return ("freed_while_reading",
                    f"prefill {engine_id} freed blocks {changed[:8].tolist()} of group {group} "
                    f"while they were being transferred (lease expired early)")
    return None
