"""Hostile handshake payloads for ``ConnectorWorker.connect`` (issue #10 item 6).

A campaign takes real payloads of small deployments (tiny presets, pull and push, one and
several target ranks), mutates one target rank's payload (or every rank's alike, as a wholly
hostile remote engine would) in a structured way (every numeric
field pushed to 0, -1, huge, 2^63, 2^64-1, floats and wrong types; lists truncated, extended,
emptied, swollen and nested; the msgpack bytes flipped, cut and padded; the outer struct and the
agent metadata broken; several at once) and feeds it to ``connect``. Every call must end in
``HandshakeError`` or a clean connection, within a time and memory bound, and leave the
transport holding exactly what it held before (no list or agent of a rank that passed before
another failed). Deterministic: the cases are a pure function of the seed.

Used by tests/connector/test_hostile_handshake.py (10,000 cases in CI) and by
benchmarks/test_handshake_fuzz.py (a larger run).
"""

from __future__ import annotations

import random
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import simpy

from hkvsim.connector.validate import HandshakeError
from hkvsim.connector.worker import ConnectorSettings, ConnectorWorker
from hkvsim.fabric import Fabric, load_profile, place_engines
from hkvsim.geometry.layout import build_layout
from hkvsim.geometry.presets import preset
from hkvsim.transport.sim import SimWorld

# CPU seconds of this process per connect() call (time.process_time): what the call costs,
# whatever else the shared machine runs meanwhile (wall time on a loaded 2-core VM is noise).
TIME_LIMIT_S = 1.0
MEMORY_LIMIT = 64 << 20

# (model, prefill TP, decode TP, mode): the local side is decode in pull, prefill in push.
# P TP4 -> D TP1 pull makes decode rank 0 handshake with four prefill ranks (rollback case).
DEPLOYMENTS = [
    ("tiny-kimi-linear", 2, 4, "pull"),
    ("tiny-kimi-linear", 4, 1, "pull"),
    ("tiny-kimi-linear", 1, 2, "push"),
    ("tiny-llama", 1, 2, "push"),
    ("tiny-deepseek", 2, 1, "pull"),
    ("tiny-qwen3-next", 4, 2, "pull"),
]

INT_VALUES: list[Any] = [0, -1, 1, 2, 3, 7, 2**31 - 1, 2**31, 2**32, 2**40, 2**62, 2**63 - 1,
                         2**63, 2**64 - 1, -(2**63)]
OTHER_VALUES: list[Any] = [0.0, 1.5, -1.0, float("inf"), float("nan"), 1e300, "7", b"7", None,
                           True, False, [], {}, [1], {"a": 1}]
SCALARS = ["tp_rank", "tp_size", "device_id", "num_blocks", "block_size", "logical_block_size",
           "physical_blocks_per_logical", "num_kv_heads"]
INT_LISTS = ["base_addrs", "block_lens", "block_strides", "region_num_blocks", "group_ids",
             "ssm_sizes", "ssm_subregion_sizes"]
BOOL_LISTS = ["region_is_mla"]
STRINGS = ["engine_id", "agent_name", "mem_type", "kv_cache_layout", "attn_backend_name"]
BOOLS = ["host_buffer", "prefix_caching"]


@dataclass(eq=False)
class Setup:
    name: str
    worker: ConnectorWorker
    remote_engine: str
    payloads: dict[int, bytes]
    targets: tuple[int, ...]


@dataclass
class Campaign:
    cases: int = 0
    refused: int = 0
    accepted: int = 0
    worst_seconds: float = 0.0
    worst_bytes: int = 0
    rules: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def _engine(world: SimWorld, model: str, role: str, tp: int, mode: str,
            num_blocks: int = 16) -> list[ConnectorWorker]:
    """The registered workers of one engine on the simulated fabric (what a run builds)."""
    spec = preset(model)
    layout = build_layout(spec, tp=tp, block_size=spec.attention.attention_backend.min_kernel_block,
                          num_blocks=num_blocks)
    workers = []
    for rank in range(tp):
        worker = ConnectorWorker(
            engine_id=f"{role}0", role=role, tp_rank=rank, layout=layout,
            transport=world.create_agent(f"{role}0.{rank}", (f"{role}0", rank)),
            settings=ConnectorSettings(mode=mode), device_id=rank)
        worker.register(mem_type="VRAM")
        workers.append(worker)
    return workers


