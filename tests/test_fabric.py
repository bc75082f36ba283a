"""Tests for hkvsim.fabric: profiles, placement, and fair link sharing in virtual time."""

from __future__ import annotations

import math
import time
from collections.abc import Hashable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from hkvsim.fabric import (
    PROFILE_DIR,
    TOML_KEYS,
    Endpoint,
    Fabric,
    FabricError,
    FabricProfile,
    PlacementError,
    ProfileError,
    TransferTiming,
    load_profile,
    place_engines,
    profile_names,
)

REL = 1e-12

# Round numbers so hand-computed expectations are easy to read.
BW = 100e9  # intra-node
NIC = 25e9  # inter-node
HBM = 1000e9  # local
LAUNCH = 10e-6
ALPHA = 1e-6
INTRA_LAT = 2e-6
INTER_LAT = 5e-6
NOTIF = 7e-6
HANDSHAKE = 1e-3


def make_profile(**changes: Any) -> FabricProfile:
    base = FabricProfile(
        name="test",
        description="round numbers for tests",
        gpus_per_node=4,
        intra_node_bandwidth=BW,
        intra_node_latency=INTRA_LAT,
        inter_node_bandwidth=NIC,
        inter_node_latency=INTER_LAT,
        local_bandwidth=HBM,
        transfer_launch=LAUNCH,
        per_descriptor=ALPHA,
        notification_latency=NOTIF,
        handshake_latency=HANDSHAKE,
        placement="pack",
        memory="VRAM",
        transport="cuda_ipc",
    )
    return replace(base, **changes)


def grid(nodes: int = 2, gpus: int = 4) -> dict[Hashable, Endpoint]:
    """Placement key (node, gpu) -> Endpoint(node, gpu)."""
    return {(n, g): Endpoint(n, g) for n in range(nodes) for g in range(gpus)}


def new_fabric(
    profile: FabricProfile | None = None,
    placement: dict[Hashable, Endpoint] | None = None,
    env: simpy.Environment | None = None,
) -> tuple[simpy.Environment, Fabric]:
    env = env or simpy.Environment()
    prof = profile or make_profile()
    return env, Fabric(env, prof, placement or grid(gpus=prof.gpus_per_node))


def run_all(
    env: simpy.Environment, fabric: Fabric, specs: Sequence[dict[str, Any]]
) -> list[TransferTiming]:
    """Submit every transfer at its ``at`` time (default 0) and run to completion."""
    events: list[simpy.Event | None] = [None] * len(specs)

    def submit(i: int, spec: dict[str, Any]):  # type: ignore[no-untyped-def]
        spec = dict(spec)
        at = spec.pop("at", 0.0)
        if at:
            yield env.timeout(at)
        events[i] = fabric.transfer(**spec)
        yield events[i]

    procs = [env.process(submit(i, s)) for i, s in enumerate(specs)]
    env.run(simpy.AllOf(env, procs))
    out = []
    for ev in events:
        assert ev is not None and ev.ok
        out.append(ev.value)
    return out


def approx(x: float, rel: float = REL) -> Any:
    return pytest.approx(x, rel=rel, abs=0)


def post(d: int) -> float:
    return LAUNCH + d * ALPHA


# ---------------------------------------------------------------- single flows, paths


def test_single_intra_node_flow_is_launch_plus_alpha_plus_bytes_plus_latency() -> None:
    env, fab = new_fabric()
    n, d = 123_456_789, 1_134
    (t,) = run_all(env, fab, [dict(initiator=(0, 1), src=(0, 0), dst=(0, 1), nbytes=n, descriptors=d)])
    assert t.done == approx(LAUNCH + d * ALPHA + n / BW + INTRA_LAT)
    assert t.submitted == 0.0 and t.post_start == 0.0
    assert t.post_end == approx(LAUNCH + d * ALPHA)
    assert t.wire_start == t.post_end
    assert t.wire_time == approx(n / BW)
    assert t.done - t.wire_end == approx(INTRA_LAT)
    assert t.path == ("n0g0.nvl.tx", "n0g1.nvl.rx")
    assert (t.nbytes, t.descriptors) == (n, d)


def test_inter_node_flow_uses_nic_bandwidth_and_latency() -> None:
    env, fab = new_fabric()
    n, d = 50_000_000, 980
    (t,) = run_all(env, fab, [dict(initiator=(1, 2), src=(0, 3), dst=(1, 2), nbytes=n, descriptors=d)])
    assert t.path == ("n0g3.nic.tx", "n1g2.nic.rx")
    assert t.done == approx(LAUNCH + d * ALPHA + n / NIC + INTER_LAT)
    assert fab.path_latency((0, 3), (1, 2)) == INTER_LAT
    assert fab.path_latency((0, 3), (0, 2)) == INTRA_LAT


def test_same_gpu_copy_uses_local_bandwidth_and_no_latency() -> None:
    env, fab = new_fabric()
    n = 10_000_000
    (t,) = run_all(env, fab, [dict(initiator=(0, 0), src=(0, 0), dst=(0, 0), nbytes=n, descriptors=3)])
    assert t.path == ("n0g0.hbm",)
    assert t.done == approx(post(3) + n / HBM)
    assert fab.path_latency((0, 0), (0, 0)) == 0.0


