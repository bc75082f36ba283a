"""The side channel of the NIXL run: length-prefixed msgpack frames over TCP, loopback by default.

NIXL's own listener binds 0.0.0.0 (DOMAIN.md §11.4 hazard 5), and multiprocessing's
``Connection.send`` pickles, so neither carries anything here. Every message between the
coordinator (the scheduler / proxy) and a rank process is one frame:

    4-byte big-endian length | msgpack map with a str "op" key

Decoding is strict: a frame over :data:`MAX_FRAME` bytes, a non-map body, extension types,
non-str map keys or a missing "op" raise :class:`ProtocolError`, and every receiver checks the
fields of each op with :func:`fields` (exact key set, exact types; bool is not an int). A peer
first proves it was started by this run: its HELLO carries a random token that the coordinator
compares in constant time.

Block ids travel as ``[[group, [ids...]], ...]`` lists (:func:`groups_out` / :func:`groups_in`),
never as pickled arrays.
"""

from __future__ import annotations

import asyncio
import hmac
import select
import socket
import struct
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

__all__ = ["MAX_FRAME", "ProtocolError", "ChannelClosed", "pack", "unpack", "FrameBuffer",
           "Channel", "read_message", "fields", "groups_out", "groups_in", "ids_out", "ids_in",
           "token_ok", "DEFAULT_HOST"]

MAX_FRAME = 16 << 20
DEFAULT_HOST = "127.0.0.1"
_HEADER = struct.Struct("!I")
_MAX_IDS = 1 << 24


class ProtocolError(ValueError):
    """A frame or message that does not follow the side-channel protocol."""


class ChannelClosed(ConnectionError):
    """The peer closed the connection (or died)."""


def _no_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not allowed")


def pack(message: Mapping[str, Any]) -> bytes:
    """One frame for ``message`` (a map with a str "op")."""
    if not isinstance(message.get("op"), str):
        raise ProtocolError(f"a message needs a str 'op', got {message.get('op')!r}")
    body = msgpack.packb(dict(message), use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"message {message['op']!r} is {len(body)} B, over the {MAX_FRAME} B "
                            f"frame limit")
    return _HEADER.pack(len(body)) + body


def unpack(body: bytes) -> dict[str, Any]:
    """Strictly decode one frame body."""
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"frame of {len(body)} B exceeds the {MAX_FRAME} B limit")
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True,
                                  ext_hook=_no_ext)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"undecodable frame: {type(exc).__name__}: {exc}") from None
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise ProtocolError("a frame must hold a map with a str 'op'")
    return message


class FrameBuffer:
    """Incremental frame decoder: feed bytes, get the complete messages."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._buf += data
        out = []
        while len(self._buf) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self._buf)
            if size > MAX_FRAME:
                raise ProtocolError(f"announced frame of {size} B exceeds the {MAX_FRAME} B limit")
            if len(self._buf) < _HEADER.size + size:
                break
            body = bytes(self._buf[_HEADER.size:_HEADER.size + size])
            del self._buf[:_HEADER.size + size]
            out.append(unpack(body))
        return out


class Channel:
    """A blocking socket with frame I/O, for rank processes and node agents."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._frames = FrameBuffer()
        self._ready: list[dict[str, Any]] = []
        self.closed = False

    @classmethod
    def connect(cls, host: str, port: int, *, timeout: float = 30.0) -> Channel:
        sock = socket.create_connection((host, port), timeout=timeout)
        sock.settimeout(None)
        return cls(sock)

    def send(self, message: Mapping[str, Any]) -> None:
        try:
            self.sock.sendall(pack(message))
        except OSError as exc:
            self.closed = True
            raise ChannelClosed(f"side channel send failed: {exc}") from None

    def poll(self, timeout: float) -> list[dict[str, Any]]:
        """Every complete message that arrives within ``timeout`` s (at least the buffered ones)."""
        if self._ready:
            out, self._ready = self._ready, []
            timeout = 0.0
        else:
            out = []
        if self.closed:
            if out:
                return out
            raise ChannelClosed("side channel closed")
        readable, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
        while readable:
            try:
                data = self.sock.recv(1 << 20)
            except OSError as exc:
                self.closed = True
                raise ChannelClosed(f"side channel receive failed: {exc}") from None
            if not data:
                self.closed = True
                if out:
                    return out
                raise ChannelClosed("the peer closed the side channel")
            out.extend(self._frames.feed(data))
            readable, _, _ = select.select([self.sock], [], [], 0.0)
        return out

    def recv(self, timeout: float) -> dict[str, Any]:
        """The next message; TimeoutError after ``timeout`` s."""
        import time

        end = time.monotonic() + timeout
        while True:
            msgs = self.poll(max(0.0, end - time.monotonic()))
            if msgs:
                first, rest = msgs[0], msgs[1:]
                self._ready = rest + self._ready
                return first
            if time.monotonic() >= end:
                raise TimeoutError(f"no side-channel message within {timeout} s")

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass


