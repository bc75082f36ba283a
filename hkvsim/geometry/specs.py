"""Layer and model specs: what one layer of each kind stores, and how it shards over TP.

All specs are frozen, keyword-only dataclasses. Byte counts are per rank unless the name says
"global". Nothing here does I/O. Errors are :class:`GeometryError` with a message that names the
offending value and what is allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from typing import Literal

__all__ = [
    "GeometryError",
    "DTYPE_BYTES",
    "dtype_bytes",
    "Sharding",
    "AttentionBackend",
    "ATTENTION_BACKENDS",
    "MLAAttentionSpec",
    "GQAAttentionSpec",
    "AttentionSpec",
    "StateSpec",
    "ModelSpec",
    "kda_state",
    "gdn_state",
    "mamba2_state",
    "mamba1_state",
]


class GeometryError(ValueError):
    """A model / TP / block-size combination that cannot exist."""


DTYPE_BYTES: dict[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "fp8": 1,
}


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise GeometryError(
            f"unknown dtype {dtype!r}; allowed: {', '.join(sorted(DTYPE_BYTES))}"
        ) from None


class Sharding(str, Enum):
    """How an attention region's block is divided over TP ranks (docs/semantics.md §1)."""

    REPLICATE = "replicate"  # MLA latent: every rank holds the whole block
    SPLIT = "split"  # GQA/MHA: every rank holds a slice of the heads


@dataclass(frozen=True, kw_only=True)
class AttentionBackend:
    """An attention kernel's constraints on the kernel block (tokens per kernel page)."""

    name: str
    mla: bool
    fixed_kernel_block: int | None  # FlashMLA: 64, whatever the user asks
    min_kernel_block: int  # smallest block the kernel accepts (the "align" floor)
    kernel_block_multiple: int  # a flexible kernel block must be a multiple of this

    def kernel_block_for(self, requested: int) -> int:
        """Kernel block (tokens) used for a user block size, before hybrid unification."""
        if self.fixed_kernel_block is not None:
            if requested % self.fixed_kernel_block:
                raise GeometryError(
                    f"attention backend {self.name!r} fixes the kernel block at "
                    f"{self.fixed_kernel_block} tokens; block_size {requested} is not a multiple "
                    f"of it (allowed: multiples of {self.fixed_kernel_block})"
                )
            return self.fixed_kernel_block
        if requested < self.min_kernel_block or requested % self.kernel_block_multiple:
            raise GeometryError(
                f"attention backend {self.name!r} needs block_size >= {self.min_kernel_block} and a "
                f"multiple of {self.kernel_block_multiple}; got {requested}"
            )
        return requested


# A registry, not an if-chain. Kernel facts: FlashMLA pages are 64 tokens (docs/semantics.md §1);
# FlashAttention / Triton take any multiple of 16.
ATTENTION_BACKENDS: dict[str, AttentionBackend] = {
    b.name: b
    for b in (
        AttentionBackend(name="flashmla", mla=True, fixed_kernel_block=64, min_kernel_block=64,
                         kernel_block_multiple=64),
        AttentionBackend(name="triton-mla", mla=True, fixed_kernel_block=None, min_kernel_block=16,
                         kernel_block_multiple=16),
        AttentionBackend(name="flash-attn", mla=False, fixed_kernel_block=None, min_kernel_block=16,
                         kernel_block_multiple=16),
    )
}


def _backend(name: str, *, mla: bool) -> AttentionBackend:
    try:
        backend = ATTENTION_BACKENDS[name]
    except KeyError:
        raise GeometryError(
            f"unknown attention backend {name!r}; allowed: {', '.join(sorted(ATTENTION_BACKENDS))}"
        ) from None
    if backend.mla != mla:
        kind = "MLA" if mla else "GQA/MHA"
        allowed = sorted(n for n, b in ATTENTION_BACKENDS.items() if b.mla == mla)
        raise GeometryError(
            f"attention backend {name!r} cannot run {kind} layers; allowed: {', '.join(allowed)}"
        )
    return backend


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise GeometryError(f"{name} must be a positive integer, got {value!r}")


