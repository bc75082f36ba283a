"""The nixl_agent-shaped adapter over hkvsim's simulated transport (needs no vLLM)."""

from __future__ import annotations

import numpy as np
import pytest
import simpy

from hkvsim.fabric import Fabric, load_profile, place_engines
from hkvsim.implementations.vllm.agent import NixlAgentError, TransportNixlAgent, host_address
from hkvsim.transport.base import TransportError
from hkvsim.transport.sim import SimWorld

N = 1 << 16


def _pair():
    env = simpy.Environment()
    profile = load_profile("cpu-ucx-loopback")
    fabric = Fabric(env, profile, place_engines(profile, [("a", "prefill", 1),
                                                          ("b", "decode", 1)]))
    world = SimWorld(env, fabric)
    ta, tb = world.create_agent("t-a", ("a", 0)), world.create_agent("t-b", ("b", 0))
    ma, mb = ta.allocate(N, mem_type="DRAM"), tb.allocate(N, mem_type="DRAM")
    a, b = TransportNixlAgent(ta, [ma]), TransportNixlAgent(tb, [mb])
    for agent, mem in ((a, ma), (b, mb)):
        agent.register_memory(agent.get_reg_descs([(host_address(mem), N, 0, "")], "DRAM"))
    return env, a, b, ma, mb


def _read_handle(a, b, ma, mb):
    a.add_remote_agent(b.get_agent_metadata())
    b.add_remote_agent(a.get_agent_metadata())
    local = a.prep_xfer_dlist("NIXL_INIT_AGENT", np.array([[host_address(ma), 256, 0]]),
                              mem_type="DRAM")
    remote = a.prep_xfer_dlist("t-b", np.array([[host_address(mb), 256, 0]]), mem_type="DRAM")
    return local, remote, a.make_prepped_xfer("READ", local, [0], remote, [0])


def test_strided_read_moves_the_named_bytes_and_notifies():
    env, a, b, ma, mb = _pair()
    mb.array[:] = np.arange(N, dtype=np.uint64).astype(np.uint8)
    assert a.add_remote_agent(b.get_agent_metadata()) == "t-b"
    b.add_remote_agent(a.get_agent_metadata())
    ha, hb = host_address(ma), host_address(mb)
    # 4 runs of 256 B every 1 KiB, as one strided row; ids count the expanded runs
    local = a.prep_xfer_dlist("NIXL_INIT_AGENT", np.array([[ha, 256, 0, 1024, 4]]),
                              mem_type="DRAM")
    remote = a.prep_xfer_dlist("t-b", np.array([[hb + 8192, 256, 0, 1024, 4]]), mem_type="DRAM")
    x = a.make_prepped_xfer("READ", local, [0, 2], remote, [1, 3], notif_msg="req-7")
    env.run(until=0.25)  # posted a quarter second in: telemetry's start is in microseconds
    assert a.transfer(x) == "PROC"
    env.run()
    assert a.check_xfer_state(x) == "DONE"
    want = np.zeros(N, np.uint8)
    want[0:256] = mb.array[8192 + 1024:8192 + 1024 + 256]
    want[2048:2304] = mb.array[8192 + 3072:8192 + 3072 + 256]
    assert np.array_equal(ma.array, want)
    assert b.get_new_notifs() == {"t-a": [b"req-7"]}
    tel = a.get_xfer_telemetry(x)
    assert (tel.totalBytes, tel.descCount) == (512, 2) and tel.postDuration > 0
    assert tel.startTime == 250_000 and tel.xferDuration > 0
    a.release_xfer_handle(x)
    with pytest.raises(NixlAgentError, match="released"):
        a.check_xfer_state(x)


def test_descriptors_outside_registered_memory_are_refused():
    env, a, b, ma, mb = _pair()
    a.add_remote_agent(b.get_agent_metadata())
    with pytest.raises(NixlAgentError, match="not inside memory remote agent t-b registered"):
        a.prep_xfer_dlist("t-b", np.array([[host_address(mb) + N - 8, 16, 0]]))
    with pytest.raises(NixlAgentError, match="descriptor 1 .* not inside memory remote agent"):
        # below the peer's only memory: no memory starts at or before it
        a.prep_xfer_dlist("t-b", np.array([[host_address(mb), 8, 0],
                                           [host_address(mb) - 64, 16, 0]]))
    with pytest.raises(NixlAgentError, match="not inside memory this agent can register"):
        a.register_memory(a.get_reg_descs([(host_address(ma) + N, 8, 0, "")], "DRAM"))
    with pytest.raises(NixlAgentError, match="unknown remote agent 'nobody'"):
        a.prep_xfer_dlist("nobody", np.array([[host_address(mb), 8, 0]]))
    with pytest.raises(NixlAgentError, match="memory type 'HBM'"):
        a.get_reg_descs([(host_address(ma), 8, 0, "")], "HBM")