def test_keys_sharing_an_endpoint_route_as_local() -> None:
    placement = {"a": Endpoint(0, 1), "b": Endpoint(0, 1), "c": Endpoint(1, 0)}
    _, fab = new_fabric(placement=placement)
    assert fab.path("a", "b") == ("n0g1.hbm",)
    assert fab.path("a", "c") == ("n0g1.nic.tx", "n1g0.nic.rx")
    assert fab.path("c", "a") == ("n1g0.nic.tx", "n0g1.nic.rx")


def test_zero_byte_transfer_costs_post_and_latency_only() -> None:
    env, fab = new_fabric()
    (t,) = run_all(env, fab, [dict(initiator=(0, 0), src=(0, 0), dst=(1, 0), nbytes=0, descriptors=0)])
    assert t.wire_time == 0.0
    assert t.done == approx(LAUNCH + INTER_LAT)
    assert fab.link_log == [] and fab.active_flows == 0


def test_published_h200_nvlink_tp1_example() -> None:
    """docs/semantics.md §10 TP1->TP1 KimiLinear 8K: 1,134 descriptors, 77.4 + 45.6 MB."""
    prof = load_profile("h200-nvlink")
    env, fab = new_fabric(prof, grid(1, 8))
    n, d = 123_000_000, 1_134
    (t,) = run_all(env, fab, [dict(initiator=(0, 1), src=(0, 0), dst=(0, 1), nbytes=n, descriptors=d)])
    expected = 30e-6 + d * 3.1e-6 + n / 380e9 + prof.intra_node_latency
    assert t.done == approx(expected)
    assert t.post_time == approx(30e-6 + 1_134 * 3.1e-6)  # ~3.5 ms of posting, as §10 says
    assert t.wire_time == approx(n / 380e9)  # ~0.32 ms of bytes


def test_notify_and_handshake_latencies() -> None:
    env, fab = new_fabric()
    got: dict[str, float] = {}

    def proc():  # type: ignore[no-untyped-def]
        yield env.timeout(1.0)
        v = yield fab.notify((0, 0), (1, 1))
        got["notify"] = env.now
        got["notify_value"] = v
        yield fab.notify((0, 0), (0, 1))
        got["notify_intra"] = env.now
        yield fab.handshake((0, 1), (1, 0))
        got["handshake"] = env.now

    env.run(env.process(proc()))
    assert got["notify"] == approx(1.0 + INTER_LAT + NOTIF)
    assert got["notify_value"] == got["notify"]
    assert got["notify_intra"] == approx(got["notify"] + INTRA_LAT + NOTIF)
    assert got["handshake"] == approx(got["notify_intra"] + HANDSHAKE + INTER_LAT)


# ---------------------------------------------------------------- sharing


def test_two_equal_concurrent_flows_on_one_link_each_take_twice_the_wire_time() -> None:
    # Two READs into (0,0) from two sources: they share only the n0g0.nvl.rx link.
    env, fab = new_fabric()
    n, d = 40_000_000, 100
    a, b = run_all(
        env,
        fab,
        [
            dict(initiator=(0, 0), src=(0, 1), dst=(0, 0), nbytes=n, descriptors=d),
            dict(initiator=(0, 3), src=(0, 2), dst=(0, 0), nbytes=n, descriptors=d),
        ],
    )
    assert a.wire_start == b.wire_start == approx(post(d))
    assert a.wire_time == approx(2 * n / BW)
    assert b.wire_time == approx(2 * n / BW)
    assert a.done == b.done == approx(post(d) + 2 * n / BW + INTRA_LAT)


def test_short_and_long_flow_processor_sharing() -> None:
    env, fab = new_fabric()
    s, l, d = 10_000_000, 70_000_000, 10
    short, long_ = run_all(
        env,
        fab,
        [
            dict(initiator=(0, 1), src=(0, 0), dst=(0, 1), nbytes=s, descriptors=d),
            dict(initiator=(0, 2), src=(0, 0), dst=(0, 2), nbytes=l, descriptors=d),
        ],
    )
    t0 = post(d)
    # Both at BW/2 until the short one ends at 2s/BW; the long one then gets BW alone.
    assert short.wire_end == approx(t0 + 2 * s / BW)
    assert long_.wire_end == approx(t0 + (s + l) / BW)
    assert long_.wire_end - short.wire_end == approx((l - s) / BW, rel=1e-9)


def test_late_arrival_slows_an_ongoing_flow() -> None:
    env, fab = new_fabric()
    n, d = 100_000_000, 10  # alone: 1 ms of wire
    first, second = run_all(
        env,
        fab,
        [
            dict(initiator=(0, 1), src=(0, 0), dst=(0, 1), nbytes=n, descriptors=d),
            dict(at=0.5e-3, initiator=(0, 2), src=(0, 0), dst=(0, 2), nbytes=n, descriptors=d),
        ],
    )
    t0 = post(d)
    t1 = 0.5e-3 + post(d)  # second flow joins; first has n - BW*(t1 - t0) left
    left = n - BW * (t1 - t0)
    assert first.wire_end == approx(t1 + 2 * left / BW, rel=1e-9)
    # second moved `left` bytes while sharing, then the rest alone
    assert second.wire_end == approx(first.wire_end + (n - left) / BW, rel=1e-9)