def setups() -> list[Setup]:
    out = []
    profile = load_profile("h200-nvlink")
    for model, p_tp, d_tp, mode in DEPLOYMENTS:
        env = simpy.Environment()
        fabric = Fabric(env, profile, place_engines(profile, [("prefill0", "prefill", p_tp),
                                                              ("decode0", "decode", d_tp)]))
        world = SimWorld(env, fabric)
        prefill = _engine(world, model, "prefill", p_tp, mode)
        decode = _engine(world, model, "decode", d_tp, mode)
        local, remote = (decode, prefill) if mode == "pull" else (prefill, decode)
        worker = local[0]
        out.append(Setup(name=f"{model} P{p_tp}->D{d_tp} {mode}", worker=worker,
                         remote_engine=remote[0].engine_id,
                         payloads={w.tp_rank: w.handshake_payload() for w in remote},
                         targets=worker.targets(len(remote))))
    return out


# ---- mutations -------------------------------------------------------------------------------
def _split(payload: bytes) -> tuple[dict, dict]:
    outer = msgpack.unpackb(payload, raw=False)
    return outer, msgpack.unpackb(outer["metadata"], raw=False)


def _join(outer: dict, inner: Any) -> bytes:
    outer = dict(outer, metadata=msgpack.packb(inner, use_bin_type=True))
    return msgpack.packb(outer, use_bin_type=True)


def _hostile_value(rng: random.Random) -> Any:
    return rng.choice(INT_VALUES) if rng.random() < 0.6 else rng.choice(OTHER_VALUES)


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


_PLACEHOLDER = b"\xab" * 16


def _with_raw(outer: dict, inner: dict, key: str, raw: bytes) -> bytes:
    """The payload with ``inner[key]`` replaced by raw msgpack bytes (structures too deep for
    msgpack's own packer)."""
    packed = msgpack.packb(dict(inner, **{key: _PLACEHOLDER}), use_bin_type=True)
    marker = msgpack.packb(_PLACEHOLDER, use_bin_type=True)
    return msgpack.packb(dict(outer, metadata=packed.replace(marker, raw, 1)), use_bin_type=True)


def _fit(value: int) -> int:
    """Clamp to what msgpack can carry (-2^63 .. 2^64 - 1)."""
    return max(-(2**63), min(value, 2**64 - 1))


def _list(inner: dict, key: str) -> list:
    value = inner.get(key)
    return list(value) if isinstance(value, list) else [1]


