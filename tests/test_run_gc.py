"""The simulated driver runs the cyclic garbage collector less often during a run (its cost per
request otherwise grew with the requests in flight: collection time) and restores the process's
thresholds afterwards, also when the run raises."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from hkvsim.drivers import sim
from hkvsim.scenario import load_scenarios

ROOT = Path(__file__).resolve().parents[1]


def _run_tiny(monkeypatch, probe):
    """A tiny scenario's simulated run, with ``probe()`` recorded as its events start:
    (driver, result, what probe returned)."""
    scenario = load_scenarios(ROOT / "scenarios" / "tp-matrix" / "tp-matrix-tiny.toml")[0]
    seen = []
    real_run = sim.simpy.Environment.run

    def run(env, *a, **kw):
        seen.append(probe())
        return real_run(env, *a, **kw)

    monkeypatch.setattr(sim.simpy.Environment, "run", run)
    driver = sim.SimDriver(scenario)
    result = driver.run()
    assert result.outcome == "ok"
    return driver, result, seen


def test_a_run_collects_less_often_and_restores_the_thresholds(monkeypatch) -> None:
    before = gc.get_threshold()
    _, _, seen = _run_tiny(monkeypatch, gc.get_threshold)
    assert seen == [sim._RUN_GC_THRESHOLDS] and seen[0][0] > before[0]
    assert gc.get_threshold() == before


def test_thresholds_are_restored_when_the_run_raises() -> None:
    before = gc.get_threshold()
    with pytest.raises(RuntimeError), sim.fewer_collections():
        assert gc.get_threshold() == sim._RUN_GC_THRESHOLDS
        raise RuntimeError("boom")
    assert gc.get_threshold() == before


def test_a_run_keeps_its_setup_out_of_collections_and_unfreezes_after(monkeypatch) -> None:
    """Objects alive when the run's events start (its requests, made at start) are frozen
    during the run -- the records among them -- and back in the collector's care after it."""
    monkeypatch.setattr(sim, "FREEZE_FROM_REQUESTS", 1)
    assert gc.get_freeze_count() == 0
    driver, result, seen = _run_tiny(monkeypatch, gc.get_freeze_count)
    assert seen and seen[0] >= len(driver.coord.records) > 0
    assert gc.get_freeze_count() == 0
    rec = result.records[0]
    assert any(o is rec for o in gc.get_objects(2))  # the oldest generation has it back


def test_an_earlier_freeze_is_left_alone() -> None:
    """Something else froze objects: the run neither freezes more nor unfreezes theirs."""
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with sim.setup_frozen():
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


def test_unfrozen_when_the_run_raises() -> None:
    with pytest.raises(RuntimeError), sim.setup_frozen():
        assert gc.get_freeze_count() > 0
        raise RuntimeError("boom")
    assert gc.get_freeze_count() == 0


def test_survivors_of_young_collections_are_frozen_inside_the_block() -> None:
    """Objects that survive a collection of the youngest generation during a run are frozen
    (not re-scanned by later collections); the callback that does it is gone after the run."""
    with sim.setup_frozen():
        before = gc.get_freeze_count()
        kept = [[i] for i in range(1000)]  # tracked objects that survive the collection
        gc.collect(0)
        assert gc.get_freeze_count() >= before + len(kept)
        assert all(not any(o is x for x in gc.get_objects(0)) for o in kept[:3])
    assert sim._freeze_survivors not in gc.callbacks
    assert gc.get_freeze_count() == 0


def test_the_runs_cyclic_garbage_is_collected_when_the_block_ends() -> None:
    """A cycle that became garbage inside the block after surviving a young collection (so it
    was frozen) is collected, its finalizer run, when the block ends -- not at some later
    full collection of an unrelated caller."""
    import weakref

    class Node:
        pass

    gc.collect()
    finalized = []
    with sim.setup_frozen():
        a, b = Node(), Node()
        a.other, b.other = b, a  # a reference cycle: only the cyclic collector frees it
        weakref.finalize(a, finalized.append, "a")
        gc.collect(0)  # it survives a young collection (it is alive): frozen
        assert gc.get_freeze_count() > 0
        del a, b
        assert finalized == []  # frozen garbage waits
    assert finalized == ["a"]


def test_a_small_run_freezes_nothing(monkeypatch) -> None:
    """Below FREEZE_FROM_REQUESTS requests a run leaves the collector as it is (no freeze, no
    full collection at its end: in a large process that collection would dominate it)."""
    driver, _, seen = _run_tiny(monkeypatch, gc.get_freeze_count)
    assert 0 < len(driver.coord.records) < sim.FREEZE_FROM_REQUESTS
    assert seen == [0]


def test_transfer_telemetry_shares_the_routes_path_tuples(monkeypatch) -> None:
    """A request record keeps one telemetry entry per transfer to the run's end; its "path"
    is the transport's tuple for the route (shared, not a list per transfer), so a long run
    retains no per-transfer container the collector must scan."""
    _, result, _ = _run_tiny(monkeypatch, lambda: None)
    entries = [t for rec in result.records for t in rec.telemetry]
    assert len(entries) >= 3
    by_route: dict[tuple[str, ...], tuple[str, ...]] = {}
    for t in entries:
        assert type(t["path"]) is tuple and t["path"]
        assert by_route.setdefault(t["path"], t["path"]) is t["path"]
    assert len(by_route) < len(entries)  # routes repeat across transfers