def test_flows_on_disjoint_links_do_not_interfere() -> None:
    env, fab = new_fabric()
    n, d = 30_000_000, 7
    a, b, c = run_all(
        env,
        fab,
        [
            dict(initiator=(0, 0), src=(0, 0), dst=(0, 1), nbytes=n, descriptors=d),
            dict(initiator=(0, 2), src=(0, 2), dst=(0, 3), nbytes=n, descriptors=d),
            dict(initiator=(1, 0), src=(1, 0), dst=(0, 0), nbytes=n, descriptors=d),  # NIC, not NVLink
        ],
    )
    assert a.wire_time == approx(n / BW)
    assert b.wire_time == approx(n / BW)
    assert c.wire_time == approx(n / NIC)


def test_opposite_directions_do_not_share() -> None:
    env, fab = new_fabric()
    n = 20_000_000
    a, b = run_all(
        env,
        fab,
        [
            dict(initiator=(0, 0), src=(0, 0), dst=(0, 1), nbytes=n, descriptors=1),
            dict(initiator=(0, 1), src=(0, 1), dst=(0, 0), nbytes=n, descriptors=1),
        ],
    )
    assert a.wire_time == approx(n / BW) and b.wire_time == approx(n / BW)


def test_rates_are_max_min_fair_not_min_of_equal_shares() -> None:
    """A: g0->g1 and B: g0->g2 share g0.tx; B, C: g3->g2, D: (1,0)->... share g2.rx.

    g2.rx is the bottleneck: B, C, D get BW/3. Max-min gives A the rest of g0.tx, 2BW/3 (a
    naive capacity/count rule would give A only BW/2).
    """
    prof = make_profile(gpus_per_node=8, inter_node_bandwidth=BW)
    env, fab = new_fabric(prof, grid(1, 8))
    n, d = 30_000_000, 5
    a, b, c, dd = run_all(
        env,
        fab,
        [
            dict(initiator=(0, 4), src=(0, 0), dst=(0, 1), nbytes=n, descriptors=d),
            dict(initiator=(0, 5), src=(0, 0), dst=(0, 2), nbytes=n, descriptors=d),
            dict(initiator=(0, 6), src=(0, 3), dst=(0, 2), nbytes=n, descriptors=d),
            dict(initiator=(0, 7), src=(0, 7), dst=(0, 2), nbytes=n, descriptors=d),
        ],
    )
    t0 = post(d)
    assert a.wire_end == approx(t0 + n / (2 * BW / 3), rel=1e-9)  # 1.5 n/BW
    for t in (b, c, dd):  # BW/3 throughout: 3 n/BW
        assert t.wire_end == approx(t0 + 3 * n / BW, rel=1e-9)


# ---------------------------------------------------------------- posting


def test_posting_is_serialised_per_initiator() -> None:
    env, fab = new_fabric()
    d1, d2, n = 1_000, 3_000, 1_000
    a, b = run_all(
        env,
        fab,
        [
            dict(initiator=(0, 0), src=(0, 1), dst=(0, 0), nbytes=n, descriptors=d1),
            dict(initiator=(0, 0), src=(0, 2), dst=(0, 0), nbytes=n, descriptors=d2),
        ],
    )
    assert a.post_start == 0.0 and a.post_end == approx(post(d1))
    assert b.submitted == 0.0
    assert b.post_start == a.post_end
    assert b.post_wait == approx(post(d1))
    assert b.post_end == approx(2 * LAUNCH + (d1 + d2) * ALPHA)


def test_posting_is_parallel_across_initiators() -> None:
    env, fab = new_fabric()
    d, n = 2_000, 1_000
    a, b = run_all(
        env,
        fab,
        [
            dict(initiator=(0, 0), src=(0, 1), dst=(0, 0), nbytes=n, descriptors=d),
            dict(initiator=(0, 3), src=(0, 2), dst=(0, 3), nbytes=n, descriptors=d),
        ],
    )
    assert a.post_start == b.post_start == 0.0
    assert a.post_end == b.post_end == approx(post(d))


def test_posting_resource_is_per_endpoint_not_per_key() -> None:
    placement = {"x": Endpoint(0, 0), "y": Endpoint(0, 0), "z": Endpoint(0, 1)}
    env, fab = new_fabric(placement=placement)
    a, b = run_all(
        env,
        fab,
        [
            dict(initiator="x", src="z", dst="x", nbytes=10, descriptors=4),
            dict(initiator="y", src="z", dst="y", nbytes=10, descriptors=4),
        ],
    )
    assert b.post_start == a.post_end == approx(post(4))


# ---------------------------------------------------------------- link log


