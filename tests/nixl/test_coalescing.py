"""NIXL coalesces descriptor pairs adjacent on both sides (docs/semantics.md §10), and the
simulator counts (and charges) exactly what NIXL reports. Each parity test runs on
``SimTransport`` and on ``NixlTransport`` (two real agents, DRAM) and expects the same
coalesced count in the telemetry."""

from __future__ import annotations

import numpy as np
import pytest
from test_transport_parity import KIB, Pair, _descs, pair  # noqa: F401  (the fixture)

from hkvsim.transport.base import DONE
from hkvsim.transport.coalesce import coalesced_count, coalesces

pytestmark = pytest.mark.timeout(60)
N = 64


def _rows(offsets: list[int], length: int = KIB, device: int = 0) -> np.ndarray:
    return np.array([[o, length, device] for o in offsets], dtype=np.uint64)


def test_coalesced_count_merges_only_runs_adjacent_on_both_sides_in_order() -> None:
    ident = [i * KIB for i in range(8)]
    assert coalesced_count(_rows(ident), _rows(ident)) == 1
    assert coalesced_count(_rows(ident[::-1]), _rows(ident[::-1])) == 8  # descending: no merge
    assert coalesced_count(_rows(ident[::2]), _rows(ident[::2])) == 4  # gaps everywhere
    remote = [i * KIB for i in (0, 1, 2, 3, 5, 6, 7, 8)]
    assert coalesced_count(_rows(ident), _rows(remote)) == 2  # local run, remote breaks once
    shifted = [o + 100 * KIB for o in ident]
    assert coalesced_count(_rows(ident), _rows(shifted)) == 1  # offsets differ, adjacency holds
    dev = _rows(ident)
    dev[4, 2] = 1
    assert coalesced_count(dev, _rows(ident)) == 3  # another device splits the run twice
    assert coalesced_count(_rows([]), _rows([])) == 0
    with pytest.raises(ValueError, match="differ in length"):
        coalesced_count(_rows(ident), _rows(ident[:3]))


def test_nixl_version_table() -> None:
    assert coalesces("prepped", "1.5.1") and not coalesces("non_prepped", "1.5.1")
    with pytest.raises(ValueError, match="allowed: prepped, non_prepped"):
        coalesces("bogus")


def _prepped(pair: Pair, local_ids: list[int], remote_ids: list[int]) -> tuple[int, int]:
    a = pair.a
    offsets = [i * KIB for i in range(N)]
    local = a.prep_xfer_dlist("", _descs(pair.ma.base_addr, offsets))
    remote = a.prep_xfer_dlist(pair.name, _descs(pair.mb.base_addr, offsets))
    pair.ma.array[:N * KIB] = np.arange(N * KIB, dtype=np.uint64).astype(np.uint8)
    h = a.make_prepped_xfer("WRITE", local, np.array(local_ids), remote, np.array(remote_ids))
    a.transfer(h)
    assert pair.wait(h) == DONE
    t = a.get_xfer_telemetry(h)
    a.release_xfer_handle(h)
    for li, ri in zip(local_ids, remote_ids):  # the bytes are right whatever the merging
        assert np.array_equal(pair.mb.array[ri * KIB:(ri + 1) * KIB],
                              pair.ma.array[li * KIB:(li + 1) * KIB])
    a.release_dlist_handle(local)
    a.release_dlist_handle(remote)
    assert t.coalesced is not None
    return t.descriptors, t.coalesced


@pytest.mark.parametrize(("local_ids", "remote_ids", "expected"), [
    (list(range(N)), list(range(N)), 1),
    (list(range(N))[::-1], list(range(N))[::-1], N),
    (list(range(0, N, 2)), list(range(0, N, 2)), N // 2),
    (list(range(32)) + list(range(32, N))[::-1], list(range(32)) + list(range(32, N))[::-1], 33),
    (list(range(8)), [0, 1, 2, 3, 5, 6, 7, 8], 2),
    (list(range(8)), list(range(8, 16)), 1),
    ([int(i) for i in np.random.default_rng(0).permutation(N)],
     [int(i) for i in np.random.default_rng(0).permutation(N)], None),
], ids=["adjacent", "descending", "every-other", "half-descending", "remote-gap", "shifted",
        "shuffled"])
def test_prepped_transfer_coalesces_like_nixl(pair: Pair, local_ids: list[int],
                                              remote_ids: list[int], expected: int | None
                                              ) -> None:
    if expected is None:  # the shuffled list: whatever the in-order rule says
        expected = coalesced_count(_rows([i * KIB for i in local_ids]),
                                   _rows([i * KIB for i in remote_ids]))
    posted, merged = _prepped(pair, local_ids, remote_ids)
    assert posted == len(local_ids)
    assert merged == expected


def test_non_prepped_transfer_is_not_coalesced_but_strided_is(pair: Pair) -> None:
    a = pair.a
    offsets = [i * KIB for i in range(N)]
    h = a.make_xfer("WRITE", _descs(pair.ma.base_addr, offsets), pair.name,
                    _descs(pair.mb.base_addr, offsets))
    a.transfer(h)
    assert pair.wait(h) == DONE
    t = a.get_xfer_telemetry(h)
    a.release_xfer_handle(h)
    assert (t.descriptors, t.coalesced) == (N, N)  # initialize_xfer: NIXL 1.5 posts every one
    strided = np.array([[pair.ma.base_addr, KIB, 0, KIB, N]], dtype=np.uint64)
    rstrided = np.array([[pair.mb.base_addr, KIB, 0, KIB, N]], dtype=np.uint64)
    h = a.make_xfer("WRITE", strided, pair.name, rstrided)
    a.transfer(h)
    assert pair.wait(h) == DONE
    t = a.get_xfer_telemetry(h)
    a.release_xfer_handle(h)
    assert (t.descriptors, t.coalesced) == (1, 1)  # one strided row of N adjacent runs


def test_simulated_post_is_charged_per_coalesced_descriptor() -> None:
    from test_transport_parity import _sim_pair

    gen = _sim_pair()
    p = next(gen)
    profile = p.a.world.fabric.profile
    for ids, merged in ((list(range(N)), 1), (list(range(N))[::-1], N)):
        posted, got = _prepped(p, ids, ids)
        assert (posted, got) == (N, merged)
        # the last transfer's post time: launch + coalesced x alpha, not posted x alpha
    h_post = {}
    for label, ids in (("adjacent", list(range(N))), ("descending", list(range(N))[::-1])):
        offsets = [i * KIB for i in range(N)]
        local = p.a.prep_xfer_dlist("", _descs(p.ma.base_addr, offsets))
        remote = p.a.prep_xfer_dlist(p.name, _descs(p.mb.base_addr, offsets))
        h = p.a.make_prepped_xfer("READ", local, np.array(ids), remote, np.array(ids))
        p.a.transfer(h)
        p.wait(h)
        h_post[label] = p.a.get_xfer_telemetry(h).post_seconds
        p.a.release_xfer_handle(h)
    # on a host-path profile (DRAM over UCX cma) the copy runs inside the post call, the same
    # bytes either way; the post's own cost is per coalesced descriptor
    copy = (N * KIB / profile.host_copy_core_bandwidth
            if profile.host_copy_core_bandwidth else 0.0)
    assert h_post["adjacent"] == pytest.approx(profile.post_time(1) + copy, rel=1e-9)
    assert h_post["descending"] == pytest.approx(profile.post_time(N) + copy, rel=1e-9)
