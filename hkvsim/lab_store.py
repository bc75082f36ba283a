"""What torchrun's workers tell each other, through torchrun's store (the c10d TCPStore).

torchrun's agent hosts a key-value store at MASTER_ADDR:MASTER_PORT for its workers; hkvsim
uses it (under a prefix of the run id and restart count) instead of a protocol of its own:

    slot/<g>             worker g -> rank 0: its node, local rank and GPU count
    round/<r>/<g>        rank 0 -> worker g: round r (one scenario variant that runs) --
                         "run" (the coordinator's address, the rank to serve, its one-time
                         credential), "idle" (the variant needs fewer ranks), or "end"

Values are msgpack maps, decoded strictly and checked field by field (:func:`~hkvsim.backends.
side_channel.fields`): no pickle, no code, no paths, no environment cross between workers.
The store itself has no authentication: it must be reachable only from the lab's nodes
(hardware/README.md), and a credential read from it still works once only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Protocol

import msgpack

from .backends.side_channel import ProtocolError, fields

__all__ = ["KeyValueStore", "LabStore", "StoreTimeout", "connect_torchrun_store", "slot_key",
           "round_key", "check_run", "check_slot", "MAX_VALUE", "NAME"]

MAX_VALUE = 64 << 10
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # engine ids as they travel (and name log files)


class StoreTimeout(TimeoutError):
    """A key did not appear in torchrun's store in time."""


class KeyValueStore(Protocol):
    """The part of torch.distributed.Store that is used (a dict does it in tests)."""

    def set(self, key: str, value: bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def wait(self, keys: list[str], timeout: timedelta) -> None: ...


def slot_key(rank: int) -> str:
    return f"slot/{rank}"


def round_key(round_no: int, rank: int) -> str:
    return f"round/{round_no}/{rank}"


class LabStore:
    """msgpack maps in and out of a key-value store, each checked on the way in."""

    def __init__(self, store: KeyValueStore) -> None:
        self.store = store

    def put(self, key: str, value: Mapping[str, Any]) -> None:
        data = msgpack.packb(dict(value), use_bin_type=True)
        if len(data) > MAX_VALUE:
            raise ProtocolError(f"store value {key!r} is {len(data)} B, over {MAX_VALUE} B")
        self.store.set(key, data)

    def take(self, key: str, timeout: float) -> dict[str, Any]:
        try:
            self.store.wait([key], timedelta(seconds=timeout))
        except Exception as exc:  # torch raises DistStoreError / RuntimeError on timeout
            raise StoreTimeout(f"{key!r} did not appear in torchrun's store within "
                               f"{timeout:g} s ({type(exc).__name__})") from None
        data = self.store.get(key)
        if len(data) > MAX_VALUE:
            raise ProtocolError(f"store value {key!r} is {len(data)} B, over {MAX_VALUE} B")
        try:
            value = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True,
                                    ext_hook=_no_ext)
        except ProtocolError:
            raise
        except Exception as exc:
            raise ProtocolError(f"store value {key!r} is not msgpack: {exc}") from None
        if not isinstance(value, dict) or not isinstance(value.get("op"), str):
            raise ProtocolError(f"store value {key!r} must be a map with a str 'op'")
        return value


def _no_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not allowed in the store")


def check_slot(value: Mapping[str, Any]) -> dict[str, Any]:
    f = fields(value, {"node": int, "local_rank": int, "gpus": (int, type(None))})
    if value["op"] != "slot" or f["node"] < 0 or f["local_rank"] < 0 or (
            f["gpus"] is not None and f["gpus"] < 0):
        raise ProtocolError(f"malformed slot {dict(value)!r:.200}")
    return f


def check_run(value: Mapping[str, Any]) -> dict[str, Any]:
    """A "run" assignment: where the coordinator listens and which rank to serve."""
    f = fields(value, {"host": str, "port": int, "engine": str, "rank": int, "credential": str})
    if not NAME.match(f["engine"]) or not 0 <= f["rank"] < 4096:
        raise ProtocolError(f"run: engine {f['engine']!r:.70} rank {f['rank']} is not a rank "
                            f"name (letters, digits, _.- up to 64) and number")
    if not 0 < f["port"] < 65536 or not f["host"] or len(f["host"]) > 255:
        raise ProtocolError(f"run: bad coordinator address {f['host']!r:.70}:{f['port']}")
    return f


def connect_torchrun_store(master_addr: str, master_port: int, prefix: str,
                           timeout: float) -> Any:
    """A client of the store torchrun's agent hosts (workers never host one: no listening
    socket of hkvsim's own besides the coordinator's side channel)."""
    import torch.distributed as dist

    store = dist.TCPStore(master_addr, master_port, is_master=False,
                          timeout=timedelta(seconds=timeout), wait_for_workers=False)
    return dist.PrefixStore(prefix, store)