async def read_message(reader: asyncio.StreamReader) -> dict[str, Any]:
    """One message from an asyncio stream; ChannelClosed at EOF."""
    try:
        header = await reader.readexactly(_HEADER.size)
        (size,) = _HEADER.unpack(header)
        if size > MAX_FRAME:
            raise ProtocolError(f"announced frame of {size} B exceeds the {MAX_FRAME} B limit")
        body = await reader.readexactly(size)
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise ChannelClosed(f"the peer closed the side channel ({type(exc).__name__})") from None
    return unpack(body)


def fields(message: Mapping[str, Any], spec: Mapping[str, Any], *,
           optional: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Check ``message`` against ``spec`` (key -> type or tuple of types; None allowed via
    ``type(None)``) plus ``optional`` keys; extra keys are errors. "op" and "seq" are implicit."""
    optional = optional or {}
    op = message.get("op")
    allowed = set(spec) | set(optional) | {"op", "seq"}
    extra = sorted(set(message) - allowed)
    if extra:
        raise ProtocolError(f"{op}: unexpected field(s) {extra}")
    out: dict[str, Any] = {}
    for key, kind in list(spec.items()) + list(optional.items()):
        if key not in message:
            if key in spec:
                raise ProtocolError(f"{op}: missing field {key!r}")
            continue
        value = message[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds:
            raise ProtocolError(f"{op}: field {key!r} must be {_names(kinds)}, got a bool")
        if not isinstance(value, kinds):
            raise ProtocolError(f"{op}: field {key!r} must be {_names(kinds)}, got "
                                f"{type(value).__name__}")
        out[key] = value
    return out


def _names(kinds: tuple) -> str:
    return " or ".join("None" if k is type(None) else k.__name__ for k in kinds)


def ids_out(ids: Any) -> list[int]:
    return [int(i) for i in np.asarray(ids, dtype=np.int64).reshape(-1)]


def ids_in(value: Any, what: str = "ids") -> np.ndarray:
    if not isinstance(value, list) or len(value) > _MAX_IDS:
        raise ProtocolError(f"{what} must be a list of at most {_MAX_IDS} ints")
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
        raise ProtocolError(f"{what} must hold non-negative ints")
    return np.asarray(value, dtype=np.int64)


def groups_out(groups: Mapping[int, Any]) -> list[list[Any]]:
    return [[int(g), ids_out(ids)] for g, ids in groups.items()]


def groups_in(value: Any, what: str = "blocks") -> dict[int, np.ndarray]:
    if not isinstance(value, list):
        raise ProtocolError(f"{what} must be a list of [group, ids] pairs")
    out: dict[int, np.ndarray] = {}
    for item in value:
        if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], int)
                or isinstance(item[0], bool) or item[0] in out):
            raise ProtocolError(f"{what}: each entry must be a [group, ids] pair with a unique "
                                f"int group")
        out[item[0]] = ids_in(item[1], f"{what}[{item[0]}]")
    return out


def token_ok(given: Any, expected: str) -> bool:
    return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())