def _mutate_inner(rng: random.Random, inner: dict) -> dict:
    inner = dict(inner)
    kind = rng.randrange(10)
    if kind == 0:  # a scalar field pushed to an edge or a wrong type
        inner[rng.choice(SCALARS)] = _hostile_value(rng)
    elif kind == 1:  # a scalar scaled (the 595-byte, 0.9 GB payload of the issue)
        key = rng.choice(SCALARS)
        if isinstance(inner.get(key), int):
            inner[key] = _fit(inner[key] * rng.choice([2, 100, 100_000, 2**20, 2**32])
                              + rng.choice([0, 1, -1]))
    elif kind == 2:  # num_blocks and every region's count scaled together (past the V7 check)
        factor = rng.choice([100, 100_000, 2**20, 2**32])
        inner["num_blocks"] = _fit((inner["num_blocks"] if isinstance(
            inner.get("num_blocks"), int) else 1) * factor)
        inner["region_num_blocks"] = [_fit(v * factor) if isinstance(v, int) else v
                                      for v in _list(inner, "region_num_blocks")]
    elif kind == 3:  # one list element pushed to an edge or a wrong type
        key = rng.choice(INT_LISTS + BOOL_LISTS)
        values = _list(inner, key)
        if values:
            values[rng.randrange(len(values))] = _hostile_value(rng)
        inner[key] = values
    elif kind == 4:  # every element of a list at an edge (addresses and strides >= 2^63)
        key = rng.choice(INT_LISTS)
        inner[key] = [rng.choice(INT_VALUES)] * len(_list(inner, key))
    elif kind == 5:  # lists truncated, extended, emptied, swollen, nested
        key = rng.choice(INT_LISTS + BOOL_LISTS)
        values = _list(inner, key)
        shape = rng.randrange(5)
        if shape == 0:
            values = values[:-1]
        elif shape == 1:
            values = values + values[-1:] * rng.choice([1, 5])
        elif shape == 2:
            values = []
        elif shape == 3:
            values = (values or [1]) * rng.choice([1000, 30_000])
        else:
            values = [_nested(rng.choice([2, 50, 400]))] + values[1:]
        inner[key] = values
    elif kind == 6:  # strings and bools of the wrong type or value
        key = rng.choice(STRINGS + BOOLS)
        inner[key] = rng.choice(["", "x" * 60_000, "VRAM", "DRAM", "dram", "NHD", "HND", 1, b"s",
                                 None, True, [], {}])
    elif kind == 7:  # keys missing or unknown
        if rng.random() < 0.5 and inner:
            inner.pop(rng.choice(sorted(inner)))
        else:
            inner[rng.choice(["extra", "", "num_blocks ", "x" * 100])] = _hostile_value(rng)
    elif kind == 8:  # the agent metadata blob broken
        inner["agent_metadata"] = _bad_agent_metadata(rng, inner.get("agent_metadata"))
    else:  # several of the above at once
        for _ in range(rng.randint(2, 4)):
            inner = _mutate_inner(rng, inner)
    return inner


def _bad_agent_metadata(rng: random.Random, good: Any) -> Any:
    try:
        envelope = msgpack.unpackb(good, raw=False)
        assert isinstance(envelope, dict)
    except Exception:  # already broken by an earlier mutation of this case
        return good
    assert isinstance(good, bytes)
    choice = rng.randrange(8)
    if choice == 0:
        return b""
    if choice == 1:
        return bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    if choice == 2:
        return good[: rng.randrange(len(good))]
    if choice == 3:  # an agent that does not exist
        return msgpack.packb(dict(envelope, agent="nobody"), use_bin_type=True)
    if choice == 4:  # regions at the edges of the address space
        regions = [[rng.choice(INT_VALUES), rng.choice(INT_VALUES), rng.choice([0, 1, -1])]]
        return msgpack.packb(dict(envelope, regions=regions), use_bin_type=True)
    if choice == 5:  # no memory announced: the remote list lies outside it
        return msgpack.packb(dict(envelope, regions=[]), use_bin_type=True)
    if choice == 6:
        return _hostile_value(rng)
    return msgpack.packb(dict(envelope, regions=[[0, 1, 0]] * 5000), use_bin_type=True)


def _flip(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        buf[rng.randrange(len(buf))] = rng.randrange(256)
    return bytes(buf)


def mutate(rng: random.Random, payload: bytes) -> Any:
    """One hostile version of ``payload``."""
    outer, inner = _split(payload)
    family = rng.randrange(8)
    if family <= 3:  # structured field mutations (most cases)
        return _join(outer, _mutate_inner(rng, inner))
    if family == 4:  # byte flips of the inner msgpack (valid outer, valid hash)
        return msgpack.packb(dict(outer, metadata=_flip(rng, outer["metadata"])),
                             use_bin_type=True)
    if family == 5:  # byte flips, cuts and padding of the whole payload
        choice = rng.randrange(3)
        if choice == 0:
            return _flip(rng, payload)
        if choice == 1:
            return payload[: rng.randrange(len(payload))]
        return payload + bytes(rng.randrange(256) for _ in range(rng.randint(1, 32)))
    if family == 6:  # the outer struct broken: types, keys, length bombs
        choice = rng.randrange(6)
        if choice == 0:
            return msgpack.packb(dict(outer, compatibility_hash=_hostile_value(rng)))
        if choice == 1:
            return msgpack.packb(dict(outer, metadata=_hostile_value(rng)))
        if choice == 2:
            return msgpack.packb(dict(outer, extra=1))
        if choice == 3:  # a map header claiming 2^32 - 1 entries, then nothing
            return b"\xdf\xff\xff\xff\xff"
        if choice == 4:  # an array header claiming 2^32 - 1 entries inside the metadata
            return msgpack.packb(dict(outer, metadata=b"\xdd\xff\xff\xff\xff" + b"\x00" * 8))
        return b"\x91" * rng.choice([100, 5000]) + b"\x01"  # [[[...[1]...]]]
    # nested bombs: a field holding a deep or wide structure, or a length header with no body
    key = rng.choice(INT_LISTS + SCALARS)
    choice = rng.randrange(5)
    if choice == 4:  # wide and deep: 1000 entries, each 400 nested one-element lists
        raw = b"\xdc\x03\xe8" + (b"\x91" * 400 + b"\x01") * 1000
    elif choice == 0:
        raw = b"\x91" * rng.choice([10, 1000, 100_000]) + b"\x01"
    elif choice == 1:
        raw = msgpack.packb([[0] * 1000] * 100)
    elif choice == 2:
        raw = b"\xdd\xff\xff\xff\xff"  # an array of 2^32 - 1 entries, none present
    else:
        raw = b"\xdf\x00\x01\x00\x00" + b"\xa0\x00" * 65536  # 65536 entries, one key
    return _with_raw(outer, inner, key, raw)


def cases(setups_: list[Setup], count: int, seed: int) -> Iterator[tuple[Setup, dict[int, Any]]]:
    rng = random.Random(seed)
    for _ in range(count):
        setup = rng.choice(setups_)
        payloads: dict[int, Any] = dict(setup.payloads)
        if rng.random() < 0.25:  # the whole remote engine is hostile: one mutation on every rank
            seed_all = rng.getrandbits(32)
            payloads = {r: mutate(random.Random(seed_all), p) for r, p in payloads.items()}
        else:  # one rank; a later target when there are several: the earlier ones pass first
            rank = setup.targets[-1] if rng.random() < 0.7 else rng.choice(sorted(payloads))
            payloads[rank] = mutate(rng, payloads[rank])
        yield setup, payloads


def run_campaign(count: int, *, seed: int = 10,
                 setups_: list[Setup] | None = None,
                 on_case: Callable[[int], None] | None = None) -> Campaign:
    """Feed ``count`` hostile payload sets to ``connect`` and record what happened."""
    setups_ = setups_ if setups_ is not None else setups()
    baseline = {id(s): s.worker.transport.resources() for s in setups_}
    result = Campaign()
    for i, (setup, payloads) in enumerate(cases(setups_, count, seed)):
        worker = setup.worker
        tracemalloc.start()  # traced for the call only: the mutations are not measured
        start = time.process_time()
        outcome = "accepted"
        try:
            worker.connect(setup.remote_engine, payloads)
        except HandshakeError as exc:
            outcome = exc.rule
        except Exception as exc:  # the defect this campaign hunts
            outcome = "raw"
            result.problems.append(f"case {i} ({setup.name}): {type(exc).__name__}: "
                                   f"{str(exc)[:200]}")
        finally:
            seconds = time.process_time() - start
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        if outcome == "accepted":
            result.accepted += 1
            worker.evict(setup.remote_engine)
        elif outcome != "raw":
            result.refused += 1
            result.rules[outcome] = result.rules.get(outcome, 0) + 1
        result.cases += 1
        result.worst_seconds = max(result.worst_seconds, seconds)
        result.worst_bytes = max(result.worst_bytes, peak)
        if seconds > TIME_LIMIT_S or peak > MEMORY_LIMIT:
            result.problems.append(f"case {i} ({setup.name}): {seconds:.2f} CPU s, "
                                   f"{peak / 1e6:.1f} MB")
        held = worker.transport.resources()
        if held != baseline[id(setup)]:
            result.problems.append(f"case {i} ({setup.name}, {outcome}): the transport "
                                   f"holds {held}, before {baseline[id(setup)]}")
            baseline[id(setup)] = held
        if on_case is not None:
            on_case(i)
    return result