def test_link_log_records_rate_segments() -> None:
    env, fab = new_fabric()
    s, l, d = 10_000_000, 30_000_000, 1
    run_all(
        env,
        fab,
        [
            dict(initiator=(0, 1), src=(0, 0), dst=(0, 1), nbytes=s, descriptors=d),
            dict(initiator=(0, 2), src=(0, 0), dst=(0, 2), nbytes=l, descriptors=d),
        ],
    )
    tx = [seg for seg in fab.link_log if seg.link == "n0g0.nvl.tx"]
    assert [(seg.flows, seg.rate) for seg in tx] == [(2, approx(BW)), (1, approx(BW))]
    assert tx[0].t_start == approx(post(d)) and tx[0].t_end == approx(post(d) + 2 * s / BW)
    assert tx[1].t_end == approx(post(d) + (s + l) / BW)
    assert sum(seg.nbytes for seg in tx) == approx(s + l, rel=1e-9)
    assert all(seg.utilisation == approx(1.0) for seg in tx)
    rx1 = [seg for seg in fab.link_log if seg.link == "n0g1.nvl.rx"]
    assert len(rx1) == 1 and rx1[0].rate == approx(BW / 2) and rx1[0].utilisation == approx(0.5)
    assert fab.link_segments() == fab.link_log  # nothing open after the run


def test_link_segments_include_open_segments() -> None:
    env, fab = new_fabric()
    fab.transfer(initiator=(0, 0), src=(0, 0), dst=(0, 1), nbytes=100_000_000, descriptors=1)
    env.run(until=post(1) + 0.25e-3)
    assert fab.link_log == []
    assert fab.active_flows == 1
    segs = fab.link_segments()
    assert {s.link for s in segs} == {"n0g0.nvl.tx", "n0g1.nvl.rx"}
    assert all(s.nbytes == approx(BW * 0.25e-3, rel=1e-9) for s in segs)



def _reallocations(descriptors: list[int]) -> tuple[int, list[Any], list[TransferTiming]]:
    """Flows from one GPU to its node's other GPUs, posted at 0 by their destinations with
    the given descriptor counts: (rate reallocations, link log, timings)."""
    env, fab = new_fabric()
    calls = [0]
    reallocate = fab._reallocate

    def counted(*args: Any, **kwargs: Any) -> None:
        calls[0] += 1
        reallocate(*args, **kwargs)

    fab._reallocate = counted  # type: ignore[method-assign]
    timings = run_all(env, fab, [
        dict(initiator=(0, g), src=(0, 0), dst=(0, g), nbytes=3_000_000, descriptors=d)
        for g, d in zip((1, 2, 3), descriptors)])
    return calls[0], fab.link_log, timings


def test_flows_starting_at_one_instant_share_one_reallocation() -> None:
    # three posts end together: the rates are computed once for the three new flows, and once
    # more when they end together (issue #14: a request's transfers start as one batch)
    calls, log, timings = _reallocations([1, 1, 1])
    assert calls == 2
    assert [t.wire_end for t in timings] == [approx(post(1) + 9_000_000 / BW)] * 3
    tx = [(seg.flows, seg.rate, seg.t_start) for seg in log if seg.link == "n0g0.nvl.tx"]
    assert tx == [(3, approx(BW), approx(post(1)))]  # no segment for the two-flow instant
    # posts ending at different times: each start reallocates, as each end does
    calls, _, timings = _reallocations([1, 2, 3])
    assert calls == 6
    assert sorted(t.wire_start for t in timings) == [approx(post(d)) for d in (1, 2, 3)]


def test_flows_ending_together_complete_in_start_order() -> None:
    # equal flows on one link, posted at one instant in the order g3, g1, g2, end together;
    # their transfers complete in the order their flows started, not in any other
    env, fab = new_fabric()
    order: list[int] = []
    for g in (3, 1, 2):
        ev = fab.transfer(initiator=(0, g), src=(0, 0), dst=(0, g), nbytes=50_000_000,
                          descriptors=1)
        ev.callbacks.append(lambda _ev, g=g: order.append(g))
    env.run()
    assert order == [3, 1, 2]


def test_link_segments_leave_out_segments_of_no_length() -> None:
    # asked at the instant a flow starts, the links it opened have carried nothing yet: no
    # segment of zero length (and no rate) is reported for them
    env, fab = new_fabric()
    fab.transfer(initiator=(0, 0), src=(0, 0), dst=(0, 1), nbytes=100_000_000, descriptors=1)
    seen: list[Any] = []

    def ask():  # type: ignore[no-untyped-def]
        yield env.timeout(post(1))  # scheduled after the post's end: the flow has started
        seen.append((fab.active_flows, fab.link_segments()))

    env.process(ask())
    env.run(until=post(1) + 1e-6)
    assert seen == [(1, [])]
    assert {s.link for s in fab.link_segments()} == {"n0g0.nvl.tx", "n0g1.nvl.rx"}

# ---------------------------------------------------------------- argument errors


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(nbytes=-1, descriptors=1), "nbytes = -1"),
        (dict(nbytes=10, descriptors=-2), "descriptors = -2"),
        (dict(nbytes=1.5, descriptors=1), "nbytes = 1.5"),
        (dict(nbytes=10, descriptors=0), "descriptors = 0"),
    ],
)
def test_transfer_rejects_bad_counts(kwargs: dict[str, Any], match: str) -> None:
    _, fab = new_fabric()
    with pytest.raises(FabricError, match=match):
        fab.transfer(initiator=(0, 0), src=(0, 0), dst=(0, 1), **kwargs)


def test_transfer_rejects_unplaced_keys() -> None:
    _, fab = new_fabric()
    with pytest.raises(FabricError, match=r"\('P', 9\) is not placed"):
        fab.transfer(initiator=("P", 9), src=(0, 0), dst=(0, 1), nbytes=1, descriptors=1)
    with pytest.raises(FabricError, match="is not placed"):
        fab.notify((0, 0), (7, 7))


