"""Which TCP addresses some processes listen on, from /proc (Linux): a process's socket inodes
(/proc/PID/fd) matched against the listening sockets of /proc/net/tcp and tcp6."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable

_LISTEN = "0A"


def _address(hex_addr: str) -> str:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        ip = ipaddress.IPv4Address(raw[::-1])
    else:  # four little-endian 32-bit words
        ip = ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
    return f"{ip}:{int(port, 16)}"


def listening_addresses(pids: Iterable[int]) -> list[str]:
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        try:
            text = open(f"/proc/net/{table}").read()
        except OSError:
            continue
        found += listeners_in(text, inodes)
    return sorted(found)


def listeners_in(table: str, inodes: set[str]) -> list[str]:
    """The listening addresses of a /proc/net/tcp{,6} table whose socket inode is in ``inodes``."""
    found = []
    for line in table.splitlines()[1:]:
        cols = line.split()
        if len(cols) > 9 and cols[3] == _LISTEN and cols[9] in inodes:
            found.append(_address(cols[1]))
    return found


def is_loopback_address(address: str) -> bool:
    host = address.rsplit(":", 1)[0]
    ip = ipaddress.ip_address(host)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback
