"""``hkvsim calibrate``: measure real NIXL transfers on this machine and fit a fabric profile.

Two spawned processes, each with its own NIXL agent (UCX backend, DRAM, progress thread off, as
the NIXL run uses it): a *target* that owns a registered, filled buffer and keeps calling into
NIXL, and an *initiator* that runs the sweep against it. They exchange agent metadata over a
multiprocessing pipe as msgpack bytes (never pickled); both log to files, with UCX_PROTO_INFO on,
so the UCX transport actually chosen for RMA ("cma/memory", or "tcp/lo" when CMA is blocked) is
read back and recorded.

Sweep: descriptor sizes 4 KiB .. 4 MiB (x4) x descriptors per transfer 1 .. 16384 (x4), READ and
WRITE, at most :data:`BYTE_CAP` bytes per transfer. Descriptors are spaced two lengths apart so
NIXL cannot merge them (it merges contiguous descriptors: 256 contiguous 4 KiB descriptors post as
one). Every point is prepared once and posted repeatedly; its time is the median of NIXL's own
telemetry (``xferDuration``: post start to completion, microseconds).

Fit (documented equivalent of "least squares on post and transfer time separately"). The
simulator predicts one transfer on an idle link as ``launch + n * per_descriptor + bytes /
bandwidth + latency`` (hkvsim/fabric/links.py). On UCX cma the copy runs inside the post call
(``postDuration`` ~= ``xferDuration``), so the post / wire split the simulator models cannot be
observed separately; we therefore fit the *total* with a relative least squares (each row scaled
by 1 / measured time, so a 4 KiB point weighs as much as a 64 MiB one) over (1, n, bytes) with
non-negative coefficients. latency = the median completion time after the post returns (small
transfers; ~0 on cma), launch = intercept - latency (floored at 0.1 us), per_descriptor = the n
coefficient, bandwidth = 1 / the bytes coefficient. The post-only and wire-only fits are reported
too. Then every sweep point is replayed through :class:`hkvsim.fabric.Fabric` on a simpy
environment with the fitted profile, and the report tabulates measured vs predicted.

Also measured: notification latency (send_notif ping-pong / 2), handshake latency (metadata over
the pipe + the first ``add_remote_agent``), first-transfer wire-up, and local memcpy bandwidth.
There is no second node: the inter-node keys copy the intra-node ones (say so in the file).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from ..fabric.profile import PROFILE_DIR

__all__ = ["SweepPoint", "run_sweep", "fit", "predict", "write_profile", "write_report",
           "run_calibration_cli", "BYTE_CAP", "ACCEPT_MEDIAN_ERROR"]

SIZES = (4096, 16384, 65536, 262144, 1 << 20, 4 << 20)
COUNTS = (1, 4, 16, 64, 256, 1024, 4096, 16384)
QUICK_SIZES = (4096, 65536, 1 << 20)
QUICK_COUNTS = (1, 64, 1024)
BYTE_CAP = 64 << 20  # bytes per transfer
ROTATION_BYTES = 1 << 30  # per side: successive repetitions rotate through this much memory
ACCEPT_MEDIAN_ERROR = 0.15
_REPO = Path(__file__).resolve().parents[2]
DEFAULT_PROFILE = PROFILE_DIR / "cpu-ucx-loopback.toml"


@dataclass(frozen=True, kw_only=True)
class SweepPoint:
    op: str
    size: int  # bytes per descriptor
    count: int  # descriptors per transfer
    reps: int
    total_us: float  # median xferDuration (post start -> complete)
    post_us: float  # median postDuration
    wall_us: float  # median wall time of transfer() + polling, as seen from Python
    merged: int  # NIXL's descriptor count after merging (should equal count)

    @property
    def nbytes(self) -> int:
        return self.size * self.count


# ---- the two processes ------------------------------------------------------------------------
def _redirect(log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ.setdefault("UCX_PROTO_INFO", "y")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # UCX's tcp listeners on loopback only


def _agent(name: str, *, progress_thread: bool = False) -> Any:
    from ..transport.nixl import load_nixl

    api = load_nixl()
    agent = api.nixl_agent(name, api.nixl_agent_config(
        enable_prog_thread=progress_thread, enable_listen_thread=False, capture_telemetry=True,
        backends=["UCX"]))
    if "UCX" not in agent.backends:
        raise RuntimeError("the UCX backend did not start")
    return agent


def _buffer(nbytes: int) -> np.ndarray:
    from ..transport.memory import lazy_buffer

    if os.environ.get("HKV_THP"):
        import mmap as _m
        mm = _m.mmap(-1, nbytes, flags=_m.MAP_PRIVATE | _m.MAP_ANONYMOUS)
        mm.madvise(_m.MADV_HUGEPAGE)
        buf = np.frombuffer(mm, dtype=np.uint8)
    else:
        buf = lazy_buffer(nbytes)
    buf.fill(0x5A)  # commit every page now, not during a measured transfer
    return buf


class _Memory:
    """The sweep's buffer on one side: DRAM (a committed numpy array) or VRAM (a torch uint8
    tensor on ``cuda:<device>``, filled before anything is measured)."""

    def __init__(self, nbytes: int, mem_type: str, device: int = 0) -> None:
        self.mem_type, self.nbytes = mem_type, nbytes
        self.device = device if mem_type == "VRAM" else 0
        if mem_type == "VRAM":
            import torch

            torch.cuda.set_device(device)  # before the agent's first CUDA call uses it
            self.tensor = torch.full((nbytes,), 0x5A, dtype=torch.uint8, device=f"cuda:{device}")
            torch.cuda.synchronize(device)
            self.addr = int(self.tensor.data_ptr())
        else:
            self.array = _buffer(nbytes)
            self.addr = int(self.array.ctypes.data)

    def register(self, agent: Any) -> Any:
        return agent.register_memory(
            np.array([[self.addr, self.nbytes, self.device]], dtype=np.uint64), self.mem_type)

    def copy_seconds(self, chunk: int, k: int) -> float:
        """Time one local copy of ``chunk`` bytes out of this buffer (host memcpy for DRAM,
        device-to-device for VRAM): the simulator's same-endpoint copy."""
        off = (k * chunk) % (self.nbytes - chunk)
        if self.mem_type == "VRAM":
            import torch

            dst = torch.empty(chunk, dtype=torch.uint8, device=self.tensor.device)
            torch.cuda.synchronize(self.device)
            w0 = time.perf_counter()
            dst.copy_(self.tensor[off:off + chunk])
            torch.cuda.synchronize(self.device)
            return time.perf_counter() - w0
        dst = np.empty(chunk, np.uint8)
        dst.fill(0)
        w0 = time.perf_counter()
        np.copyto(dst, self.array[off:off + chunk])
        return time.perf_counter() - w0


