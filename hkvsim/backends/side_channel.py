"""The side channel of the NIXL run: length-prefixed msgpack frames over TCP, loopback by default.

NIXL's own listener binds 0.0.0.0 (docs/semantics.md §11.4 hazard 5), and multiprocessing's
``Connection.send`` pickles, so neither carries anything here. Every message between the
coordinator (the scheduler / proxy) and a rank process is one frame:

    4-byte big-endian length | msgpack map with a str "op" key

Decoding is strict: a frame over :data:`MAX_FRAME` bytes, a non-map body, extension types,
non-str map keys or a missing "op" raise :class:`ProtocolError`, and every receiver checks the
fields of each op with :func:`fields` (exact key set, exact types; bool is not an int).

Before a connection is trusted it passes the coordinator's :class:`HelloGate`: at most
``max_pending`` connections may be unauthenticated at once (more are closed at once), the first
frame must announce at most :data:`HELLO_MAX_BYTES` (refused from its 4-byte header, before any
body is read) and arrive complete within :data:`HELLO_TIMEOUT_S` (a slow or silent peer is cut
off), and a rank's HELLO must carry that rank's one-time credential from
:class:`RankCredentials` (random per run, issued to the rank's process when it is started,
compared in constant time and spent on first use), so a captured HELLO cannot be used again, in
this run or another. There is no other way in: under torchrun the credentials travel through
torchrun's store (:mod:`hkvsim.lab`), never through a launcher protocol of hkvsim's own. Refused
connections are aborted, so nothing they sent stays buffered.

Block ids travel as ``[[group, [ids...]], ...]`` lists (:func:`groups_out` / :func:`groups_in`),
never as pickled arrays.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import select
import socket
import struct
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

__all__ = ["MAX_FRAME", "HELLO_MAX_BYTES", "HELLO_TIMEOUT_S", "MAX_UNAUTHENTICATED",
           "ProtocolError", "ChannelClosed", "pack", "unpack", "FrameBuffer", "Channel",
           "read_message", "fields", "groups_out", "groups_in", "ids_out", "ids_in", "token_ok",
           "RankCredentials", "HelloGate", "DEFAULT_HOST"]

MAX_FRAME = 16 << 20
HELLO_MAX_BYTES = 4 << 10  # a HELLO is ~100 B
HELLO_TIMEOUT_S = 5.0  # a rank sends its HELLO right after connecting
MAX_UNAUTHENTICATED = 32  # at least; the coordinator allows more for a run with more ranks
DEFAULT_HOST = "127.0.0.1"
log = logging.getLogger("hkvsim.side_channel")
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
    """A blocking socket with frame I/O, for rank processes."""

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


async def read_message(reader: asyncio.StreamReader, *, max_size: int = MAX_FRAME
                       ) -> dict[str, Any]:
    """One message from an asyncio stream; ChannelClosed at EOF. A frame announcing more than
    ``max_size`` bytes is refused from its header, before its body is read."""
    try:
        header = await reader.readexactly(_HEADER.size)
        (size,) = _HEADER.unpack(header)
        if size > max_size:
            raise ProtocolError(f"announced frame of {size} B exceeds the {max_size} B limit")
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


class RankCredentials:
    """One-time credentials of one run, one per rank: random, issued by the coordinator to the
    process it starts for that rank (or, under torchrun, through its store), accepted once.

    A captured HELLO is useless: replayed in the same run its credential is spent, in another run
    it was never issued."""

    def __init__(self) -> None:
        self._issued: dict[tuple[str, int], str] = {}
        self._spent: set[tuple[str, int]] = set()

    def issue(self, engine: str, rank: int) -> str:
        credential = secrets.token_hex(16)
        self._issued[(engine, rank)] = credential
        return credential

    def redeem(self, engine: str, rank: int, credential: Any) -> str | None:
        """None when ``credential`` is that rank's and unspent (it is spent now), else why not."""
        key = (engine, rank)
        expected = self._issued.get(key)
        if expected is None:
            return f"HELLO for an unknown rank {engine!r:.40} {rank}"
        if not token_ok(credential, expected):
            return f"HELLO for {engine} rank {rank} with a wrong credential"
        if key in self._spent:
            return f"replayed HELLO for {engine} rank {rank} (its credential is spent)"
        self._spent.add(key)
        return None


_HELLO = {"engine": str, "rank": int, "credential": str, "pid": int}


class HelloGate:
    """Admission of new side-channel connections until they have proven themselves.

    ``admit`` returns the first message of a connection that passed (a rank's ``hello``) or None after aborting one that did not. Bounds: ``max_pending``
    unauthenticated connections at once, a first frame of at most ``max_bytes`` (refused from
    its header), complete within ``timeout`` seconds. ``refused`` counts refusals by reason and
    ``pending`` is the number of connections being checked now."""

    def __init__(self, *, credentials: RankCredentials, max_pending: int = MAX_UNAUTHENTICATED, max_bytes: int = HELLO_MAX_BYTES,
                 timeout: float | None = None) -> None:
        self.credentials = credentials
        self.max_pending = max_pending
        self.max_bytes = max_bytes
        self.timeout = HELLO_TIMEOUT_S if timeout is None else timeout
        self.pending = 0
        self.admitted = 0
        self.refused: dict[str, int] = {}

    def check(self, message: Mapping[str, Any]) -> str | None:
        """Why a first message is refused, or None (sans-I/O; spends a rank's credential)."""
        op = message.get("op")
        if op == "hello":
            try:
                f = fields(message, _HELLO)
            except ProtocolError as exc:
                return str(exc)
            return self.credentials.redeem(f["engine"], f["rank"], f["credential"])
        return f"unexpected first message {op!r:.40}"

    async def admit(self, reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter) -> dict[str, Any] | None:
        if self.pending >= self.max_pending:
            self._refuse(writer, "too many unauthenticated connections", "capacity")
            return None
        self.pending += 1
        try:
            message = await asyncio.wait_for(read_message(reader, max_size=self.max_bytes),
                                             self.timeout)
        except asyncio.TimeoutError:
            self._refuse(writer, f"no complete HELLO within {self.timeout:g} s", "timeout")
            return None
        except ProtocolError as exc:
            self._refuse(writer, str(exc), "malformed")
            return None
        except ChannelClosed:
            self._refuse(writer, "closed before its HELLO", "closed")
            return None
        finally:
            self.pending -= 1
        reason = self.check(message)
        if reason is not None:
            kind = ("replay" if "replayed" in reason else "credential" if "credential" in reason
                    or "token" in reason else "malformed")
            self._refuse(writer, reason, kind)
            return None
        self.admitted += 1
        return message

    def _refuse(self, writer: asyncio.StreamWriter, reason: str, kind: str) -> None:
        first = kind not in self.refused
        self.refused[kind] = self.refused.get(kind, 0) + 1
        (log.warning if first else log.debug)("side channel: refused a connection: %s", reason)
        writer.transport.abort()  # drop what it sent; nothing is buffered for it any more