def test_fabric_rejects_gpu_outside_node() -> None:
    with pytest.raises(FabricError, match="gpu index must be in 0..3"):
        Fabric(simpy.Environment(), make_profile(), {"a": Endpoint(0, 4)})


# ---------------------------------------------------------------- event budget


class CountingEnv(simpy.Environment):
    """Counts every event simpy schedules."""

    def __init__(self) -> None:
        super().__init__()
        self.scheduled = 0

    def schedule(self, event: simpy.Event, priority: int = 1, delay: float = 0) -> None:  # type: ignore[override]
        self.scheduled += 1
        super().schedule(event, priority, delay)


def _burst(flows: int, descriptors: int) -> tuple[int, float, list[TransferTiming]]:
    env = CountingEnv()
    prof = make_profile(gpus_per_node=8)
    _, fab = new_fabric(prof, grid(2, 8), env=env)
    specs = [
        dict(
            initiator=((k // 8) % 2, k % 8),  # 16 initiators, round robin
            src=(1 - (k // 8) % 2, (k + 3) % 8),  # always the other node
            dst=((k // 8) % 2, k % 8),
            nbytes=1_000_000 + k,
            descriptors=descriptors,
        )
        for k in range(flows)
    ]
    t0 = time.perf_counter()
    timings = run_all(env, fab, specs)
    return env.scheduled, time.perf_counter() - t0, timings


def test_event_count_is_linear_in_flows_and_independent_of_descriptors() -> None:
    # Posting (10+ ms) dwarfs the wire (40 us) here, so flows never overlap and the event count
    # must not move at all with the descriptor count.
    counts = {d: _burst(100, d)[0] for d in (1_000, 10_000, 100_000)}
    assert len(set(counts.values())) == 1, counts
    many_desc, _, timings = _burst(100, 10_000)
    double, _, _ = _burst(200, 10_000)
    assert double / many_desc == pytest.approx(2.0, rel=0.02)
    # A small constant per flow (including the test's own submit process), overlap or not.
    assert many_desc <= 12 * 100
    assert _burst(100, 1)[0] <= 12 * 100
    # 16 initiators post 100 flows: 7 posts in a row for the busiest ones
    assert max(t.post_end for t in timings) == approx(7 * post(10_000), rel=1e-9)


def test_thousand_flows_of_ten_thousand_descriptors_are_fast() -> None:
    events, wall, timings = _burst(1_000, 10_000)
    assert len(timings) == 1_000
    assert wall < 1.0
    assert events <= 20 * 1_000


def test_many_concurrent_flows_on_one_link_are_fast_and_exact() -> None:
    """500 flows posted at once by 500 initiators, all into one GPU's ingress."""
    prof = make_profile(gpus_per_node=1, inter_node_bandwidth=BW)
    placement: dict[Hashable, Endpoint] = {i: Endpoint(i, 0) for i in range(501)}
    env, fab = new_fabric(prof, placement)
    sizes = [1_000_000 * (1 + i % 7) for i in range(500)]
    t0 = time.perf_counter()
    timings = run_all(
        env,
        fab,
        [dict(initiator=i + 1, src=i + 1, dst=0, nbytes=s, descriptors=1) for i, s in enumerate(sizes)],
    )
    assert time.perf_counter() - t0 < 2.0
    # Work conserving: the last byte lands exactly when the link has carried all bytes.
    assert max(t.wire_end for t in timings) == approx(post(1) + sum(sizes) / BW, rel=1e-9)
    # Processor sharing: equal-size flows end together (exactly), smaller ones first.
    ends: dict[int, set[float]] = {}
    for t in timings:
        ends.setdefault(t.nbytes, set()).add(t.wire_end)
    assert all(len(v) == 1 for v in ends.values())
    by_size = [ends[s].pop() for s in sorted(ends)]
    assert by_size == sorted(by_size) and len(set(by_size)) == 7


def test_runs_are_deterministic() -> None:
    _, _, a = _burst(300, 50)
    _, _, b = _burst(300, 50)
    assert a == b


# ---------------------------------------------------------------- properties


def _slack(t: float) -> float:
    """Timestamps are absolute floats: a duration is only known to a few ulps of its end time."""
    return 4 * math.ulp(t)


flow_st = st.tuples(
    st.integers(min_value=1, max_value=2_000_000_000),  # bytes
    st.integers(min_value=1, max_value=200),  # descriptors
    st.floats(min_value=0.0, max_value=0.05, allow_nan=False),  # submit time
)


@settings(max_examples=60, deadline=None)
@given(st.lists(flow_st, min_size=1, max_size=12))
def test_property_one_link_never_exceeds_bandwidth(flows: list[tuple[int, int, float]]) -> None:
    prof = make_profile(gpus_per_node=16)
    env, fab = new_fabric(prof, grid(1, 16))
    specs = [
        dict(at=at, initiator=(0, i + 1), src=(0, 0), dst=(0, 0), nbytes=n, descriptors=d)
        for i, (n, d, at) in enumerate(flows)
    ]
    timings = run_all(env, fab, specs)
    for t in timings:
        assert t.wire_time >= t.nbytes / HBM * (1 - 1e-9) - _slack(t.wire_end)
    end = max(t.wire_end for t in timings)
    makespan = end - min(t.wire_start for t in timings)
    assert sum(t.nbytes for t in timings) <= HBM * (makespan + _slack(end)) * (1 + 1e-9)
    for seg in fab.link_log:
        assert seg.rate <= HBM * (1 + 1e-9)
    assert sum(seg.nbytes for seg in fab.link_log) == pytest.approx(
        sum(t.nbytes for t in timings), rel=1e-9, abs=HBM * _slack(end) * (len(fab.link_log) + 1)
    )


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=10**9), min_size=1, max_size=12))
def test_property_simultaneous_flows_on_one_link_are_work_conserving(sizes: list[int]) -> None:
    prof = make_profile(gpus_per_node=16)
    env, fab = new_fabric(prof, grid(1, 16))
    timings = run_all(
        env,
        fab,
        [
            dict(initiator=(0, i), src=(0, 15), dst=(0, 15), nbytes=n, descriptors=3)
            for i, n in enumerate(sizes)
        ],
    )
    assert max(t.wire_end for t in timings) == approx(post(3) + sum(sizes) / HBM, rel=1e-9)
    # Under processor sharing flows finish in size order.
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    ends = [timings[i].wire_end for i in order]
    assert ends == sorted(ends)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 7),  # src (node*4+gpu)
            st.integers(0, 7),  # dst
            st.integers(1, 500_000_000),
            st.floats(min_value=0.0, max_value=0.01, allow_nan=False),
        ),
        min_size=1,
        max_size=16,
    )
)
def test_property_no_link_ever_carries_more_than_its_capacity(
    flows: list[tuple[int, int, int, float]],
) -> None:
    env, fab = new_fabric()
    specs = [
        dict(at=at, initiator=divmod(s, 4), src=divmod(s, 4), dst=divmod(d, 4), nbytes=n, descriptors=1)
        for s, d, n, at in flows
    ]
    timings = run_all(env, fab, specs)
    for seg in fab.link_log:
        assert seg.rate <= seg.capacity * (1 + 1e-9)
    # the log's open/close boundaries never overlap on one link
    by_link: dict[str, list[tuple[float, float]]] = {}
    for seg in fab.link_log:
        by_link.setdefault(seg.link, []).append((seg.t_start, seg.t_end))
    for spans in by_link.values():
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    for t, (s, d, n, _) in zip(timings, flows):
        cap = HBM if s == d else (BW if s // 4 == d // 4 else NIC)
        assert t.wire_time >= n / cap * (1 - 1e-9) - _slack(t.wire_end)


# ---------------------------------------------------------------- placement


def test_pack_fills_nodes_in_order() -> None:
    prof = make_profile(gpus_per_node=8)
    got = place_engines(prof, [("p0", "prefill", 2), ("d0", "decode", 4), ("p1", "prefill", 4)])
    assert list(got) == [("p0", 0), ("p0", 1), ("d0", 0), ("d0", 1), ("d0", 2), ("d0", 3),
                         ("p1", 0), ("p1", 1), ("p1", 2), ("p1", 3)]
    assert [got["p0", r] for r in range(2)] == [Endpoint(0, 0), Endpoint(0, 1)]
    assert [got["d0", r] for r in range(4)] == [Endpoint(0, g) for g in range(2, 6)]
    # p1 does not fit in the 2 GPUs left on node 0: it starts node 1
    assert [got["p1", r] for r in range(4)] == [Endpoint(1, g) for g in range(4)]


def test_split_keeps_prefill_and_decode_apart() -> None:
    prof = make_profile(gpus_per_node=8, placement="split")
    engines = [("p0", "prefill", 2), ("d0", "decode", 4), ("p1", "prefill", 8), ("d1", "decode", 4)]
    got = place_engines(prof, engines)
    assert [got["p0", r] for r in range(2)] == [Endpoint(0, 0), Endpoint(0, 1)]
    assert [got["p1", r] for r in range(8)] == [Endpoint(1, g) for g in range(8)]
    assert [got["d0", r] for r in range(4)] == [Endpoint(2, g) for g in range(4)]
    assert [got["d1", r] for r in range(4)] == [Endpoint(2, g) for g in range(4, 8)]
    assert list(got)[:2] == [("p0", 0), ("p0", 1)] and list(got)[2] == ("d0", 0)
    assert got == place_engines(prof, engines)  # deterministic


def test_split_with_partial_prefill_node_and_no_prefill() -> None:
    prof = make_profile(gpus_per_node=4, placement="split")
    got = place_engines(prof, [("p", "prefill", 1), ("d", "decode", 1)])
    assert got == {("p", 0): Endpoint(0, 0), ("d", 0): Endpoint(1, 0)}
    got = place_engines(prof, [("d", "decode", 2)])
    assert got == {("d", 0): Endpoint(0, 0), ("d", 1): Endpoint(0, 1)}


def test_split_places_pd_transfers_on_nics() -> None:
    prof = load_profile("h200-cx7-rdma")
    placement = place_engines(prof, [("P", "prefill", 2), ("D", "decode", 2)])
    env = simpy.Environment()
    fab = Fabric(env, prof, placement)
    assert fab.path(("P", 1), ("D", 0)) == ("n0g1.nic.tx", "n1g0.nic.rx")
    assert fab.path(("P", 0), ("P", 1)) == ("n0g0.nvl.tx", "n0g1.nvl.rx")
    pack = place_engines(load_profile("h200-nvlink"), [("P", "prefill", 2), ("D", "decode", 2)])
    assert Fabric(env, load_profile("h200-nvlink"), pack).path(("P", 1), ("D", 0)) == (
        "n0g1.nvl.tx",
        "n0g2.nvl.rx",
    )


@pytest.mark.parametrize("placement", ["pack", "split"])
def test_tp_larger_than_node_is_an_error(placement: str) -> None:
    prof = make_profile(gpus_per_node=8, placement=placement)
    with pytest.raises(PlacementError, match=r"tp = 16 does not fit.*gpus_per_node = 8"):
        place_engines(prof, [("d0", "decode", 16)])


@pytest.mark.parametrize(
    ("engines", "match"),
    [
        ([("a", "prefill", 1), ("a", "decode", 1)], "appears twice"),
        ([("a", "encoder", 1)], "role 'encoder'"),
        ([("a", "prefill", 0)], "tp = 0"),
        ([("a", "prefill", True)], "tp = True"),
        ([("a", "prefill")], r"engine entry \('a', 'prefill'\): expected \(engine_id, role, tp\)"),
        ([["a", "prefill", 1]], r"engine entry \['a', 'prefill', 1\]: expected"),
    ],
)
def test_placement_rejects_bad_engines(engines: list[Any], match: str) -> None:
    with pytest.raises(PlacementError, match=match):
        place_engines(make_profile(), engines)


# ---------------------------------------------------------------- profiles


def test_shipped_profiles_exist_and_load() -> None:
    assert profile_names() == ["cpu-ucx-loopback", "h200-cx7-rdma", "h200-nvlink", "pcie-host"]
    for name in profile_names():
        assert load_profile(name).name == name


def test_shipped_profile_numbers() -> None:
    nv = load_profile("h200-nvlink")
    assert (nv.gpus_per_node, nv.placement, nv.memory, nv.transport) == (8, "pack", "VRAM", "cuda_ipc")
    assert nv.intra_node_bandwidth == 380e9
    assert nv.per_descriptor == pytest.approx(3.1e-6, rel=1e-15)
    assert nv.transfer_launch == 30e-6
    assert nv.inter_node_bandwidth == 42.6e9
    assert nv.local_bandwidth == pytest.approx(4800e9 * 0.5 * 0.85, rel=1e-15)

    rdma = load_profile("h200-cx7-rdma")
    assert (rdma.placement, rdma.transport, rdma.memory) == ("split", "rc_mlx5", "VRAM")
    assert rdma.inter_node_bandwidth == 42.6e9
    assert 0.8e-6 <= rdma.per_descriptor <= 2.3e-6 * (1 + 1e-12)

    pcie = load_profile("pcie-host")
    assert (pcie.placement, pcie.memory, pcie.intra_node_bandwidth) == ("pack", "DRAM", 50e9)

    cpu = load_profile("cpu-ucx-loopback")  # measured here by `hkvsim calibrate`
    assert (cpu.placement, cpu.memory, cpu.transport) == ("pack", "DRAM", "cma")
    text = (PROFILE_DIR / "cpu-ucx-loopback.toml").read_text()
    assert "written by `hkvsim calibrate`" in text.lower()
    assert 1e9 <= cpu.intra_node_bandwidth <= 50e9
    assert 0.1e-6 <= cpu.per_descriptor <= 10e-6
    assert cpu.handshake_latency > 0


def test_shipped_profiles_cite_sources() -> None:
    nv = (PROFILE_DIR / "h200-nvlink.toml").read_text()
    for cite in ("DeepEP #16", "https://github.com/ai-dynamo/nixl/pull/115",
                 "https://github.com/ai-dynamo/nixl/pull/1647", "AMD AINIC", "estimate"):
        assert cite in nv
    rdma = (PROFILE_DIR / "h200-cx7-rdma.toml").read_text()
    assert "https://github.com/ai-dynamo/nixl/pull/1647" in rdma and "multi-rail" in rdma


@pytest.mark.parametrize("name", ["h200-nvlink", "h200-cx7-rdma", "pcie-host"])
def test_every_number_of_a_gpu_profile_has_a_comment_and_points_inside_the_repo(name: str
                                                                               ) -> None:
    lines = (PROFILE_DIR / f"{name}.toml").read_text().splitlines()
    assert not any("DOMAIN.md" in line for line in lines)  # the product's own docs only
    for i, line in enumerate(lines):
        key = line.split("=")[0].strip()
        if "=" in line and not line.startswith("#") and key.endswith(("_gbps", "_us")):
            above = i - 1
            while above >= 0 and lines[above].startswith("#") is False and lines[above].strip():
                above -= 1  # a pair of keys under one comment (latency next to bandwidth)
            assert above >= 0 and lines[above].startswith("#"), f"{name}: {key} has no source"


def test_load_by_path_and_overrides(tmp_path: Path) -> None:
    p = load_profile(str(PROFILE_DIR / "h200-nvlink.toml"))
    assert p == load_profile("h200-nvlink")
    o = load_profile(
        "h200-nvlink",
        overrides={"per_descriptor_us": 5, "intra_node_bandwidth_gbps": 100.5, "placement": "split"},
    )
    assert o.per_descriptor == 5e-6
    assert o.intra_node_bandwidth == 100.5e9
    assert o.placement == "split"
    assert replace(o, per_descriptor=p.per_descriptor, intra_node_bandwidth=p.intra_node_bandwidth,
                   placement="pack") == p
    # a profile in a user directory, found by name through search_dirs
    (tmp_path / "mine.toml").write_text(_toml(name="mine"))
    assert load_profile("mine", search_dirs=[tmp_path]).name == "mine"
    assert profile_names([tmp_path]) == ["mine"]


def _toml(**changes: Any) -> str:
    values: dict[str, Any] = {
        "name": "custom",
        "description": "test profile",
        "gpus_per_node": 4,
        "intra_node_bandwidth_gbps": 100,
        "intra_node_latency_us": 2,
        "inter_node_bandwidth_gbps": 25,
        "inter_node_latency_us": 5,
        "local_bandwidth_gbps": 1000,
        "transfer_launch_us": 10,
        "per_descriptor_us": 1,
        "notification_latency_us": 7,
        "handshake_latency_us": 1000,
        "placement": "pack",
        "memory": "VRAM",
        "transport": "cuda_ipc",
    }
    values.update(changes)
    lines = []
    for k, v in values.items():
        if v is _DROP:
            continue
        lines.append(f"{k} = {_lit(v)}")
    return "\n".join(lines) + "\n"


_DROP = object()


def _lit(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v + '"'
    return repr(v)


def test_custom_file_converts_units_exactly(tmp_path: Path) -> None:
    f = tmp_path / "custom.toml"
    f.write_text(_toml())
    assert load_profile(str(f)) == make_profile(name="custom", description="test profile")


@pytest.mark.parametrize(
    ("changes", "needles"),
    [
        ({"bogus_gbps": 3}, ["'bogus_gbps'", "unknown key", "allowed keys"]),
        ({"per_descriptor_us": _DROP}, ["missing", "'per_descriptor_us'"]),
        ({"intra_node_bandwidth_gbps": 0}, ["'intra_node_bandwidth_gbps'", "= 0", "> 0"]),
        ({"per_descriptor_us": -3.1}, ["'per_descriptor_us'", "-3.1", "> 0"]),
        ({"inter_node_latency_us": "5"}, ["'inter_node_latency_us'", "'5'", "number"]),
        ({"handshake_latency_us": True}, ["'handshake_latency_us'", "True", "number"]),
        ({"gpus_per_node": 8.0}, ["'gpus_per_node'", "8.0", "integer"]),
        ({"gpus_per_node": 0}, ["'gpus_per_node'", "= 0", "integer > 0"]),
        ({"placement": "spread"}, ["'placement'", "'spread'", "'pack', 'split'"]),
        ({"memory": "HBM"}, ["'memory'", "'HBM'", "'VRAM', 'DRAM'"]),
        ({"transport": ""}, ["'transport'", "non-empty string"]),
        ({"local_bandwidth_gbps": float("inf")}, ["'local_bandwidth_gbps'", "inf", "finite"]),
    ],
)
def test_validation_errors_name_file_key_value_and_allowed(
    tmp_path: Path, changes: dict[str, Any], needles: list[str]
) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(_toml(**changes))
    with pytest.raises(ProfileError) as exc:
        load_profile(str(f))
    msg = str(exc.value)
    assert str(f) in msg
    for needle in needles:
        assert needle in msg, (needle, msg)


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        ({"per_descriptor": 5}, ["unknown override key", "'per_descriptor'", "per_descriptor_us"]),
        ({"per_descriptor_us": 0}, ["override key", "'per_descriptor_us'", "= 0", "> 0"]),
        ({"placement": "ring"}, ["override key", "'placement'", "'ring'", "'pack', 'split'"]),
    ],
)
def test_override_errors(overrides: dict[str, Any], needles: list[str]) -> None:
    with pytest.raises(ProfileError) as exc:
        load_profile("h200-nvlink", overrides=overrides)
    msg = str(exc.value)
    assert "h200-nvlink.toml" in msg
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_unknown_profile_name_lists_available() -> None:
    with pytest.raises(ProfileError) as exc:
        load_profile("h100-nvlink")
    msg = str(exc.value)
    assert "'h100-nvlink'" in msg
    for name in profile_names():
        assert name in msg


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile(str(tmp_path / "nope.toml"))
    f = tmp_path / "broken.toml"
    f.write_text("name = \n")
    with pytest.raises(ProfileError, match="not valid TOML"):
        load_profile(str(f))


def test_profile_dataclass_validates_direct_construction() -> None:
    with pytest.raises(ProfileError, match="'per_descriptor_us'"):
        make_profile(per_descriptor=0.0)
    with pytest.raises(ProfileError, match="'placement'"):
        make_profile(placement="both")
    assert set(TOML_KEYS) >= {"per_descriptor_us", "intra_node_bandwidth_gbps", "placement"}
    assert make_profile().post_time(1_000) == LAUNCH + 1_000 * ALPHA
