"""Fabric profiles: the published (or measured) numbers a simulated fabric runs on.

A profile is a TOML file in ``<repo>/hardware/profiles/<name>.toml`` (or any file a user points
at). The file uses human units, the dataclass uses SI units:

* ``*_gbps`` keys are bandwidths in GB/s (1e9 bytes/s), stored in bytes/s;
* ``*_us`` keys are durations in microseconds, stored in seconds.

Every key is required, every number must be finite and > 0, and nothing is guessed or clamped:
any problem raises :class:`ProfileError` naming the file, the key, the value and what is allowed.
``overrides`` (e.g. a scenario's ``[fabric]`` section) use the same TOML key names.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Final, Mapping

__all__ = [
    "ProfileError",
    "FabricProfile",
    "PLACEMENTS",
    "MEMORY_KINDS",
    "PROFILE_DIR",
    "TOML_KEYS",
    "load_profile",
    "profile_names",
]

PROFILE_DIR: Final[Path] = Path(__file__).resolve().parents[2] / "hardware" / "profiles"
PLACEMENTS: Final[tuple[str, ...]] = ("pack", "split")
MEMORY_KINDS: Final[tuple[str, ...]] = ("VRAM", "DRAM")


class ProfileError(ValueError):
    """A fabric profile that is missing, malformed or out of range."""


@dataclass(frozen=True)
class _Field:
    """How one dataclass field is spelled in TOML and what it may hold."""

    attr: str
    key: str  # the TOML key
    kind: str  # "int" | "float" | "str"
    unit: str = ""  # "gbps" (GB/s -> bytes/s), "us" (microseconds -> seconds) or "" (as is)
    choices: tuple[str, ...] = ()

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
)
_BY_KEY: Final[dict[str, _Field]] = {f.key: f for f in _SCHEMA}
_BY_ATTR: Final[dict[str, _Field]] = {f.attr: f for f in _SCHEMA}

#: The TOML keys a profile file (and an overrides mapping) may contain, in file order.
TOML_KEYS: Final[tuple[str, ...]] = tuple(f.key for f in _SCHEMA)


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
        raise ProfileError(f"{where}: {label} {spec.key!r} = {value!r}: expected {_allowed(spec)}")

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

    def __post_init__(self) -> None:
        for f in fields(self):
            spec = _BY_ATTR[f.name]
            value = getattr(self, f.name)
            shown = spec.from_si(value) if spec.kind == "float" and _is_number(value) else value
            _check(spec, shown, f"FabricProfile {self.name!r}", "field for key")

    def post_time(self, descriptors: int) -> float:
        """CPU time to post one transfer of ``descriptors`` descriptors (launch + n * alpha)."""
        return self.transfer_launch + descriptors * self.per_descriptor


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


def _resolve(name_or_path: str, search_dirs: list[Path]) -> Path:
    candidate = Path(name_or_path)
    looks_like_path = (
        candidate.suffix == ".toml" or len(candidate.parts) > 1 or candidate.is_file()
    )
    if looks_like_path:
        if not candidate.is_file():
            raise ProfileError(f"fabric profile file {str(candidate)!r} does not exist")
        return candidate
    for d in search_dirs:
        p = Path(d) / f"{name_or_path}.toml"
        if p.is_file():
            return p
    available = ", ".join(profile_names(search_dirs)) or "(none)"
    where = ", ".join(str(d) for d in search_dirs)
    raise ProfileError(
        f"unknown fabric profile {name_or_path!r}; available: {available} (searched {where})"
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
    return ProfileError(
        f"{where}: unknown {label} {key!r} = {value!r}; allowed keys: {', '.join(TOML_KEYS)}"
    )


def load_profile(
    name_or_path: str | Path,
    *,
    overrides: Mapping[str, Any] | None = None,
    search_dirs: list[Path] | None = None,
) -> FabricProfile:
    """Load a fabric profile by name (``hardware/profiles/<name>.toml``) or by file path.

    ``overrides`` maps TOML keys (``per_descriptor_us``, ``placement``, ...) to values that
    replace the file's; they are validated like the file. ``search_dirs`` replaces the default
    profile directory for name lookups.
    """
    dirs = [PROFILE_DIR] if search_dirs is None else [Path(d) for d in search_dirs]
    path = _resolve(str(name_or_path), dirs)
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

    missing = [k for k in TOML_KEYS if k not in merged]
    if missing:
        raise ProfileError(
            f"{where}: missing key(s) {', '.join(repr(k) for k in missing)}; "
            f"a profile needs all of: {', '.join(TOML_KEYS)}"
        )

    values: dict[str, Any] = {}
    for spec in _SCHEMA:
        value = merged[spec.key]
        _check(spec, value, where, "override key" if spec.key in from_override else "key")
        values[spec.attr] = spec.to_si(value) if spec.kind == "float" else value
    return FabricProfile(**values)
