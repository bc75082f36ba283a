"""The simulated run's cheap paths for what happens per completion (issue #14, round 7): the
coordinator loop carries out nothing after an input that made no effects, the driver's timer
is re-checked only when the coordinator made a timer, and what a long run keeps per transfer
(link-log segments, transfer timings) are plain tuples the garbage collector untracks."""

from __future__ import annotations

import gc

import simpy

from hkvsim.cluster import SimDriver
from hkvsim.drivers.sim import _SimLoop
from hkvsim.fabric import Fabric, load_profile, place_engines
from hkvsim.fabric.links import LinkSegment
from hkvsim.pd.ops import Outcome
from tiny_timing_scenario import tiny_timing_driver


def _driver() -> SimDriver:
    return tiny_timing_driver("completion path", decode_tp=2, requests=3)


class _Coord:
    """The coordinator surface the loop uses: inputs append effects; run_ready makes none."""

    def __init__(self) -> None:
        self.effects: list[str] = []
        self.ran = 0

    def has_effects(self) -> bool:
        return bool(self.effects)

    def run_ready(self) -> None:
        self.ran += 1

    def take_effects(self) -> list[str]:
        out, self.effects = self.effects, []
        return out


def test_the_loop_carries_out_an_inputs_effects_and_skips_an_input_without() -> None:
    coord = _Coord()
    carried: list[list[str]] = []
    after: list[int] = []
    loop = _SimLoop(coord, carried.append, lambda: after.append(1))  # type: ignore[arg-type]
    loop.deliver(lambda: None)  # an input that made no effects: nothing to run or carry out
    assert carried == [] and coord.ran == 0 and after == [1]
    loop.deliver(lambda: coord.effects.extend(["a", "b"]))
    assert carried == [["a", "b"]] and coord.ran == 2 and after == [1, 1]  # before, after


def test_an_earlier_timer_made_after_the_armed_one_is_armed() -> None:
    driver = _driver()
    sched = driver.coord.sched
    sched.at(5.0)
    driver._arm_timer()
    assert driver._timer_at == 5.0
    sched.at(7.0)  # later: the armed one still comes first
    driver._arm_timer()
    assert driver._timer_at == 5.0
    made = driver.coord.timers_made()
    sched.at(2.0)  # earlier, made since the last check: armed now
    assert driver.coord.timers_made() == made + 1
    driver._arm_timer()
    assert driver._timer_at == 2.0


def test_a_run_is_the_same_with_its_timers_and_inputs_checked_lazily() -> None:
    """Every request completes and the run ends at the last request's time."""
    result = _driver().run()
    assert result.outcome == "ok" and result.completed == 3
    assert result.sim_seconds > 0


def test_the_link_log_keeps_untracked_tuples_until_it_is_read() -> None:
    env = simpy.Environment()
    profile = load_profile("h200-nvlink")
    fab = Fabric(env, profile, place_engines(profile, [("p", "prefill", 1), ("d", "decode", 1)]))

    def go():
        yield fab.transfer(initiator=("d", 0), src=("p", 0), dst=("d", 0), nbytes=1 << 20,
                           descriptors=4)
        yield fab.transfer(initiator=("d", 0), src=("p", 0), dst=("d", 0), nbytes=1 << 21,
                           descriptors=4)

    env.process(go())
    env.run()
    raw = list(fab._log)
    assert len(raw) >= 2
    gc.collect()
    assert all(type(t) is tuple and not gc.is_tracked(t) for t in raw)
    log = fab.link_log
    assert all(type(s) is LinkSegment for s in log)
    assert [tuple(s) for s in log] == [tuple(t) for t in raw]  # the same fields, in order
    assert fab.link_log is log and fab.link_segments() == log  # nothing open after the run


def test_a_transfers_timing_is_kept_as_an_untracked_tuple(monkeypatch) -> None:
    driver = _driver()
    seen = []
    real = driver.coord.on_events

    def on_events(events, now):
        seen.extend(e for e in events if isinstance(e, Outcome))
        return real(events, now)

    monkeypatch.setattr(driver.coord, "on_events", on_events)
    result = driver.run()
    assert result.outcome == "ok" and seen
    xfers = [x for ex in driver.ranks.values() for x in ex.worker.transport._xfers.values()]
    assert len(xfers) == 6  # 3 requests x 2 decode ranks
    # a collection untracks a tuple only if its items are untracked when it is reached: the
    # shared path tuple may be reached after the timings (by where earlier tests left the
    # generations), so the second collection is the one that decides; a tracked item (a list,
    # a record) keeps a timing tracked however many collections run
    gc.collect()
    gc.collect()
    for x in xfers:
        assert type(x.timing) is tuple and not gc.is_tracked(x.timing)
    # the telemetry the records keep reads the same fields
    for rec in result.records:
        for t in rec.telemetry:
            assert t["completed"] >= t["submitted"] and t["transfer_seconds"] > 0
            assert type(t["path"]) is tuple
