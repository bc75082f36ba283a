"""Per-engine, per-rank cache layout: kernel/logical blocks, page unification, HMA groups,
shared tensors and registered regions (docs/semantics.md §2.2, §3.1-3.2).

Everything here is a pure function of (model, engine settings). The result is the ground truth of
*where the cache lives*; the connector derives descriptors from the region records, the oracle
derives expected bytes from the tensor views, and the two never share offset arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

from .specs import GeometryError, ModelSpec, Sharding

__all__ = [
    "REGISTRATION_ORDERS",
    "KV_CACHE_LAYOUTS",
    "TENSOR_ALIGNMENT",
    "HMAGroup",
    "Region",
    "EngineLayout",
    "build_layout",
    "registration_walk",
    "register_regions",
    "unify_pages",
    "has_uneven_group",
]

REGISTRATION_ORDERS = ("sorted", "state-first", "attention-first")
KV_CACHE_LAYOUTS = ("HND", "NHD")
TENSOR_ALIGNMENT = 4096  # each shared tensor starts on its own page in a rank's allocation


@dataclass(frozen=True, kw_only=True)
class HMAGroup:
    """A hybrid-cache-manager group: same-spec layers; layer i of every group aliases tensor i."""

    group_id: int
    kind: Literal["attention", "state"]
    layers: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class Region:
    """One registered range per distinct tensor base (docs/semantics.md §3.1)."""

    tensor: int  # shared tensor index (its base is the rank's base + tensor_offset)
    tensor_offset: int  # byte offset of the tensor within the rank's cache allocation
    tensor_bytes: int
    block_len: int  # bytes per kernel block (attention view) or page/ppl (state view)
    stride: int  # bytes between consecutive blocks of this region's view
    num_blocks: int  # kernel-granular for attention views, logical for state-only views
    is_mla: bool
    group_id: int  # -1 when aliased by layers of different groups
    layers: tuple[int, ...]  # every layer aliasing this tensor, ascending

    @property
    def sharding(self) -> Sharding:
        return Sharding.REPLICATE if self.is_mla else Sharding.SPLIT

    def as_dict(self) -> dict:
        return {
            "tensor": self.tensor,
            "is_mla": self.is_mla,
            "block_len": self.block_len,
            "stride": self.stride,
            "num_blocks": self.num_blocks,
            "group_id": self.group_id,
            "layers": list(self.layers),
        }


@dataclass(frozen=True, kw_only=True)
class EngineLayout:
    """The cache of one engine rank (all ranks of an engine share the same layout)."""

    model: ModelSpec
    tp: int
    requested_block_size: int
    kernel_block_size: int  # tokens per attention kernel page
    logical_block_size: int  # tokens per allocator / prefix-hash block
    physical_blocks_per_logical: int
    num_logical_blocks: int
    kv_cache_layout: str
    attention_page_bytes: int  # one attention layer's kernel page on this rank
    state_page_bytes: int  # unpadded conv + recurrent bytes per state layer (0 without state)
    unified_page_bytes: int  # bytes per logical block per tensor
    groups: tuple[HMAGroup, ...]
    tensor_layers: tuple[tuple[int, ...], ...]  # tensor i -> the layers aliasing it
    regions: tuple[Region, ...] = field(repr=False)
    registration_order: tuple[int, ...] = field(repr=False)

    # ---- derived facts -------------------------------------------------------------------
    @cached_property
    def num_kernel_blocks(self) -> int:
        return self.num_logical_blocks * self.physical_blocks_per_logical

    @cached_property
    def num_tensors(self) -> int:
        return len(self.tensor_layers)

    @cached_property
    def tensor_bytes(self) -> int:
        return self.num_logical_blocks * self.unified_page_bytes

    @cached_property
    def tensor_stride(self) -> int:
        """Byte distance between consecutive tensors in a rank's allocation."""
        return -(-self.tensor_bytes // TENSOR_ALIGNMENT) * TENSOR_ALIGNMENT

    @cached_property
    def total_bytes(self) -> int:
        return self.num_tensors * self.tensor_stride

    @cached_property
    def is_hybrid(self) -> bool:
        return self.model.is_hybrid

    @cached_property
    def state_pad_bytes(self) -> int:
        return self.unified_page_bytes - self.state_page_bytes if self.is_hybrid else 0

    @cached_property
    def attention_groups(self) -> tuple[HMAGroup, ...]:
        return tuple(g for g in self.groups if g.kind == "attention")

    @cached_property
    def state_groups(self) -> tuple[HMAGroup, ...]:
        return tuple(g for g in self.groups if g.kind == "state")

    @property
    def attention_regions(self) -> tuple[Region, ...]:
        """Regions with an attention view (every region of a hybrid model: they are shared)."""
        return self.regions

    @cached_property
    def state_regions(self) -> tuple[Region, ...]:
        if not self.is_hybrid:
            return ()
        state_layers = set(self.model.state_layers)
        return tuple(r for r in self.regions if state_layers & set(r.layers))

    def tensor_of_layer(self, layer: int) -> int:
        for i, layers in enumerate(self.tensor_layers):
            if layer in layers:
                return i
        raise GeometryError(f"layer {layer} is not part of model {self.model.name!r}")

    def group_of_layer(self, layer: int) -> HMAGroup:
        for g in self.groups:
            if layer in g.layers:
                return g
        raise GeometryError(f"layer {layer} is not part of model {self.model.name!r}")

    def blocks_for_tokens(self, tokens: int) -> int:
        """Logical blocks an allocation of ``tokens`` tokens needs."""
        return -(-tokens // self.logical_block_size)

    @cached_property
    def ssm_sizes(self) -> tuple[int, int]:
        """(conv_bytes, recurrent_bytes) on this rank; (0, 0) without state (handshake field)."""
        if not self.is_hybrid:
            return (0, 0)
        assert self.model.state is not None
        return (self.model.state.conv_bytes(self.tp), self.model.state.recurrent_bytes(self.tp))

    def summary(self) -> dict:
        return {
            "tp": self.tp,
            "requested_block_size": self.requested_block_size,
            "kernel_block_size": self.kernel_block_size,
            "logical_block_size": self.logical_block_size,
            "physical_blocks_per_logical": self.physical_blocks_per_logical,
            "num_logical_blocks": self.num_logical_blocks,
            "num_kernel_blocks": self.num_kernel_blocks,
            "kv_cache_layout": self.kv_cache_layout,
            "attention_page_bytes": self.attention_page_bytes,
            "state_page_bytes": self.state_page_bytes,
            "unified_page_bytes": self.unified_page_bytes,
            "state_pad_bytes": self.state_pad_bytes,
            "kv_bytes_per_token": self.model.kv_bytes_per_token(self.tp),
            "state_bytes_per_request": self.model.state_bytes_per_request(self.tp),
            "groups": [
                {"group_id": g.group_id, "kind": g.kind, "layers": list(g.layers)}
                for g in self.groups
            ],
            "regions": [r.as_dict() for r in self.regions],
        }


def unify_pages(model: ModelSpec, tp: int, requested_block_size: int) -> tuple[int, int]:
    """(kernel_block_size, logical_block_size) after mamba page unification (docs/semantics.md §2.2).

    Without state the logical block is the requested block size. With state the attention
    logical block is raised to align * ceil(mamba_page / (align * attn_bytes_per_token)) with
    align = max(backend's smallest kernel block, requested), so one attention logical page covers
    the state page; the kernel block stays the backend's (FlashMLA: 64 tokens).
    """
    if not isinstance(requested_block_size, int) or requested_block_size <= 0:
        raise GeometryError(f"block_size must be a positive integer, got {requested_block_size!r}")
    model.check_tp(tp)
    backend = model.attention.attention_backend
    if not model.is_hybrid:
        kernel = backend.kernel_block_for(requested_block_size)
        return kernel, requested_block_size
    assert model.state is not None
    align = max(backend.min_kernel_block, requested_block_size)
    kernel = backend.kernel_block_for(align)
    attn_bytes = model.attention.bytes_per_token(tp)
    mamba_page = model.state.page_bytes(tp)
    logical = align * math.ceil(mamba_page / (align * attn_bytes))
    return kernel, logical


def _hma_groups(model: ModelSpec) -> tuple[HMAGroup, ...]:
    """Attention group(s) first, then state groups, each of ``group_size`` layers (last uneven).

    The group size is the smaller layer count of the two kinds, so the smaller kind forms one
    full group and the larger kind is chunked in numeric order (KimiLinear: 7 MLA; 7/7/6 KDA).
    Without state every layer is its own tensor and all layers form one group.
    """
    if not model.is_hybrid:
        return (HMAGroup(group_id=0, kind="attention", layers=model.attention_layers),)
    kinds: list[tuple[Literal["attention", "state"], tuple[int, ...]]] = [
        ("attention", model.attention_layers),
        ("state", model.state_layers),
    ]
    size = min(len(layers) for _, layers in kinds)
    groups: list[HMAGroup] = []
    for kind, layers in kinds:
        for start in range(0, len(layers), size):
            groups.append(HMAGroup(group_id=len(groups), kind=kind, layers=layers[start:start + size]))
    return tuple(groups)


def has_uneven_group(model: ModelSpec) -> bool:
    """Whether a cache group holds fewer layers than the others (the last chunk of the larger
    kind: KimiLinear's 7 KDA layers in groups of 3), leaving shared tensors that no layer of it
    uses. Never for a model without state (one group)."""
    return len({len(g.layers) for g in _hma_groups(model)}) > 1


def _tensor_layers(model: ModelSpec, groups: Sequence[HMAGroup]) -> tuple[tuple[int, ...], ...]:
    if not model.is_hybrid:
        return tuple((layer,) for layer in model.attention_layers)
    size = max(len(g.layers) for g in groups)
    return tuple(
        tuple(g.layers[i] for g in groups if i < len(g.layers)) for i in range(size)
    )


def registration_walk(model: ModelSpec, order: str | Sequence[int]) -> tuple[int, ...]:
    """The order in which layers register their cache tensors."""
    if isinstance(order, str):
        if order == "sorted":
            return tuple(range(model.num_layers))
        if order == "state-first":
            return model.state_layers + model.attention_layers
        if order == "attention-first":
            return model.attention_layers + model.state_layers
        raise GeometryError(
            f"unknown registration_order {order!r}; allowed: {', '.join(REGISTRATION_ORDERS)}"
        )
    walk = tuple(order)
    if sorted(walk) != list(range(model.num_layers)):
        raise GeometryError(
            f"a registration order must be a permutation of the {model.num_layers} layers"
        )
    return walk


def register_regions(
    *,
    model: ModelSpec,
    walk: Iterable[int],
    tensor_layers: Sequence[Sequence[int]],
    groups: Sequence[HMAGroup],
    tensor_stride: int,
    tensor_bytes: int,
    attention_page_bytes: int,
    unified_page_bytes: int,
    physical_blocks_per_logical: int,
    num_logical_blocks: int,
    first_registration_wins: bool = False,
) -> tuple[Region, ...]:
    """Walk the layers and build one region per distinct tensor base (docs/semantics.md §3.1-3.2).

    The #49762 merge: when a layer aliases a base already seen, ``is_mla`` is OR-ed over every
    alias, an attention alias's block geometry (kernel block_len, stride, kernel count) replaces a
    state view's, and differing group ids become -1. The result is independent of the walk order.
    (docs/semantics.md names only MLA aliases as replacing; any attention alias does here, so GQA hybrids
    are order-independent too: with first-wins their stride would depend on the walk.)

    ``first_registration_wins`` replays the pre-#49762 bug: later aliases are skipped, so a
    KDA-first walk leaves a dual-purpose region flagged SPLIT with the state view's geometry.
    """
    tensor_of = {layer: t for t, layers in enumerate(tensor_layers) for layer in layers}
    group_of = {layer: g.group_id for g in groups for layer in g.layers}
    attention = set(model.attention_layers)
    ppl = physical_blocks_per_logical
    records: dict[int, dict] = {}
    for layer in walk:
        t = tensor_of[layer]
        if layer in attention:
            view = dict(block_len=attention_page_bytes, stride=attention_page_bytes,
                        num_blocks=num_logical_blocks * ppl, is_mla=model.attention.is_mla,
                        is_attention=True)
        else:
            view = dict(block_len=unified_page_bytes // ppl, stride=unified_page_bytes,
                        num_blocks=num_logical_blocks, is_mla=False, is_attention=False)
        record = records.get(t)
        if record is None:
            records[t] = dict(view, group_id=group_of[layer], layers={layer})
            continue
        if first_registration_wins:
            record["layers"].add(layer)
            continue
        record["layers"].add(layer)
        record["is_mla"] = record["is_mla"] or view["is_mla"]
        if view["is_attention"]:
            for key in ("block_len", "stride", "num_blocks", "is_attention"):
                record[key] = view[key]
        if record["group_id"] != group_of[layer]:
            record["group_id"] = -1
    if first_registration_wins:
        # The skipped aliases never reached the record: its layer set is still complete (it is
        # the tensor's), but the group id stays the first layer's, as in the buggy connector.
        pass
    regions = []
    for t in sorted(records):
        r = records[t]
        regions.append(Region(
            tensor=t, tensor_offset=t * tensor_stride, tensor_bytes=tensor_bytes,
            block_len=r["block_len"], stride=r["stride"], num_blocks=r["num_blocks"],
            is_mla=r["is_mla"], group_id=r["group_id"], layers=tuple(sorted(r["layers"])),
        ))
    return tuple(regions)


def _check_regions(layout_model: ModelSpec, regions: Sequence[Region], *, ppl: int,
                   num_kernel_blocks: int) -> None:
    """Registration-time checks (docs/semantics.md §3.1 step 5)."""
    sizes = {r.tensor_bytes for r in regions if not r.is_mla}
    if len(sizes) > 1:
        raise GeometryError(f"non-MLA tensors differ in total size: {sorted(sizes)}")
    for r in regions:
        if r.stride < r.block_len:
            raise GeometryError(
                f"region {r.tensor}: stride {r.stride} is smaller than block_len {r.block_len}"
            )
        if ppl == 1 and r.num_blocks != num_kernel_blocks:
            raise GeometryError(
                f"region {r.tensor}: {r.num_blocks} blocks, expected {num_kernel_blocks} with ppl 1"
            )


def build_layout(
    model: ModelSpec,
    *,
    tp: int,
    block_size: int,
    num_blocks: int,
    kv_cache_layout: str = "HND",
    registration_order: str | Sequence[int] = "sorted",
    first_registration_wins: bool = False,
) -> EngineLayout:
    """Resolve one engine's per-rank cache layout.

    ``num_blocks`` counts logical blocks (the allocator's unit); the worker's kernel-granular
    count is ``num_blocks * physical_blocks_per_logical``.
    """
    if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks <= 0:
        raise GeometryError(f"num_blocks must be a positive integer, got {num_blocks!r}")
    if kv_cache_layout not in KV_CACHE_LAYOUTS:
        raise GeometryError(
            f"unknown kv_cache_layout {kv_cache_layout!r}; allowed: {', '.join(KV_CACHE_LAYOUTS)}"
        )
    kernel, logical = unify_pages(model, tp, block_size)
    if logical % kernel:
        raise GeometryError(
            f"logical block {logical} tokens is not a multiple of the kernel block {kernel}"
        )
    ppl = logical // kernel
    attn_bytes = model.attention.bytes_per_token(tp)
    attention_page = kernel * attn_bytes
    unified_page = logical * attn_bytes
    state_page = model.state.page_bytes(tp) if model.is_hybrid and model.state else 0
    if state_page > unified_page:  # unify_pages guarantees this; keep the invariant loud
        raise GeometryError(f"state page {state_page} B exceeds the unified page {unified_page} B")
    groups = _hma_groups(model)
    tensor_layers = _tensor_layers(model, groups)
    tensor_bytes = num_blocks * unified_page
    tensor_stride = -(-tensor_bytes // TENSOR_ALIGNMENT) * TENSOR_ALIGNMENT
    walk = registration_walk(model, registration_order)
    regions = register_regions(
        model=model, walk=walk, tensor_layers=tensor_layers, groups=groups,
        tensor_stride=tensor_stride, tensor_bytes=tensor_bytes,
        attention_page_bytes=attention_page, unified_page_bytes=unified_page,
        physical_blocks_per_logical=ppl, num_logical_blocks=num_blocks,
        first_registration_wins=first_registration_wins,
    )
    if not first_registration_wins:
        _check_regions(model, regions, ppl=ppl, num_kernel_blocks=num_blocks * ppl)
    return EngineLayout(
        model=model, tp=tp, requested_block_size=block_size, kernel_block_size=kernel,
        logical_block_size=logical, physical_blocks_per_logical=ppl,
        num_logical_blocks=num_blocks, kv_cache_layout=kv_cache_layout,
        attention_page_bytes=attention_page, state_page_bytes=state_page,
        unified_page_bytes=unified_page, groups=groups, tensor_layers=tensor_layers,
        regions=regions, registration_order=walk,
    )