def test_a_malformed_peer_metadata_is_a_handshake_failure():
    env, a, b, ma, mb = _pair()
    with pytest.raises(NixlAgentError, match="undecodable") as err:
        a.add_remote_agent(b"\x93garbage")
    assert err.value.kind == "handshake_failed"


def test_deregistration_is_counted_and_withdraws_memory():
    env, a, b, ma, mb = _pair()
    a.add_remote_agent(b.get_agent_metadata())
    b.deregister_memory([(host_address(mb), N, 0, "")])
    with pytest.raises(NixlAgentError, match="not registered"):
        b.deregister_memory([(host_address(mb), N, 0, "")])
    a.add_remote_agent(b.get_agent_metadata())  # the peer's newer metadata: nothing registered
    with pytest.raises(NixlAgentError, match="registered no memory"):
        a.prep_xfer_dlist("t-b", np.array([[host_address(mb), 8, 0]]))


def test_descriptor_ids_are_cast_from_whole_floats_as_nixl_does() -> None:
    # NIXL's binding casts a float id array (vLLM 0.27 builds one when a group's block list is
    # empty: np.asarray([]) is float64); a fractional id stays an error
    from hkvsim.implementations.vllm.agent import _indices

    out = _indices(np.concatenate([np.asarray([]), np.array([3, 4])]))
    assert out.dtype == np.int64 and out.tolist() == [3, 4]
    assert _indices([1, 2]).dtype.kind in "iu"
    assert _indices(np.array([0.5])).dtype.kind == "f"  # left for the transport to refuse


def test_gated_notifications_reach_vllm_only_after_they_were_peeked():
    # a prefill rank peeks its notifications (registering each request with vLLM) before vLLM
    # reads them; one arriving in between (real NIXL delivers at any time) must wait for the
    # next peek, or vLLM would read it for a request it does not know yet and drop it
    env, a, b, ma, mb = _pair()
    a.add_remote_agent(b.get_agent_metadata())
    b.add_remote_agent(a.get_agent_metadata())
    b.gate_notifs = True
    a.send_notif("t-b", b"req-1:1")
    env.run()
    assert b.peek_notifs() == {"t-a": [b"req-1:1"]}
    a.send_notif("t-b", b"req-2:1")  # arrives after the peek, before vLLM reads
    env.run()
    assert b.get_new_notifs() == {"t-a": [b"req-1:1"]}  # what was peeked, nothing more
    assert b.get_new_notifs() == {}
    assert b.peek_notifs() == {"t-a": [b"req-2:1"]}
    assert b.get_new_notifs() == {"t-a": [b"req-2:1"]}


def test_how_vllm_saw_a_transfer_end_is_kept_until_its_handle_is_made_again(monkeypatch):
    # the harness learns a failed push WRITE from vLLM's own checks (vLLM forgets it in the call
    # that records it): kept after vLLM releases the handle, dropped when a transport hands the
    # same handle number to a new transfer
    env, a, b, ma, mb = _pair()
    local, remote, x = _read_handle(a, b, ma, mb)
    assert a.transfer(x) == "PROC" and a.ended_as(x) is None
    assert a.check_xfer_state(x) == "PROC" and a.ended_as(x) is None
    env.run()
    assert a.check_xfer_state(x) == "DONE" and a.ended_as(x) == "DONE"
    a.release_xfer_handle(x)
    assert a.ended_as(x) == "DONE"
    monkeypatch.setattr(a.transport, "make_prepped_xfer", lambda *args: x)
    assert a.make_prepped_xfer("READ", local, [0], remote, [0]) == x
    assert a.ended_as(x) is None


def test_a_transfer_is_live_until_vllm_releases_its_handle(monkeypatch):
    # the coordinator must not reuse or recompute blocks a transfer vLLM still holds may write:
    # live from the post until vLLM's release succeeds (not at DONE or ERR: vLLM 0.33.0 keeps a
    # handle whose release fails, the backend's DMA may still run); a post that raised moved
    # nothing; a handle number made again is a new transfer (nothing of the old one is kept)
    env, a, b, ma, mb = _pair()
    local, remote, x = _read_handle(a, b, ma, mb)
    assert not a.is_live(x)  # made, not posted: nothing moves
    assert a.transfer(x) == "PROC" and a.is_live(x)
    env.run()
    assert a.check_xfer_state(x) == "DONE" and a.is_live(x)
    old = a.telemetry_of(x)
    a.release_xfer_handle(x)
    assert not a.is_live(x) and a.telemetry_of(x) == old
    monkeypatch.setattr(a.transport, "make_prepped_xfer", lambda *args: x)
    assert a.make_prepped_xfer("READ", local, [0], remote, [0]) == x
    assert not a.is_live(x)  # made again: a new transfer, not posted yet
    monkeypatch.setattr(a.transport, "transfer", lambda h: "PROC")
    assert a.transfer(x) == "PROC" and a.is_live(x)  # posted, not released
    monkeypatch.setattr(a.transport, "get_xfer_telemetry", lambda h: "the new transfer's")
    assert a.telemetry_of(x) == "the new transfer's"  # not the released one's
    monkeypatch.setattr(a.transport, "transfer", lambda h: (_ for _ in ()).throw(
        TransportError("no route", kind="remote_disconnect")))
    with pytest.raises(NixlAgentError):
        a.transfer(x)
    assert not a.is_live(x) and a.post_failure(x)[0] == "remote_disconnect"
    assert a.make_prepped_xfer("READ", local, [0], remote, [0]) == x
    assert a.post_failure(x) is None and not a.is_live(x)


