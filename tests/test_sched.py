"""The coordinator's clock-free scheduler (hkvsim/pd/sched.py): signals, timers and flows, driven
by whoever owns time (simpy on the simulated fabric, asyncio on real NIXL)."""

from __future__ import annotations

import pytest

from hkvsim.pd.sched import Scheduler


def test_any_of_answers_with_the_first_signal_and_cancels_the_other_timers() -> None:
    sched = Scheduler()
    done = sched.signal()
    lease, watchdog = sched.timeout(30.0), sched.timeout(60.0)
    first = sched.any_of([done, lease, watchdog])
    assert sched.next_timer() == 30.0
    done.succeed("finished")
    assert first.triggered and first.value is done
    # a request that finished early leaves no timer behind to fire later
    assert lease.cancelled and watchdog.cancelled and sched.next_timer() is None
    sched.advance(100.0)
    assert not lease.triggered and not watchdog.triggered


def test_any_of_won_by_a_timer_keeps_the_signals_and_cancels_the_later_timer() -> None:
    sched = Scheduler()
    done, lease, watchdog = sched.signal(), sched.timeout(30.0), sched.timeout(60.0)
    first = sched.any_of([done, lease, watchdog])
    sched.advance(30.0)
    assert first.value is lease and lease.triggered and not lease.cancelled
    assert watchdog.cancelled and sched.next_timer() is None
    done.succeed(1)  # arrives later: the answer stays the lease
    assert first.value is lease


def test_all_of_gives_every_value_in_the_order_asked() -> None:
    sched = Scheduler()
    a, b, c = sched.signal(), sched.signal(), sched.signal()
    every = sched.all_of([a, b, c])
    c.succeed(3)
    a.succeed(1)
    assert not every.triggered
    b.succeed(2)
    assert every.triggered and every.value == [1, 2, 3]
    assert sched.all_of([]).value == []


def test_timers_fire_in_deadline_order_and_cancelled_ones_never() -> None:
    sched = Scheduler()
    fired: list[float] = []
    timers = [sched.at(t) for t in (5.0, 1.0, 3.0, 3.0, 2.0)]
    for timer in timers:
        timer.on(lambda s: fired.append(s.deadline))
    timers[4].cancel()
    assert sched.timers_made == 5
    assert sched.next_timer() == 1.0
    sched.advance(3.0)
    assert fired == [1.0, 3.0, 3.0] and sched.now == 3.0
    assert sched.next_timer() == 5.0
    with pytest.raises(ValueError, match="time went backwards: 2.0 < 3.0"):
        sched.advance(2.0)
    sched.advance(5.0)
    assert fired == [1.0, 3.0, 3.0, 5.0] and sched.next_timer() is None
    assert sched.timeout(-1.0).deadline == 5.0  # never in the past


def test_flows_resume_with_values_urgent_ones_first() -> None:
    sched = Scheduler()
    order: list[str] = []
    plain, urgent = sched.signal(), sched.signal(urgent=True)

    def flow(name, sig):
        value = yield sig
        order.append(f"{name}={value}")
        return name.upper()

    a = sched.spawn(flow("plain", plain), "plain")
    b = sched.spawn(flow("urgent", urgent), "urgent")
    assert sched.tasks == 2
    sched.run()
    assert sched.idle() and order == []
    plain.succeed(1)
    urgent.succeed(2)  # triggered second, resumed first
    sched.run()
    assert order == ["urgent=2", "plain=1"]
    assert (a.value, b.value, sched.tasks) == ("PLAIN", "URGENT", 0)


def test_run_stops_when_the_driver_must_act_first() -> None:
    sched = Scheduler()
    steps: list[str] = []

    def flow(name):
        steps.append(name)
        yield sched.timeout(1.0)
        steps.append(name + " again")

    sched.spawn(flow("a"))
    sched.spawn(flow("b"))
    sched.run(until_blocked=lambda: len(steps) >= 1)  # a call is waiting after a's first step
    assert steps == ["a"] and not sched.idle()
    sched.run()
    assert steps == ["a", "b"] and sched.idle()
    sched.advance(1.0)
    sched.run()
    assert steps == ["a", "b", "a again", "b again"] and sched.tasks == 0


def test_a_flow_yielding_something_else_fails_loudly() -> None:
    sched = Scheduler()

    def broken():
        yield 5

    sched.spawn(broken(), "broken")
    with pytest.raises(TypeError, match="flow 'broken' yielded 5, not a Signal"):
        sched.run()
