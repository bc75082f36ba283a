"""Attacks on the coordinator's side channel (issue #10 item 9), scripted on loopback against a
real coordinator (``NixlCluster`` waiting for ranks a launcher would start, ``spawn_ranks``
empty: no rank process and no NIXL needed): a flood of unauthenticated connections, oversize first frames, slow-loris
partial frames, wrong credentials and replayed HELLOs are all refused, the coordinator's memory
stays bounded, and every socket is returned once the attackers are gone. The last test runs a
real NIXL scenario while it is being attacked."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgpack
import pytest

from hkvsim.backends import side_channel
from hkvsim.drivers.nixl import NixlDriver as NixlCluster
from hkvsim.drivers.nixl import NixlRunError, NixlRunOptions
from hkvsim.backends.rank import hello_message
from hkvsim.backends.side_channel import MAX_FRAME, pack
from hkvsim.scenario import parse_scenarios

pytestmark = pytest.mark.timeout(120)

SCENARIO = """
[scenario]
name = "side-channel attack target"
[model]
preset = "tiny-llama"
[prefill]
tp = 1
[decode]
tp = 1
[workload]
requests = 2
prompt_tokens = 100
"""


ANNOUNCED: dict[int, dict[tuple[str, int], str]] = {}  # port -> credentials handed to launchers


@contextmanager
def coordinator(tmp_path: Any, *, wait: float = 8.0) -> Iterator[tuple[NixlCluster, int]]:
    """A coordinator listening on loopback and waiting ``wait`` s for ranks that never come
    (the run then ends with "did not connect"). It spawns none itself: the credentials it
    would hand a launcher (torchrun's store, hkvsim.lab) are kept in ``ANNOUNCED``."""
    (scenario,) = parse_scenarios(SCENARIO)
    listening = threading.Event()
    port: list[int] = []

    def announce(_host: str, p: int, credentials: dict[tuple[str, int], str]) -> None:
        ANNOUNCED[p] = dict(credentials)
        port.append(p)
        listening.set()

    cluster = NixlCluster(scenario, options=NixlRunOptions(
        spawn_ranks=frozenset(), startup_timeout=wait, log_dir=str(tmp_path),
        announce=announce))
    errors: list[BaseException] = []

    def run() -> None:
        try:
            cluster.run()
        except BaseException as exc:  # noqa: BLE001 -- reported below
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert listening.wait(15), "the coordinator did not start listening"
    try:
        yield cluster, port[0]
    finally:
        thread.join(wait + 30)
        assert not thread.is_alive(), "the coordinator did not end"
    assert len(errors) == 1 and isinstance(errors[0], NixlRunError), errors
    # no rank ever connected, or (the replay test) the one that did went away again
    assert "did not connect" in str(errors[0]) or "closed its side channel" in str(errors[0])


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the coordinator closes (EOF or reset) ``sock`` within ``seconds``."""
    end = time.monotonic() + seconds
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return False
        sock.settimeout(left)
        try:
            if sock.recv(1 << 16) == b"":
                return True
        except TimeoutError:
            return False
        except OSError:  # reset: the coordinator aborted it
            return True


def _send(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:  # already refused and reset
        pass


def _until(condition: Callable[[], bool], seconds: float) -> bool:
    end = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _launcher_credentials(port: int) -> dict[tuple[str, int], str]:
    """What a launcher learns: each rank's one-time credential (hkvsim.lab puts them in
    torchrun's store)."""
    return ANNOUNCED[port]


def test_a_flood_of_unauthenticated_connections_is_capped_and_returned(tmp_path, monkeypatch):
    monkeypatch.setattr(side_channel, "HELLO_TIMEOUT_S", 3.0)
    with coordinator(tmp_path) as (cluster, port):
        gate = cluster.gate
        assert gate is not None
        fds = _open_fds()
        extra = 40
        socks = [_connect(port) for _ in range(gate.max_pending + extra)]
        # connections beyond the cap are closed at once, the others when their HELLO is late
        assert _until(lambda: gate.refused.get("capacity", 0) >= extra, 5), gate.refused
        assert gate.refused["capacity"] == extra and gate.pending <= gate.max_pending
        assert all(_closed_within(s, 8) for s in socks)
        assert gate.refused.get("timeout", 0) == gate.max_pending
        for s in socks:
            s.close()
        assert _until(lambda: gate.pending == 0 and _open_fds() <= fds, 5), (gate.pending,
                                                                             _open_fds(), fds)


def test_oversize_first_frames_are_refused_from_their_header(tmp_path):
    body = bytes(2 << 20)  # allocated before tracing: the attackers' bytes are not counted
    with coordinator(tmp_path) as (cluster, port):
        gate = cluster.gate
        assert gate is not None
        fds = _open_fds()
        tracemalloc.start()
        try:
            socks = []
            for _ in range(24):
                s = _connect(port)
                _send(s, struct.pack("!I", MAX_FRAME) + body[:1 << 16])  # "16 MiB follow"
                socks.append(s)
            for s in socks:
                _send(s, body)
            s = _connect(port)
            _send(s, struct.pack("!I", (1 << 32) - 1))  # past even the frame limit
            socks.append(s)
            closed = [_closed_within(s, 3) for s in socks]
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert all(closed), closed
        # 24 x 2 MiB were sent; the coordinator never buffers a body it will not accept
        assert peak < 8 << 20, f"{peak / 2**20:.1f} MiB traced during the attack"
        assert gate.refused.get("malformed", 0) == 25
        for s in socks:
            s.close()
        assert _until(lambda: gate.pending == 0 and _open_fds() <= fds, 5)


def test_slow_and_partial_hellos_are_cut_off(tmp_path, monkeypatch):
    monkeypatch.setattr(side_channel, "HELLO_TIMEOUT_S", 1.0)
    with coordinator(tmp_path) as (cluster, port):
        gate = cluster.gate
        assert gate is not None
        hello = pack({"op": "hello", "credential": "x", "engine": "prefill0", "rank": 0,
                      "pid": 1})
        silent = _connect(port)
        half_header = _connect(port)
        _send(half_header, hello[:2])
        half_body = _connect(port)
        _send(half_body, hello[:len(hello) // 2])
        trickle = _connect(port)
        start = time.monotonic()
        for i in range(len(hello) - 1):  # one byte every 0.2 s: never a whole frame in time
            _send(trickle, hello[i:i + 1])
            if _closed_within(trickle, 0.2):
                break
        trickled = time.monotonic() - start
        assert trickled < 3, f"a byte-by-byte HELLO held its connection for {trickled:.1f} s"
        for s in (silent, half_header, half_body):
            assert _closed_within(s, 3)
        assert _until(lambda: gate.refused.get("timeout", 0) == 4 and gate.pending == 0, 3), (
            gate.refused)


def test_wrong_credentials_and_foreign_first_messages_are_refused(tmp_path):
    with coordinator(tmp_path) as (cluster, port):
        gate = cluster.gate
        assert gate is not None
        attempts = [
            pack(hello_message("0" * 32, "prefill0", 0)),  # a guessed credential
            pack(hello_message("0" * 32, "prefill9", 0)),  # a rank that does not exist
            pack({"op": "hello", "token": "t", "engine": "prefill0", "rank": 0, "pid": 1}),
            pack({"op": "node_hello", "token": "guess", "node": 0, "slots": 8}),  # gone
            pack({"op": "ready", "payload": b"", "agent_metadata": b""}),
            struct.pack("!I", 3) + b"\xc1\xc1\xc1",  # not msgpack
        ]
        for data in attempts:
            s = _connect(port)
            _send(s, data)
            assert _closed_within(s, 3), data[:40]
            s.close()
        assert gate.admitted == 0
        assert sum(gate.refused.values()) == len(attempts), gate.refused


def test_a_hello_cannot_be_replayed_in_this_run_or_the_next(tmp_path):
    with coordinator(tmp_path / "run1") as (cluster, port):
        credentials = _launcher_credentials(port)
        assert set(credentials) == {("prefill0", 0), ("decode0", 0)}
        captured = pack(hello_message(credentials[("prefill0", 0)], "prefill0", 0))
        rank = _connect(port)
        _send(rank, captured)
        assert not _closed_within(rank, 1.0)  # admitted: the coordinator keeps it
        replay = _connect(port)
        _send(replay, captured)
        assert _closed_within(replay, 3)
        assert cluster.gate is not None and cluster.gate.refused == {"replay": 1}
        rank.close()
        replay.close()
    # the next run of the lab: the captured HELLO is worthless there too
    with coordinator(tmp_path / "run2") as (cluster, port):
        replay = _connect(port)
        _send(replay, captured)
        assert _closed_within(replay, 3)
        assert cluster.gate is not None and cluster.gate.refused == {"credential": 1}
        fresh = _launcher_credentials(port)
        assert fresh[("prefill0", 0)] != credentials[("prefill0", 0)]
        rank = _connect(port)
        _send(rank, pack(hello_message(fresh[("prefill0", 0)], "prefill0", 0)))
        assert not _closed_within(rank, 1.0)
        assert cluster.gate.admitted == 1  # this rank
        rank.close()
        replay.close()


@pytest.mark.usefixtures("nixl_required")
@pytest.mark.timeout(300)
def test_a_real_nixl_run_completes_while_its_side_channel_is_attacked(tmp_path):
    from hkvsim.drivers.nixl import run_scenario_nixl

    (scenario,) = parse_scenarios(SCENARIO)
    stop = threading.Event()
    refused: list[bool] = []

    def attack(port: int) -> None:
        # one connection at a time, each refused at once: a flood of concurrent connections
        # past the cap would refuse the ranks too (the cap bounds memory, not availability)
        junk = [struct.pack("!I", MAX_FRAME) + bytes(1 << 16),
                pack(hello_message("0" * 32, "prefill0", 0)),
                pack({"op": "hello", "token": "x", "engine": "decode0", "rank": 0, "pid": 1}),
                struct.pack("!I", 3) + msgpack.packb([1, 2])]
        while not stop.is_set():
            for data in junk:
                try:
                    s = _connect(port)
                    _send(s, data)
                    refused.append(_closed_within(s, 2))
                    s.close()
                except OSError:
                    pass
                time.sleep(0.005)

    def on_listening(_host: str, port: int) -> None:
        threading.Thread(target=attack, args=(port,), daemon=True).start()

    try:
        result = run_scenario_nixl(scenario, options=NixlRunOptions(
            on_listening=on_listening, log_dir=str(tmp_path)))
    finally:
        stop.set()
    assert result.outcome == "ok" and result.completed == 2
    assert len(refused) >= 4 and all(refused), refused


# ---- the pieces, without a coordinator --------------------------------------------------------
def test_credentials_are_per_rank_one_time_and_compared_strictly() -> None:
    creds = side_channel.RankCredentials()
    a, b = creds.issue("prefill0", 0), creds.issue("decode0", 0)
    assert a != b and len(a) == 32
    assert "wrong credential" in creds.redeem("prefill0", 0, b)  # another rank's
    assert "wrong credential" in creds.redeem("prefill0", 0, a.encode())  # not a str
    assert "unknown rank" in creds.redeem("prefill0", 1, a)
    assert creds.redeem("prefill0", 0, a) is None
    assert "replayed HELLO" in creds.redeem("prefill0", 0, a)
    assert creds.redeem("decode0", 0, b) is None
    other_run = side_channel.RankCredentials()
    other_run.issue("prefill0", 0)
    assert "wrong credential" in other_run.redeem("prefill0", 0, a)


def test_the_gate_checks_the_first_message_exactly() -> None:
    creds = side_channel.RankCredentials()
    cred = creds.issue("prefill0", 0)
    gate = side_channel.HelloGate(credentials=creds)
    assert "unexpected field" in gate.check(dict(hello_message(cred, "prefill0", 0), x=1))
    assert "must be int" in gate.check(dict(hello_message(cred, "prefill0", 0), rank=True))
    assert "missing field 'credential'" in gate.check({"op": "hello", "engine": "prefill0",
                                                       "rank": 0, "pid": 1})
    assert gate.check(hello_message(cred, "prefill0", 0)) is None
    assert "unexpected first message" in gate.check({"op": "setup"})
    # the node agents' way in (a shared token) is gone with their protocol
    assert "unexpected first message" in gate.check({"op": "node_hello", "token": "tok",
                                                     "node": 0, "slots": 1})
