"""Event-driven completion (issue #14): the simulated transport tells the worker which handles
finished, and the worker checks only their requests. Outcomes, their order and every time must
be exactly those of checking every request in flight on each completion."""

from __future__ import annotations

from pathlib import Path

import pytest

import golden_outputs as golden
from hkvsim.cluster import run_scenario
from hkvsim.scenario import load_scenarios
from hkvsim.transport.sim import SimTransport

ROOT = Path(__file__).resolve().parents[1]
# transfer failures, poll exceptions, stalls, dead peers, many concurrent requests
FILES = ["faults/fail-setup-and-poll.toml", "faults/stall-transfer.toml",
         "faults/disconnect-peer.toml", "soak/mixed-faults.toml"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", FILES)
def test_event_driven_poll_equals_full_scan(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    scenarios = load_scenarios(ROOT / "scenarios" / name)
    event_driven = [golden.run_output(run_scenario(s)) for s in scenarios]
    monkeypatch.setattr(SimTransport, "take_finished", lambda self: None)  # poll(None): scan all
    scanned = [golden.run_output(run_scenario(s)) for s in scenarios]
    for a, b in zip(event_driven, scanned):
        assert golden.first_difference(b, a) is None


def test_wake_soon_polls_the_rank_once_after_the_current_call() -> None:
    # SimTransport.wake_soon: the agent's activity listeners run at the same simulated time,
    # but only after the caller returns (not re-entrantly), and once per call
    import simpy

    from hkvsim.fabric import Fabric, load_profile, place_engines
    from hkvsim.transport.sim import SimWorld

    env = simpy.Environment()
    profile = load_profile("h200-nvlink")
    world = SimWorld(env, Fabric(env, profile, place_engines(profile, [("p", "prefill", 1)])))
    transport = world.create_agent("p.0", ("p", 0))
    woken: list[float] = []
    world.on_activity("p.0", lambda: woken.append(env.now))
    env.run(until=2.5)
    transport.wake_soon()
    assert woken == []  # not from inside the call
    env.run()
    assert woken == [2.5]
