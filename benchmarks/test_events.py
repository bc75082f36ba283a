"""Cost of one simulated event and of one flow against flows in flight (issue #14).

* The fabric alone: CPU per flow with 16 / 64 / 256 / 1,024 flows on the wire together on two
  NIC paths (4 GB each, so that the wire time dwarfs the posting that serialises per endpoint)
  (O(log n) per flow start or end: flat within +-20 % is the target).
* The simulator: hkvsim's CPU per simpy event in a timing-only run next to a plain simpy loop
  of timeouts in the same process (target: at most 3x).
"""

from __future__ import annotations

import time

import pytest
import simpy

from hkvsim.fabric import Endpoint, Fabric
from hkvsim.fabric.profile import load_profile


def cost_per_flow(in_flight: int, total: int) -> float:
    prof = load_profile("h200-nvlink")
    placement = {i: Endpoint(i, 0) for i in range(4)}
    env = simpy.Environment()
    fab = Fabric(env, prof, placement)

    def chain(k: int):  # type: ignore[no-untyped-def]
        for j in range(total // in_flight):
            yield fab.transfer(initiator=k % 2, src=k % 2, dst=2 + k % 2,
                               nbytes=4_000_000_000 + 37 * ((k * 7919 + j) % 1000),
                               descriptors=1)

    for k in range(in_flight):
        env.process(chain(k))
    t0 = time.process_time()
    env.run()
    return (time.process_time() - t0) / total


def simpy_loop_cost(events: int) -> float:
    env = simpy.Environment()

    def proc(k: int):  # type: ignore[no-untyped-def]
        for _ in range(events // 100):
            yield env.timeout(1.0 + k * 1e-3)

    for k in range(100):
        env.process(proc(k))
    t0 = time.process_time()
    env.run()
    return (time.process_time() - t0) / events


@pytest.mark.timeout(600)
def test_fabric_cost_per_flow_is_flat_in_flows_in_flight(benchmark, figures) -> None:
    total = 20_480
    costs = {k: min(cost_per_flow(k, total) for _ in range(2)) for k in (16, 64, 256, 1024)}
    benchmark.pedantic(cost_per_flow, args=(256, total), rounds=1, iterations=1)
    spread = max(costs.values()) / min(costs.values())
    figures.add("fabric: CPU per flow, 1,024 vs 16 in flight", spread, "x", target="<= 1.2",
                met=spread <= 1.2, note=", ".join(f"{k}: {1e6 * c:.1f} us"
                                                  for k, c in costs.items()))
    if figures.enabled:
        assert spread <= 1.5  # noisy shared machine: the figure row says whether 1.2 was met


@pytest.mark.timeout(600)
def test_event_cost_next_to_a_plain_simpy_loop(benchmark, figures, known_gap) -> None:
    from hkvsim.cluster import SimDriver
    from hkvsim.scenario import parse_scenarios
    from test_simulation import workload

    known_gap("each event still runs connector planning, id checks, the landing guard and the "
              "coordinator in Python/numpy (about 45 us per event against 0.7 us for simpy)")
    (s,) = parse_scenarios(workload(requests=1_000))
    driver = SimDriver(s, timing_only=True)
    count = {"n": 0}
    step = driver.env.step

    def counted() -> None:
        count["n"] += 1
        step()

    driver.env.step = counted  # type: ignore[method-assign]
    t0 = time.process_time()
    result = driver.run()
    hk = (time.process_time() - t0) / count["n"]
    assert result.outcome == "ok"
    plain = benchmark.pedantic(simpy_loop_cost, args=(count["n"],), rounds=1, iterations=1)
    ratio = hk / plain
    figures.add("simulation: CPU per simpy event vs a plain simpy loop", ratio, "x",
                target="<= 3", met=ratio <= 3,
                note=f"hkvsim {1e6 * hk:.1f} us/event ({count['n']:,} events), plain simpy "
                     f"{1e6 * plain:.2f} us/event")
    if figures.enabled:
        assert ratio <= 3