def _check_tp(tp: int) -> None:
    """TP is any positive size; whether it fits a model is decided by the head/column checks."""
    if not isinstance(tp, int) or isinstance(tp, bool) or not 1 <= tp <= 1024:
        raise GeometryError(f"TP size must be an integer from 1 to 1024, got {tp!r}")


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec:
    """Multi-head latent attention: one latent row (kv_lora_rank + rope_dim) per token.

    The latent is identical on every rank (REPLICATE), so bytes per token do not depend on TP.
    ``cache_dtype="fp8_ds_mla"`` is DeepSeek's packed FP8 format: 512 fp8 latent + 4 fp32 scales +
    64 bf16 rope = 656 B per token (docs/semantics.md §2.4: 40,016 B/token over 61 layers).
    """

    kv_lora_rank: int
    rope_dim: int
    dtype: str = "bfloat16"
    cache_dtype: str | None = None  # None: same as dtype
    backend: str = "flashmla"

    def __post_init__(self) -> None:
        _positive("kv_lora_rank", self.kv_lora_rank)
        _positive("rope_dim", self.rope_dim)
        if self.cache_dtype not in (None, "fp8_ds_mla"):
            dtype_bytes(self.cache_dtype)
        dtype_bytes(self.dtype)
        _backend(self.backend, mla=True)

    is_mla: bool = field(default=True, init=False)
    sharding: Sharding = field(default=Sharding.REPLICATE, init=False)

    @property
    def attention_backend(self) -> AttentionBackend:
        return _backend(self.backend, mla=True)

    def heads_per_rank(self, tp: int) -> int:
        _check_tp(tp)
        return 1

    @property
    def stored_dtype(self) -> str:
        """The dtype the cache holds: ``cache_dtype``, else the model's."""
        return self.cache_dtype or self.dtype

    def bytes_per_token(self, tp: int = 1) -> int:
        """Bytes per token per layer on one rank (TP-independent: replicated)."""
        _check_tp(tp)
        if self.stored_dtype == "fp8_ds_mla":
            return self.kv_lora_rank * 1 + 4 * 4 + self.rope_dim * 2
        return (self.kv_lora_rank + self.rope_dim) * dtype_bytes(self.stored_dtype)


@dataclass(frozen=True, kw_only=True)
class GQAAttentionSpec:
    """Grouped-query / multi-head attention: K and V rows per KV head, divided by head over TP.

    Once TP exceeds the KV head count every rank holds one head (replicated, tp % K == 0).
    """

    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    backend: str = "flash-attn"

    is_mla: bool = field(default=False, init=False)
    sharding: Sharding = field(default=Sharding.SPLIT, init=False)

    def __post_init__(self) -> None:
        _positive("num_kv_heads", self.num_kv_heads)
        _positive("head_dim", self.head_dim)
        dtype_bytes(self.dtype)
        _backend(self.backend, mla=False)

    @property
    def attention_backend(self) -> AttentionBackend:
        return _backend(self.backend, mla=False)

    @property
    def stored_dtype(self) -> str:
        """The dtype the cache holds (a GQA engine's cache dtype is its ``dtype``)."""
        return self.dtype

    def heads_per_rank(self, tp: int) -> int:
        _check_tp(tp)
        k = self.num_kv_heads
        if tp <= k:
            if k % tp:
                raise GeometryError(
                    f"TP {tp} does not divide the {k} KV heads (allowed: a divisor of {k}, "
                    f"or a multiple of it)"
                )
            return k // tp
        if tp % k:
            raise GeometryError(
                f"TP {tp} exceeds the {k} KV heads but is not a multiple of {k}; "
                f"heads cannot be replicated evenly"
            )
        return 1

    def first_head(self, tp: int, rank: int) -> int:
        """Global index of the first KV head that ``rank`` holds at ``tp``."""
        return rank * self.num_kv_heads // tp if tp > self.num_kv_heads else rank * (
            self.num_kv_heads // tp
        )

    def bytes_per_token(self, tp: int = 1) -> int:
        """K and V bytes per token per layer on one rank."""
        return 2 * self.heads_per_rank(tp) * self.head_dim * dtype_bytes(self.dtype)


AttentionSpec = MLAAttentionSpec | GQAAttentionSpec


