"""Scenario files: the TOML schema, loading, sweep expansion and one-line errors.

A scenario file describes one deployment (model, prefill and decode engines, connector, fabric),
a workload, optional injected faults and the expected outcome (docs/scenarios.md)::

    scenarios = load_scenarios("scenarios/kimi/pull-2p4d.toml")   # one per sweep variant
    spec = scenarios[0].model_spec()

Validation is strict and loud: every section is a frozen pydantic model
with ``extra="forbid"``; integers, floats, strings and booleans are not coerced across types
(``tp = "2"`` and ``tp = true`` are errors, ``lease_seconds = 30`` is a float); nothing is
clamped. Every failure raises :class:`ScenarioError`, a one-line ``ValueError`` of the form
``<file>[ [variant]]: <dotted key>: <problem>[, got <value>][; allowed: ...]``.

Allowed values that other modules own (model presets, registration orders, KV-cache layouts,
quirk names) are read from those modules, never copied here. Values whose meaning is only known
later (``attention_backend``, fabric override names, the fabric profile) are only type-checked.

Sweeps: ``[sweep]`` maps dotted keys of the schema to non-empty lists. ``mode = "product"``
(default) takes the cartesian product, the first key varying slowest, in the order TOML reads
the keys: by section in order of first appearance, then in file order within a section;
``mode = "zip"`` pairs the lists element-wise (equal lengths required). Each variant is the base
document with its values substituted, validated on its own, named ``"<name> [k=v, ...]"`` and
carrying ``sweep_point = {k: v, ...}``. Every variant keeps the file's seed. A sweepable key is
any leaf field of a section (``prefill.tp``, ``connector.quirks``, ``workload.prompt_tokens``,
...) or one entry of ``fabric.overrides``; ``faults`` cannot be swept. At most
:data:`MAX_SWEEP_VARIANTS` variants per file.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, get_args, get_origin

import numpy as np
from numpy.typing import NDArray
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Strict,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from .connector.quirks import quirk_names
from .geometry.layout import KV_CACHE_LAYOUTS, REGISTRATION_ORDERS
from .geometry.presets import preset, preset_names
from .geometry.specs import GeometryError, ModelSpec

if TYPE_CHECKING:
    from .traces import Trace

__all__ = [
    "ScenarioError",
    "Scenario",
    "ScenarioDocument",
    "ScenarioSection",
    "ModelSection",
    "EngineSection",
    "ConnectorSection",
    "FabricSection",
    "Workload",
    "TokenRange",
    "PromptRange",
    "PrefixHitRange",
    "Fault",
    "Expect",
    "FAULT_KINDS",
    "MAX_TOKENS",
    "MAX_REQUESTS",
    "MAX_SWEEP_VARIANTS",
    "load_scenarios",
    "parse_scenarios",
    "sweepable_keys",
]

MAX_TOKENS = 1 << 24  # per request; far above any context length, keeps token math in int64
MAX_SWEEP_VARIANTS = 10_000
MAX_BLOCK_SIZE = 4096  # tokens, a power of two
FAULT_KINDS = (
    "drop-notification",
    "delay-notification",
    "fail-transfer",
    "stall-transfer",
    "disconnect-peer",
    "slow-link",
    "expire-lease-early",
    "kill-rank",
    "abort-request",
)
# Kinds that act on a request, not on a rank or a moment: they take only request and
# probability (an engine, rank or at_seconds target is refused, not ignored).
REQUEST_ONLY_FAULTS = ("expire-lease-early", "abort-request")
# What duration_seconds means for each kind that uses it (any other kind refuses it).
FAULT_DURATIONS = {"delay-notification": "how late the notification arrives",
                   "stall-transfer": "how long the transfer stays PROC",
                   "expire-lease-early": "when prefill's lease expires"}
# Kinds whose at_seconds opens a window (window_seconds long; open-ended without it). A timed
# disconnect-peer / kill-rank is an instant: its agent dies at at_seconds.
WINDOWED_FAULTS = ("drop-notification", "delay-notification", "fail-transfer", "stall-transfer",
                   "slow-link")
# where a fail-transfer fault strikes, and where an abort-request happens
FAULT_PHASES = ("completion", "setup", "poll", "on-prefill", "before-scheduling",
                "during-handshake", "mid-transfer", "after-completion")
_VALUE_REPR_CHARS = 60
_ERR = "hkvsim_scenario"  # pydantic error type of every check written in this module


class ScenarioError(ValueError):
    """A scenario file that cannot be used: one line naming the file, the key and the problem."""

    def __init__(self, problem: str, *, source: str | None = None, key: str | None = None):
        self.problem = problem
        self.source = source
        self.key = key
        text = ": ".join(part for part in (source, key, problem) if part)
        super().__init__(" ".join(text.splitlines()))

    def within(self, source: str) -> ScenarioError:
        """The same error attributed to ``source`` (a file, possibly with a variant label)."""
        return ScenarioError(self.problem, source=source, key=self.key)


# --- building blocks ---------------------------------------------------------------------------


def _show(value: Any) -> str:
    text = repr(value)
    if len(text) > _VALUE_REPR_CHARS:
        text = text[: _VALUE_REPR_CHARS - 3] + "..."
    return text


def _err(
    problem: str, *, allowed: str | None = None, key: str | None = None, show_input: bool = True
) -> PydanticCustomError:
    """A validation error with a readable problem; ``key`` names a sub-key of the failing model."""
    context: dict[str, Any] = {"problem": problem, "show_input": show_input}
    if allowed is not None:
        context["allowed"] = allowed
    if key is not None:
        context["key"] = key
    return PydanticCustomError(_ERR, "{problem}", context)


def _existing_file(value: str | None, info: ValidationInfo, *, expand_user: bool = False
                   ) -> str | None:
    """A file key's value as an absolute path to an existing file: relative to the scenario
    file's folder (the validation context's ``base_dir``), else to the working directory."""
    if value is None:
        return None
    context = info.context if isinstance(info.context, dict) else {}
    base = context.get("base_dir")
    try:
        path = Path(value).expanduser() if expand_user else Path(value)
        if not path.is_absolute():
            path = Path(base if base is not None else Path.cwd()) / path
        path = path.resolve()
        exists = path.is_file()
    except (OSError, ValueError, RuntimeError) as exc:
        raise _err(f"unusable path ({exc})") from None
    if not exists:
        raise _err(f"no such file: {path}")
    return str(path)


def _one_of(values: Callable[[], Sequence[str]], what: str) -> AfterValidator:
    def check(value: str) -> str:
        allowed = list(values())
        if value not in allowed:
            raise _err(f"unknown {what}", allowed=", ".join(allowed))
        return value

    return AfterValidator(check)


def _power_of_two(low: int, high: int) -> AfterValidator:
    def check(value: int) -> int:
        if not low <= value <= high or value & (value - 1):
            raise _err(f"expected a power of two from {low} to {high}")
        return value

    return AfterValidator(check)


def _compiles(pattern: str | None) -> str | None:
    if pattern is not None:
        try:
            re.compile(pattern)
        except (re.error, OverflowError, RecursionError, ValueError) as exc:
            raise _err(f"invalid regular expression ({exc})") from None
    return pattern


Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]
Float = Annotated[float, Strict()]  # strict float still accepts TOML integers, never booleans
PositiveFloat = Annotated[float, Strict(), Field(gt=0)]
PresetName = Annotated[str, Strict(), _one_of(preset_names, "model preset")]
KVCacheLayout = Annotated[str, Strict(), _one_of(lambda: KV_CACHE_LAYOUTS, "kv_cache_layout")]
RegistrationOrder = Annotated[
    str, Strict(), _one_of(lambda: REGISTRATION_ORDERS, "registration_order")
]
QuirkName = Annotated[str, Strict(), _one_of(quirk_names, "quirk")]
PromptCount = Annotated[int, Strict(), Field(ge=2, le=MAX_TOKENS)]
HitCount = Annotated[int, Strict(), Field(ge=0, le=MAX_TOKENS)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# --- token counts: an int, a list cycled over requests, or a sampled range ---------------------


class TokenRange(_Section):
    """``{ min = a, max = b, distribution = "uniform" | "loguniform" }``, both ends inclusive."""

    min: Int
    max: Int
    distribution: Literal["uniform", "loguniform"] = "uniform"

    @model_validator(mode="after")
    def _ordered(self) -> TokenRange:
        if self.max < self.min:
            raise _err(f"expected max >= min ({self.min})", key="max", show_input=False)
        if self.max > MAX_TOKENS:
            raise _err(f"expected max <= {MAX_TOKENS}", key="max", show_input=False)
        return self

    def sample(self, n: int, rng: np.random.Generator) -> NDArray[np.int64]:
        """``n`` integers in ``[min, max]``; log-uniform samples ``x + 1`` log-uniformly."""
        if self.distribution == "uniform":
            return rng.integers(self.min, self.max, size=n, endpoint=True, dtype=np.int64)
        # Shift by one so that min = 0 (prefix hits) is allowed; the bounds guard float rounding.
        logs = rng.uniform(np.log(self.min + 1), np.log(self.max + 2), size=n)
        values = np.floor(np.exp(logs)).astype(np.int64) - 1
        return np.clip(values, self.min, self.max)


class PromptRange(TokenRange):
    min: Annotated[int, Strict(), Field(ge=2)]


class PrefixHitRange(TokenRange):
    min: Annotated[int, Strict(), Field(ge=0)]


def _token_shape(value: Any) -> str | None:
    if isinstance(value, int):  # bool included: the strict int then rejects it by name
        return "<int>"
    if isinstance(value, (list, tuple)):
        return "<list>"
    if isinstance(value, (dict, TokenRange)):
        return "<table>"
    return None


def _token_shape_error(lowest: int) -> str:
    return (
        f"expected an int >= {lowest}, a non-empty list of ints >= {lowest}, "
        "or a table { min, max, distribution }"
    )


# Tags start with "<" so that error locations can drop them ("workload.prompt_tokens.min").
PromptTokens = Annotated[
    Union[
        Annotated[PromptCount, Tag("<int>")],
        Annotated[tuple[PromptCount, ...], Field(min_length=1), Tag("<list>")],
        Annotated[PromptRange, Tag("<table>")],
    ],
    Discriminator(
        _token_shape, custom_error_type=_ERR + "_shape", custom_error_message=_token_shape_error(2)
    ),
]
PrefixHitTokens = Annotated[
    Union[
        Annotated[HitCount, Tag("<int>")],
        Annotated[tuple[HitCount, ...], Field(min_length=1), Tag("<list>")],
        Annotated[PrefixHitRange, Tag("<table>")],
    ],
    Discriminator(
        _token_shape, custom_error_type=_ERR + "_shape", custom_error_message=_token_shape_error(0)
    ),
]


def _lengths(
    spec: int | tuple[int, ...] | TokenRange, n: int, rng: np.random.Generator | None
) -> NDArray[np.int64]:
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if isinstance(spec, TokenRange):
        if rng is None:
            raise ValueError("a token range needs a random generator")
        return spec.sample(n, rng)
    if isinstance(spec, tuple):
        return np.resize(np.asarray(spec, dtype=np.int64), n)
    return np.full(n, spec, dtype=np.int64)


def _check_hits(prompts: NDArray[np.int64], hits: NDArray[np.int64]) -> str | None:
    """The problem with the first request whose prefix hit leaves nothing to prefill."""
    bad = np.flatnonzero(hits >= prompts)
    if bad.size == 0:
        return None
    i = int(bad[0])
    return (
        f"request {i}: prefix hit {int(hits[i])} >= prompt length {int(prompts[i])} "
        f"(a hit must leave at least one token to prefill; {bad.size} request(s) affected)"
    )


# --- sections ----------------------------------------------------------------------------------


class ScenarioSection(_Section):
    name: Str
    seed: Annotated[int, Strict(), Field(ge=0)] = 0
    description: Str = ""

    @field_validator("name")
    @classmethod
    def _not_blank(cls, name: str) -> str:
        if not name.strip():
            raise _err("expected a non-empty name")
        return name


class ModelSection(_Section):
    """Exactly one of a named preset or a Hugging Face ``config.json`` path.

    ``hf_config`` is resolved against the scenario file's directory (the validation context's
    ``base_dir``; the working directory without one) and stored as an absolute path.
    """

    preset: PresetName | None = None
    hf_config: Str | None = None

    @model_validator(mode="before")
    @classmethod
    def _exactly_one(cls, data: Any) -> Any:
        if isinstance(data, dict):
            given = [k for k in ("preset", "hf_config") if data.get(k) is not None]
            if len(given) != 1:
                problem = "both given" if given else "neither given"
                raise _err(
                    f"set exactly one of model.preset or model.hf_config ({problem})",
                    show_input=False,
                )
        return data

    @field_validator("hf_config")
    @classmethod
    def _resolve(cls, value: str | None, info: ValidationInfo) -> str | None:
        return _existing_file(value, info)


CacheDtype = Literal["bfloat16", "float16", "fp8", "fp8_ds_mla"]
DEFAULT_WARMUP_REQUESTS = 64  # [prefill]/[decode] block_ids = "warmed" without warmup_requests


class EngineSection(_Section):
    """One engine role (``[prefill]`` or ``[decode]``)."""

    tp: Annotated[int, Strict(), Field(ge=1, le=64)] = 1  # fit to the model is checked later
    instances: Annotated[int, Strict(), Field(ge=1)] = 1
    # None: the backend's smallest kernel block
    block_size: Annotated[int, Strict(), _power_of_two(1, MAX_BLOCK_SIZE)] | None = None
    num_blocks: Annotated[int, Strict(), Field(gt=0)] | None = None  # None: sized by the runner
    prefix_caching: Bool = False
    kv_cache_layout: KVCacheLayout = "HND"
    attention_backend: Str | None = None  # checked by geometry when the layout is built
    # The KV cache dtype of this engine's attention layers (None: the model's dtype). It enters
    # the compatibility hash; with enforce_handshake_compat = false a mismatch reaches rule V6.
    cache_dtype: CacheDtype | None = None
    # This engine runs another checkpoint (a preset name) than [model]: a misdeployment that the
    # compatibility hash (or, with enforce_handshake_compat = false, rules V6/V7) must refuse.
    preset: PresetName | None = None
    # Block ids as a fresh engine hands them out ("fresh": ascending, requests freed in order)
    # or as a warmed-up vLLM engine does ("warmed": a request's blocks are freed tail first to
    # the back of the free queue, after ``warmup_requests`` synthetic requests of churn), which
    # decides how many descriptors NIXL can coalesce (docs/semantics.md §10).
    block_ids: Literal["fresh", "warmed"] = "fresh"
    warmup_requests: Annotated[int, Strict(), Field(ge=1, le=100_000)] | None = None

    @model_validator(mode="after")
    def _warmup(self) -> EngineSection:
        if self.warmup_requests is not None and self.block_ids != "warmed":
            raise _err("warmup_requests applies only to block_ids = \"warmed\"",
                       allowed="set block_ids = \"warmed\", or drop warmup_requests",
                       key="warmup_requests", show_input=False)
        return self

    @property
    def warmup(self) -> int:
        """Synthetic requests of churn before the workload (0 for fresh block ids)."""
        if self.block_ids != "warmed":
            return 0
        return DEFAULT_WARMUP_REQUESTS if self.warmup_requests is None else self.warmup_requests


class PrefillSection(EngineSection):
    """``[prefill]``: an engine, plus its compute throughput for the report's P/D sizing view
    (prompt tokens per second per rank; it does not change the simulation)."""

    tokens_per_second: PositiveFloat | None = None


class ConnectorSection(_Section):
    mode: Literal["pull", "push"] = "pull"
    registration_order: RegistrationOrder = "sorted"
    quirks: tuple[QuirkName, ...] = ()
    kv_load_failure_policy: Literal["fail", "recompute"] = "fail"
    lease_seconds: PositiveFloat = 30.0
    transfer_timeout_seconds: PositiveFloat = 60.0
    enforce_handshake_compat: Bool = True
    descriptor_merge: Literal["off", "contiguous", "strided"] = "off"
    # a remote engine idle this long is evicted when a new handshake starts (docs/semantics.md §9.4)
    engine_ttl_seconds: PositiveFloat = 3600.0
    host_buffer: Bool = False
    # whose connector code runs: hkvsim's own core, or a vLLM release's (docs/vllm.md)
    implementation: Literal["hkvsim", "vllm"] = "hkvsim"
    # what hkvsim's core moves per request (docs/scenarios.md): "allocated" (the reference:
    # every state slot over every shared tensor, whole logical blocks) or "needed" (vLLM
    # 0.34.0's: state only over tensors holding a layer of the slot's group, a pull between
    # engines of different block sizes stopping at the last computed token)
    transfer_extent: Literal["allocated", "needed"] = "allocated"

    @field_validator("quirks")
    @classmethod
    def _unique(cls, quirks: tuple[str, ...]) -> tuple[str, ...]:
        repeated = sorted({q for q in quirks if quirks.count(q) > 1})
        if repeated:
            raise _err(f"quirk(s) listed twice: {', '.join(repeated)}")
        return quirks


def _scalar(value: Any) -> Any:
    """A TOML scalar kept as written (16 stays an int); the profile decides what a key takes."""
    if not isinstance(value, (bool, int, float, str)):
        raise _err("expected a number or a string")
    return value


OverrideValue = Annotated[Any, AfterValidator(_scalar)]


class FabricSection(_Section):
    """A fabric profile (a shipped name or a ``.toml`` path) plus overrides of its keys.

    A path is resolved against the scenario file's directory (the validation context's
    ``base_dir``; the working directory without one) and stored as an absolute path. The profile
    is loaded with the overrides here, so an unknown profile, an unknown override key or a value
    of the wrong type is an error of this file (the fabric module decides what is allowed:
    integers for integer keys, integers or floats for number keys, strings for string keys).
    """

    profile: Str = "h200-nvlink"
    overrides: dict[str, OverrideValue] = Field(default_factory=dict)

    @field_validator("profile")
    @classmethod
    def _resolve(cls, value: str, info: ValidationInfo) -> str:
        from .fabric.profile import ProfileError, is_profile_path, resolve_profile

        context = info.context if isinstance(info.context, dict) else {}
        try:
            path = resolve_profile(value, base_dir=context.get("base_dir"))
        except ProfileError as exc:
            raise _err(exc.problem, show_input=False) from None
        except (OSError, ValueError, RuntimeError) as exc:
            raise _err(f"unusable path ({exc})") from None
        return str(path) if is_profile_path(value) else value

    @model_validator(mode="after")
    def _loads(self) -> FabricSection:
        from .fabric.profile import ProfileError, load_profile

        try:
            load_profile(self.profile, overrides=self.overrides)
        except ProfileError as exc:
            key = "profile" if exc.override_key is None else f"overrides.{exc.override_key}"
            raise _err(exc.problem, key=key, show_input=False) from None
        return self


_TRACE_FIXES = ("prompt_tokens", "prefix_hit_tokens", "arrival", "rate")
MAX_REQUESTS = 1_000_000


class Workload(_Section):
    """The requests: sampled (``requests``, ``prompt_tokens``, ``prefix_hit_tokens``, ``arrival``,
    ``rate``) or replayed from a trace file (``trace``, see :mod:`hkvsim.traces`).

    A trace fixes the prompt lengths, prefix hits and arrivals, so those four keys are refused
    beside it; ``requests`` then caps the replay at the trace's first ``requests`` lines (at most
    as many as it has). ``trace`` is resolved against the scenario file's directory (the
    validation context's ``base_dir``) and stored as an absolute path; the file is read and
    validated here.
    """

    requests: Annotated[int, Strict(), Field(ge=1, le=MAX_REQUESTS)] | None = None
    prompt_tokens: PromptTokens | None = None
    prefix_hit_tokens: PrefixHitTokens = 0
    arrival: Literal["burst", "poisson"] = "burst"
    rate: PositiveFloat | None = None  # requests per second, only with arrival = "poisson"
    trace: Str | None = None  # a Mooncake .jsonl or a .csv trace, relative to the file
    verify: Bool = True  # False: timing only, no byte verification
    max_inflight: Annotated[int, Strict(), Field(ge=1)] | None = None

    @field_validator("trace")
    @classmethod
    def _resolve_trace(cls, value: str | None, info: ValidationInfo) -> str | None:
        return _existing_file(value, info, expand_user=True)

    @model_validator(mode="after")
    def _consistent(self) -> Workload:
        if self.trace is not None:
            return self._trace_consistent()
        for key in ("requests", "prompt_tokens"):
            if getattr(self, key) is None:
                raise _err("required key is missing (or give workload.trace)", key=key,
                           show_input=False)
        if self.arrival == "poisson" and self.rate is None:
            raise _err("required when arrival = 'poisson'", key="rate", show_input=False)
        if self.arrival != "poisson" and self.rate is not None:
            raise _err(
                f"only allowed with arrival = 'poisson' (arrival is {self.arrival!r})",
                key="rate",
                show_input=False,
            )
        fixed = (int, tuple)
        if isinstance(self.prompt_tokens, fixed) and isinstance(self.prefix_hit_tokens, fixed):
            problem = _check_hits(
                _lengths(self.prompt_tokens, self.num_requests, None),
                _lengths(self.prefix_hit_tokens, self.num_requests, None),
            )
            if problem:
                raise _err(problem, key="prefix_hit_tokens", show_input=False)
        return self

    def _trace_consistent(self) -> Workload:
        fixed = [k for k in _TRACE_FIXES if k in self.model_fields_set]
        if fixed:
            raise _err(
                "not allowed beside workload.trace (the trace fixes prompt lengths, prefix "
                "hits and arrivals; workload.requests may cap how many of its requests run)",
                key=fixed[0],
                show_input=False,
            )
        from .traces import TraceError

        try:
            available = len(self._full_trace())
        except TraceError as exc:
            raise _err(str(exc), key="trace", show_input=False) from None
        if self.requests is not None and self.requests > available:
            raise _err(f"the trace has only {available} request(s)", key="requests")
        return self

    def _full_trace(self) -> Trace:
        from .traces import load_trace

        assert self.trace is not None
        return load_trace(self.trace, max_tokens=MAX_TOKENS, max_requests=MAX_REQUESTS)

    def replayed_trace(self) -> Trace | None:
        """The trace requests that run (capped by ``requests``), or None without a trace."""
        if self.trace is None:
            return None
        trace = self._full_trace()
        return trace.head(self.requests) if self.requests is not None else trace

    @property
    def num_requests(self) -> int:
        """How many requests run: ``requests``, or the trace's length (capped by ``requests``)."""
        trace = self.replayed_trace()
        if trace is not None:
            return len(trace)
        assert self.requests is not None  # guaranteed by validation
        return self.requests

    def prompt_lengths(self, n: int, rng: np.random.Generator) -> NDArray[np.int64]:
        """Prompt length of requests ``0..n-1``; lists are cycled, ranges sampled from ``rng``."""
        trace = self.replayed_trace()
        if trace is not None:
            return _from_trace(trace.prompt_tokens, n)
        assert self.prompt_tokens is not None  # guaranteed by validation
        return _lengths(self.prompt_tokens, n, rng)

    def prefix_hit_lengths(
        self,
        n: int,
        rng: np.random.Generator,
        *,
        prompt_lengths: NDArray[np.int64] | None = None,
    ) -> NDArray[np.int64]:
        """Prefix-cache hit tokens of requests ``0..n-1``, drawn like :meth:`prompt_lengths`.

        With ``prompt_lengths``, a hit that leaves no token to prefill raises ScenarioError
        naming the request index (nothing is clamped).
        """
        trace = self.replayed_trace()
        hits = (_from_trace(trace.prefix_hit_tokens, n) if trace is not None
                else _lengths(self.prefix_hit_tokens, n, rng))
        if prompt_lengths is not None:
            if len(prompt_lengths) != n:
                raise ValueError(f"prompt_lengths has {len(prompt_lengths)} entries, not {n}")
            problem = _check_hits(np.asarray(prompt_lengths, dtype=np.int64), hits)
            if problem:
                raise ScenarioError(problem, key="workload.prefix_hit_tokens")
        return hits

    def sample(
        self, n: int, rng: np.random.Generator
    ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """Prompt lengths, then prefix hits (checked against them), from one generator."""
        prompts = self.prompt_lengths(n, rng)
        return prompts, self.prefix_hit_lengths(n, rng, prompt_lengths=prompts)

    def arrival_times(self, n: int, rng: np.random.Generator) -> NDArray[np.float64]:
        """Arrival time in seconds of requests ``0..n-1``, the first at 0: all at once
        (``burst``), exponential gaps of mean 1/rate drawn from ``rng`` (``poisson``), or the
        trace's arrivals. Every driver takes its arrivals from here."""
        trace = self.replayed_trace()
        if trace is not None:
            return _from_trace(trace.arrival_seconds, n).astype(np.float64)
        if n == 0:
            return np.zeros(0)
        if self.arrival == "poisson":
            assert self.rate is not None  # guaranteed by validation
            gaps = rng.exponential(1.0 / float(self.rate), size=n)
            return np.cumsum(gaps) - gaps[0]
        return np.zeros(n)


def _from_trace(values: NDArray[Any], n: int) -> NDArray[Any]:
    if n > len(values):
        raise ValueError(f"the trace has {len(values)} requests, not {n}")
    return np.array(values[:n])


class Fault(_Section):
    """One injected fault (``[[faults]]``); it needs at least one target."""

    kind: Literal[FAULT_KINDS]  # type: ignore[valid-type]
    request: Annotated[int, Strict(), Field(ge=0)] | None = None
    engine: Str | None = None
    rank: Annotated[int, Strict(), Field(ge=0)] | None = None
    at_seconds: Annotated[float, Strict(), Field(ge=0)] | None = None
    probability: Annotated[float, Strict(), Field(ge=0, le=1)] | None = None
    window_seconds: PositiveFloat | None = None  # the at_seconds window's length
    duration_seconds: PositiveFloat | None = None  # the delay / stall / lease (FAULT_DURATIONS)
    factor: PositiveFloat | None = None
    # fail-transfer: "completion" (state ERR, default), "setup" (creating/posting raises) or
    # "poll" (polling raises); abort-request: "on-prefill", "before-scheduling",
    # "during-handshake", "mid-transfer" (default) or "after-completion"
    phase: Literal[FAULT_PHASES] | None = None  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _targeted(self) -> Fault:
        allowed = {"fail-transfer": FAULT_PHASES[:3], "abort-request": FAULT_PHASES[3:]}
        if self.phase is not None and self.phase not in allowed.get(self.kind, ()):
            raise _err(
                f"phase {self.phase!r} does not apply to kind {self.kind!r}; allowed: "
                f"{', '.join(allowed.get(self.kind, ())) or 'none'}",
                key="phase",
                show_input=False,
            )
        targets = (self.request, self.rank, self.engine, self.at_seconds, self.probability)
        if all(t is None for t in targets):
            raise _err(
                "a fault needs a target: give at least one of request, rank, engine, "
                "at_seconds, probability",
                show_input=False,
            )
        if self.kind in REQUEST_ONLY_FAULTS:
            for name in ("engine", "rank", "at_seconds"):
                if getattr(self, name) is not None:
                    raise _err(f"{self.kind} acts on a request, not on a rank or a moment: "
                               f"{name} would be ignored", allowed="request, probability",
                               key=name, show_input=False)
        if self.kind in ("disconnect-peer", "kill-rank") and self.at_seconds is not None:
            for name in ("request", "probability"):
                if getattr(self, name) is not None:
                    raise _err(f"a timed {self.kind} (at_seconds) kills its engine/rank at that "
                               f"moment, for every request: {name} would be ignored",
                               allowed="at_seconds with engine and/or rank; or request / "
                               "probability without at_seconds", key=name, show_input=False)
            if self.engine is None and self.rank is None:
                raise _err(f"a timed {self.kind} needs engine and/or rank: which agent dies at "
                           f"at_seconds", key="at_seconds", show_input=False)
        if self.window_seconds is not None and (
                self.kind not in WINDOWED_FAULTS or self.at_seconds is None):
            raise _err(f"window_seconds is the length of the window that at_seconds opens, for "
                       f"kinds {', '.join(WINDOWED_FAULTS)}",
                       allowed="window_seconds with at_seconds, on one of those kinds",
                       key="window_seconds", show_input=False)
        if self.duration_seconds is not None and self.kind not in FAULT_DURATIONS:
            hint = ("; the window after at_seconds is window_seconds"
                    if self.kind in WINDOWED_FAULTS else "")
            raise _err(f"duration_seconds does not apply to kind {self.kind!r}{hint}",
                       allowed=", ".join(f"{k} ({v})" for k, v in FAULT_DURATIONS.items()),
                       key="duration_seconds", show_input=False)
        if self.factor is not None and self.kind != "slow-link":
            raise _err(f"factor (the bandwidth divisor) applies only to slow-link, not to "
                       f"{self.kind!r}", key="factor", show_input=False)
        return self


class Expect(_Section):
    outcome: Literal["ok", "handshake-error", "request-failure"] = "ok"
    error_match: Annotated[str, Strict(), AfterValidator(_compiles)] | None = None  # re.search
    byte_exact: Bool = True
    failed_requests: Annotated[int, Strict(), Field(ge=0)] | None = None
    reason: Str | None = None  # the failure class every failed request must have
    # requests whose prefill blocks a lease expiry freed (e.g. after a dropped notification);
    # None: expect none for the requests that completed
    lease_expiries: Annotated[int, Strict(), Field(ge=0)] | None = None
    recomputed: Annotated[int, Strict(), Field(ge=0)] | None = None  # policy "recompute"
    aborted_requests: Annotated[int, Strict(), Field(ge=0)] | None = None

    @model_validator(mode="after")
    def _matched(self) -> Expect:
        if self.outcome == "handshake-error" and self.error_match is None:
            raise _err(
                "required when outcome = 'handshake-error' (a regex the error must match)",
                key="error_match",
                show_input=False,
            )
        return self


class ScenarioDocument(_Section):
    """The sections of a scenario file after sweep expansion (no ``[sweep]``)."""

    scenario: ScenarioSection
    model: ModelSection
    prefill: PrefillSection = Field(default_factory=PrefillSection)
    decode: EngineSection = Field(default_factory=EngineSection)
    connector: ConnectorSection = Field(default_factory=ConnectorSection)
    fabric: FabricSection = Field(default_factory=FabricSection)
    workload: Workload
    faults: tuple[Fault, ...] = ()
    expect: Expect = Field(default_factory=Expect)

    @model_validator(mode="after")
    def _cross_section(self) -> ScenarioDocument:
        requests = self.workload.num_requests
        engines = {f"{role}{i}": section.tp
                   for role, section in (("prefill", self.prefill), ("decode", self.decode))
                   for i in range(section.instances)}
        for i, fault in enumerate(self.faults):
            if fault.request is not None and fault.request >= requests:
                raise _err(
                    f"request {fault.request} does not exist ({requests} request(s) in the "
                    f"workload)",
                    key=f"faults[{i}].request",
                    show_input=False,
                )
            if fault.engine is not None and fault.engine not in engines:
                raise _err(f"engine {fault.engine!r} does not exist in this deployment, so the "
                           f"fault could never hit", allowed=", ".join(engines),
                           key=f"faults[{i}].engine", show_input=False)
            ranks = engines[fault.engine] if fault.engine is not None else max(engines.values())
            if fault.rank is not None and fault.rank >= ranks:
                where = fault.engine or "any engine"
                raise _err(f"rank {fault.rank} does not exist in {where} (TP {ranks}), so the "
                           f"fault could never hit",
                           allowed=f"0 to {ranks - 1}" if ranks > 1 else "0",
                           key=f"faults[{i}].rank", show_input=False)
        trace = self.workload.replayed_trace()
        hits = self.workload.prefix_hit_tokens
        if trace is not None:
            hits_possible = bool(trace.prefix_hit_tokens.any())
        else:
            hits_possible = (hits != 0) if isinstance(hits, int) else (
                any(hits) if isinstance(hits, tuple) else hits.max > 0)
        if hits_possible and not self.decode.prefix_caching:
            what = "the trace's prefix hits" if trace is not None else "prefix hits"
            raise _err(
                f"{what} need [decode] prefix_caching = true (decode's prefix cache is "
                "where the hit comes from)",
                key="workload.trace" if trace is not None else "workload.prefix_hit_tokens",
                show_input=False,
            )
        failed = self.expect.failed_requests
        if failed is not None and failed > requests:
            raise _err(
                f"{failed} failed requests out of {requests} request(s) in the workload",
                key="expect.failed_requests",
                show_input=False,
            )
        return self


class Scenario(ScenarioDocument):
    """One runnable scenario: a validated document plus where it came from."""

    sweep_point: dict[str, Any] = Field(default_factory=dict)  # swept dotted key -> value
    source: Str = "<string>"

    @property
    def where(self) -> str:
        """The file, with the variant label for a sweep variant (the prefix of its errors)."""
        return _where(self.source, self.sweep_point)

    def model_spec(self) -> ModelSpec:
        """The model's geometry: the named preset or the loaded ``config.json``."""
        key = "model.preset" if self.model.preset is not None else "model.hf_config"
        try:
            if self.model.preset is not None:
                return preset(self.model.preset)
            from .geometry.hf_config import load_hf_config  # written alongside; import lazily

            assert self.model.hf_config is not None  # guaranteed by ModelSection
            return load_hf_config(Path(self.model.hf_config))
        except GeometryError as exc:
            raise ScenarioError(str(exc), source=self.where, key=key) from exc

    def request_lengths(
        self, rng: np.random.Generator | None = None
    ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """Prompt lengths and prefix hits of all requests (default generator: the seed)."""
        generator = rng if rng is not None else np.random.default_rng(self.scenario.seed)
        try:
            return self.workload.sample(self.workload.num_requests, generator)
        except ScenarioError as exc:
            raise exc.within(self.where) from None

    def arrival_times(self, n: int, rng: np.random.Generator) -> NDArray[np.float64]:
        """Arrival times (s) of the ``n`` requests :meth:`request_lengths` gave; ``rng`` is the
        driver's generator, drawn after the lengths (Workload.arrival_times)."""
        return self.workload.arrival_times(n, rng)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (tuples become lists); ``Scenario.model_validate`` reads it back.

        Only the keys the file set (paths resolved), so that reading it back applies the same
        rules (a key refused beside another stays refused, a default stays a default)."""
        return self.model_dump(mode="json", exclude_unset=True)


# --- validation errors -> one line -------------------------------------------------------------

_EXPECTED = {
    "int_type": "expected an integer",
    "float_type": "expected a number",
    "string_type": "expected a string",
    "bool_type": "expected true or false",
    "tuple_type": "expected a list",
    "list_type": "expected a list",
    "dict_type": "expected a table",
    "model_type": "expected a table",
    "model_attributes_type": "expected a table",
    "finite_number": "expected a finite number",
    "greater_than": "expected a value > {gt}",
    "greater_than_equal": "expected a value >= {ge}",
    "less_than": "expected a value < {lt}",
    "less_than_equal": "expected a value <= {le}",
    "too_short": "expected at least {min_length} item(s)",
}


def _dotted(loc: Sequence[Any]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and not part.startswith("<") and part != "[key]":
            out += f".{part}" if out else part
    return out


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _keys_at(loc: Sequence[Any]) -> list[str] | None:
    """The keys allowed in the table at ``loc`` (None when it is not a schema table)."""
    current: type[BaseModel] | None = ScenarioDocument
    for part in loc:
        if not isinstance(part, str) or part.startswith("<"):
            continue
        if current is None or part not in current.model_fields:
            return None
        current = _model_in(current.model_fields[part].annotation)
    if current is None:
        return None
    keys = list(current.model_fields)
    return keys + ["sweep"] if current is ScenarioDocument else keys


def _describe(error: Any) -> tuple[str, str]:
    """(dotted key, problem) of one pydantic error."""
    kind: str = error["type"]
    loc = tuple(error["loc"])
    ctx = error.get("ctx") or {}
    if kind == _ERR and ctx.get("key"):
        loc += (ctx["key"],)
    key = _dotted(loc) or "(top level)"
    if kind == "missing":
        return key, "required key is missing"
    if kind == "extra_forbidden":
        keys = _keys_at(loc[:-1])
        return key, "unknown key" + (f"; allowed: {', '.join(keys)}" if keys else "")
    allowed: str | None = None
    show = True
    if kind == _ERR:
        problem = str(ctx["problem"])
        allowed = ctx.get("allowed")
        show = bool(ctx.get("show_input", True))
    elif kind == "literal_error":
        problem = "invalid value"
        allowed = str(ctx.get("expected", "")).replace(" or ", ", ")
    elif kind in _EXPECTED:
        try:
            problem = _EXPECTED[kind].format(**ctx)
        except (KeyError, IndexError):
            problem = _EXPECTED[kind]
    else:
        problem = str(error["msg"]).removeprefix("Value error, ")
        if problem.startswith("Input should be "):
            problem = "expected " + problem.removeprefix("Input should be ")
    if show:
        problem += f", got {_show(error['input'])}"
    if allowed:
        problem += f"; allowed: {allowed}"
    return key, problem


def _from_validation_error(exc: ValidationError, where: str) -> ScenarioError:
    errors = exc.errors(include_url=False)
    if not errors:  # pragma: no cover - pydantic always reports at least one
        return ScenarioError("invalid scenario", source=where)
    key, problem = _describe(errors[0])
    return ScenarioError(problem, source=where, key=key)


# --- sweeps ------------------------------------------------------------------------------------


def sweepable_keys() -> list[str]:
    """Dotted keys a ``[sweep]`` may vary (``fabric.overrides.*`` stands for any override)."""
    keys: list[str] = []
    for section, field in ScenarioDocument.model_fields.items():
        model = field.annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            continue  # faults: a list of tables, not a sweepable leaf
        for name, sub in model.model_fields.items():
            keys.append(f"{section}.{name}")
            if get_origin(sub.annotation) is dict:
                keys.append(f"{section}.{name}.*")
    return keys


def _is_sweepable(key: str) -> bool:
    allowed = sweepable_keys()
    if key in allowed:
        return True
    head, _, tail = key.rpartition(".")
    return bool(tail) and f"{head}.*" in allowed


def _flatten(table: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = []
    for name, value in table.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict):
            items.extend(_flatten(value, key + "."))
        else:
            items.append((key, value))
    return items


def _expand_sweep(sweep: Any, source: str) -> list[dict[str, Any]]:
    """The sweep points of a file in a deterministic order ([{}] without a sweep)."""
    if sweep is None:
        return [{}]
    if not isinstance(sweep, dict):
        raise ScenarioError(
            f"expected a table of dotted keys -> lists, got {_show(sweep)}",
            source=source,
            key="sweep",
        )
    table = dict(sweep)
    mode = table.pop("mode", "product")
    if mode not in ("product", "zip"):
        raise ScenarioError(
            f"invalid value, got {_show(mode)}; allowed: 'product', 'zip'",
            source=source,
            key="sweep.mode",
        )
    axes = _flatten(table)
    if not axes:
        raise ScenarioError("no keys to sweep", source=source, key="sweep")
    for key, values in axes:
        if not _is_sweepable(key):
            raise ScenarioError(
                f"not a sweepable key; allowed: {', '.join(sweepable_keys())}",
                source=source,
                key=f"sweep.{key}",
            )
        if not isinstance(values, list) or not values:
            raise ScenarioError(
                f"expected a non-empty list of values, got {_show(values)}",
                source=source,
                key=f"sweep.{key}",
            )
    keys = [key for key, _ in axes]
    lists = [values for _, values in axes]
    if mode == "zip":
        lengths = {len(values) for values in lists}
        if len(lengths) > 1:
            sizes = ", ".join(f"{k}: {len(v)}" for k, v in axes)
            raise ScenarioError(
                f"mode = 'zip' needs lists of equal length, got {sizes}",
                source=source,
                key="sweep",
            )
        combos: Any = zip(*lists)
        count = len(lists[0])
    else:
        combos = itertools.product(*lists)
        count = 1
        for values in lists:
            count *= len(values)
    if count > MAX_SWEEP_VARIANTS:
        raise ScenarioError(
            f"{count} variants exceed the limit of {MAX_SWEEP_VARIANTS}", source=source, key="sweep"
        )
    return [dict(zip(keys, combo)) for combo in combos]


def _format_value(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, default=str, ensure_ascii=False)


def _label(point: dict[str, Any]) -> str:
    return ", ".join(f"{key}={_format_value(value)}" for key, value in point.items())


def _where(source: str, point: dict[str, Any]) -> str:
    return f"{source} [{_label(point)}]" if point else source


def _substitute(document: dict[str, Any], point: dict[str, Any]) -> dict[str, Any]:
    variant = copy.deepcopy(document)
    for key, value in point.items():
        *path, leaf = key.split(".")
        table: Any = variant
        for part in path:
            table = table.setdefault(part, {}) if isinstance(table, dict) else None
        if isinstance(table, dict):  # otherwise the base is malformed there and validation says so
            table[leaf] = copy.deepcopy(value)
    return variant


# --- loading -----------------------------------------------------------------------------------


def _build(
    document: dict[str, Any], point: dict[str, Any], source: str, base_dir: Path | None
) -> Scenario:
    where = _where(source, point)
    try:
        validated = ScenarioDocument.model_validate(
            _substitute(document, point), context={"base_dir": base_dir}
        )
    except ValidationError as exc:
        raise _from_validation_error(exc, where) from None
    if Path(source).name.startswith("xfail-") and validated.expect.outcome == "ok":
        raise ScenarioError(
            "xfail-* scenarios must state the failure they expect "
            "(outcome 'handshake-error' or 'request-failure')",
            source=where,
            key="expect.outcome",
        )
    sections = {name: getattr(validated, name) for name in ScenarioDocument.model_fields}
    if point:
        name = f"{validated.scenario.name} [{_label(point)}]"
        sections["scenario"] = validated.scenario.model_copy(update={"name": name})
    scenario = Scenario(**sections, sweep_point=dict(point), source=source)
    _check_engines(scenario)
    return scenario


_ALLOWED_HINT = re.compile(r"\s*\(allowed[^)]*\)")  # geometry's own hint, replaced by a list


def _check_engines(scenario: Scenario) -> None:
    """Each engine's geometry fits its model, or a ScenarioError naming the engine's key.

    The checks the runner would hit when it builds the engines, made at load time so that each
    names the file, the variant and the key at fault (``prefill.tp``, ``decode.block_size``...)
    with what is allowed.
    """
    from .pd.deployment import engine_layout, engine_model  # the runner's own construction

    model = scenario.model_spec()
    for role in ("prefill", "decode"):
        section: EngineSection = getattr(scenario, role)

        def fail(key: str, problem: str) -> ScenarioError:
            return ScenarioError(problem, source=scenario.where, key=f"{role}.{key}")

        base = preset(section.preset) if section.preset is not None else model
        try:
            engine_model(base, section.model_copy(update={"cache_dtype": None}))
        except GeometryError as exc:
            raise fail("attention_backend", str(exc)) from None
        try:
            spec = engine_model(base, section)
        except GeometryError as exc:
            dtypes = [d for d in get_args(CacheDtype) if _engine_model_ok(base, section, d)]
            raise fail("cache_dtype", f"{exc}; allowed: {', '.join(dtypes)}") from None
        try:
            spec.check_tp(section.tp)
        except GeometryError as exc:
            fits = [str(t) for t in range(1, 65) if _fits(spec, t)]
            raise fail("tp", f"{_ALLOWED_HINT.sub('', str(exc))} ({spec.name}); allowed: "
                             f"{', '.join(fits) or 'none up to 64'}") from None
        try:
            engine_layout(model, section, num_blocks=1,
                          registration_order=scenario.connector.registration_order,
                          quirks=frozenset(scenario.connector.quirks))
        except GeometryError as exc:
            if section.block_size is None:
                raise fail("tp", str(exc)) from None
            sizes = [str(b) for b in _BLOCK_SIZES if _unifies(spec, section.tp, b)]
            raise fail("block_size", f"{_ALLOWED_HINT.sub('', str(exc))}; allowed: "
                                     f"{', '.join(sizes) or 'none'}") from None


def _engine_model_ok(model: ModelSpec, section: EngineSection, cache_dtype: str) -> bool:
    from .pd.deployment import engine_model

    try:
        engine_model(model, section.model_copy(update={"cache_dtype": cache_dtype}))
    except GeometryError:
        return False
    return True


_BLOCK_SIZES = tuple(1 << k for k in range(MAX_BLOCK_SIZE.bit_length()))  # schema's range


def _unifies(model: ModelSpec, tp: int, block_size: int) -> bool:
    from .geometry.layout import unify_pages

    try:
        unify_pages(model, tp, block_size)
    except GeometryError:
        return False
    return True


def _fits(model: ModelSpec, tp: int) -> bool:
    try:
        model.check_tp(tp)
    except GeometryError:
        return False
    return True


def parse_scenarios(
    text: str, *, source: str = "<string>", base_dir: Path | None = None
) -> list[Scenario]:
    """The scenarios (sweep variants, in order) of TOML ``text``.

    ``source`` names the text in errors and decides the ``xfail-`` rule; ``base_dir`` resolves a
    relative ``model.hf_config`` (default: the working directory).
    """
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"malformed TOML: {exc}", source=source) from None
    except RecursionError:
        raise ScenarioError("malformed TOML: nested too deeply", source=source) from None
    points = _expand_sweep(raw.pop("sweep", None), source)
    return [_build(raw, point, source, base_dir) for point in points]


def load_scenarios(path: str | Path) -> list[Scenario]:
    """The scenarios of a file: its sweep variants in order, or just one without ``[sweep]``."""
    file = Path(path)
    source = str(path)
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise ScenarioError(f"cannot read file: {exc.strerror or exc}", source=source) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ScenarioError(f"not UTF-8 text: {exc}", source=source) from None
    return parse_scenarios(text, source=source, base_dir=file.parent)
