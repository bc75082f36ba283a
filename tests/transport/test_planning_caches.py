"""What the per-request planning path keeps between calls (issue #14, round 6) answers as if
it were rebuilt on every call: the simulated transport's registered regions (kept per
registration), the connector's two-part OuterIds (built without the general loop), and the
shared row ids of non-prepped transfers."""

from __future__ import annotations

import numpy as np
import pytest

from hkvsim.transport.base import TransportError
from hkvsim.transport.outer import OuterIds
from tests.sim_agents import sim_agent_pair


def _pair() -> tuple[object, object, str]:
    _env, a, b = sim_agent_pair()
    mb = b.allocate(1 << 16, mem_type="DRAM")
    b.register_memory(mb)
    name = a.add_remote_agent(b.get_agent_metadata())
    return a, mb, name


def _rows(base: int, n: int = 4) -> np.ndarray:
    return np.array([[base + 256 * i, 128, 0] for i in range(n)], dtype=np.uint64)


def test_own_registrations_follow_register_and_deregister() -> None:
    """make_xfer's local check sees every registration change: memory registered after a
    transfer was made is accepted, deregistered memory refused (with the message)."""
    a, mb, name = _pair()
    m1 = a.allocate(1 << 16, mem_type="DRAM")
    a.register_memory(m1)
    remote = _rows(mb.base_addr)
    a.release_xfer_handle(a.make_xfer("WRITE", _rows(m1.base_addr), name, remote))
    m2 = a.allocate(1 << 16, mem_type="DRAM")  # not registered yet
    with pytest.raises(TransportError, match=r"make_xfer local side: descriptor 0 .* is "
                                             r"outside the registered memory"):
        a.make_xfer("WRITE", _rows(m2.base_addr), name, remote)
    a.register_memory(m2)
    a.release_xfer_handle(a.make_xfer("WRITE", _rows(m2.base_addr), name, remote))
    a.deregister_memory(m2)
    with pytest.raises(TransportError, match="outside the registered memory"):
        a.make_xfer("WRITE", _rows(m2.base_addr), name, remote)
    a.release_xfer_handle(a.make_xfer("WRITE", _rows(m1.base_addr), name, remote))
    a.deregister_memory(m1)
    with pytest.raises(TransportError, match=r"\(registered: none\)"):
        a.make_xfer("WRITE", _rows(m1.base_addr), name, remote)


def test_own_registrations_are_read_only() -> None:
    a, _, _ = _pair()
    a.register_memory(a.allocate(1 << 12, mem_type="DRAM"))
    regions = a._own_regions()
    assert regions is a._own_regions()  # kept between calls
    with pytest.raises(ValueError):
        regions[0, 1] = 1 << 40  # nobody can widen what is registered through it


def test_row_ids_are_shared_read_only_ranges() -> None:
    a, mb, name = _pair()
    m1 = a.allocate(1 << 16, mem_type="DRAM")
    a.register_memory(m1)
    handles = [a.make_xfer("WRITE", _rows(m1.base_addr, n), name, _rows(mb.base_addr, n))
               for n in (4, 4, 3)]
    ids = [a._xfers[h].local_ids for h in handles]
    assert ids[0] is ids[1] and np.array_equal(ids[0], np.arange(4))
    assert np.array_equal(ids[2], np.arange(3)) and ids[2].dtype == np.int64
    with pytest.raises(ValueError):
        ids[0][0] = 5


_INPUTS = [
    (np.arange(3, dtype=np.int64), np.array([4, 7, 9], dtype=np.int64),
     np.array([100, 200], dtype=np.int64), np.array([1], dtype=np.int64)),
    (np.arange(3, dtype=np.int64), np.zeros(0, dtype=np.int64),  # an empty part: dropped
     np.array([100, 200], dtype=np.int64), np.array([1, 2], dtype=np.int64)),
    (np.arange(3, dtype=np.int64), np.array([4, 7], dtype=np.int64),
     np.zeros(0, dtype=np.int64), np.array([1, 2], dtype=np.int64)),
    (np.arange(3), np.array([4, 7], dtype=np.int32),  # not int64: converted
     np.array([100, 200]), np.array([1, 2], dtype=np.uint16)),
    ([0, 10], [1, 2], [100], [3]),  # lists
]


@pytest.mark.parametrize("inputs", _INPUTS)
@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("first_range", [False, True])
def test_of_two_is_of_arrays(inputs: tuple, frozen: bool, first_range: bool) -> None:
    s0, c0, s1, c1 = inputs
    got = OuterIds.of_two(s0, c0, s1, c1, frozen=frozen, first_range=first_range)
    want = OuterIds.of_arrays(((s0, c0), (s1, c1)), frozen=frozen,
                              ranges=(first_range, False) if first_range else None)
    assert got.size == want.size and got.frozen == want.frozen and got.ranges == want.ranges
    assert len(got.parts) == len(want.parts)
    for (gs, gc), (ws, wc) in zip(got.parts, want.parts):
        assert gs.dtype == ws.dtype == np.int64 and gc.dtype == wc.dtype == np.int64
        assert np.array_equal(gs, ws) and np.array_equal(gc, wc)
    assert np.array_equal(np.asarray(got), np.asarray(want))


def test_of_two_refuses_what_of_arrays_refuses() -> None:
    bad = np.array([[1, 2]], dtype=np.int64)  # 2-D columns
    with pytest.raises(ValueError, match="columns must be 1-D") as two:
        OuterIds.of_two(np.arange(2), bad, np.arange(1), np.arange(1))
    with pytest.raises(ValueError) as arrays:
        OuterIds.of_arrays(((np.arange(2), bad), (np.arange(1), np.arange(1))))
    assert str(two.value) == str(arrays.value)
