"""The path-grouped fabric (hkvsim/fabric/fairshare.py) against an independent per-flow fluid
model: every flow's wire end must agree to float rounding, on mixed paths (NVLink, NIC,
same-GPU copies) with staggered starts. (The cost per flow against flows in flight is measured
in benchmarks/test_events.py.)"""

from __future__ import annotations

import math
from collections.abc import Hashable

import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from hkvsim.fabric import Endpoint, Fabric
from test_fabric import make_profile, run_all

GPUS = 2
PLACEMENT: dict[Hashable, Endpoint] = {(n, g): Endpoint(n, g) for n in range(3) for g in range(GPUS)}


def reference_wire_ends(fab: Fabric, flows: list[tuple[float, tuple[str, ...], int]]
                        ) -> list[float]:
    """Per-flow fluid model, written from the semantics (not from the fabric's code): between
    two events every active flow moves at its max-min fair rate (progressive filling over
    flows); an event is a flow start or the earliest flow end."""
    start = [s for s, _, _ in flows]
    left = [float(n) for _, _, n in flows]
    end = [math.nan] * len(flows)
    active: list[int] = []
    pending = sorted(range(len(flows)), key=lambda i: (start[i], i))
    now = 0.0
    while pending or active:
        rate = {}
        caps = {l: fab.link_capacity(l) for i in active for l in flows[i][1]}
        todo = set(active)
        while todo:
            share = {l: caps[l] / sum(1 for i in todo if l in flows[i][1])
                     for l in caps if any(l in flows[i][1] for i in todo)}
            link = min(share, key=share.__getitem__)
            for i in [i for i in todo if link in flows[i][1]]:
                rate[i] = share[link]
                todo.discard(i)
                for l in flows[i][1]:
                    caps[l] -= share[link]
        finish = {i: now + left[i] / rate[i] for i in active}
        t = min(min(finish.values(), default=math.inf),
                start[pending[0]] if pending else math.inf)
        for i in list(active):
            if finish[i] <= t * (1 + 1e-12):  # ends now (ties within float rounding)
                end[i] = t
                active.remove(i)
            else:
                left[i] -= rate[i] * (t - now)
        now = t
        while pending and start[pending[0]] <= now:
            active.append(pending.pop(0))
    return end


flow_st = st.tuples(
    st.sampled_from(sorted(PLACEMENT)),  # src
    st.sampled_from(sorted(PLACEMENT)),  # dst
    st.integers(min_value=1, max_value=3_000_000_000),  # bytes
    st.floats(min_value=0.0, max_value=0.2, allow_nan=False),  # submit time
)


@settings(max_examples=80, deadline=None)
@given(st.lists(flow_st, min_size=1, max_size=14))
def test_property_grouped_fabric_matches_per_flow_reference(flows) -> None:  # type: ignore[no-untyped-def]
    prof = make_profile(gpus_per_node=GPUS)
    env = simpy.Environment()
    fab = Fabric(env, prof, PLACEMENT)
    # posting serialises per initiator; the reference starts each wire where the fabric did
    specs = [dict(at=at, initiator=src, src=src, dst=dst, nbytes=n, descriptors=1)
             for src, dst, n, at in flows]
    timings = run_all(env, fab, specs)
    want = reference_wire_ends(fab, [(t.wire_start, t.path, t.nbytes) for t in timings])
    for t, w in zip(timings, want):
        assert t.wire_end == pytest.approx(w, rel=1e-9, abs=1e-15)
    # link utilisation log: no link ever above capacity; bytes logged == bytes moved
    for seg in fab.link_log:
        assert seg.rate <= seg.capacity * (1 + 1e-9)
    segments = fab.link_segments()
    logged = sum(seg.nbytes for seg in segments)
    # each segment's bytes are rate x duration, its times floats of ~0.1 s: about 1e-4 B of
    # rounding per segment at link speeds (a 1-byte flow alone is off by a few 1e-6 of itself)
    assert logged == pytest.approx(sum(t.nbytes * len(t.path) for t in timings), rel=1e-6,
                                   abs=1e-3 * len(segments))


