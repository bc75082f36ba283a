"""The block pool's ring-buffer free queue behaves exactly as a FIFO deque of ids (issue #14:
the deque of Python ints grew the run's memory with num_blocks)."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from hkvsim.pd.pool import BlockAllocator


@pytest.mark.parametrize("tail_first", [False, True])
def test_ring_matches_a_fifo_deque(tail_first: bool) -> None:
    rng = np.random.default_rng(7)
    ring, model = BlockAllocator(37, tail_first=tail_first), deque(range(37))
    live: list[np.ndarray] = []
    for _ in range(2_000):
        if live and (rng.random() < 0.5 or not ring.can_allocate(1)):
            ids = live.pop(int(rng.integers(len(live))))
            ring.free(ids)
            model.extend(int(i) for i in (ids[::-1] if tail_first else ids))
        else:
            n = int(rng.integers(1, 12))
            if not ring.can_allocate(n):
                assert n > len(model)
                with pytest.raises(MemoryError, match=f"need {n} blocks"):
                    ring.allocate(n)
                continue
            got = ring.allocate(n)
            assert got.dtype == np.int64
            assert got.tolist() == [model.popleft() for _ in range(n)]
            live.append(got)
        assert ring.free_order().tolist() == list(model)
        assert ring.used == 37 - len(model)


def test_freeing_more_than_the_pool_grows_the_queue() -> None:
    ring = BlockAllocator(2)
    ring.free(np.array([5, 6]))
    assert ring.free_order().tolist() == [0, 1, 5, 6]
    assert ring.allocate(3).tolist() == [0, 1, 5]
