"""NixlTransport against real NIXL agents (two agents in this process, DRAM): the Transport
protocol, and every docs/semantics.md §11.4 hazard turned into a readable TransportError."""

from __future__ import annotations

import time

import numpy as np
import pytest

from hkvsim.transport.base import DONE, ERR, PROC, Transport, TransportError

pytestmark = [pytest.mark.usefixtures("nixl_required"), pytest.mark.timeout(60)]

KIB = 4096


@pytest.fixture
def pair():
    from hkvsim.transport.nixl import NixlTransport

    a, b = NixlTransport("t-a"), NixlTransport("t-b")
    ma = a.allocate(1 << 20, mem_type="DRAM")
    mb = b.allocate(1 << 20, mem_type="DRAM")
    a.register_memory(ma)
    b.register_memory(mb)
    mb.array[:] = (np.arange(mb.nbytes) % 251).astype(np.uint8)
    name = a.add_remote_agent(b.get_agent_metadata())
    yield a, b, ma, mb, name
    a.close()
    b.close()


def _descs(base: int, offsets: list[int], length: int = KIB) -> np.ndarray:
    return np.array([[base + o, length, 0] for o in offsets], dtype=np.uint64)


def _wait(t, handle, peer=None) -> str:
    end = time.monotonic() + 10
    state = t.check_xfer_state(handle)
    while state == PROC and time.monotonic() < end:
        if peer is not None:
            peer.get_new_notifs()  # the target keeps calling into NIXL (hazard 6)
        state = t.check_xfer_state(handle)
    return state


def _one_read_done(pair) -> tuple[int, int, int]:
    """One 4 KiB READ from b's memory into a's, waited on until DONE: (local list, remote
    list, transfer handle), nothing released."""
    a, b, ma, mb, name = pair
    local = a.prep_xfer_dlist("", _descs(ma.base_addr, [0]))
    remote = a.prep_xfer_dlist(name, _descs(mb.base_addr, [0]))
    h = a.make_prepped_xfer("READ", local, [0], remote, [0])
    a.transfer(h)
    assert _wait(a, h, b) == DONE
    return local, remote, h


def test_is_a_transport(pair) -> None:
    a, *_ = pair
    assert isinstance(a, Transport)
    assert a.backends == ("UCX",)


def test_read_moves_bytes_notifies_and_reports_telemetry(pair) -> None:
    a, b, ma, mb, name = pair
    local = a.prep_xfer_dlist("", _descs(ma.base_addr, [0, 3 * KIB]))
    remote = a.prep_xfer_dlist(name, _descs(mb.base_addr, [8 * KIB, 20 * KIB]))
    h = a.make_prepped_xfer("READ", local, np.arange(2), remote, np.arange(2), b"req-1:1")
    a.transfer(h)
    assert _wait(a, h, b) == DONE
    assert np.array_equal(ma.array[:KIB], mb.array[8 * KIB:9 * KIB])
    assert np.array_equal(ma.array[3 * KIB:4 * KIB], mb.array[20 * KIB:21 * KIB])
    tel = a.get_xfer_telemetry(h)
    assert (tel.nbytes, tel.descriptors) == (2 * KIB, 2) and tel.completed is not None
    assert tel.path[0] == "UCX"
    end = time.monotonic() + 5
    got: dict[str, list[bytes]] = {}
    while not got and time.monotonic() < end:
        got = b.get_new_notifs()
    assert got == {"t-a": [b"req-1:1"]}
    a.release_xfer_handle(h)
    assert a.open_handles() == 0


def test_transfers_in_progress_counts_what_was_last_seen_in_progress(pair) -> None:
    """What a rank asks before an operation that stops it polling NIXL: on UCX cma the copy
    ends inside the post, so nothing is in progress afterwards; a transfer last seen PROC (as
    on a GPU) counts until a poll sees it done, and a released one never does."""
    a, b, ma, mb, name = pair
    local = a.prep_xfer_dlist("", _descs(ma.base_addr, [0]))
    remote = a.prep_xfer_dlist(name, _descs(mb.base_addr, [8 * KIB]))
    h = a.make_prepped_xfer("READ", local, np.arange(1), remote, np.arange(1), b"")
    assert a.transfers_in_progress() == 0  # made, not posted
    a.transfer(h)
    assert _wait(a, h, b) == DONE and a.transfers_in_progress() == 0
    a._xfers[h].state = PROC  # as a GPU transfer whose post returned in progress
    a._posted.add(h)
    assert a.transfers_in_progress() == 1
    assert a.check_xfer_state(h) == DONE and a.transfers_in_progress() == 0  # a poll sees it
    a.release_xfer_handle(h)
    a._xfers[h].state = PROC
    a._posted.add(h)
    assert a.transfers_in_progress() == 0  # released: not waited for