@dataclass(frozen=True, kw_only=True)
class StateSpec:
    """Per-request recurrent state of a Mamba-like layer (GDN, KDA, Mamba2, Mamba1).

    Conv state is stored channel-first (DS layout): each conv sub-projection is a contiguous run
    of ``columns/tp`` channels x ``conv_kernel - 1`` rows. The recurrent state is head-major:
    ``recurrent_heads/tp`` heads of ``recurrent_head_shape`` elements. Page = [conv | recurrent].
    """

    kind: Literal["gdn", "kda", "mamba2", "mamba1"]
    conv_subprojections: tuple[tuple[str, int], ...]  # (name, global conv columns), in page order
    conv_kernel: int
    conv_dtype: str = "bfloat16"
    recurrent_heads: int
    recurrent_head_shape: tuple[int, ...]
    recurrent_dtype: str = "float32"

    def __post_init__(self) -> None:
        if not self.conv_subprojections:
            raise GeometryError("a state layer needs at least one conv sub-projection")
        for name, columns in self.conv_subprojections:
            _positive(f"conv columns of {name}", columns)
        if self.conv_kernel < 2:
            raise GeometryError(f"conv_kernel must be >= 2, got {self.conv_kernel}")
        _positive("recurrent_heads", self.recurrent_heads)
        for dim in self.recurrent_head_shape:
            _positive("recurrent head dimension", dim)
        dtype_bytes(self.conv_dtype)
        dtype_bytes(self.recurrent_dtype)

    @cached_property
    def conv_rows(self) -> int:
        return self.conv_kernel - 1

    @cached_property
    def num_conv_subprojections(self) -> int:
        return len(self.conv_subprojections)

    @cached_property
    def subregion_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.conv_subprojections) + ("recurrent",)

    def check_tp(self, tp: int) -> None:
        _check_tp(tp)
        for name, columns in self.conv_subprojections:
            if columns % tp:
                raise GeometryError(
                    f"TP {tp} does not divide the {columns} conv columns of {self.kind} "
                    f"sub-projection {name} (allowed TP: divisors of {columns})"
                )
        if self.recurrent_heads % tp:
            raise GeometryError(
                f"TP {tp} does not divide the {self.recurrent_heads} recurrent heads of "
                f"{self.kind} (allowed TP: divisors of {self.recurrent_heads})"
            )

    def conv_columns_per_rank(self, tp: int) -> tuple[int, ...]:
        self.check_tp(tp)
        return tuple(columns // tp for _, columns in self.conv_subprojections)

    def conv_subprojection_bytes(self, tp: int) -> tuple[int, ...]:
        row = self.conv_rows * dtype_bytes(self.conv_dtype)
        return tuple(cols * row for cols in self.conv_columns_per_rank(tp))

    def conv_bytes(self, tp: int) -> int:
        return sum(self.conv_subprojection_bytes(tp))

    @cached_property
    def recurrent_head_bytes(self) -> int:
        return math.prod(self.recurrent_head_shape) * dtype_bytes(self.recurrent_dtype)

    def recurrent_bytes(self, tp: int) -> int:
        self.check_tp(tp)
        return self.recurrent_heads // tp * self.recurrent_head_bytes

    def page_bytes(self, tp: int) -> int:
        """mamba_page: conv + recurrent bytes per layer, per slot, per rank (unpadded)."""
        return self.conv_bytes(tp) + self.recurrent_bytes(tp)

    def subregion_sizes(self, tp: int) -> tuple[int, ...]:
        """Sizes of the state sub-regions in page order: conv sub-projections, then recurrent."""
        return self.conv_subprojection_bytes(tp) + (self.recurrent_bytes(tp),)

    def subregion_offsets(self, tp: int) -> tuple[int, ...]:
        sizes = self.subregion_sizes(tp)
        return tuple(sum(sizes[:i]) for i in range(len(sizes)))


def kda_state(*, num_heads: int, head_dim: int, conv_kernel: int, conv_dtype: str = "bfloat16",
              recurrent_dtype: str = "float32") -> StateSpec:
    """KimiDeltaAttention: GDN with Hk = Hv = H and dk = dv = d, so Q = K = V = H*d columns."""
    columns = num_heads * head_dim
    return StateSpec(kind="kda", conv_subprojections=(("Q", columns), ("K", columns), ("V", columns)),
                     conv_kernel=conv_kernel, conv_dtype=conv_dtype, recurrent_heads=num_heads,
                     recurrent_head_shape=(head_dim, head_dim), recurrent_dtype=recurrent_dtype)


def gdn_state(*, num_k_heads: int, num_v_heads: int, k_head_dim: int, v_head_dim: int,
              conv_kernel: int, conv_dtype: str = "bfloat16",
              recurrent_dtype: str = "float32") -> StateSpec:
    """Gated DeltaNet: conv Q|K|V = Hk*dk | Hk*dk | Hv*dv columns; recurrent (Hv, dv, dk)."""
    key = num_k_heads * k_head_dim
    return StateSpec(kind="gdn",
                     conv_subprojections=(("Q", key), ("K", key), ("V", num_v_heads * v_head_dim)),
                     conv_kernel=conv_kernel, conv_dtype=conv_dtype, recurrent_heads=num_v_heads,
                     recurrent_head_shape=(v_head_dim, k_head_dim), recurrent_dtype=recurrent_dtype)


def mamba2_state(*, intermediate_size: int, n_groups: int, d_state: int, num_heads: int,
                 head_dim: int, conv_kernel: int, conv_dtype: str = "bfloat16",
                 recurrent_dtype: str = "float32") -> StateSpec:
    """Mamba2: conv x|B|C = I | G*d_state | G*d_state columns; recurrent (H, head_dim, d_state)."""
    bc = n_groups * d_state
    return StateSpec(kind="mamba2",
                     conv_subprojections=(("x", intermediate_size), ("B", bc), ("C", bc)),
                     conv_kernel=conv_kernel, conv_dtype=conv_dtype, recurrent_heads=num_heads,
                     recurrent_head_shape=(head_dim, d_state), recurrent_dtype=recurrent_dtype)


def mamba1_state(*, intermediate_size: int, d_state: int, conv_kernel: int,
                 conv_dtype: str = "bfloat16", recurrent_dtype: str = "float32") -> StateSpec:
    """Mamba1: conv x = I columns; recurrent (I, d_state), split over TP by channel."""
    return StateSpec(kind="mamba1", conv_subprojections=(("x", intermediate_size),),
                     conv_kernel=conv_kernel, conv_dtype=conv_dtype,
                     recurrent_heads=intermediate_size, recurrent_head_shape=(d_state,),
                     recurrent_dtype=recurrent_dtype)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A model's cache-relevant structure: which layers are attention and which carry state."""

    name: str
    architecture: str
    num_layers: int
    hidden_size: int
    attention: AttentionSpec
    attention_layers: tuple[int, ...]  # 0-based layer indices
    state: StateSpec | None = None
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        _positive("num_layers", self.num_layers)
        if not self.attention_layers:
            raise GeometryError(f"model {self.name!r} has no attention layers")
        if len(set(self.attention_layers)) != len(self.attention_layers) or any(
            not 0 <= i < self.num_layers for i in self.attention_layers
        ):
            raise GeometryError(
                f"model {self.name!r}: attention_layers must be distinct indices in "
                f"[0, {self.num_layers}), got {self.attention_layers}"
            )
        if tuple(sorted(self.attention_layers)) != self.attention_layers:
            object.__setattr__(self, "attention_layers", tuple(sorted(self.attention_layers)))
        if self.state is None and len(self.attention_layers) != self.num_layers:
            raise GeometryError(
                f"model {self.name!r}: {self.num_layers - len(self.attention_layers)} layers are "
                f"neither attention nor state (give a state spec or list every layer as attention)"
            )

    @cached_property
    def state_layers(self) -> tuple[int, ...]:
        if self.state is None:
            return ()
        attn = set(self.attention_layers)
        return tuple(i for i in range(self.num_layers) if i not in attn)

    @cached_property
    def is_hybrid(self) -> bool:
        return bool(self.state_layers)

    @cached_property
    def is_mla(self) -> bool:
        return self.attention.is_mla

    def is_attention_layer(self, layer: int) -> bool:
        return layer in set(self.attention_layers)

    def check_tp(self, tp: int) -> None:
        """Raise GeometryError if this model cannot run at TP ``tp``."""
        _check_tp(tp)
        self.attention.heads_per_rank(tp)
        if self.is_hybrid:
            assert self.state is not None
            self.state.check_tp(tp)

    def kv_bytes_per_token(self, tp: int = 1) -> int:
        """Attention KV bytes per token over all attention layers, on one rank."""
        return len(self.attention_layers) * self.attention.bytes_per_token(tp)

    def state_bytes_per_request(self, tp: int = 1) -> int:
        """Conv + recurrent bytes per request over all state layers, on one rank (unpadded)."""
        if not self.is_hybrid:
            return 0
        assert self.state is not None
        return len(self.state_layers) * self.state.page_bytes(tp)