def test_progressive_filling_weights_paths_by_their_flows() -> None:
    """Two flows n0->n1 and two flows n2->n1 (same GPU) share n1's NIC ingress; one more flow
    n0->n2 shares n0's egress with the first pair. Ingress of n1 is the bottleneck (4 flows,
    NIC/4 each); the n0->n2 flow then gets what the pair leaves on n0's egress: NIC/2."""
    prof = make_profile(gpus_per_node=GPUS)
    env = simpy.Environment()
    fab = Fabric(env, prof, PLACEMENT)
    size = 10**9
    specs = [dict(initiator=(0, 0), src=(0, 0), dst=(1, 0), nbytes=size, descriptors=1)] * 2
    specs += [dict(initiator=(2, 0), src=(2, 0), dst=(1, 0), nbytes=size, descriptors=1)] * 2
    specs += [dict(initiator=(0, 1), src=(0, 0), dst=(2, 1), nbytes=size, descriptors=1)]
    timings = run_all(env, fab, specs)
    nic = prof.inter_node_bandwidth
    want = reference_wire_ends(fab, [(t.wire_start, t.path, t.nbytes) for t in timings])
    assert [t.wire_end for t in timings] == pytest.approx(want, rel=1e-9)
    # the lone flow moves at NIC/2 while the others move at NIC/4, so it ends first
    lone = timings[4]
    assert lone.wire_end - lone.wire_start == pytest.approx(size / (nic / 2), rel=1e-3)
    assert lone.wire_end < min(t.wire_end for t in timings[:4])
    assert all(seg.rate <= seg.capacity * (1 + 1e-9) for seg in fab.link_segments())


class _NoMemo(dict):
    """A rate memo that remembers nothing: every allocation is computed."""

    def get(self, key, default=None):  # type: ignore[no-untyped-def]
        return default

    def __setitem__(self, key, value) -> None:  # type: ignore[no-untyped-def]
        pass


@settings(max_examples=60, deadline=None)
@given(st.lists(flow_st, min_size=2, max_size=24))
def test_property_remembered_allocations_equal_computed_ones(flows) -> None:  # type: ignore[no-untyped-def]
    """The fabric reuses a rate allocation met before (same active paths, same flow counts):
    wire ends, timings and the link log must be exactly those of computing every one."""
    specs = [dict(at=at, initiator=src, src=src, dst=dst, nbytes=n, descriptors=1)
             for src, dst, n, at in flows * 3]  # the same flows thrice: allocations recur
    out = []
    for memo in (True, False):
        env = simpy.Environment()
        fab = Fabric(env, make_profile(gpus_per_node=GPUS), PLACEMENT)
        if not memo:
            fab._rate_memo = _NoMemo()
        timings = run_all(env, fab, specs)
        out.append(([(t.wire_start, t.wire_end, t.done) for t in timings],
                    fab.link_segments()))
    assert out[0] == out[1]


def test_allocations_are_remembered_by_flow_counts() -> None:
    """Paths with other flow counts are another allocation (2 flows on one path, 1 on another
    is not 1 and 2), and a reused one gives the computed rates."""
    env = simpy.Environment()
    fab = Fabric(env, make_profile(gpus_per_node=GPUS), PLACEMENT)
    a, b = ((0, 0), (1, 0)), ((0, 0), (2, 0))  # share node 0's NIC
    specs = ([dict(at=0.0, initiator=a[0], src=a[0], dst=a[1], nbytes=10**9, descriptors=1)] * 2
             + [dict(at=0.0, initiator=b[0], src=b[0], dst=b[1], nbytes=10**9, descriptors=1)]
             + [dict(at=1.0, initiator=a[0], src=a[0], dst=a[1], nbytes=10**9, descriptors=1)]
             + [dict(at=1.0, initiator=b[0], src=b[0], dst=b[1], nbytes=10**9, descriptors=1)] * 2)
    timings = run_all(env, fab, specs)
    assert len(fab._rate_memo) >= 2
    want = reference_wire_ends(fab, [(t.wire_start, t.path, t.nbytes) for t in timings])
    for t, w in zip(timings, want):
        assert t.wire_end == pytest.approx(w, rel=1e-9, abs=1e-15)
