"""Fabric profiles: the published (or measured) numbers a simulated fabric runs on.

A profile is a TOML file: a shipped one, ``hkvsim/fabric/profiles/<name>.toml`` (package data,
so a name works from an installed wheel in any directory), or any file a user points at by path
(a value ending in ``.toml`` or containing a ``/``; relative paths resolve against ``base_dir``,
e.g. the scenario file's directory, else the working directory). The file uses human units, the
dataclass uses SI units:

* ``*_gbps`` keys are bandwidths in GB/s (1e9 bytes/s), stored in bytes/s;
* ``*_us`` keys are durations in microseconds, stored in seconds.

Every key is required except the host-path keys below, every number must be finite and > 0, and
nothing is guessed or clamped:
any problem raises :class:`ProfileError` naming the file, the key, the value and what is allowed.

Optional host-path keys (absent = not modelled; the GPU profiles leave them out):

* ``host_copy_cores`` and ``host_copy_core_gbps`` (both or neither; DRAM profiles only): on a
  host path (UCX cma, memcpy) the initiating rank's own thread does the copy, inside its post
  and poll calls, on one of the node's CPU cores, and every rank process of the node competes
  for those cores. A transfer then holds one core of its initiator's node (a FIFO pool of
  ``host_copy_cores``, first come first served) for its dispatch, its post and its copy
  (``nbytes / host_copy_core_gbps``); it crosses no fair-shared link (see
  :class:`hkvsim.fabric.links.Fabric`).
* ``rank_dispatch_us`` (only with ``host_copy_cores``): the CPU time a rank spends on a transfer
  before posting it (taking the coordinator's order, planning descriptors, preparing the
  request), on the core it then posts and copies from. Absent = 0.
* ``rank_dispatch_unprepped_us`` (only with ``host_copy_cores``): the same for a transfer made
  from raw descriptors (``make_xfer``: ``descriptor_merge`` contiguous or strided), whose lists
  NIXL prepares on each call. Absent = ``rank_dispatch_us``.
* ``rank_op_dispatch_us`` / ``rank_op_dispatch_unprepped_us`` (only with ``host_copy_cores``): a
  rank's CPU per operation (one StartRead / StartWrite, which may post to several remote ranks)
  before its first post, besides the per-post dispatch above; the second for an operation
  posting raw descriptors (absent = the first). Absent = 0.
* ``peer_poll_idle_us`` and ``peer_poll_busy_us`` (both or neither, only with
  ``host_copy_cores``): on UCX cma a posted transfer completes only once the remote agent's
  worker has progressed since the post (the remote rank's next call into NIXL). A rank process
  calls into NIXL whenever a message from the coordinator wakes it and otherwise every
  ``peer_poll_busy_us`` while it has transfers in flight, every ``peer_poll_idle_us`` when not
  (the rank loop's select timeouts). Absent = the remote's progress is not waited for.
* ``poll_cpu_us`` (only with the poll periods above): the CPU one idle iteration of a rank's
  loop spends calling into NIXL (progress, notification checks). Every rank process then
  demands ``poll_cpu_us / (peer_poll_idle_us + poll_cpu_us)`` of a core while it waits, and
  CPU work on a node's cores runs slower when the other ranks' polling leaves fewer cores than
  are busy: a job that finds ``k`` of the node's cores busy (itself included) runs
  ``max(1, k / max(cores - demand, 1))`` times as long, ``demand`` being the polling of the
  node's other rank processes. (A busy rank's few iterations between a post and its completion
  are the completion notice, below.) Measured by ``hkvsim calibrate --host`` in the real
  ranks' loops; absent = polling costs no CPU.
* ``core_contention`` (only with ``host_copy_cores``; a number, no unit): CPU work slows when
  the node's other cores are busy too (memory bandwidth, caches and the hypervisor are shared:
  on the 2-core CI VM two processes copying at once each copy at ~70 % of one alone, two
  running Python at ~80 %). A job that finds ``k`` of the node's cores busy (itself included)
  runs ``1 + core_contention * (k - 1)`` times as long, on top of the polling stretch above.
  Fitted by ``hkvsim calibrate --host`` with the per-core rate; absent = no contention.
* ``rank_thread_order`` (only with ``host_copy_cores``): how a rank's one thread orders its
  work. ``"fifo"`` (absent): first come, first served, a completion notice included.
  ``"loop-batches"``: as the rank loop runs (hkvsim/backends/rank.py): it handles every message
  it has read (a batch: posts, oracle work), then polls NIXL once; work arriving while the
  thread is busy goes to the next batch, and a completion that lands while a batch runs (or as
  its post returns, when the remote rank more likely than not polled NIXL during the post) is
  noticed at that batch's end, ahead of the next batch.
* ``coordinator_call_us`` (only with ``host_copy_cores``): the coordinator's CPU per operation
  it sends a rank (deciding it, encoding it, writing it to the rank's socket), on the
  coordinator's one thread and a core of node 0: a request's calls reach its ranks one after
  another. Absent = 0.
* ``oracle_core_gbps`` (only with ``host_copy_cores``): what one core fills or checks with the
  byte oracle of a verified run (the prefill rank writing a request's pattern, the decode rank
  checking it): that work holds a core of the rank's node too. Measured by ``hkvsim calibrate
  --host``; absent = the oracle costs no simulated time.
* ``oracle_op_us`` (only with ``oracle_core_gbps``): the CPU one such fill or check costs
  besides its bytes (its walk over layers and regions, the rank's handling of the operation):
  a fill or check of ``n`` bytes costs ``oracle_op_us + n / oracle_core_gbps``. Measured by
  ``hkvsim calibrate --host``; absent = 0.
* ``completion_notice_us``: from a transfer's data landing to the rank's poll loop noticing it
  (the loop sleeps between NIXL polls).
* ``coordinator_message_us``: the rank's completion message to the coordinator (one local
  socket hop plus process scheduling). Both are added to every transfer's completion time.
``overrides`` (e.g. a scenario's ``[fabric]`` section) use the same TOML key names and types: an
integer key (``gpus_per_node``) takes an integer, a number key an integer or a float, a string key
a string.
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Final, Mapping

__all__ = [
    "ProfileError",
    "FabricProfile",
    "PLACEMENTS",
    "MEMORY_KINDS",
    "PROFILE_DIR",
    "TOML_KEYS",
    "REQUIRED_KEYS",
    "load_profile",
    "is_profile_path",
    "profile_names",
    "resolve_profile",
]

#: The shipped profiles (package data: present in an installed wheel as in a source checkout).
PROFILE_DIR: Final[Path] = Path(__file__).resolve().parent / "profiles"
PLACEMENTS: Final[tuple[str, ...]] = ("pack", "split")
MEMORY_KINDS: Final[tuple[str, ...]] = ("VRAM", "DRAM")
#: How a rank's one thread orders its host-path work (``rank_thread_order``).
RANK_THREAD_ORDERS: Final[tuple[str, ...]] = ("fifo", "loop-batches")


class ProfileError(ValueError):
    """A fabric profile that is missing, malformed or out of range.

    ``str(error)`` is the whole one-line message. For callers that attribute the error to their
    own keys (a scenario's ``fabric.profile`` / ``fabric.overrides.<key>``): ``problem`` is the
    message without the file prefix, and ``override_key`` names the override at fault (None when
    the name, the path or the file's own content is at fault).
    """

    def __init__(self, message: str, *, problem: str | None = None,
                 override_key: str | None = None) -> None:
        super().__init__(message)
        self.problem = message if problem is None else problem
        self.override_key = override_key


@dataclass(frozen=True)
class _Field:
    """How one dataclass field is spelled in TOML and what it may hold."""

    attr: str
    key: str  # the TOML key
    kind: str  # "int" | "float" | "str"
    unit: str = ""  # "gbps" (GB/s -> bytes/s), "us" (microseconds -> seconds) or "" (as is)
    choices: tuple[str, ...] = ()
    optional: bool = False  # absent from the file -> the dataclass default (feature off)

    def to_si(self, value: float) -> float:
        """TOML units -> SI. Dividing by 1e6 (not multiplying by 1e-6) keeps 30 us == 3e-05 s."""
        if self.unit == "gbps":
            return value * 1e9
        if self.unit == "us":
            return value / 1e6
        return value

    def from_si(self, value: float) -> float:
        """SI -> TOML units (for messages)."""
        if self.unit == "gbps":
            return value / 1e9
        if self.unit == "us":
            return value * 1e6
        return value


_SCHEMA: Final[tuple[_Field, ...]] = (
    _Field("name", "name", "str"),
    _Field("description", "description", "str"),
    _Field("gpus_per_node", "gpus_per_node", "int"),
    _Field("intra_node_bandwidth", "intra_node_bandwidth_gbps", "float", "gbps"),
    _Field("intra_node_latency", "intra_node_latency_us", "float", "us"),
    _Field("inter_node_bandwidth", "inter_node_bandwidth_gbps", "float", "gbps"),
    _Field("inter_node_latency", "inter_node_latency_us", "float", "us"),
    _Field("local_bandwidth", "local_bandwidth_gbps", "float", "gbps"),
    _Field("transfer_launch", "transfer_launch_us", "float", "us"),
    _Field("per_descriptor", "per_descriptor_us", "float", "us"),
    _Field("notification_latency", "notification_latency_us", "float", "us"),
    _Field("handshake_latency", "handshake_latency_us", "float", "us"),
    _Field("placement", "placement", "str", choices=PLACEMENTS),
    _Field("memory", "memory", "str", choices=MEMORY_KINDS),
    _Field("transport", "transport", "str"),
    _Field("host_copy_cores", "host_copy_cores", "int", optional=True),
    _Field("host_copy_core_bandwidth", "host_copy_core_gbps", "float", "gbps", optional=True),
    _Field("rank_dispatch", "rank_dispatch_us", "float", "us", optional=True),
    _Field("rank_dispatch_unprepped", "rank_dispatch_unprepped_us", "float", "us",
           optional=True),
    _Field("rank_op_dispatch", "rank_op_dispatch_us", "float", "us", optional=True),
    _Field("rank_op_dispatch_unprepped", "rank_op_dispatch_unprepped_us", "float", "us",
           optional=True),
    _Field("coordinator_call", "coordinator_call_us", "float", "us", optional=True),
    _Field("oracle_core_bandwidth", "oracle_core_gbps", "float", "gbps", optional=True),
    _Field("oracle_op", "oracle_op_us", "float", "us", optional=True),
    _Field("peer_poll_idle", "peer_poll_idle_us", "float", "us", optional=True),
    _Field("peer_poll_busy", "peer_poll_busy_us", "float", "us", optional=True),
    _Field("poll_cpu", "poll_cpu_us", "float", "us", optional=True),
    _Field("core_contention", "core_contention", "float", optional=True),
    _Field("completion_notice", "completion_notice_us", "float", "us", optional=True),
    _Field("coordinator_message", "coordinator_message_us", "float", "us", optional=True),
    _Field("rank_thread_order", "rank_thread_order", "str", choices=RANK_THREAD_ORDERS,
           optional=True),
)
_BY_KEY: Final[dict[str, _Field]] = {f.key: f for f in _SCHEMA}
_BY_ATTR: Final[dict[str, _Field]] = {f.attr: f for f in _SCHEMA}

#: The TOML keys a profile file (and an overrides mapping) may contain, in file order.
TOML_KEYS: Final[tuple[str, ...]] = tuple(f.key for f in _SCHEMA)
#: The keys every profile must have.
REQUIRED_KEYS: Final[tuple[str, ...]] = tuple(f.key for f in _SCHEMA if not f.optional)


def _allowed(spec: _Field) -> str:
    if spec.choices:
        return "one of " + ", ".join(repr(c) for c in spec.choices)
    if spec.kind == "int":
        return "an integer > 0"
    if spec.kind == "float":
        return "a finite number > 0"
    return "a non-empty string"


def _check(spec: _Field, value: Any, where: str, label: str) -> None:
    """Raise ProfileError unless ``value`` is acceptable for ``spec`` (in its TOML units)."""

    def fail() -> None:
        override = spec.key if label.startswith("override") else None
        raise ProfileError(
            f"{where}: {label} {spec.key!r} = {value!r}: expected {_allowed(spec)}",
            problem=f"expected {_allowed(spec)}, got {value!r}" if override else None,
            override_key=override,
        )

    if spec.kind == "str":
        if not isinstance(value, str) or not value.strip():
            fail()
        if spec.choices and value not in spec.choices:
            fail()
    elif spec.kind == "int":
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            fail()
    else:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail()
        if not math.isfinite(value) or value <= 0:
            fail()


@dataclass(frozen=True, kw_only=True)
class FabricProfile:
    """One fabric, in SI units (bytes/s, seconds). See the module docstring for the TOML form.

    Validated on construction, so a profile built in code obeys the same rules as a file.
    """

    name: str
    description: str
    gpus_per_node: int  # endpoints per node
    intra_node_bandwidth: float  # bytes/s per direction per GPU (NVLink-class or PCIe)
    intra_node_latency: float  # seconds
    inter_node_bandwidth: float  # bytes/s per NIC per direction; one NIC per GPU
    inter_node_latency: float  # seconds
    local_bandwidth: float  # bytes/s for a same-GPU copy (HBM)
    transfer_launch: float  # seconds per posted transfer, on the initiator's CPU
    per_descriptor: float  # seconds per descriptor posted, on the initiator's CPU
    notification_latency: float  # seconds from data completion to the notification arriving
    handshake_latency: float  # seconds for one metadata fetch + add_remote_agent
    placement: str  # "pack" | "split"
    memory: str  # "VRAM" | "DRAM"
    transport: str  # NIXL/UCX transport label, e.g. "cuda_ipc", "rc_mlx5", "cma"
    # Host-path model (optional; None / 0.0 = not modelled), see the module docstring.
    host_copy_cores: int | None = None  # CPU cores of a node that do the copies
    host_copy_core_bandwidth: float | None = None  # bytes/s one core copies
    rank_dispatch: float = 0.0  # seconds of a rank's CPU per transfer before its post (host path)
    rank_dispatch_unprepped: float = 0.0  # ... for a make_xfer transfer (0: rank_dispatch)
    rank_op_dispatch: float = 0.0  # seconds per operation before its first post (host path)
    rank_op_dispatch_unprepped: float = 0.0  # ... for an operation posting raw descriptors
    coordinator_call: float = 0.0  # seconds of the coordinator's CPU per call it sends (host path)
    oracle_core_bandwidth: float | None = None  # bytes/s one core fills or checks (host path)
    oracle_op: float = 0.0  # seconds of CPU per oracle fill or check besides its bytes
    peer_poll_idle: float = 0.0  # seconds between a remote rank's NIXL polls, idle (host path)
    peer_poll_busy: float = 0.0  # ... and with transfers in flight
    poll_cpu: float = 0.0  # seconds of CPU per idle loop iteration of a rank (host path)
    core_contention: float = 0.0  # slowdown per other busy core of the node (host path)
    completion_notice: float = 0.0  # seconds: the rank's poll loop noticing a completion
    coordinator_message: float = 0.0  # seconds: the rank's completion message to the coordinator
    rank_thread_order: str | None = None  # "fifo" (None) | "loop-batches" (host path)

    def __post_init__(self) -> None:
        for f in fields(self):
            spec = _BY_ATTR[f.name]
            value = getattr(self, f.name)
            if spec.optional and value in (None, 0.0):
                continue
            shown = spec.from_si(value) if spec.kind == "float" and _is_number(value) else value
            _check(spec, shown, f"FabricProfile {self.name!r}", "field for key")
        _check_host_copy(lambda attr: getattr(self, attr), self.memory,
                         f"FabricProfile {self.name!r}")

    @property
    def host_cores(self) -> int | None:
        """CPU cores per node that the host-path copies run on (None: not modelled)."""
        return self.host_copy_cores if self.host_copy_core_bandwidth is not None else None

    @property
    def completion_overhead(self) -> float:
        """Seconds from a transfer's data landing to the coordinator knowing of it, beyond the
        path latency: completion notice + coordinator message."""
        return self.completion_notice + self.coordinator_message

    def dispatch_time(self, *, unprepped: bool = False) -> float:
        """A rank's CPU on one host-path transfer before its post: ``rank_dispatch_unprepped``
        for a transfer made from raw descriptors when the profile gives one, else
        ``rank_dispatch``."""
        if unprepped and self.rank_dispatch_unprepped:
            return self.rank_dispatch_unprepped
        return self.rank_dispatch

    def op_dispatch_time(self, *, unprepped: bool = False) -> float:
        """A rank's CPU per operation before its first host-path post, besides each transfer's
        :meth:`dispatch_time`: ``rank_op_dispatch_unprepped`` for an operation posting raw
        descriptors when the profile gives one, else ``rank_op_dispatch``."""
        if unprepped and self.rank_op_dispatch_unprepped:
            return self.rank_op_dispatch_unprepped
        return self.rank_op_dispatch

    def oracle_time(self, nbytes: int) -> float:
        """Seconds of one core for an oracle fill or check of ``nbytes`` (host path, verified
        runs): ``oracle_op + nbytes / oracle_core_bandwidth``."""
        if self.oracle_core_bandwidth is None:
            raise ValueError(f"profile {self.name!r} models no oracle CPU (no oracle_core_gbps)")
        return self.oracle_op + nbytes / self.oracle_core_bandwidth

    @property
    def poll_demand(self) -> float:
        """The fraction of a core a waiting rank process's NIXL polling takes:
        ``poll_cpu / (peer_poll_idle + poll_cpu)`` (0 when not modelled)."""
        cpu = self.poll_cpu
        return cpu / (self.peer_poll_idle + cpu) if cpu else 0.0

    def post_time(self, descriptors: int) -> float:
        """CPU time to post one transfer of ``descriptors`` descriptors (launch + n * alpha)."""
        return self.transfer_launch + descriptors * self.per_descriptor


#: Host-path keys that are CPU time on a node's core, so they need ``host_copy_cores`` (attrs)
_NEED_HOST_CORES: Final[tuple[str, ...]] = ("rank_dispatch", "oracle_core_bandwidth",
                                            "peer_poll_idle", "coordinator_call",
                                            "rank_dispatch_unprepped", "rank_op_dispatch",
                                            "rank_op_dispatch_unprepped", "core_contention",
                                            "rank_thread_order")


def _check_host_copy(get: Callable[[str], Any], memory: str, where: str) -> None:
    """The host-path keys' rules; ``get(attr)`` gives a field's value (None / 0 when absent)."""
    cores, rate = get("host_copy_cores"), get("host_copy_core_bandwidth")
    if bool(get("peer_poll_idle")) != bool(get("peer_poll_busy")):
        raise ProfileError(
            f"{where}: 'peer_poll_idle_us' and 'peer_poll_busy_us' go together: give both (a "
            "remote rank's NIXL poll periods) or neither")
    for attr in _NEED_HOST_CORES:
        key = _BY_ATTR[attr].key
        if get(attr) and cores is None:
            raise ProfileError(
                f"{where}: {key!r} without 'host_copy_cores': it is CPU time on a node's core; "
                "give the host copy model (host_copy_cores, host_copy_core_gbps) too or leave "
                f"{key} out")
    if get("poll_cpu") and not get("peer_poll_idle"):
        raise ProfileError(
            f"{where}: 'poll_cpu_us' without 'peer_poll_idle_us' / 'peer_poll_busy_us': a "
            "rank's polling CPU is per poll period; give the periods too or leave poll_cpu_us "
            "out")
    if get("oracle_op") and not get("oracle_core_bandwidth"):
        raise ProfileError(
            f"{where}: 'oracle_op_us' without 'oracle_core_gbps': it is the oracle's CPU per "
            "fill or check besides its bytes; give oracle_core_gbps too or leave oracle_op_us "
            "out")
    if (cores is None) != (rate is None):
        raise ProfileError(
            f"{where}: 'host_copy_cores' and 'host_copy_core_gbps' go together: give both "
            "(the node's CPU cores copy, one transfer per core) or neither")
    if cores is not None and memory != "DRAM":
        raise ProfileError(
            f"{where}: 'host_copy_cores' with memory = {memory!r}: the host copy model applies "
            "to memory = 'DRAM' profiles only")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def profile_names(search_dirs: list[Path] | None = None) -> list[str]:
    """Names (file stems) of the profiles found in ``search_dirs`` (default: the shipped ones)."""
    dirs = [PROFILE_DIR] if search_dirs is None else search_dirs
    names: set[str] = set()
    for d in dirs:
        if Path(d).is_dir():
            names.update(p.stem for p in Path(d).glob("*.toml") if p.is_file())
    return sorted(names)


def is_profile_path(name_or_path: str) -> bool:
    """A path ends in ``.toml`` or has a directory part; anything else is a profile name."""
    return name_or_path.endswith(".toml") or "/" in name_or_path or os.sep in name_or_path


def resolve_profile(
    name_or_path: str | Path,
    *,
    base_dir: str | Path | None = None,
    search_dirs: list[Path] | None = None,
) -> Path:
    """The file a profile name or path denotes (absolute), or ProfileError.

    A name is looked up in ``search_dirs`` (default: the shipped profiles); a relative path
    resolves against ``base_dir`` (default: the working directory).
    """
    dirs = [PROFILE_DIR] if search_dirs is None else [Path(d) for d in search_dirs]
    text = str(name_or_path)
    if is_profile_path(text):
        path = Path(text).expanduser()
        if not path.is_absolute():
            path = Path(base_dir if base_dir is not None else Path.cwd()) / path
        path = path.resolve()
        if not path.is_file():
            raise ProfileError(
                f"fabric profile file {str(path)!r} does not exist",
                problem=f"no such fabric profile file: {path}",
            )
        return path
    for d in dirs:
        p = d / f"{text}.toml"
        if p.is_file():
            return p.resolve()
    names = profile_names(dirs)
    where = ", ".join(str(d) for d in dirs)
    allowed = ", ".join(names) if names else "(no profile found)"
    raise ProfileError(
        f"unknown fabric profile {text!r}; available: {allowed} (searched {where})",
        problem=f"unknown fabric profile {text!r} (searched {where}); allowed: {allowed}, "
        "or a path to a profile .toml file",
    )


def _read(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{path}: not valid TOML: {exc}") from None
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read fabric profile: {exc}") from None


def _unknown(where: str, label: str, key: str, value: Any) -> ProfileError:
    override = label.startswith("override")
    return ProfileError(
        f"{where}: unknown {label} {key!r} = {value!r}; allowed keys: {', '.join(TOML_KEYS)}",
        problem=f"unknown override key; allowed: {', '.join(TOML_KEYS)}" if override else None,
        override_key=key if override else None,
    )


def load_profile(
    name_or_path: str | Path,
    *,
    overrides: Mapping[str, Any] | None = None,
    search_dirs: list[Path] | None = None,
    base_dir: str | Path | None = None,
) -> FabricProfile:
    """Load a fabric profile by name (``hkvsim/fabric/profiles/<name>.toml``) or by file path.

    ``overrides`` maps TOML keys (``per_descriptor_us``, ``placement``, ...) to values that
    replace the file's; they are validated like the file. ``search_dirs`` replaces the default
    profile directory for name lookups; ``base_dir`` anchors a relative path (see
    :func:`resolve_profile`).
    """
    path = resolve_profile(name_or_path, base_dir=base_dir, search_dirs=search_dirs)
    raw = _read(path)
    where = str(path)

    for key, value in raw.items():
        if key not in _BY_KEY:
            raise _unknown(where, "key", key, value)
    merged = dict(raw)
    from_override: set[str] = set()
    for key, value in (overrides or {}).items():
        if key not in _BY_KEY:
            raise _unknown(where, "override key", key, value)
        merged[key] = value
        from_override.add(key)

    missing = [k for k in REQUIRED_KEYS if k not in merged]
    if missing:
        raise ProfileError(
            f"{where}: missing key(s) {', '.join(repr(k) for k in missing)}; "
            f"a profile needs all of: {', '.join(REQUIRED_KEYS)}"
        )

    values: dict[str, Any] = {}
    for spec in _SCHEMA:
        if spec.key not in merged:
            continue  # an optional key: the dataclass default
        value = merged[spec.key]
        _check(spec, value, where, "override key" if spec.key in from_override else "key")
        values[spec.attr] = spec.to_si(value) if spec.kind == "float" else value
    _check_host_copy(values.get, values["memory"], where)
    return FabricProfile(**values)