def _send(conn: Any, obj: Any) -> None:
    conn.send_bytes(msgpack.packb(obj, use_bin_type=True))


def _recv(conn: Any, timeout: float) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"no message within {timeout} s")
    return msgpack.unpackb(conn.recv_bytes(1 << 24), raw=False)


def _target_main(peer: Any, log_path: str, nbytes: int, mem_type: str = "DRAM") -> None:
    """Owns the remote buffer; answers pings; keeps calling into NIXL until told to stop."""
    _redirect(log_path)
    buf = _Memory(nbytes, mem_type)
    agent = _agent("calib-target")
    reg = buf.register(agent)
    _send(peer, {"md": agent.get_agent_metadata(), "addr": buf.addr})
    initiator = None
    deadline = time.monotonic() + 600.0
    spin = False
    while time.monotonic() < deadline:
        for msgs in agent.get_new_notifs().values():
            for m in msgs:
                if m.startswith(b"ping:") and initiator is not None:
                    agent.send_notif(initiator, b"pong:" + m[5:])
        # poll every 100 us while the initiator measures notification latency (a receiver that
        # spins flat out on a loaded 2-core box gets descheduled for whole 4 ms ticks), else
        # every 2 ms: the RMA copies need nothing from this process
        if peer.poll(0.0001 if spin else 0.002):
            msg = _recv(peer, 1.0)
            if msg.get("op") == "get_md":  # the side-channel metadata fetch, timed
                _send(peer, {"md": agent.get_agent_metadata()})
            elif msg.get("op") in ("spin", "idle"):
                spin = msg["op"] == "spin"
                _send(peer, {"op": "ok"})
            elif msg.get("op") == "md":
                initiator = agent.add_remote_agent(msg["md"])
                initiator = initiator.decode() if isinstance(initiator, bytes) else initiator
                _send(peer, {"op": "ok"})
            elif msg.get("op") == "stop":
                break
    agent.deregister_memory(reg)


def _initiator_main(peer: Any, parent: Any, log_path: str, nbytes: int, sizes: list[int],
                    counts: list[int], budget: float, min_reps: int, mem_type: str = "DRAM"
                    ) -> None:
    serve_initiator(peer, parent, log_path, lambda: _initiate(
        peer, nbytes, sizes, counts, budget, min_reps, mem_type))


def serve_initiator(peer: Any, parent: Any, log_path: str, work: Any) -> None:
    """An initiator process's body: log to ``log_path``, run ``work()``, tell the target to
    stop, and send the result (or the error, as text: never pickled) to the parent."""
    _redirect(log_path)
    try:
        result = work()
    except Exception as exc:  # reported to the parent, never pickled
        result = {"error": f"{type(exc).__name__}: {exc}"}
    try:
        _send(peer, {"op": "stop"})
    except OSError:
        pass
    _send(parent, result)


def _low_quartile(values: list[float]) -> float:
    """Mean of the 10th..40th percentile: on a small shared machine interference only ever adds
    time, so the low quartile is the machine's own cost; a mean, not one sample, because NIXL's
    telemetry counts whole microseconds."""
    v = sorted(values)
    lo, hi = len(v) // 10, max(len(v) * 4 // 10, len(v) // 10 + 1)
    mid = v[lo:hi] or v
    return float(sum(mid) / len(mid))