def test_a_state_check_that_raises_is_remembered_as_a_transfer_exception(monkeypatch):
    # vLLM's log calls it transfer_exception whatever raised; the harness names the request's
    # failure the same way (hkvsim's core does); a handle made again forgets it
    env, a, b, ma, mb = _pair()
    local, remote, x = _read_handle(a, b, ma, mb)
    a.transfer(x)
    monkeypatch.setattr(a.transport, "check_xfer_state", lambda h: (_ for _ in ()).throw(
        TransportError("peer gone", kind="remote_disconnect")))
    with pytest.raises(NixlAgentError):
        a.check_xfer_state(x)
    assert a.poll_failure(x) == ("transfer_exception", "peer gone")
    assert a.ended_as(x) is None and a.is_live(x)  # a raising check says nothing of the DMA
    monkeypatch.setattr(a.transport, "make_prepped_xfer", lambda *args: x)
    a.make_prepped_xfer("READ", local, [0], remote, [0])
    assert a.poll_failure(x) is None


def test_descriptor_rows_keep_an_empty_list_empty_and_refuse_a_negative_field() -> None:
    # vLLM hands the agent lists of tuples, arrays or (addr, len, dev, name) rows: an empty
    # list is zero rows (not one row at address 0), and a negative field in a signed array is
    # refused rather than wrapped to a huge unsigned address
    from hkvsim.implementations.vllm.agent import _rows

    for empty in ([], (), np.zeros((0, 3), np.int64)):
        rows = _rows(empty, what="x")
        assert rows.shape == (0, 3) and rows.dtype == np.uint64
    rows = _rows([(4096, 256, 0, "name"), (8192, 128, 1, "")], what="x")
    assert rows.tolist() == [[4096, 256, 0], [8192, 128, 1]] and rows.dtype == np.uint64
    for negative in (np.array([[4096, -1, 0]], np.int64), [(-4096, 256, 0)]):
        with pytest.raises(NixlAgentError, match="x: a descriptor has a negative field"):
            _rows(negative, what="x")
    with pytest.raises(NixlAgentError, match=r"must be \(N, 3\)"):
        _rows(np.array([[1.5, 2.0, 0.0]]), what="x")


def test_memory_registered_as_another_type_than_it_was_allocated_is_refused():
    # vLLM names the memory type of what it registers: DRAM memory registered as VRAM would
    # have the transport move bytes as the wrong kind, so the agent refuses it
    env = simpy.Environment()
    profile = load_profile("cpu-ucx-loopback")
    fabric = Fabric(env, profile, place_engines(profile, [("a", "prefill", 1)]))
    transport = SimWorld(env, fabric).create_agent("t-a", ("a", 0))
    memory = transport.allocate(N, mem_type="DRAM")
    agent = TransportNixlAgent(transport, [memory])
    descs = [(host_address(memory), N, 0, "")]
    with pytest.raises(NixlAgentError, match="memory type VRAM but the memory was allocated as "
                                             "DRAM"):
        agent.register_memory(agent.get_reg_descs(descs, "VRAM"))
    agent.register_memory(agent.get_reg_descs(descs, "DRAM"))  # its own type: registered
    agent.deregister_memory(descs)


def test_agent_metadata_over_two_mib_is_refused_before_it_is_decoded():
    env, a, b, ma, mb = _pair()
    with pytest.raises(NixlAgentError, match="undecodable"):  # at the cap: decoded (and bad)
        a.add_remote_agent(b"\xc1" * (1 << 21))
    with pytest.raises(NixlAgentError, match="at most 2097152 B") as err:
        a.add_remote_agent(b"\xc1" * ((1 << 21) + 1))
    assert err.value.kind == "handshake_failed"


def test_memory_registered_twice_stays_registered_until_its_last_deregistration():
    # vLLM may register one tensor's memory under several descriptors: the transport keeps it
    # until the last of them is deregistered
    env, a, b, ma, mb = _pair()
    memories = a.transport.world.agent("t-a").memories
    descs = [(host_address(ma), N, 0, "")]
    a.register_memory(a.get_reg_descs(descs, "DRAM"))  # a second time
    a.deregister_memory(descs)
    assert ma in memories
    a.deregister_memory(descs)
    assert ma not in memories
