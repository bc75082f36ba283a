"""The simulator's landing guard (drivers/sim.py ``_on_landing``) answers alike on its first
call for a transfer and on later calls answered from the transfer's memo: blocks the request
holds pass; bytes outside every block and blocks in the free pool are flagged, every time."""

from __future__ import annotations

import numpy as np

from hkvsim.cluster import SimDriver
from tiny_timing_scenario import tiny_timing_driver


def _driver() -> tuple[SimDriver, str, int, object]:
    driver = tiny_timing_driver("landing guard", num_blocks=16)
    agent = next(a for a, rank in driver._agent_rank.items() if rank[0].startswith("decode"))
    rank = driver._agent_rank[agent]
    engine = driver.coord.engine(rank[0])
    return driver, agent, driver._base[rank], engine


def test_held_blocks_pass_and_free_ones_are_flagged_on_every_call() -> None:
    driver, agent, base, engine = _driver()
    page = engine.layout.unified_page_bytes
    engine.pool.owner[[2, 3]] = 7
    addrs = np.array([base + 2 * page, base + 3 * page], dtype=np.int64)
    lengths = np.array([page, page], dtype=np.int64)
    memo: dict = {}
    for _ in range(2):  # the first call fills the memo, the second reads it
        assert driver._on_landing(agent, addrs, lengths, 7, False, memo=memo) is False
    assert memo["outside"] is False
    assert driver.coord.counters["stray_writes"] == 0
    engine.pool.owner[3] = -1  # freed under the transfer
    for n in (1, 2):
        assert driver._on_landing(agent, addrs, lengths, 7, True, memo=memo) is True
        assert driver.coord.counters["late_landings"] == n
    assert "the free pool" in driver.coord.misplaced_write_reports[-1]


def test_a_report_counts_the_blocks_hit_and_names_their_holders() -> None:
    # block 0 counts like any other; bytes outside every block are not a block, and the
    # request's own block is not counted
    driver, agent, base, engine = _driver()
    layout = engine.layout
    page = layout.unified_page_bytes
    engine.pool.owner[[0, 1]] = -1
    engine.pool.owner[2] = 7
    past = base + layout.num_tensors * layout.tensor_stride
    addrs = np.array([base, base + page, base + 2 * page, past], dtype=np.int64)
    lengths = np.array([page, page, page, 64], dtype=np.int64)
    assert driver._on_landing(agent, addrs, lengths, 7, False) is True
    report = driver.coord.misplaced_write_reports[-1]
    assert report.startswith(f"a transfer for request 7 was posted into 2 block(s) of {agent} ")
    assert report.endswith("(held by the free pool, bytes outside every block)")


def test_bytes_outside_every_block_are_flagged_on_every_call() -> None:
    driver, agent, base, engine = _driver()
    layout = engine.layout
    page = layout.unified_page_bytes
    engine.pool.owner[:] = 7  # every block is the request's: only the outside bytes are wrong
    past = base + layout.num_tensors * layout.tensor_stride  # past the allocation
    addrs = np.array([base + page, past], dtype=np.int64)
    lengths = np.array([page, 64], dtype=np.int64)
    memo: dict = {}
    for n in (1, 2):
        assert driver._on_landing(agent, addrs, lengths, 7, False, memo=memo) is True
        assert driver.coord.counters["stray_writes"] == n
        assert "bytes outside every block" in driver.coord.misplaced_write_reports[-1]
    assert memo["outside"] is True


