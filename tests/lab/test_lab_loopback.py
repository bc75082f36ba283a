"""torchrun as hkvsim launches it on one machine (``python -m hkvsim.lab_torchrun``): every store
a run serves on a loopback name listens on loopback only (plain torchrun listens on every
interface whatever host it is given)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hkvsim.lab_torchrun import _bind, _loopback_listener, is_loopback_name

from .listening import is_loopback_address, listening_addresses, listeners_in

HERE = Path(__file__).resolve().parent


def test_loopback_names() -> None:
    for name in ("localhost", "127.0.0.1", "127.1.2.3", "::1", "[::1]", "LOCALHOST"):
        assert is_loopback_name(name), name
    for name in ("0.0.0.0", "::", "10.0.0.1", "example.org", "", "localhost.example.org"):
        assert not is_loopback_name(name), name


def test_store_arguments_are_bound_by_torchs_order() -> None:
    assert _bind(("localhost", 0), {"is_master": True}) == {
        "host_name": "localhost", "port": 0, "is_master": True}
    assert _bind(("h", 1, 3, True), {}) == {"host_name": "h", "port": 1, "world_size": 3,
                                            "is_master": True}
    assert _bind((), {"host_name": "h", "port": 2}) == {"host_name": "h", "port": 2}
    # what does not fit torch's documented signature is left to torch
    assert _bind(("h",), {"host_name": "x", "port": 1}) is None
    assert _bind(("h", 1), {"bogus": 1}) is None
    assert _bind(("h",), {}) is None


TCP = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 111
   1: 0100007F:1F91 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 222
   2: 0100007F:1F92 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 333
   3: 0200000A:1F93 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 444
"""
TCP6 = """  sl  local_address                         remote_address                        st ...
   0: 00000000000000000000000000000000:A14F 00000000000000000000000000000000:0000 0A 0 0 0 0 0 555
   1: 00000000000000000000000001000000:A150 00000000000000000000000000000000:0000 0A 0 0 0 0 0 666
"""


def test_a_taken_port_raises_what_torch_falls_back_on() -> None:
    """Two agents of one multi-node run on the same machine both try to serve the store: the
    second must get TCPStore's RuntimeError (torch then joins as a client), not an OSError."""
    first = _loopback_listener(0)
    try:
        with pytest.raises(RuntimeError, match="cannot listen on 127.0.0.1:"):
            _loopback_listener(first.getsockname()[1])
    finally:
        first.close()


def test_the_probe_reads_wildcard_loopback_and_other_listeners() -> None:
    assert listeners_in(TCP, {"111", "222", "333"}) == ["0.0.0.0:8080", "127.0.0.1:8081"]
    assert listeners_in(TCP, {"444"}) == ["10.0.0.2:8083"]  # another process's: only if asked
    assert listeners_in(TCP6, {"555", "666"}) == [":::41295", "::1:41296"]
    verdicts = [is_loopback_address(a) for a in
                ("0.0.0.0:8080", "127.0.0.1:8081", "10.0.0.2:8083", ":::41295", "::1:41296",
                 "::ffff:127.0.0.1:80", "::ffff:10.0.0.1:80")]
    assert verdicts == [False, True, False, False, True, True, False]


def test_the_probe_finds_this_process_listener() -> None:
    with socket.socket() as local:
        local.bind(("127.0.0.1", 0))
        local.listen()
        port = local.getsockname()[1]
        assert f"127.0.0.1:{port}" in listening_addresses([os.getpid()])


def _listeners(cmd: list[str]) -> list[str]:
    out = subprocess.run([*cmd, "--standalone", "--nproc-per-node", "1",
                          str(HERE / "listener_probe.py")], capture_output=True, text=True,
                         timeout=100, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("LISTENERS ")]
    return json.loads(line.split(" ", 1)[1])


@pytest.mark.timeout(120)
def test_standalone_run_listens_on_loopback_only(torchrun: list[str]) -> None:
    found = _listeners(torchrun)
    assert found, "torchrun's agent serves its rendezvous store: expected a listener"
    assert all(is_loopback_address(a) for a in found), found


@pytest.mark.timeout(120)
def test_plain_torchrun_would_listen_on_every_interface(torchrun: list[str]) -> None:
    """Why the wrapper exists (if torch ever binds loopback itself, this test says so)."""
    plain = str(Path(sys.executable).parent / "torchrun")
    found = _listeners([plain])
    assert any(not is_loopback_address(a) for a in found), found
