"""NIXL hazards still open in issue #10 item 10, and the simulator refusing the same things the
same way: memory the peer withdrew (its re-announced agent metadata no longer lists it), bad
memory types, float descriptor ids and handles, unknown telemetry handles. Every test runs on
``SimTransport`` and on ``NixlTransport`` (two real agents in this process, DRAM) and expects the
same ``TransportError``."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import pytest

from hkvsim.transport.base import DONE, PROC, Memory, TransportError

pytestmark = pytest.mark.timeout(60)

KIB = 4096


@dataclass
class Pair:
    a: Any  # the initiator
    b: Any  # its peer
    ma: Memory
    mb: Memory
    name: str  # b as a knows it
    wait: Callable[[int], str]  # a transfer's final state


def _sim_pair() -> Iterator[Pair]:
    from tests.sim_agents import sim_agent_pair

    env, a, b = sim_agent_pair()

    def wait(handle: int) -> str:
        env.run()
        return a.check_xfer_state(handle)

    yield from _registered(a, b, wait)


def _nixl_pair() -> Iterator[Pair]:
    from hkvsim.transport.nixl import NixlTransport

    a, b = NixlTransport("t-a"), NixlTransport("t-b")

    def wait(handle: int) -> str:
        end = time.monotonic() + 10
        state = a.check_xfer_state(handle)
        while state == PROC and time.monotonic() < end:
            b.get_new_notifs()  # the target keeps calling into NIXL (hazard 6)
            state = a.check_xfer_state(handle)
        return state

    try:
        yield from _registered(a, b, wait)
    finally:
        a.close()
        b.close()


def _registered(a: Any, b: Any, wait: Callable[[int], str]) -> Iterator[Pair]:
    ma, mb = a.allocate(1 << 20, mem_type="DRAM"), b.allocate(1 << 20, mem_type="DRAM")
    a.register_memory(ma)
    b.register_memory(mb)
    yield Pair(a=a, b=b, ma=ma, mb=mb, name=a.add_remote_agent(b.get_agent_metadata()),
               wait=wait)


@pytest.fixture(params=["sim", "nixl"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    if request.param == "nixl":
        request.getfixturevalue("nixl_required")
        yield from _nixl_pair()
    else:
        yield from _sim_pair()


def _descs(base: int, offsets: list[int], length: int = KIB) -> np.ndarray:
    return np.array([[base + o, length, 0] for o in offsets], dtype=np.uint64)


def test_memory_the_peer_withdrew_takes_no_more_transfers(pair: Pair) -> None:
    a, b, ma, mb, name = pair.a, pair.b, pair.ma, pair.mb, pair.name
    local = a.prep_xfer_dlist("", _descs(ma.base_addr, [0, KIB]))
    remote = a.prep_xfer_dlist(name, _descs(mb.base_addr, [0, KIB]))
    ma.array[:2 * KIB] = 7
    h = a.make_prepped_xfer("WRITE", local, [0, 1], remote, [0, 1])
    a.transfer(h)
    assert pair.wait(h) == DONE and (mb.array[:2 * KIB] == 7).all()  # the control: it works
    a.release_xfer_handle(h)
    early = a.make_prepped_xfer("WRITE", local, [0], remote, [0])  # made before the withdrawal

    b.deregister_memory(mb)
    a.add_remote_agent(b.get_agent_metadata())  # b's re-announced metadata, over the side channel
    ma.array[:2 * KIB] = 9
    stale = "stale: remote agent t-b deregistered that memory"
    with pytest.raises(TransportError, match=stale):
        a.make_prepped_xfer("WRITE", local, [0], remote, [0])
    with pytest.raises(TransportError, match="uses a stale descriptor list \\(remote agent t-b "
                                             "deregistered that memory\\); re-prepare it"):
        a.transfer(early)  # NIXL itself: DONE, and the bytes land in the withdrawn memory
    outside = "is outside the memory remote agent t-b has registered"
    with pytest.raises(TransportError, match=outside):
        a.prep_xfer_dlist(name, _descs(mb.base_addr, [0]))  # NIXL itself accepts it
    with pytest.raises(TransportError, match=outside):
        a.make_xfer("WRITE", _descs(ma.base_addr, [0]), name, _descs(mb.base_addr, [0]))
    assert (mb.array[:2 * KIB] == 7).all()  # nothing landed
    a.release_xfer_handle(early)


def test_memory_the_peer_adds_is_accepted_once_announced(pair: Pair) -> None:
    a, b, ma, name = pair.a, pair.b, pair.ma, pair.name
    more = b.allocate(1 << 16, mem_type="DRAM")
    with pytest.raises(TransportError, match="outside the memory remote agent t-b"):
        a.prep_xfer_dlist(name, _descs(more.base_addr, [0]))  # not registered yet
    b.register_memory(more)
    with pytest.raises(TransportError, match="outside the memory remote agent t-b"):
        a.prep_xfer_dlist(name, _descs(more.base_addr, [0]))  # registered, not announced
    a.add_remote_agent(b.get_agent_metadata())
    remote = a.prep_xfer_dlist(name, _descs(more.base_addr, [0, KIB]))
    local = a.prep_xfer_dlist("", _descs(ma.base_addr, [0, KIB]))
    ma.array[:2 * KIB] = 5
    h = a.make_prepped_xfer("WRITE", local, [0, 1], remote, [0, 1])
    a.transfer(h)
    assert pair.wait(h) == DONE and (more.array[:2 * KIB] == 5).all()
    a.release_xfer_handle(h)


def test_a_released_handle_is_refused_by_name(pair: Pair) -> None:
    # NIXL's own API segfaults on transfer() of a released handle and says "DONE" when it is
    # polled (docs/semantics.md §11.4 hazard 1): both transports refuse it, and a second release
    # is a no-op, as in NIXL
    a, ma, mb = pair.a, pair.ma, pair.mb
    local = a.prep_xfer_dlist("", _descs(ma.base_addr, [0]))
    remote = a.prep_xfer_dlist(pair.name, _descs(mb.base_addr, [0]))
    held = a.resources()["transfer_handles"]
    h = a.make_prepped_xfer("WRITE", local, [0], remote, [0])
    assert a.resources()["transfer_handles"] == held + 1
    a.transfer(h)
    assert pair.wait(h) == DONE
    a.release_xfer_handle(h)
    assert a.resources()["transfer_handles"] == held
    ma.array[:KIB] = 3
    for call in (a.transfer, a.check_xfer_state):
        with pytest.raises(TransportError, match=f"transfer handle {h} was released"):
            call(h)
    a.release_xfer_handle(h)  # twice: nothing happens
    assert a.resources()["transfer_handles"] == held
    assert not (mb.array[:KIB] == 3).any()  # the refused re-post moved nothing


def test_a_wrong_memory_type_is_a_transport_error(pair: Pair) -> None:
    a, ma = pair.a, pair.ma
    for bad in ("dram", "GPU", "", None, 3):
        kw = {"mem_type": bad}
        if bad is None:
            continue  # None means "the type of the registered memory"
        with pytest.raises(TransportError, match="memory type .*; allowed: DRAM, VRAM"):
            a.prep_xfer_dlist("", _descs(ma.base_addr, [0]), **kw)  # NIXL: a bare KeyError
    with pytest.raises(TransportError, match="memory type 'dram'; allowed: DRAM, VRAM"):
        a.allocate(KIB, mem_type="dram")
    assert a.prep_xfer_dlist("", _descs(ma.base_addr, [0]), mem_type="DRAM") > 0


def test_float_ids_and_handles_are_refused_not_truncated(pair: Pair) -> None:
    a, ma, mb, name = pair.a, pair.ma, pair.mb, pair.name
    local = a.prep_xfer_dlist("", _descs(ma.base_addr, [0, KIB]))
    remote = a.prep_xfer_dlist(name, _descs(mb.base_addr, [0, KIB]))
    for ids in (np.array([0.0, 1.7]), [0.5, 1.0], np.array([1.0], dtype=np.float32),
                np.array([True, False])):
        with pytest.raises(TransportError, match="descriptor ids must be integers"):
            a.make_prepped_xfer("READ", local, ids, remote, [0, 1][:len(ids)])
        with pytest.raises(TransportError, match="descriptor ids must be integers"):
            a.make_prepped_xfer("READ", local, [0, 1][:len(ids)], remote, ids)
    h = a.make_prepped_xfer("READ", local, np.array([0, 1], dtype=np.uint32), remote, [1, 0])
    assert a.make_prepped_xfer("READ", local, [], remote, []) > 0  # empty: no ids to check
    for bad in (float(h), True, "1", None):
        with pytest.raises(TransportError, match="handle must be an int"):
            a.transfer(bad)
        with pytest.raises(TransportError, match="handle must be an int"):
            a.make_prepped_xfer("READ", bad, [0], remote, [0])
    a.release_xfer_handle(h)


def test_telemetry_of_an_unknown_handle_is_a_transport_error(pair: Pair) -> None:
    a = pair.a
    for bad in (12345, -1):
        with pytest.raises(TransportError, match=f"get_xfer_telemetry of unknown transfer "
                                                 f"handle {bad}"):
            a.get_xfer_telemetry(bad)  # NIXL and the simulator: a bare KeyError
    with pytest.raises(TransportError, match="handle must be an int"):
        a.get_xfer_telemetry(1.0)


@pytest.mark.parametrize("blob,why", [
    (b"", "expected non-empty bytes"),
    (b"\xc1", "undecodable"),
    (msgpack.packb({"agent": "t-b", "native": b""}), "keys agent, native, regions"),
    (msgpack.packb({"agent": "t-b", "native": b"", "regions": [[1, 2]]}),
     "list of \\[addr, len, device\\]"),
    (msgpack.packb({"agent": "t-b", "native": b"", "regions": [[2**64 - 1, 2, 0]]}),
     "overflows the address space"),
    (msgpack.packb({"agent": "t-b", "native": b"", "regions": [[-1, 2, 0]]}),
     "non-negative integers"),
    (msgpack.packb([1] * 5000), "undecodable"),
])
def test_agent_metadata_is_decoded_strictly(pair: Pair, blob: bytes, why: str) -> None:
    with pytest.raises(TransportError, match=f"bad agent metadata: .*{why}") as exc:
        pair.a.add_remote_agent(blob)
    assert exc.value.kind == "handshake_failed"


def test_a_local_list_outside_registered_memory_is_refused_at_prep(pair: Pair) -> None:
    """NIXL checks a local list against the agent's registrations when it is prepared (the
    first-registration-mla-flag quirk ends there on real NIXL); the simulator must too."""
    inside = _descs(pair.ma.base_addr, [0, KIB])
    pair.a.release_dlist_handle(pair.a.prep_xfer_dlist("", inside))
    past_end = _descs(pair.ma.base_addr, [0, pair.ma.nbytes])  # the second starts at the end
    with pytest.raises(TransportError, match="descriptor 1 .* is outside the registered memory"):
        pair.a.prep_xfer_dlist("", past_end)


def test_a_zero_length_descriptor_is_refused_at_prep(pair: Pair) -> None:
    descs = _descs(pair.ma.base_addr, [0, KIB])
    descs[1, 1] = 0
    with pytest.raises(TransportError, match="descriptor 1 has length 0"):
        pair.a.prep_xfer_dlist("", descs)
    remote = _descs(pair.mb.base_addr, [0, KIB])
    remote[0, 1] = 0
    with pytest.raises(TransportError, match="descriptor 0 has length 0"):
        pair.a.prep_xfer_dlist(pair.name, remote)


def test_an_unprepped_transfer_checks_its_local_side_too(pair: Pair) -> None:
    local = _descs(pair.ma.base_addr, [pair.ma.nbytes])  # just past the registered memory
    remote = _descs(pair.mb.base_addr, [0])
    with pytest.raises(TransportError, match="local side: .*outside the registered memory"):
        pair.a.make_xfer("READ", local, pair.name, remote)