def test_write_and_non_prepped_strided(pair) -> None:
    a, b, ma, mb, name = pair
    ma.array[:] = 9
    rows_l = np.array([[ma.base_addr, KIB, 0, 2 * KIB, 3]], dtype=np.uint64)
    rows_r = np.array([[mb.base_addr + 64 * KIB, KIB, 0, 4 * KIB, 3]], dtype=np.uint64)
    h = a.make_xfer("WRITE", rows_l, name, rows_r, b"")
    a.transfer(h)
    assert _wait(a, h, b) == DONE
    for i in range(3):
        off = 64 * KIB + i * 4 * KIB
        assert (mb.array[off:off + KIB] == 9).all()
    a.release_xfer_handle(h)
    h = a.make_xfer("READ", _descs(ma.base_addr, [0]), name, _descs(mb.base_addr, [KIB]))
    a.transfer(h)
    assert _wait(a, h, b) == DONE
    assert np.array_equal(ma.array[:KIB], mb.array[KIB:2 * KIB])
    a.release_xfer_handle(h)


def test_released_handles_are_refused_not_segfaults(pair) -> None:
    a = pair[0]
    *_, h = _one_read_done(pair)
    a.release_xfer_handle(h)
    a.release_xfer_handle(h)  # idempotent
    with pytest.raises(TransportError, match="was released"):
        a.transfer(h)  # NIXL itself segfaults here (hazard 1)
    with pytest.raises(TransportError, match="was released"):
        a.check_xfer_state(h)  # NIXL answers "DONE" (hazard 1)


def test_malformed_descriptor_arrays_are_refused(pair) -> None:
    a, _, ma, mb, name = pair
    with pytest.raises(TransportError, match=r"\(N, 3\)"):
        a.prep_xfer_dlist("", np.arange(3, dtype=np.uint64))  # NIXL returns None (hazard 3)
    with pytest.raises(TransportError, match="length 0"):
        a.prep_xfer_dlist("", _descs(ma.base_addr, [0], length=0))
    with pytest.raises(TransportError, match="outside the registered memory"):
        a.prep_xfer_dlist("", _descs(ma.base_addr, [ma.nbytes]))
    with pytest.raises(TransportError, match="unknown remote agent"):
        a.prep_xfer_dlist("nobody", _descs(mb.base_addr, [0]))


def test_transfer_errors_name_operation_agent_index_and_lengths(pair) -> None:
    a, _, ma, mb, name = pair
    local = a.prep_xfer_dlist("", _descs(ma.base_addr, [0, KIB]))
    remote = a.prep_xfer_dlist(name, np.array([[mb.base_addr, KIB, 0],
                                               [mb.base_addr + KIB, 2 * KIB, 0]], np.uint64))
    with pytest.raises(TransportError, match=r"READ with t-b: remote descriptor id out of range "
                                             r"at index 1 \(id 7\).*has 2 descriptors"):
        a.make_prepped_xfer("READ", local, [0, 1], remote, [0, 7])
    with pytest.raises(TransportError, match="pair 1 .*local length 4096 but remote length 8192"):
        a.make_prepped_xfer("READ", local, [0, 1], remote, [0, 1])
    with pytest.raises(TransportError, match="unknown op 'read'"):
        a.make_prepped_xfer("read", local, [0], remote, [0])
    with pytest.raises(TransportError, match="invalid sides"):
        a.make_prepped_xfer("READ", remote, [0], local, [0])


def test_deregistered_memory_makes_lists_stale(pair) -> None:
    a, _, ma, mb, name = pair
    local = a.prep_xfer_dlist("", _descs(ma.base_addr, [0]))
    remote = a.prep_xfer_dlist(name, _descs(mb.base_addr, [0]))
    a.deregister_memory(ma)
    with pytest.raises(TransportError, match="stale: its memory was deregistered"):
        a.make_prepped_xfer("READ", local, [0], remote, [0])  # NIXL would post it (hazard 2)
    with pytest.raises(TransportError, match="not registered"):
        a.deregister_memory(ma)
    a.register_memory(ma)
    local = a.prep_xfer_dlist("", _descs(ma.base_addr, [0]))
    a.remove_remote_agent(name)  # hazard 7: remote lists must be re-prepared
    with pytest.raises(TransportError, match="stale: remote agent t-b was removed"):
        a.make_prepped_xfer("READ", local, [0], remote, [0])
    with pytest.raises(TransportError, match="unknown remote agent"):
        a.make_xfer("READ", _descs(ma.base_addr, [0]), name, _descs(mb.base_addr, [0]))


def test_memory_under_a_finished_transfer_may_be_deregistered(pair) -> None:
    # only a transfer still in progress pins its memory; a finished one (not yet released)
    # does not, and its lists then go stale like any other
    a, _, ma, _, _ = pair
    local, remote, _ = _one_read_done(pair)
    a.deregister_memory(ma)
    assert a.resources()["registered_memory"] == 0
    with pytest.raises(TransportError, match="stale: its memory was deregistered"):
        a.make_prepped_xfer("READ", local, [0], remote, [0])