def _initiate(peer: Any, nbytes: int, sizes: list[int], counts: list[int], budget: float,
              min_reps: int, mem_type: str = "DRAM") -> dict[str, Any]:
    start_all = time.monotonic()
    buf = _Memory(nbytes, mem_type)
    agent = _agent("calib-initiator")
    reg = buf.register(agent)
    hello = _recv(peer, 120.0)  # the target's metadata, once it is up
    t0 = time.perf_counter()
    name = agent.add_remote_agent(hello["md"])
    add = time.perf_counter() - t0
    name = name.decode() if isinstance(name, bytes) else name
    raddr = int(hello["addr"])
    _send(peer, {"op": "md", "md": agent.get_agent_metadata()})
    _recv(peer, 30.0)
    fetches = []
    for _ in range(5):  # what a handshake's metadata fetch costs on our channel
        t0 = time.perf_counter()
        _send(peer, {"op": "get_md"})
        _recv(peer, 30.0)
        fetches.append(time.perf_counter() - t0)
    fetch = statistics.median(fetches)

    def dlists(size: int) -> tuple[Any, Any, int]:
        """Lists tiling the whole buffer with descriptors two lengths apart (never contiguous:
        NIXL merges contiguous descriptors); repetitions walk through them."""
        total = nbytes // (2 * size)
        offs = np.arange(total, dtype=np.uint64) * np.uint64(2 * size)
        dev = np.full(total, buf.device, np.uint64)
        local = np.stack([np.uint64(buf.addr) + offs, np.full(total, size, np.uint64), dev],
                         axis=1).astype(np.uint64)
        remote = np.stack([np.uint64(raddr) + offs, np.full(total, size, np.uint64), dev],
                          axis=1).astype(np.uint64)
        return (agent.prep_xfer_dlist("NIXL_INIT_AGENT",
                                      agent.get_xfer_descs(local, mem_type)),
                agent.prep_xfer_dlist(name, agent.get_xfer_descs(remote, mem_type)), total)

    def post(op: str, lh: Any, rh: Any, ids: np.ndarray) -> tuple[float, float, float, int]:
        x = agent.make_prepped_xfer(op, lh, ids, rh, ids, b"")
        w0 = time.perf_counter()
        state = agent.transfer(x)
        while state == "PROC":
            state = agent.check_xfer_state(x)
        wall = time.perf_counter() - w0
        if state != "DONE":
            raise RuntimeError(f"{op} of {ids.size} descriptors ended in {state}")
        tel = agent.get_xfer_telemetry(x)
        out = (float(tel.xferDuration), float(tel.postDuration), wall * 1e6, int(tel.descCount))
        agent.release_xfer_handle(x)
        return out

    # notification latency: ping-pong, with the target spinning
    _send(peer, {"op": "spin"})
    _recv(peer, 30.0)
    rtts = []
    for k in range(50):
        w0 = time.perf_counter()
        agent.send_notif(name, b"ping:%d" % k)
        want = b"pong:%d" % k
        got = False
        end = time.monotonic() + 5.0
        while not got and time.monotonic() < end:
            for msgs in agent.get_new_notifs().values():
                got = got or want in msgs
        if got:
            rtts.append(time.perf_counter() - w0)
    _send(peer, {"op": "idle"})
    _recv(peer, 30.0)

    # first transfer to the peer: UCX wire-up
    lh, rh, _ = dlists(4 << 20)
    w0 = time.perf_counter()
    post("READ", lh, rh, np.zeros(1, np.int64))
    wireup = time.perf_counter() - w0
    agent.release_dlist_handle(lh)
    agent.release_dlist_handle(rh)

    # local memcpy bandwidth (16 MiB, cold), as the simulator's same-endpoint copy
    copies = [buf.copy_seconds(16 << 20, k) for k in range(7)]

    plan = [(size, n, op) for size in sizes for n in counts if size * n <= BYTE_CAP
            for op in ("READ", "WRITE")]
    lists = {size: dlists(size) for size in sorted({size for size, _, _ in plan})}
    for size, n, op in plan:  # warm-up (first use of each list)
        post(op, lists[size][0], lists[size][1], np.arange(n, dtype=np.int64))
    samples: dict[tuple[int, int, str], list[tuple[float, float, float, int]]] = {
        key: [] for key in plan}
    cursor = {size: 0 for size in lists}  # shared by every point of a size: always cold
    # Several passes over the whole plan: a burst of interference from another process on a
    # small shared machine then hits a few repetitions of many points, not all of one point.
    passes = 4
    for k in range(passes):
        left = budget - (time.monotonic() - start_all)
        per_point = max(0.01, left / max(1, len(plan) * (passes - k)))
        for key in plan:
            size, n, op = key
            lh, rh, total = lists[size]
            got = samples[key]
            p_end = time.monotonic() + per_point
            want = -(-min_reps * (k + 1) // passes)
            while len(got) < want or (time.monotonic() < p_end and len(got) < 50 * (k + 1)):
                # walk through the buffer: each repetition moves memory the previous ones did
                # not touch, so no point runs cache-hot (KV caches dwarf the LLC)
                first = cursor[size] if cursor[size] + n <= total else 0
                cursor[size] = first + n
                got.append(post(op, lh, rh, np.arange(first, first + n, dtype=np.int64)))
    points = []
    for size, n, op in sorted(plan, key=lambda k: (k[0], k[1], k[2] != "READ")):
        got = samples[(size, n, op)]
        points.append({"op": op, "size": size, "count": n, "reps": len(got),
                       "total_us": _low_quartile([x[0] for x in got]),
                       "post_us": _low_quartile([x[1] for x in got]),
                       "wall_us": _low_quartile([x[2] for x in got]),
                       "merged": int(statistics.median(x[3] for x in got))})
    for lh, rh, _ in lists.values():
        agent.release_dlist_handle(lh)
        agent.release_dlist_handle(rh)
    agent.remove_remote_agent(name)
    agent.deregister_memory(reg)
    return {"points": points, "handshake_s": fetch + add, "add_remote_agent_s": add,
            "metadata_fetch_s": fetch, "wireup_s": wireup,
            "notif_oneway_s": _low_quartile(rtts) / 2 if rtts else None,
            "memcpy_gbps": (16 << 20) / statistics.median(copies) / 1e9,
            "memory": mem_type, "sweep_seconds": time.monotonic() - start_all}


def run_pair(target: Any, initiator: Any, parent_end: Any, logs: Path, *, timeout: float,
             what: str, max_bytes: int) -> dict[str, Any]:
    """Start two spawned processes (a target and an initiator, each logging under ``logs``),
    wait up to ``timeout`` seconds for the initiator's msgpack result on ``parent_end``, then
    stop both. A RuntimeError naming ``what`` and the logs when it did not finish, the
    initiator died, or it reported an error."""
    target.start()
    initiator.start()
    try:
        if not parent_end.poll(timeout):
            raise RuntimeError(f"the {what} did not finish within {timeout:.0f} s "
                               f"(logs in {logs})")
        result = msgpack.unpackb(parent_end.recv_bytes(max_bytes), raw=False)
    except EOFError:
        raise RuntimeError(f"the {what}'s initiator died (exit {initiator.exitcode}; logs in "
                           f"{logs})") from None
    finally:
        for p in (initiator, target):
            p.join(10.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)
    if "error" in result:
        raise RuntimeError(f"{what} failed: {result['error']} (logs in {logs})")
    return result


def log_transports(logs: Path) -> list[str]:
    """The UCX transports the pair's two logs name (rank.ucx_transports), in order, once."""
    from .rank import ucx_transports

    transports: list[str] = []
    for name in ("initiator.log", "target.log"):
        try:
            text = (logs / name).read_text(errors="replace")
        except OSError:
            continue
        transports += [t for t in ucx_transports(text) if t not in transports]
    return transports


def run_sweep(*, quick: bool = False, budget: float = 150.0, log_dir: str | None = None,
              memory: str = "DRAM") -> dict[str, Any]:
    """Run the sweep in two spawned processes; returns the raw measurements plus the UCX
    transports found in their logs. ``memory``: DRAM (CPU), or VRAM (both buffers on
    ``cuda:0``: a one-GPU lab machine measures cuda_ipc inside one device)."""
    if memory not in ("DRAM", "VRAM"):
        raise ValueError(f"memory must be DRAM or VRAM, got {memory!r}")
    import tempfile

    sizes = list(QUICK_SIZES if quick else SIZES)
    counts = list(QUICK_COUNTS if quick else COUNTS)
    cap = max(s * n for s in sizes for n in counts if s * n <= BYTE_CAP)
    rotation = ROTATION_BYTES // 4 if quick else ROTATION_BYTES
    nbytes = max(rotation, 4 * cap)  # descriptors are spaced two lengths apart
    logs = Path(log_dir or tempfile.mkdtemp(prefix="hkvsim-calibrate-"))
    logs.mkdir(parents=True, exist_ok=True)
    ctx = multiprocessing.get_context("spawn")
    a, b = ctx.Pipe()
    parent_end, child_end = ctx.Pipe(duplex=False)
    target = ctx.Process(target=_target_main,
                         args=(b, str(logs / "target.log"), nbytes, memory), daemon=True)
    initiator = ctx.Process(target=_initiator_main,
                            args=(a, child_end, str(logs / "initiator.log"), nbytes, sizes,
                                  counts, budget, 3 if quick else 5, memory), daemon=True)
    result = run_pair(target, initiator, parent_end, logs, timeout=budget + 120.0,
                      what="calibration sweep", max_bytes=1 << 26)
    result["transports"] = log_transports(logs)
    result["log_dir"] = str(logs) if log_dir else None
    if not log_dir:
        import shutil

        shutil.rmtree(logs, ignore_errors=True)
    return result


# ---- fit --------------------------------------------------------------------------------------
def _nnls_relative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Minimise sum(((x @ c) / y - 1)^2) with c >= 0 (active set: drop negative terms)."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        a = x[:, active] / y[:, None]
        sol, *_ = np.linalg.lstsq(a, np.ones_like(y), rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return coef


def fit(points: list[SweepPoint]) -> dict[str, float]:
    """The fitted fabric numbers (seconds, bytes/s) and the separate post / wire fits."""
    n = np.array([p.count for p in points], float)
    b = np.array([p.nbytes for p in points], float)
    total = np.array([p.total_us for p in points], float) * 1e-6
    post = np.array([p.post_us for p in points], float) * 1e-6
    ones = np.ones_like(n)
    c0, c1, c2 = _nnls_relative(np.stack([ones, n, b], axis=1), total)
    after = total - post
    small = after[b <= 64 * 1024]
    latency = max(1e-7, float(np.median(small)) if small.size else 1e-7)
    launch = max(1e-7, c0 - latency)
    bandwidth = 1.0 / c2 if c2 > 0 else float("inf")
    p0, p1 = _nnls_relative(np.stack([ones, n], axis=1), post)
    wire = np.maximum(after, 1e-9)
    w0, w1 = _nnls_relative(np.stack([ones, b], axis=1), wire)
    return {"transfer_launch": launch, "per_descriptor": float(c1), "bandwidth": bandwidth,
            "latency": latency, "intercept": float(c0),
            "post_only_launch": float(p0), "post_only_per_descriptor": float(p1),
            "wire_only_latency": float(w0),
            "wire_only_bandwidth": 1.0 / w1 if w1 > 0 else float("inf")}


def predict(profile: Any, points: list[SweepPoint]) -> list[float]:
    """Each point's transfer time as the simulator predicts it: one transfer between two
    endpoints of one node, alone on a fresh simpy environment."""
    import simpy

    from ..fabric import Endpoint, Fabric

    out = []
    for p in points:
        env = simpy.Environment()
        fabric = Fabric(env, profile, {"a": Endpoint(0, 0), "b": Endpoint(0, 1)})
        src, dst = ("b", "a") if p.op == "READ" else ("a", "b")
        ev = fabric.transfer(initiator="a", src=src, dst=dst, nbytes=p.nbytes,
                             descriptors=p.count)
        env.run()
        out.append(float(ev.value.total))
    return out


# ---- outputs ----------------------------------------------------------------------------------
def _profile_values(numbers: dict[str, float], raw: dict[str, Any], transport: str
                    ) -> dict[str, Any]:
    gbps = numbers["bandwidth"] / 1e9
    return {
        "intra_node_bandwidth_gbps": round(gbps, 3),
        "intra_node_latency_us": round(max(numbers["latency"] * 1e6, 0.1), 3),
        "inter_node_bandwidth_gbps": round(gbps, 3),
        "inter_node_latency_us": round(max(numbers["latency"] * 1e6, 0.1), 3),
        "local_bandwidth_gbps": round(float(raw["memcpy_gbps"]), 3),
        "transfer_launch_us": round(max(numbers["transfer_launch"] * 1e6, 0.1), 3),
        "per_descriptor_us": round(max(numbers["per_descriptor"] * 1e6, 0.001), 4),
        "notification_latency_us": round(max((raw.get("notif_oneway_s") or 1e-5) * 1e6, 0.1),
                                         2),
        "handshake_latency_us": round(max(raw["handshake_s"] * 1e6, 1.0), 1),
        "transport": transport,
    }


def _machine() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{os.cpu_count()} CPU(s) {model or platform.processor()}, Linux "
            f"{platform.release()}, Python {platform.python_version()}")


def _nixl_version() -> str:
    from importlib import metadata

    for dist in ("nixl-cu12", "nixl-cu13", "nixl"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def write_profile(path: Path, values: dict[str, Any], numbers: dict[str, float],
                  raw: dict[str, Any], median_error: float) -> None:
    stamp = time.strftime("%Y-%m-%d")
    v = values
    tl = v["transport"]
    post_alpha = numbers["post_only_per_descriptor"] * 1e6
    post_launch = numbers["post_only_launch"] * 1e6
    text = f"""# Written by `hkvsim calibrate` on {stamp} (do not edit by hand; re-run it instead).
# NIXL over UCX between two processes of one machine, DRAM buffers: the CI configuration of the
# real NIXL backend. Machine: {_machine()}; {_nixl_version()}.
# UCX transport chosen for RMA (from UCX_PROTO_INFO): {v['transport']}.
# Units: *_gbps = GB/s (1e9 bytes/s) per direction; *_us = microseconds.
# Fit: relative least squares of the measured total transfer time (NIXL telemetry, post start to
# completion) over (1, descriptors, bytes), non-negative; {len(raw['points'])} sweep points, median
# absolute error {100 * median_error:.1f} % when replayed through the simulated fabric (see
# reports/calibration/cpu-ucx-loopback.md for every point).

name = "cpu-ucx-loopback"
description = "One CPU machine, NIXL/UCX {tl} between processes, DRAM (calibrated {stamp})"
# Endpoints are processes on one box, not GPUs; 64 keeps every CI scenario on one node.
gpus_per_node = 64

# 1 / (bytes coefficient of the fit). The wire-only fit (completion after the post) is
# meaningless on cma, where the copy runs inside the post call.
intra_node_bandwidth_gbps = {v['intra_node_bandwidth_gbps']}
# Median completion time after the post returned, for transfers <= 64 KiB.
intra_node_latency_us = {v['intra_node_latency_us']}

# Not measured: there is no second node. Copied from the intra-node figures.
inter_node_bandwidth_gbps = {v['inter_node_bandwidth_gbps']}
inter_node_latency_us = {v['inter_node_latency_us']}

# numpy memcpy of 16 MiB in one process (median of 7).
local_bandwidth_gbps = {v['local_bandwidth_gbps']}

# Intercept of the fit minus the latency above ({numbers['intercept'] * 1e6:.3f} us intercept).
transfer_launch_us = {v['transfer_launch_us']}
# Descriptor coefficient of the fit (a fit of the post time alone gives
# {post_alpha:.4f} us/descriptor and {post_launch:.3f} us launch).
per_descriptor_us = {v['per_descriptor_us']}

# send_notif ping-pong between the two agents / 2 (low quartile of 50), the receiver polling
# NIXL every 100 us (the rank processes of a run poll every 0.1-1 ms).
notification_latency_us = {v['notification_latency_us']}
# A metadata fetch over a local pipe ({raw['metadata_fetch_s'] * 1e6:.0f} us, median of 5) + the
# first add_remote_agent ({raw['add_remote_agent_s'] * 1e6:.0f} us). The first transfer to a new
# peer then took {raw['wireup_s'] * 1e3:.1f} ms of UCX wire-up, not part of this figure.
handshake_latency_us = {v['handshake_latency_us']}

placement = "pack"
memory = "DRAM"
transport = "{v['transport']}"
"""
    # keep the host-path block of `calibrate --host` (fitted separately, on whole scenarios)
    old = path.read_text() if path.is_file() else ""
    cut = old.find("\n# ---- host-path model")
    if cut >= 0:
        text += old[cut:]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def write_report(directory: Path, points: list[SweepPoint], predicted: list[float],
                 numbers: dict[str, float], values: dict[str, Any], raw: dict[str, Any],
                 errors: np.ndarray, profile_path: Path | None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    md = directory / "cpu-ucx-loopback.md"
    lines = [
        "# Calibration: NIXL UCX loopback (DRAM) vs the simulated fabric",
        "",
        f"Generated by `hkvsim calibrate` on {time.strftime('%Y-%m-%d %H:%M')}. Machine: "
        f"{_machine()}; {_nixl_version()}; UCX transport for RMA: "
        f"**{values['transport']}** (from UCX_PROTO_INFO in the agents' logs). Sweep "
        f"{raw['sweep_seconds']:.0f} s, NIXL progress thread off, the target polling.",
        "",
        "## Fitted profile" + (f" (`{_shown(profile_path)}`)" if profile_path else
                               " (not written)"),
        "",
        "| key | value |", "|---|---|",
        *[f"| {k} | {v} |" for k, v in values.items()],
        "",
        f"Separate fits, for reference: post time alone over (1, descriptors): "
        f"{numbers['post_only_launch'] * 1e6:.3f} us + "
        f"{numbers['post_only_per_descriptor'] * 1e6:.4f} us/descriptor; completion after the "
        f"post over (1, bytes): " + (
            f"{numbers['wire_only_latency'] * 1e6:.3f} us + "
            f"{numbers['wire_only_bandwidth'] / 1e9:.3g} GB/s"
            if numbers["wire_only_bandwidth"] < 1e15 else "not observable") +
        ". On cma the copy runs inside the post call (post ~= total in the table), so the "
        "profile uses the total-time fit (see hkvsim/backends/calibrate.py).",
        "",
        f"First transfer to the new peer (wire-up): {raw['wireup_s'] * 1e3:.2f} ms. "
        f"add_remote_agent: {raw['add_remote_agent_s'] * 1e3:.2f} ms.",
        "",
        "## Error",
        "",
        f"Predicted = the simulator's time for the same transfer (one flow, one node, fitted "
        f"profile, `hkvsim.fabric.Fabric` on a simpy environment). Error = (predicted - "
        f"measured) / measured. **Median absolute error "
        f"{100 * float(np.median(np.abs(errors))):.1f} %** "
        f"(acceptance: < {100 * ACCEPT_MEDIAN_ERROR:.0f} %), 90th percentile "
        f"{100 * float(np.percentile(np.abs(errors), 90)):.1f} %, worst "
        f"{100 * float(np.max(np.abs(errors))):.1f} %.",
        "",
        "## Every sweep point",
        "",
        "| op | descriptor | descriptors | bytes | reps | measured (us) | post (us) | "
        "predicted (us) | error | GB/s measured | merged descs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p, pred, err in zip(points, predicted, errors):
        lines.append(
            f"| {p.op} | {_size(p.size)} | {p.count:,} | {p.nbytes:,} | {p.reps} | "
            f"{p.total_us:,.1f} | {p.post_us:,.1f} | {pred * 1e6:,.1f} | {100 * err:+.1f} % | "
            f"{p.nbytes / (p.total_us * 1e-6) / 1e9:.2f} | {p.merged:,} |")
    md.write_text("\n".join(lines) + "\n")
    (directory / "cpu-ucx-loopback.json").write_text(json.dumps({
        "source": "hkvsim calibrate", "transport": values["transport"], "fit": numbers,
        "profile": values,
        "median_abs_error": float(np.median(np.abs(errors))),
        "points": [{"label": f"{p.op} {_size(p.size)} x {p.count}", "op": p.op,
                    "descriptor_bytes": p.size, "descriptors": p.count, "nbytes": p.nbytes,
                    "measured_seconds": p.total_us * 1e-6, "simulated_seconds": pred,
                    "post_seconds": p.post_us * 1e-6, "wall_seconds": p.wall_us * 1e-6,
                    "reps": p.reps}
                   for p, pred in zip(points, predicted)]}, indent=1) + "\n")
    return md


def _shown(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(_REPO))
    except ValueError:
        return str(path)


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def calibrate(*, quick: bool = False, budget: float = 150.0, profile_out: Path | None = None,
              report_dir: Path | None = None, log_dir: str | None = None,
              force: bool = False) -> dict[str, Any]:
    """Sweep, fit, replay through the simulator, write the profile (if the fit is accepted, or
    ``force``) and the report. Returns a summary."""
    from ..fabric.profile import load_profile

    raw = run_sweep(quick=quick, budget=budget, log_dir=log_dir)
    points = [SweepPoint(**p) for p in raw["points"]]
    numbers = fit(points)
    transport = ",".join(t.split("/")[0] for t in raw["transports"]) or "unknown"
    values = _profile_values(numbers, raw, transport)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        trial = Path(tmp) / "trial.toml"
        write_profile(trial, values, numbers, raw, 0.0)
        profile = load_profile(trial)
    predicted = predict(profile, points)
    measured = np.array([p.total_us * 1e-6 for p in points])
    errors = (np.array(predicted) - measured) / measured
    median_error = float(np.median(np.abs(errors)))
    accepted = median_error < ACCEPT_MEDIAN_ERROR
    written = None
    if profile_out is not None and (accepted or force):
        write_profile(profile_out, values, numbers, raw, median_error)
        load_profile(profile_out)  # what we wrote must load
        written = profile_out
    report = None
    if report_dir is not None:
        report = write_report(report_dir, points, predicted, numbers, values, raw, errors,
                              written)
    return {"accepted": accepted, "median_abs_error": median_error,
            "p90_abs_error": float(np.percentile(np.abs(errors), 90)),
            "points": len(points), "transport": transport, "transports": raw["transports"],
            "profile": values, "fit": numbers, "profile_written": str(written) if written else None,
            "report": str(report) if report else None,
            "sweep_seconds": raw["sweep_seconds"], "log_dir": raw["log_dir"]}


def _print_json(result: Any) -> None:
    json.dump(result, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def run_calibration_cli(args: Any) -> int:
    """``hkvsim calibrate``: exit 0 when the fit meets the acceptance (median error < 15 %)."""
    if getattr(args, "replay", None) is not None:  # stored runs only: no NIXL needed
        return _run_replay_cli(args)
    from ..transport.nixl import NixlUnavailable, load_nixl

    try:
        load_nixl()
    except NixlUnavailable as exc:
        print(f"hkvsim: error: {exc}", file=sys.stderr)
        return 2
    from ..validate_fit import LoadError, check_load

    if getattr(args, "host", False):
        return _run_host_cli(args)
    quick = bool(args.quick)
    try:
        load, cores = check_load(force=bool(getattr(args, "force", False)) or quick)
    except LoadError as exc:
        print(f"hkvsim: error: {exc}", file=sys.stderr)
        return 2
    if load > cores:
        print(f"hkvsim: warning: load average {load:.2f} > {cores} core(s); fitting anyway "
              f"(--force)", file=sys.stderr)
    profile_out = Path(args.profile_out) if args.profile_out else (
        None if quick else DEFAULT_PROFILE)
    report_dir = Path(args.report_dir) if (args.report_dir and not quick) or (
        quick and args.report_dir != "reports/calibration") else None
    try:
        summary = calibrate(quick=quick, budget=float(args.budget), profile_out=profile_out,
                            report_dir=report_dir)
    except RuntimeError as exc:
        print(f"hkvsim: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        _print_json(summary)
    else:
        v = summary["profile"]
        print(f"UCX transport: {summary['transport']} ({', '.join(summary['transports'])})")
        print(f"fit: launch {v['transfer_launch_us']} us, {v['per_descriptor_us']} us/descriptor,"
              f" {v['intra_node_bandwidth_gbps']} GB/s, latency {v['intra_node_latency_us']} us")
        print(f"{summary['points']} points, median |error| "
              f"{100 * summary['median_abs_error']:.1f} % (p90 "
              f"{100 * summary['p90_abs_error']:.1f} %), sweep {summary['sweep_seconds']:.0f} s")
        if summary["profile_written"]:
            print(f"wrote {summary['profile_written']}")
        if summary["report"]:
            print(f"wrote {summary['report']}")
    if not summary["accepted"]:
        print(f"hkvsim: calibration not accepted: median error "
              f"{100 * summary['median_abs_error']:.1f} % >= {100 * ACCEPT_MEDIAN_ERROR:.0f} %; "
              f"profile not written", file=sys.stderr)
        return 1
    return 0


def _run_host_cli(args: Any) -> int:
    """``hkvsim calibrate --host``: exit 0 when the held-out bounds are met and the profile is
    written, 1 when they are not (nothing written), 2 on bad input or a loaded machine."""
    from ..validate import ValidationError
    from ..validate_fit import LoadError, calibrate_host

    fit_files = [Path(f) for f in args.fit] if args.fit else sorted(
        (_REPO / "scenarios" / "fit").glob("*.toml"))
    held = [Path(f) for f in args.held_out] if args.held_out else sorted(
        (_REPO / "scenarios" / "validation").glob("*.toml"))
    if args.repeats < 1:
        print(f"hkvsim: error: --repeats {args.repeats}: expected an integer >= 1",
              file=sys.stderr)
        return 2
    if args.warm_up < 0:
        print(f"hkvsim: error: --warm-up {args.warm_up}: expected an integer >= 0",
              file=sys.stderr)
        return 2
    profile_out = Path(args.profile_out) if args.profile_out else DEFAULT_PROFILE
    try:
        result = calibrate_host(
            fit_files, held, profile_in=DEFAULT_PROFILE, profile_out=profile_out,
            report_dir=Path(args.report_dir) if args.report_dir else None,
            repeats=args.repeats, force=bool(args.force), warm_up=args.warm_up,
            progress=lambda text: print(f"calibrate: {text}", file=sys.stderr))
    except (LoadError, ValidationError) as exc:
        print(f"hkvsim: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        _print_json(result)
    else:
        f = result["fit"]
        print(f"fit: {f['cores']} core(s) x {f['core_gbps']} GB/s, rank dispatch "
              f"{f['rank_dispatch_us']} us, completion notice {f['completion_notice_us']} us, "
              f"coordinator message {f['coordinator_message_us']} us, oracle "
              f"{f['oracle_core_gbps']} GB/s per core")
        if result.get("report"):
            print(f"wrote {result['report']}")
        if result["profile_written"]:
            print(f"wrote {result['profile_written']}")
    if not result["accepted"]:
        print(f"hkvsim: calibration refused, profile not written: {result['refused']}",
              file=sys.stderr)
        return 1
    return 0


def _run_replay_cli(args: Any) -> int:
    """``hkvsim calibrate --host --replay JSON``: exit 0 when the replayed held-out errors are
    within the bounds, 1 when not, 2 on bad input. Writes nothing."""
    from ..validate import ACCEPT_MEDIAN, ACCEPT_WORST, ValidationError, resampled_sentence
    from ..validate_fit import replay_host

    if not getattr(args, "host", False):
        print("hkvsim: error: --replay needs --host (it replays a host-path calibration)",
              file=sys.stderr)
        return 2
    source = Path(args.replay)
    try:
        try:
            record = json.loads(source.read_text())
        except OSError as exc:
            raise ValidationError(exc.strerror or str(exc)) from None
        except json.JSONDecodeError as exc:
            raise ValidationError(f"not JSON ({exc})") from None
        result = replay_host(record, profile_in=DEFAULT_PROFILE)
    except ValidationError as exc:
        print(f"hkvsim: error: --replay {source}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        _print_json(result)
    else:
        f = result["fit"]
        print(f"replay of {source} (real runs measured {result['measured_at']}); refitted: "
              f"{f['core_gbps']} GB/s per core, completion notice {f['completion_notice_us']} us "
              f"(stored: {result['stored_fit']['core_gbps']} GB/s, "
              f"{result['stored_fit']['completion_notice_us']} us)")
        for title, key in (("FIT, in sample", "fit_files"), ("held out", "held_out_files")):
            print(f"{title}:")
            for r in result[key]:
                print(f"  {Path(r['file']).name}: sim {1e3 * r['sim_seconds']:.3f} ms, real "
                      f"median {1e3 * r['real_median']:.3f} ms, error {100 * r['error']:+.0f} %")
        within = "within" if result["within_bounds"] else "outside"
        print(f"held-out median |error| {100 * result['held_out_median']:.1f} %, worst "
              f"{100 * result['held_out_worst']:.0f} %: {within} the bounds (median <= "
              f"{100 * ACCEPT_MEDIAN:.0f} %, worst <= {100 * ACCEPT_WORST:.0f} %). "
              f"{resampled_sentence(result['resampled'])}")
        print("nothing written: the stored held-out runs were looked at before, so a replay "
              "explores a model change; only a fresh `hkvsim calibrate --host` writes a profile")
    return 0 if result["within_bounds"] else 1
