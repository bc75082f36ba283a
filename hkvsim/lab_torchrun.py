"""torchrun whose stores listen on loopback only when they are served on a loopback name.

    python -m hkvsim.lab_torchrun --standalone --nproc-per-node 3 -m hkvsim.lab SCENARIO.toml

takes exactly torchrun's arguments and runs torchrun (``torch.distributed.run``) in this process.
The one difference: a TCPStore *server* (the rendezvous store of torchrun's agent, and any other
store a process of the run serves) whose host is a loopback name (``localhost``, ``127.x.y.z``,
``::1``; ``--standalone`` uses ``localhost``) listens on a socket bound to 127.0.0.1, handed to
torch as ``master_listen_fd``. Plain torchrun's store listens on every interface of the machine,
whatever host it is given, so on a single machine anyone who can reach it could read and write
the keys the ranks meet through (hkvsim's run token among them). A store served on another name
(a multi-node lab: ``--rdzv-endpoint 10.0.0.1:29400``) is left as torch makes it: the other nodes
have to reach it.
"""

from __future__ import annotations

import ipaddress
import socket
import sys
from typing import Any

__all__ = ["is_loopback_name", "install", "main"]

_KEEP: list[socket.socket] = []  # the listening sockets handed to torch, alive for the process


def is_loopback_name(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface (never resolves other names)."""
    if host.strip().lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _loopback_listener(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        # what TCPStore raises when its port is taken: torch's rendezvous then joins the store
        # another agent of the same run already serves there, as a client
        raise RuntimeError(f"hkvsim.lab_torchrun: cannot listen on 127.0.0.1:{port}: "
                           f"{exc}") from exc
    return sock


def install() -> type:
    """Make ``torch.distributed.TCPStore`` the loopback-binding subclass (before torchrun's
    modules import it); returns the class now installed."""
    import torch.distributed as dist

    base = dist.TCPStore
    if getattr(base, "_hkvsim_loopback", False):
        return base

    class LoopbackTCPStore(base):  # type: ignore[misc, valid-type]
        _hkvsim_loopback = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            bound = _bind(args, kwargs)
            if (bound is not None and bound.get("is_master") and bound.get("master_listen_fd")
                    is None and is_loopback_name(str(bound.get("host_name", "")))):
                sock = _loopback_listener(int(bound.get("port") or 0))
                _KEEP.append(sock)
                bound["port"] = sock.getsockname()[1]
                bound["master_listen_fd"] = sock.fileno()
                super().__init__(**bound)
                return
            super().__init__(*args, **kwargs)

    LoopbackTCPStore.__name__ = LoopbackTCPStore.__qualname__ = "TCPStore"
    dist.TCPStore = LoopbackTCPStore
    return LoopbackTCPStore


_PARAMS = ("host_name", "port", "world_size", "is_master", "timeout", "wait_for_workers",
           "multi_tenant", "master_listen_fd", "use_libuv")


def _bind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """TCPStore's arguments by name (pybind's signature is opaque: torch 2.x's documented order
    is used), or None when they do not fit it (then the store is made as torch would)."""
    if len(args) > len(_PARAMS) or any(k not in _PARAMS for k in kwargs):
        return None
    named = dict(zip(_PARAMS, args))
    if any(k in named for k in kwargs):
        return None
    named.update(kwargs)
    return named if "host_name" in named and "port" in named else None


def main(argv: list[str] | None = None) -> int:
    install()
    from torch.distributed.run import main as torchrun_main

    sys.argv[0] = "hkvsim.lab_torchrun"
    torchrun_main(sys.argv[1:] if argv is None else argv)
    return 0


if __name__ == "__main__":  # pragma: no cover - exercised through subprocesses in tests/lab
    sys.exit(main())