def test_local_descriptors_outside_registered_memory_are_refused(pair) -> None:
    a, _, ma, _, _ = pair
    with pytest.raises(TransportError, match="registered memory"):
        a.prep_xfer_dlist("", _descs(ma.base_addr + ma.nbytes, [0]))
    with pytest.raises(TransportError, match="registered memory"):  # straddles its end
        a.prep_xfer_dlist("", _descs(ma.base_addr, [ma.nbytes - KIB // 2]))


def test_a_deferred_list_is_released_with_its_last_transfer(pair) -> None:
    a = pair[0]
    local, _, h = _one_read_done(pair)
    a.release_dlist_handle(local)  # deferred: the transfer still uses it
    assert a.resources()["dlist_handles"] == 2
    a.release_xfer_handle(h)
    assert a.resources()["dlist_handles"] == 1  # the remote list, still wanted
    report = a.close()  # releases the remote list itself
    assert report["released_dlists"] == 1 and report["leaked"] == 0
    assert not any(a.resources().values()), a.resources()


def test_metadata_naming_another_agent_than_nixl_loads_is_refused(pair) -> None:
    # a peer's wrapper says "t-x" around t-b's NIXL metadata: refused, nothing recorded under
    # either name, and t-b's own metadata still loads afterwards
    from hkvsim.transport.base import decode_agent_metadata, encode_agent_metadata
    from hkvsim.transport.nixl import NixlTransport

    _, b, *_ = pair
    native = decode_agent_metadata(b.get_agent_metadata(), what="test").native
    c = NixlTransport("t-c")
    try:
        with pytest.raises(TransportError, match="announced agent 't-x' but NIXL loaded 't-b'"
                           ) as refused:
            c.add_remote_agent(encode_agent_metadata("t-x", native, []))
        assert refused.value.kind == "handshake_failed"
        assert c.resources()["remote_agents"] == 0
        assert c.add_remote_agent(b.get_agent_metadata()) == "t-b"  # the honest one loads
    finally:
        c.close()


def test_peer_death_is_remote_disconnect(pair) -> None:
    a, b, *_ = pair
    *_, h = _one_read_done(pair)
    b.close()  # the peer's agent goes away (in a run: its process dies)
    try:
        state = a.transfer(h)
        state = _wait(a, h) if state == PROC else state
    except TransportError as exc:
        assert exc.kind == "remote_disconnect", exc
    else:  # in one process UCX may still complete; it must not claim anything else
        assert state in (DONE, ERR)


def test_close_releases_everything_even_mid_use(pair) -> None:
    a, b, ma, mb, name = pair
    local = a.prep_xfer_dlist("", _descs(ma.base_addr, [0]))
    remote = a.prep_xfer_dlist(name, _descs(mb.base_addr, [0]))
    h = a.make_prepped_xfer("READ", local, [0], remote, [0])
    a.transfer(h)
    _wait(a, h, b)
    a.release_dlist_handle(local)  # deferred: a transfer still uses it
    assert a.resources()["dlist_handles"] == 2
    report = a.close()
    assert report["deregistered"] == 1 and report["removed_agents"] == 1
    assert report["released_xfers"] == 1 and report["leaked"] == 0
    assert a.close()["deregistered"] == 0  # idempotent
    with pytest.raises(TransportError, match="closed"):
        a.get_agent_metadata()


def test_unknown_backend_is_refused() -> None:
    from hkvsim.transport.nixl import NixlConfig, NixlTransport

    with pytest.raises(TransportError, match="did not start"):
        NixlTransport("t-bad", config=NixlConfig(backends=("NO_SUCH_BACKEND",)))


def test_listener_is_never_enabled(monkeypatch) -> None:
    from hkvsim.transport import nixl as mod

    seen = {}
    api = mod.load_nixl()
    real = api.nixl_agent_config

    def spy(**kwargs):
        seen.update(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(api, "nixl_agent_config", spy)
    mod.NixlTransport("t-spy").close()
    assert seen["enable_listen_thread"] is False


@pytest.mark.timeout(60)
def test_loading_nixl_does_not_import_torch(nixl_required) -> None:
    """In a fresh interpreter, as in every rank process: NIXL loads and torch stays out (the meta
    package imports a CPU build of torch to learn it has no CUDA: ~2.4 s of CPU per rank here).
    Meaningful where torch is installed, as in scripts/test's environment."""
    import subprocess
    import sys

    from hkvsim.transport.nixl import installed_nixl_backends

    if len(installed_nixl_backends()) != 1:
        pytest.skip("several NIXL backend wheels: the meta package chooses (and may import torch)")
    code = ("import sys; from hkvsim.transport.nixl import load_nixl; api = load_nixl(); "
            "print(api.__name__, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=50, check=True).stdout.split()
    assert out[1] == "False", out