def test_runs_of_the_same_shape_elsewhere_are_not_answered_from_the_last_ones() -> None:
    """The guard reuses an engine's last answer only for equal runs (a request's transfers to
    the ranks of one engine): runs of the same shape at other offsets are looked up anew."""
    driver, agent, base, engine = _driver()
    page = engine.layout.unified_page_bytes
    engine.pool.owner[[2, 3]] = 7
    lengths = np.array([page, page], dtype=np.int64)
    held = np.array([base + 2 * page, base + 3 * page], dtype=np.int64)
    free = np.array([base + 4 * page, base + 5 * page], dtype=np.int64)
    assert driver._on_landing(agent, held, lengths, 7, False, memo={}) is False
    assert driver._on_landing(agent, held.copy(), lengths.copy(), 7, False, memo={}) is False
    assert driver._on_landing(agent, free, lengths, 7, False, memo={}) is True
    assert driver._on_landing(agent, held, lengths * 2, 7, False, memo={}) is True  # into 4, 5
    assert driver._on_landing(agent, held, lengths, 7, False, memo={}) is False


def test_runs_named_by_the_transport_are_shared_only_at_the_same_offsets() -> None:
    """Transfers the transport names with the same runs token (the same runs up to a shift)
    share the guard's block lookup only where the runs start at the same offset in the rank's
    allocation; a token seen at another offset is looked up anew (other blocks). Named runs
    may come without addresses: the memo's "extents" gives them when the lookup needs them."""
    driver, agent, base, engine = _driver()
    page = engine.layout.unified_page_bytes
    engine.pool.owner[[2, 3]] = 7
    token = object()
    lengths = np.array([page, page], dtype=np.int64)
    rel = np.array([0, page], dtype=np.int64)

    def unused() -> None:
        raise AssertionError("addresses asked for runs whose blocks are known")

    memo = {"runs": (token, "local", base + 2 * page)}
    assert driver._on_landing(agent, base + 2 * page + rel, lengths, 7, False,
                              memo=memo) is False
    memo = {"runs": (token, "local", base + 2 * page), "extents": unused}
    assert driver._on_landing(agent, None, None, 7, False, memo=memo) is False
    assert memo["blocks"].tolist() == [2, 3]
    # the same token, two blocks later: looked up, from the addresses "extents" gives
    memo = {"runs": (token, "local", base + 4 * page),
            "extents": lambda: (base + 4 * page + rel, lengths)}
    assert driver._on_landing(agent, None, None, 7, False, memo=memo) is True
    assert memo["blocks"].tolist() == [4, 5]
    assert driver.coord.counters["stray_writes"] == 1


def test_shared_blocks_are_checked_again_after_the_pool_changes_owners() -> None:
    """A request's ranks land on the same blocks: the guard checks their owners once per
    change of the pool's owners (``owner_epoch``), so a free or an allocation between two
    checks -- through the pool's own calls, not only writes through ``owner`` -- is seen."""
    driver, agent, base, engine = _driver()
    pool = engine.pool
    page = engine.layout.unified_page_bytes
    token = object()
    lengths = np.array([page, page], dtype=np.int64)
    addrs = base + np.array([2 * page, 3 * page], dtype=np.int64)
    pool.owner[[2, 3]] = 7

    def check(landed: bool) -> bool:  # another rank's transfer over the same runs
        return driver._on_landing(agent, addrs, lengths, 7, landed,
                                  memo={"runs": (token, "local", int(addrs[0]))})

    assert check(False) is False and check(False) is False
    epoch = pool.owner_epoch
    assert check(False) is False and pool.owner_epoch == epoch  # reads do not count as changes
    pool.free({0: np.array([3], dtype=np.int64)})  # the coordinator's path
    assert pool.owner_epoch > epoch
    assert check(True) is True
    assert driver.coord.counters["late_landings"] == 1
    pool.owner[3] = 7
    assert check(True) is False
    other = pool.allocate(1, 0)  # request 0 takes free blocks: blocks 2, 3 stay 7's
    assert check(True) is False
    pool._owner[3] = -1  # bypassing the pool is not observable; only its own calls are
    pool.free(other)
    assert check(True) is True


def test_owner_view_cannot_be_written() -> None:
    _, _, _, engine = _driver()
    import pytest

    with pytest.raises(ValueError):
        engine.pool.owner_view[0] = 3
