"""The side channel of the NIXL run: length-prefixed msgpack, strict decoding, no pickle. Pure
Python: these run without NIXL."""

from __future__ import annotations

import pickle
import socket
import struct

import msgpack
import numpy as np
import pytest

from hkvsim.backends.rank import ucx_transports
from hkvsim.backends.side_channel import (
    MAX_FRAME,
    Channel,
    ChannelClosed,
    FrameBuffer,
    ProtocolError,
    fields,
    groups_in,
    groups_out,
    pack,
    token_ok,
    unpack,
)

pytestmark = pytest.mark.timeout(30)


def test_round_trip_and_incremental_frames() -> None:
    msgs = [{"op": "read", "seq": i, "payload": b"\x00" * i, "blocks": [[0, [1, 2]]]}
            for i in range(5)]
    stream = b"".join(pack(m) for m in msgs)
    buf = FrameBuffer()
    out = []
    for i in range(0, len(stream), 7):  # arbitrary TCP segmentation
        out.extend(buf.feed(stream[i:i + 7]))
    assert out == msgs


@pytest.mark.parametrize("body", [
    pickle.dumps({"op": "x"}),  # never unpickled
    msgpack.packb([1, 2, 3]),  # not a map
    msgpack.packb({"seq": 1}),  # no op
    msgpack.packb({1: "op"}),  # non-str key
    msgpack.packb({"op": "x", "e": msgpack.ExtType(1, b"z")}),  # extension type
    b"\xc1",  # invalid msgpack
])
def test_strict_decoding_refuses(body: bytes) -> None:
    with pytest.raises(ProtocolError):
        unpack(body)


def test_size_limit() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        FrameBuffer().feed(struct.pack("!I", MAX_FRAME + 1))
    with pytest.raises(ProtocolError, match="frame limit"):
        pack({"op": "big", "b": b"\x00" * (MAX_FRAME + 1)})


def test_field_checks_are_exact() -> None:
    spec = {"rank": int, "name": str}
    assert fields({"op": "x", "rank": 1, "name": "a"}, spec) == {"rank": 1, "name": "a"}
    with pytest.raises(ProtocolError, match="missing field 'name'"):
        fields({"op": "x", "rank": 1}, spec)
    with pytest.raises(ProtocolError, match="unexpected field"):
        fields({"op": "x", "rank": 1, "name": "a", "extra": 0}, spec)
    with pytest.raises(ProtocolError, match="got a bool"):
        fields({"op": "x", "rank": True, "name": "a"}, spec)


def test_block_groups() -> None:
    groups = {0: np.array([3, 4]), 2: np.array([], dtype=np.int64)}
    back = groups_in(groups_out(groups))
    assert set(back) == {0, 2} and back[0].tolist() == [3, 4] and back[2].size == 0
    for bad in ([[0, [-1]]], [[0, [1]], [0, [2]]], [["g", [1]]], {"0": [1]}):
        with pytest.raises(ProtocolError):
            groups_in(bad)


def test_token_is_compared_strictly() -> None:
    assert token_ok("abc", "abc")
    assert not token_ok("abd", "abc") and not token_ok(None, "abc")


def test_channel_over_loopback() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    client = Channel.connect("127.0.0.1", server.getsockname()[1], timeout=5)
    conn, _ = server.accept()
    peer = Channel(conn)
    client.send({"op": "hello", "seq": 1})
    assert peer.recv(5.0) == {"op": "hello", "seq": 1}
    with pytest.raises(TimeoutError):
        peer.recv(0.05)
    client.close()
    with pytest.raises(ChannelClosed):
        peer.recv(5.0)
    with pytest.raises(ChannelClosed):  # and on every later call
        peer.poll(0.0)
    # messages sent before the close are delivered first; a channel closed on this side says
    # so, not an OSError of its socket
    client = Channel.connect("127.0.0.1", server.getsockname()[1], timeout=5)
    conn, _ = server.accept()
    peer = Channel(conn)
    client.send({"op": "a", "seq": 1})
    client.send({"op": "b", "seq": 2})
    client.close()
    assert [peer.recv(5.0)["seq"], peer.recv(5.0)["seq"]] == [1, 2]
    with pytest.raises(ChannelClosed):
        peer.recv(5.0)
    peer.close()
    with pytest.raises(ChannelClosed, match="side channel closed"):
        peer.poll(0.0)
    server.close()


def test_ucx_transport_parsing() -> None:
    log = """[1.0] [vm:1:0]   | A self cfg#0                                             |
[1.0] [vm:1:0]   | remote memory write by ucp_put* from host memory to host |
[1.0] [vm:1:0]   | 0..inf | zero-copy   | cma/memory                        |
[1.0] [vm:1:0]   | A intra-node cfg#1                                       |
[1.0] [vm:1:0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1.0] [vm:1:0]   +--------+-------------+-----------------+
[1.0] [vm:1:0]   | 0..inf | zero-copy   | cma/memory                        |
[1.0] [vm:1:0]   | A intra-node cfg#1                                       |
[1.0] [vm:1:0]   | active message by ucp_am_send* from host memory |
[1.0] [vm:1:0]   |   1..16515 | zero-copy          | tcp/lo        |
"""
    assert ucx_transports(log) == ["cma/memory"]
    assert ucx_transports("nothing here") == []
