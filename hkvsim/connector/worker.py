"""Per-rank connector worker: registration, handshake, posting reads, polling, notifications.

Sans-I/O: it never sleeps, starts threads or reads a clock; it calls the injected transport and
is driven by the cluster (simulated) or a rank process (real NIXL).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..geometry.layout import EngineLayout
from ..geometry.specs import dtype_bytes
from ..transport.base import DONE, ERR, PROC, Memory, Transport, TransportError, check_pairs
from ..transport.outer import OuterIds
from .blocks import (
    PairingError,
    expand_logical_range,
    pair_attention_ids,
    pair_state_slots,
    to_sub_blocks,
)
from .descriptors import (
    DescriptorList,
    local_descriptors,
    remote_descriptors,
    remote_list_length,
    sliced_descriptors,
    split_descriptors,
)
from .metadata import (
    MetadataError,
    RankMetadata,
    compatibility_hash,
    decode_handshake,
    encode_handshake,
    rank_metadata,
)
from .push import WriteRequest
from .templates import PlanTemplates
from .tp import SourcePlan, handshake_targets, source_plan
from .validate import (
    HandshakeError,
    PairSettings,
    check_remote_list_length,
    validate_pair,
    validate_remote_ranks,
)

__all__ = ["ConnectorSettings", "TRANSFER_EXTENTS", "ReadRequest", "ConnectorWorker",
           "RequestOutcome", "parse_notification"]


@dataclass(frozen=True, kw_only=True)
class ConnectorSettings:
    mode: str = "pull"
    quirks: frozenset[str] = frozenset()
    prefix_caching: bool = False
    host_buffer: bool = False
    enforce_handshake_compat: bool = True
    descriptor_merge: str = "off"  # off | contiguous | strided (DESIGN: fewer descriptors)
    # what a transfer covers: "allocated" (the reference: every state slot over every shared
    # tensor, whole logical blocks) or "needed" (state only on the tensors holding a layer of
    # the slot's cache group; a pull between engines whose blocks differ in size stops at the
    # request's last computed token): TRANSFER_EXTENTS
    transfer_extent: str = "allocated"


TRANSFER_EXTENTS = ("allocated", "needed")


@dataclass(frozen=True, kw_only=True)
class ReadRequest:
    """What one decode rank needs to pull one request (from the proxy's kv_transfer_params)."""

    request_id: str  # decode's id
    prefill_request_id: str
    remote_engine: str
    prefill_blocks: Mapping[int, np.ndarray]  # group id -> prefill logical ids (clipped)
    decode_blocks: Mapping[int, np.ndarray]  # group id -> decode logical ids to fill (uncached)
    decode_hit_blocks: int = 0  # logical blocks decode holds from its prefix cache
    # tokens prefill computed for the request (vLLM's ``remote_num_tokens``, which its proxy
    # forwards; 0.34 pairs blocks of different sizes by it); None where the caller has no count
    prefill_tokens: int | None = None


@dataclass(kw_only=True)
class RequestOutcome:
    request_id: str
    ok: bool
    reason: str | None = None
    failure_class: str | None = None
    descriptors: int = 0
    nbytes: int = 0
    transfers: int = 0
    telemetry: list = field(default_factory=list)
    # handles the connector gave up on that could not be released (DMA may still be live)
    unreleased: int = 0


@dataclass(eq=False)
class _RemoteRank:
    meta: RankMetadata
    agent: str
    bsr: int
    plan: SourcePlan
    remote_list: DescriptorList
    remote_handle: int


@dataclass(eq=False)
class _PairedBlocks:  # read-only once made: one request's ranks may share it
    attention_prefill: np.ndarray  # prefill kernel-block ids
    attention_decode: np.ndarray  # decode kernel (or sub-) block ids, paired by position
    state_prefill: np.ndarray
    state_decode: np.ndarray
    # whether attention_prefill / attention_decode are known to be consecutive ids (a
    # range: expand_logical_range); lets the transport skip reading them (OuterIds.ranges)
    prefill_range: bool = False
    decode_range: bool = False
    # transfer extent "needed": the state slots of cache groups that leave some shared tensor
    # unused, as (sub-region positions they are moved over, prefill slots, decode slots)
    state_partial: tuple[tuple[tuple[int, ...], np.ndarray, np.ndarray], ...] = ()

    @property
    def state_slots(self) -> int:
        """State slots paired, over every sub-region set."""
        return self.state_prefill.size + sum(p.size for _, p, _ in self.state_partial)

    @functools.cached_property
    def partial_decode_first(self) -> tuple[tuple[tuple[int, ...], np.ndarray, np.ndarray], ...]:
        """``state_partial`` as (positions, decode slots, prefill slots): a pull's local side
        first."""
        return tuple((q, d, p) for q, p, d in self.state_partial)


@dataclass(eq=False)
class _InFlight:
    request_id: str
    handles: list[int]
    outcome: RequestOutcome
    post_process: list = field(default_factory=list)


def parse_notification(message: bytes) -> tuple[str, int] | None:
    """'{request_id}:{count}' -> (request_id, count); None for a malformed message."""
    try:
        text = message.decode()
        rid, _, n = text.rpartition(":")
        count = int(n)
    except (UnicodeDecodeError, ValueError):
        return None
    if not rid or count < 1:
        return None
    return rid, count


# (request, what else the pairing depends on, its _PairedBlocks): see ConnectorWorker._paired_for
_INT64 = np.dtype(np.int64)


def _join(parts: list[np.ndarray]) -> np.ndarray:
    """The parts' ids as one new int64 array (no part is returned as such: the request's
    arrays are never kept)."""
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _logical_blocks(meta: RankMetadata) -> int:
    """An engine's logical block count from its handshake (num_blocks is kernel-granular)."""
    return meta.num_blocks // meta.physical_blocks_per_logical


def _check_block_ids(ids: Any, limit: int, side: str, group_id: int) -> None:
    """Raise PairingError unless every logical block id of ``ids`` lies in [0, limit)."""
    arr = ids if type(ids) is np.ndarray else np.asarray(ids, dtype=np.int64)
    if arr.size == 0:
        return
    if arr.size == 1:
        lo = hi = arr.item(0)
    else:
        lo, hi = arr.min(), arr.max()
    if lo < 0 or hi >= limit:
        flat = arr.reshape(-1)
        bad = int(np.flatnonzero((flat < 0) | (flat >= limit))[0])
        raise PairingError(f"{side} block id {int(flat[bad])} (group {group_id}, position "
                           f"{bad}) is outside the {side} engine's {limit} logical blocks; "
                           f"allowed: 0 to {limit - 1}")


_LAST_PAIRING: "tuple[ReadRequest, tuple[Any, ...], _PairedBlocks] | None" = None


class ConnectorWorker:
    """One rank's connector state."""

    def __init__(self, *, engine_id: str, role: str, tp_rank: int, layout: EngineLayout,
                 transport: Transport, settings: ConnectorSettings, device_id: int = 0) -> None:
        self.engine_id = engine_id
        self.role = role
        self.tp_rank = tp_rank
        self.layout = layout
        self.model = layout.model
        # quirk hybrid-failed-read-reported-loaded (vLLM 0.26.0-0.33.0): a hybrid's failed READ
        # counts as a completed load (decode's blocks then hold whatever they held)
        self._reports_failed_reads_as_loaded = (
            "hybrid-failed-read-reported-loaded" in settings.quirks and self.model.is_hybrid)
        self.transport = transport
        self.settings = settings
        self.device_id = device_id
        # a transport that reads the structure of descriptor ids gets them as OuterIds
        self._outer_ids = bool(getattr(transport, "accepts_outer_ids", False))
        self.memory: Memory | None = None
        self._meta: RankMetadata | None = None
        self._local_lists: dict[int, tuple[DescriptorList, int]] = {}  # sub_blocks -> (list, handle)
        self._split_lists: dict[tuple[int, int, int], tuple[DescriptorList, int]] = {}
        self._remotes: dict[str, dict[int, _RemoteRank]] = {}
        self._in_flight: dict[str, _InFlight] = {}
        # for poll(finished=...): in-flight handle -> its request, request -> posting order
        self._handle_rid: dict[int, str] = {}
        self._order: dict[str, int] = {}
        self._next_order = 0
        # handles whose release failed (DMA may be live) -> the request they belong to
        self._zombies: dict[int, str] = {}
        self._released: list[str] = []  # requests whose last live handle was just released
        self.notification_failures = 0
        self._notify_agents: set[str] = set()
        self._templates = PlanTemplates()  # descriptor_merge: merged rows by id structure
        self.state_regions = [i for i, r in enumerate(layout.regions)
                              if set(r.layers) & set(self.model.state_layers)]
        # (group id, is attention) of every group, in order (_pair_blocks, per request)
        self._group_kinds = tuple((g.group_id, g.kind == "attention") for g in layout.groups)
        if settings.transfer_extent not in TRANSFER_EXTENTS:
            raise ValueError(f"unknown transfer_extent {settings.transfer_extent!r}; allowed: "
                             f"{', '.join(TRANSFER_EXTENTS)}")

    @functools.cached_property
    def _held_positions(self) -> dict[int, tuple[int, ...]]:
        """Transfer extent "needed": state group id -> the state sub-regions (positions in the
        descriptor lists' state part) of the tensors holding one of its layers, for the groups
        that leave some shared tensor unused (KimiLinear's last KDA group); empty otherwise.
        Read once the rank is registered (the sub-regions per tensor come from its metadata)."""
        if self.settings.transfer_extent != "needed":
            return {}
        subregions = len(self.metadata.ssm_subregion_sizes)
        out: dict[int, tuple[int, ...]] = {}
        regions = [self.layout.regions[i] for i in self.state_regions]
        for group in self.layout.groups:
            if group.kind != "state":
                continue
            layers = set(group.layers)
            held = [pos for pos, region in enumerate(regions) if layers & set(region.layers)]
            if len(held) < len(regions):
                out[group.group_id] = tuple(pos * subregions + j for pos in held
                                            for j in range(subregions))
        return out

    # ---- registration --------------------------------------------------------------------
    @functools.cached_property
    def compat_hash(self) -> str:
        return compatibility_hash(self.layout, mode=self.settings.mode)

    def register(self, mem_type: str = "VRAM") -> Memory:
        self.memory = self.transport.allocate(self.layout.total_bytes, mem_type=mem_type,
                                              device_id=self.device_id)
        self.transport.register_memory(self.memory)
        self._meta = rank_metadata(
            layout=self.layout, engine_id=self.engine_id, tp_rank=self.tp_rank,
            agent_name=self.transport.name, agent_metadata=self.transport.get_agent_metadata(),
            base_addr=self.memory.base_addr, mem_type=mem_type, device_id=self.device_id,
            host_buffer=self.settings.host_buffer, prefix_caching=self.settings.prefix_caching)
        self._local_list(1)
        return self.memory

    @property
    def metadata(self) -> RankMetadata:
        if self._meta is None:
            raise RuntimeError("register() first")
        return self._meta

    def handshake_payload(self) -> bytes:
        return encode_handshake(self.metadata, self.compat_hash)

    def _local_list(self, sub_blocks: int) -> tuple[DescriptorList, int]:
        if sub_blocks not in self._local_lists:
            dl = local_descriptors(self.metadata, self.state_regions, sub_blocks=sub_blocks)
            self._local_lists[sub_blocks] = (dl, self.transport.prep_xfer_dlist("", dl.affine))
        return self._local_lists[sub_blocks]

    def _split_list(self, plan: SourcePlan, remote_rank: int, sub_blocks: int
                    ) -> tuple[DescriptorList, int]:
        key = (plan.tp_ratio, remote_rank, sub_blocks)
        if key not in self._split_lists:
            dl = split_descriptors(self.metadata, self.state_regions, plan, remote_rank,
                                   sub_blocks=sub_blocks)
            self._split_lists[key] = (dl, self.transport.prep_xfer_dlist("", dl.affine))
        return self._split_lists[key]

    # ---- handshake -----------------------------------------------------------------------
    def is_connected(self, engine: str) -> bool:
        return engine in self._remotes

    def targets(self, remote_tp: int) -> tuple[int, ...]:
        return handshake_targets(self.layout.tp, remote_tp, self.tp_rank)

    def connect(self, remote_engine: str, payloads: Mapping[int, bytes]) -> None:
        """Decode and validate the remote ranks' payloads and prepare the remote lists.

        ``payloads`` maps remote rank -> handshake payload for every rank of the remote engine
        (they are all needed for the cross-rank V7 check). Raises HandshakeError, and only that,
        whatever the payloads hold: every payload is decoded, bounded and validated against this
        rank before anything is allocated from it, and a refusal after some remote ranks were
        set up releases their lists and agents again.
        """
        metas = self._decode_remotes(remote_engine, payloads)
        remote_tp = next(iter(metas.values())).tp_size
        settings = PairSettings(
            prefix_caching=self.settings.prefix_caching,
            skip_hybrid_block_len_check="skip-hybrid-block-len-check" in self.settings.quirks,
            allow_heterogeneous_ppl_with_prefix_cache="front-trim-with-prefix-cache"
            in self.settings.quirks,
        )
        local_is_decode = self.role == "decode"
        try:
            targets = self.targets(remote_tp)
        except ValueError as exc:
            raise HandshakeError("V1", str(exc)) from None
        checked: list[tuple[int, RankMetadata, int]] = []
        own_length = len(self._local_list(1)[0])
        for rank in targets:
            if rank not in metas:
                raise HandshakeError("V7", f"remote {remote_engine} sent no metadata for rank {rank}")
            meta = metas[rank]
            bsr = validate_pair(model=self.model, local=self.metadata, remote=meta,
                                local_is_decode=local_is_decode, settings=settings)
            length = remote_list_length(meta, self.metadata, self.state_regions,
                                        remote_sub_blocks=1 if local_is_decode else bsr)
            check_remote_list_length(
                length, local_length=own_length,
                field=f"remote {remote_engine} rank {rank}: num_blocks {meta.num_blocks}")
            checked.append((rank, meta, bsr))
        plan = source_plan(self.model, local_tp=self.layout.tp, remote_tp=remote_tp,
                           tp_rank=self.tp_rank)
        remotes: dict[int, _RemoteRank] = {}
        known = self._agents_in_use()
        added: list[str] = []
        try:
            for rank, meta, bsr in checked:
                step = "add_remote_agent"
                agent = self.transport.add_remote_agent(meta.agent_metadata)
                if agent not in known and agent not in added:
                    added.append(agent)
                if local_is_decode:  # pull: decode's blocks are bsr prefill blocks
                    rl = remote_descriptors(meta, self.metadata, self.state_regions, plan, bsr=bsr)
                else:  # push: list decode's blocks as bsr sub-blocks, one per prefill kernel block
                    rl = remote_descriptors(meta, self.metadata, self.state_regions, plan, bsr=1,
                                            remote_sub_blocks=bsr)
                step = f"preparing the remote list ({len(rl)} descriptors)"
                handle = self.transport.prep_xfer_dlist(agent, rl.affine)
                remotes[rank] = _RemoteRank(meta=meta, agent=agent, bsr=bsr, plan=plan,
                                            remote_list=rl, remote_handle=handle)
        except TransportError as exc:
            for remote in remotes.values():
                self.transport.release_dlist_handle(remote.remote_handle)
            for agent in added:
                self.transport.remove_remote_agent(agent)
            raise HandshakeError("V8", f"remote {remote_engine} rank {rank}: {step} failed: {exc}"
                                 ) from None
        self._remotes[remote_engine] = remotes

    def _decode_remotes(self, remote_engine: str, payloads: Mapping[int, bytes]
                        ) -> dict[int, RankMetadata]:
        """Every remote rank's payload, strictly decoded and checked across ranks (V7, V8)."""
        expected = None if not self.settings.enforce_handshake_compat else self.compat_hash
        if not payloads:
            raise HandshakeError("V8", f"remote {remote_engine} sent no handshake payload")
        metas: dict[int, RankMetadata] = {}
        for rank, payload in sorted(payloads.items()):
            try:
                metas[rank] = decode_handshake(payload, expected_hash=expected)
            except MetadataError as exc:
                raise HandshakeError(exc.rule, f"{exc.rule}: remote {remote_engine} rank {rank}: "
                                     f"{exc.detail}") from None
        validate_remote_ranks(metas, expected_engine=remote_engine)
        return metas

    def _agents_in_use(self) -> set[str]:
        return ({r.agent for remotes in self._remotes.values() for r in remotes.values()}
                | self._notify_agents)

    # ---- pull ----------------------------------------------------------------------------
    def start_read(self, req: ReadRequest) -> RequestOutcome | None:
        """Post one READ per source rank (and notification-only messages to the ranks it does
        not read). Returns an immediate outcome on a setup failure, else None (poll for it)."""
        outcome = RequestOutcome(request_id=req.request_id, ok=False)
        try:
            handles = self._post_reads(req, outcome)
        except (TransportError, PairingError) as exc:
            outcome.reason = str(exc)
            outcome.failure_class = getattr(exc, "kind", "transfer_setup_failed")
            outcome.unreleased = self._unreleased(req.request_id)
            return outcome
        self._track(_InFlight(request_id=req.request_id, handles=handles, outcome=outcome))
        if not handles:
            return self._finish(req.request_id)
        return None

    def _paired_for(self, req: ReadRequest, *, ppl_p: int, bsr: int, remote_blocks: int
                    ) -> "_PairedBlocks":
        """The blocks of ``req`` paired (``_pair_blocks``). A request goes to every rank of an
        engine, and the ranks share its layout: what the first rank paired is reused by the
        others for the very same request object (the last pairing is remembered with the
        request and everything else it depends on; the request's block arrays are not
        modified after it is made)."""
        global _LAST_PAIRING
        ppl_d = self.layout.physical_blocks_per_logical
        key = (id(self.layout), self.role, self.settings.quirks, ppl_p, ppl_d, bsr,
               remote_blocks, self.settings.transfer_extent, req.prefill_tokens)
        last = _LAST_PAIRING
        if last is not None and last[0] is req and last[1] == key:
            return last[2]
        paired = self._pair_blocks(
            prefill_blocks=req.prefill_blocks, decode_blocks=req.decode_blocks,
            hit_blocks=req.decode_hit_blocks, ppl_p=ppl_p, ppl_d=ppl_d, bsr=bsr,
            remote_blocks=remote_blocks, prefill_tokens=req.prefill_tokens)
        _LAST_PAIRING = (req, key, paired)
        return paired

    def _transfer_ids(self, local_list: DescriptorList, remote_list: DescriptorList,
                      blocks: "tuple[np.ndarray, np.ndarray] | None",
                      slots: "tuple[np.ndarray, np.ndarray] | None",
                      ranges: tuple[bool, bool] = (False, False),
                      partial: "Sequence[tuple[tuple[int, ...], np.ndarray, np.ndarray]]" = (),
                      ) -> tuple[Any, Any, int]:
        """(local ids, remote ids, bytes) of a transfer of paired attention ``blocks`` and state
        ``slots`` ((local, remote) ids each; None: that part is not moved): every attention
        region's ids of the blocks, then every state sub-region's of the slots. As OuterIds
        (the same ids with their structure, transport/outer.py) for a transport that reads it,
        else flat int64 arrays; bytes counted per region, without a per-descriptor gather.
        ``ranges``: whether the local / remote attention blocks are known to be consecutive
        ids (_PairedBlocks; passed on with the OuterIds). ``partial``: (state sub-region
        positions, local slots, remote slots) moved over those sub-regions only (transfer
        extent "needed"; _PairedBlocks.state_partial, local and remote as ``slots``), after
        the rest."""
        (la, ra), (ls, rs) = blocks or (None, None), slots or (None, None)
        local_held: "Sequence[tuple[tuple[int, ...], np.ndarray]]" = ()
        remote_held: "Sequence[tuple[tuple[int, ...], np.ndarray]]" = ()
        if partial and ls is not None:  # (they ride with the state part)
            local_held = [(q, local) for q, local, _ in partial]
            remote_held = [(q, remote) for q, _, remote in partial]
        # the paired ids are never modified once made (_PairedBlocks): frozen columns
        local_ids = local_list.outer_ids(la, ls, frozen=True, block_range=ranges[0],
                                         held=local_held)
        remote_ids = remote_list.outer_ids(ra, rs, frozen=True, block_range=ranges[1],
                                           held=remote_held)
        nbytes = ((0 if la is None else la.size * local_list.attention_bytes)
                  + (0 if ls is None else ls.size * local_list.state_bytes)
                  + (local_list.held_bytes(local_held) if local_held else 0))
        if not self._outer_ids and self.settings.descriptor_merge == "off":
            return local_ids.flat(), remote_ids.flat(), nbytes
        return local_ids, remote_ids, nbytes  # merging reads their structure (_make_xfer)

    def _pair_blocks(self, *, prefill_blocks: Mapping[int, np.ndarray],
                     decode_blocks: Mapping[int, np.ndarray], hit_blocks: int, ppl_p: int,
                     ppl_d: int, bsr: int, remote_blocks: int | None = None,
                     prefill_tokens: int | None = None) -> "_PairedBlocks":
        """Pair prefill's and decode's block ids group by group (docs/semantics.md §6-7), in the
        descriptor-id units both lists use: prefill kernel blocks and decode (sub-)blocks.

        Attention: logical ids expanded with each side's own ppl, decode's split into bsr
        sub-blocks, paired by ``pair_attention``. State: paired slot by slot. The remote side's
        ids are expanded with the remote ppl; quirk local-ppl-remote-expansion uses the local
        one instead (the Qwen3.5 4P2D corruption).

        ``remote_blocks``: the remote engine's logical block count (its handshake). Every
        block id must name one of its engine's logical blocks: an id past the end would
        address a block of the next cache region (another layer's bytes), which a range check
        over the whole descriptor list notices only when it runs off the list's end;
        PairingError names it. None: not checked.

        Transfer extent "needed": ``prefill_tokens`` (a pull's; None: unknown) bounds the
        attention when the two engines' blocks differ in size (a block size ratio or another
        physical_blocks_per_logical): no prefill kernel block past the one holding the last
        computed token is paired, as vLLM 0.34.0 pairs such blocks by the request's last
        token. State slots of a group that leaves some shared tensor unused are paired apart
        (``state_partial``), to move over the tensors holding its layers only.
        """
        quirks = self.settings.quirks
        local_is_decode = self.role == "decode"
        # the logical block counts of decode and prefill (None: not checked)
        d_limit: int | None = None
        p_limit: int | None = None
        if remote_blocks is not None:
            own = self.layout.num_logical_blocks
            d_limit, p_limit = (own, remote_blocks) if local_is_decode else (remote_blocks, own)
        wrong_ppl = "local-ppl-remote-expansion" in quirks
        p_expand = ppl_d if wrong_ppl and local_is_decode else ppl_p
        d_expand = ppl_p if wrong_ppl and not local_is_decode else ppl_d
        # docs/semantics.md §7: "Non-hybrid: end-trim"; hybrid attention groups: "If the ppl
        # are equal, end-trim. Otherwise front-trim" -- the same ppl test as V4. A block size
        # ratio is absorbed by decode's sub-block list (ids and hit offset are in
        # prefill-kernel units), so it is not a ppl difference.
        heterogeneous = self.model.is_hybrid and ppl_d != ppl_p
        hit_units = hit_blocks * ppl_d * bsr
        front_trim = "front-trim-with-prefix-cache" in quirks
        by_count = "bsr-prefix-end-trim" in quirks
        held = self._held_positions
        # extent "needed": prefill kernel blocks up to the last computed token
        last_unit: int | None = None
        if (prefill_tokens is not None and self.settings.transfer_extent == "needed"
                and local_is_decode and (bsr > 1 or ppl_p != ppl_d)):
            tokens_per_unit = self.layout.kernel_block_size // bsr
            last_unit = -(-prefill_tokens // tokens_per_unit)
        attn_p, attn_d, state_p, state_d = [], [], [], []
        partial: list[tuple[tuple[int, ...], np.ndarray, np.ndarray]] = []
        ranges = (False, False)
        for group_id, attention in self._group_kinds:
            p_ids = prefill_blocks.get(group_id, ())
            d_ids = decode_blocks.get(group_id, ())
            if attention:
                d_sub, d_range = expand_logical_range(d_ids, d_expand)
                if d_limit is not None and not (  # a range: its first and last id say it
                        d_range and d_sub.item(0) >= 0 and d_sub.item(-1) < d_limit * d_expand):
                    _check_block_ids(d_ids, d_limit, "decode", group_id)
                if bsr > 1:
                    d_sub, d_range = to_sub_blocks(d_sub, bsr), False
                p_sub, p_range = expand_logical_range(p_ids, p_expand)
                if p_limit is not None and not (
                        p_range and p_sub.item(0) >= 0 and p_sub.item(-1) < p_limit * p_expand):
                    _check_block_ids(p_ids, p_limit, "prefill", group_id)
                if last_unit is not None and p_sub.size > last_unit:
                    p_sub = p_sub[:last_unit]  # (a prefix of a range is a range)
                # (a slice of consecutive ids is consecutive: pairing keeps the flags)
                local, remote = pair_attention_ids(
                    d_sub, p_sub, decode_hit_units=hit_units,
                    heterogeneous_ppl=heterogeneous, ppl_decode=ppl_d * bsr,
                    ppl_prefill=ppl_p, front_trim_with_prefix=front_trim,
                    end_trim_by_count=by_count)
                attn_p.append(remote)
                attn_d.append(local)
                ranges = (p_range, d_range)
                continue
            if not (type(p_ids) is np.ndarray and p_ids.dtype is _INT64):
                p_ids = np.asarray(p_ids, dtype=np.int64)
            if not (type(d_ids) is np.ndarray and d_ids.dtype is _INT64):
                d_ids = np.asarray(d_ids, dtype=np.int64)
            if d_limit is not None and not (  # one slot each (the common case): two ids
                    d_ids.size == 1 == p_ids.size and 0 <= d_ids.item(0) < d_limit
                    and 0 <= p_ids.item(0) < p_limit):
                _check_block_ids(d_ids, d_limit, "decode", group_id)
                _check_block_ids(p_ids, p_limit, "prefill", group_id)
            if d_ids.size == p_ids.size:  # the common case of pair_state_slots
                p_slots, d_slots = p_ids, d_ids
            else:
                d_slots, p_slots = pair_state_slots(d_ids, p_ids)
            positions = held.get(group_id) if held else None
            if positions is None:
                state_p.append(p_slots)
                state_d.append(d_slots)
            elif p_slots.size:  # (copies: the request's arrays are never kept)
                partial.append((positions, p_slots.copy(), d_slots.copy()))
        # one attention group: its pairing's arrays are already new (expand_logical), not
        # the request's, so they need no copy; state slots are copied (concatenated)
        if len(attn_p) == 1:
            paired = _PairedBlocks(
                attention_prefill=attn_p[0], attention_decode=attn_d[0],
                state_prefill=_join(state_p), state_decode=_join(state_d),
                prefill_range=ranges[0], decode_range=ranges[1], state_partial=tuple(partial))
        else:  # (joined groups: not known to be consecutive)
            paired = _PairedBlocks(
                attention_prefill=_join(attn_p), attention_decode=_join(attn_d),
                state_prefill=_join(state_p), state_decode=_join(state_d),
                state_partial=tuple(partial))
        if "attention-only-transfer" in quirks:  # decode runs from zeroed state (ATOM #2154)
            paired.state_prefill = paired.state_decode = np.zeros(0, np.int64)
            paired.state_partial = ()
        return paired

    def _post_reads(self, req: ReadRequest, outcome: RequestOutcome) -> list[int]:
        remotes = self._remotes[req.remote_engine]
        first = next(iter(remotes.values()))
        bsr, plan = first.bsr, first.plan
        quirks = self.settings.quirks
        paired = self._paired_for(req, ppl_p=first.meta.physical_blocks_per_logical, bsr=bsr,
                                  remote_blocks=_logical_blocks(first.meta))
        la, ra = paired.attention_decode, paired.attention_prefill
        ls, rs = paired.state_decode, paired.state_prefill
        count = max(1, self.layout.tp // first.meta.tp_size)
        handles: list[int] = []
        for rank, remote in remotes.items():
            reads_attention = rank in plan.attention_sources and la.size > 0
            reads_state = rank in plan.state_sources and paired.state_slots > 0
            if not (reads_attention or reads_state):
                # Never-read rank (pure-MLA broadcast, or nothing to move): notification only,
                # with prefill's request id so prefill can free.
                rid = req.request_id if "notify-with-decode-request-id" in quirks else (
                    req.prefill_request_id)
                self._notify(remote.agent, f"{rid}:{count}".encode())
                continue
            if plan.use_split_handles:
                local_list, local_handle = self._split_list(plan, rank, bsr)
            else:
                local_list, local_handle = self._local_list(bsr)
            rl = remote.remote_list
            local_ids, remote_ids, nbytes = self._transfer_ids(
                local_list, rl, (la, ra) if reads_attention else None,
                (ls, rs) if reads_state else None,
                (paired.decode_range, paired.prefill_range),
                paired.partial_decode_first if reads_state else ())
            notif = f"{req.prefill_request_id}:{count}".encode()
            self._post("READ", local_list, local_handle, local_ids, remote, remote_ids, notif,
                       handles, outcome, nbytes)
        return handles

    # ---- push (prefill side) --------------------------------------------------------------
    def start_write(self, req: WriteRequest) -> RequestOutcome | None:
        """Post one WRITE per decode rank this prefill rank covers (docs/semantics.md §8.2). Returns an
        immediate outcome on a setup failure or when nothing needs moving, else None."""
        outcome = RequestOutcome(request_id=req.prefill_request_id, ok=False)
        try:
            handles = self._post_writes(req, outcome)
        except (TransportError, PairingError, AssertionError) as exc:
            outcome.reason = f"{type(exc).__name__}: {exc}" if isinstance(
                exc, AssertionError) else str(exc)
            outcome.failure_class = getattr(exc, "kind", "transfer_setup_failed")
            outcome.unreleased = self._unreleased(req.prefill_request_id)
            return outcome
        self._track(_InFlight(request_id=req.prefill_request_id, handles=handles,
                              outcome=outcome))
        if not handles:
            return self._finish(req.prefill_request_id)
        return None

    def _post_writes(self, req: WriteRequest, outcome: RequestOutcome) -> list[int]:
        reg = req.registration
        remotes = self._remotes[reg.decode_engine]
        first = next(iter(remotes.values()))
        bsr, plan = first.bsr, first.plan
        p_tp, d_tp = self.layout.tp, first.meta.tp_size
        ppl_p = self.layout.physical_blocks_per_logical
        ppl_d = first.meta.physical_blocks_per_logical
        quirks = self.settings.quirks
        pure_mla = self.model.attention.is_mla and not self.model.is_hybrid
        if ("push-single-source-assert" in quirks and self.model.attention.is_mla
                and self.model.is_hybrid and len(remotes) > 1):
            # pre-#49762: the replicated-MLA WRITE branch asserted a single target rank
            raise AssertionError(
                f"replicated-MLA WRITE expects a single target rank, mapping has "
                f"{sorted(remotes)} (hybrid MLA+SSM with prefill TP {p_tp} < decode TP {d_tp})")
        paired = self._pair_blocks(
            prefill_blocks=req.prefill_blocks, decode_blocks=reg.blocks,
            hit_blocks=reg.hit_blocks, ppl_p=ppl_p, ppl_d=ppl_d, bsr=bsr,
            remote_blocks=_logical_blocks(first.meta))
        la, ra = paired.attention_prefill, paired.attention_decode
        ls, rs = paired.state_prefill, paired.state_decode
        notif = f"{reg.decode_request_id}:{p_tp}".encode()
        targets = sorted(remotes)
        heads = self.model.attention.heads_per_rank
        handles: list[int] = []
        for index, d_rank in enumerate(targets):
            remote = remotes[d_rank]
            if la.size == 0 and paired.state_slots == 0:  # full prefix hit: notification only
                self._notify(remote.agent, notif)
                continue
            if plan.tp_ratio < 0 and not pure_mla:
                # prefill TP < decode TP: every covered decode rank gets the attention it holds
                # (whole MLA blocks, or its head slice) and state chunk ``index`` (#49762)
                attn = self.model.attention
                if attn.is_mla:
                    slot, splits = 0, 1
                else:
                    splits = heads(p_tp) // heads(d_tp)
                    slot = (attn.first_head(d_tp, d_rank) - attn.first_head(p_tp, self.tp_rank)
                            ) // heads(d_tp)  # type: ignore[union-attr]
                key = (plan.tp_ratio, -1 - d_rank, 1)
                if key not in self._split_lists:
                    dl = sliced_descriptors(self.metadata, self.state_regions,
                                            attention_slot=slot, attention_splits=splits,
                                            state_chunk=index, state_splits=len(targets))
                    self._split_lists[key] = (dl, self.transport.prep_xfer_dlist("", dl.affine))
                local_list, local_handle = self._split_lists[key]
            else:
                local_list, local_handle = self._local_list(1)
            rl = remote.remote_list
            local_ids, remote_ids, nbytes = self._transfer_ids(
                local_list, rl, (la, ra), (ls, rs), (paired.prefill_range, paired.decode_range),
                paired.state_partial)
            self._post("WRITE", local_list, local_handle, local_ids, remote, remote_ids, notif,
                       handles, outcome, nbytes)
        return handles

    def _post(self, op: str, local_list: DescriptorList, local_handle: int,
              local_ids: np.ndarray, remote: _RemoteRank, remote_ids: np.ndarray, notif: bytes,
              handles: list[int], outcome: RequestOutcome, nbytes: int) -> None:
        """Create and post one transfer, adding it to ``handles``. If posting raises, this and
        the request's earlier handles are released (kept if still live) and the error re-raised:
        the request fails as a whole. ``nbytes``: the bytes ``local_ids`` name (the caller
        counts them per region from the block counts, without a per-descriptor gather)."""
        handle = self._make_xfer(op, local_list, local_handle, local_ids, remote, remote_ids,
                                 notif)
        try:
            self.transport.transfer(handle)
        except TransportError:
            self._release_quietly(handle, outcome.request_id)
            for h in handles:
                self._release_quietly(h, outcome.request_id)
            raise
        handles.append(handle)
        outcome.descriptors += int(local_ids.size)
        outcome.nbytes += int(nbytes)
        outcome.transfers += 1

    def _notify(self, agent: str, message: bytes) -> None:
        """A notification-only message. A failure is counted, not raised: the peer frees the
        blocks at lease expiry instead (docs/semantics.md §9.3 notification_failed)."""
        try:
            self.transport.send_notif(agent, message)
        except TransportError:
            self.notification_failures += 1

    def _make_xfer(self, op: str, local_list: DescriptorList, local_handle: int,
                   local_ids: np.ndarray, remote: _RemoteRank, remote_ids: np.ndarray,
                   notif: bytes) -> int:
        """Create one transfer from paired descriptor ids.

        ``descriptor_merge = "off"``: the reference's per-block plan, prepared lists indexed by
        descriptor id. ``"contiguous"`` / ``"strided"``: the same pairs, merged into fewer
        descriptors (connector/merge.py) and posted non-prepped (``Transport.make_xfer``); the
        ids, the pairing and the bytes moved are unchanged, and no merged descriptor spans two
        registered regions (cache tensors) on either side. Ids whose pattern was seen before
        get their rows from a template (connector/templates.py: the same rows, without
        checking and merging every descriptor again); any other ids are checked and merged
        here."""
        mode = self.settings.descriptor_merge
        if mode == "off":
            return self.transport.make_prepped_xfer(op, local_handle, local_ids,
                                                    remote.remote_handle, remote_ids, notif)
        if isinstance(local_ids, OuterIds) and isinstance(remote_ids, OuterIds):
            # transfers whose ids have the same structure merge alike (connector/templates.py)
            got = self._templates.plan(local_list.affine, local_ids, remote.remote_list.affine,
                                       remote_ids, mode, self.metadata.base_addrs,
                                       remote.meta.base_addrs)
            if got is not None:
                lrows, rrows = got if self._outer_ids else (got[0].rows, got[1].rows)
                return self.transport.make_xfer(op, lrows, remote.agent, rrows, notif)
        from .merge import collapsed_pairs, merge_descriptors

        # the prepped path's checks (ids inside both lists, equal lengths), then the rows, runs
        # that the contiguous merge joins anyway already joined
        pairs = check_pairs(local_list.affine, local_ids, remote.remote_list.affine, remote_ids,
                            what=f"{self.transport.name}: {op} with {remote.agent}")
        local, remote_descs, regions = collapsed_pairs(pairs, self.metadata.base_addrs,
                                                       remote.meta.base_addrs)
        plan = merge_descriptors(local, remote_descs, mode, regions)
        return self.transport.make_xfer(op, plan.local, remote.agent, plan.remote, notif)

    def _release_quietly(self, handle: int, request_id: str) -> bool:
        """Release a handle; one that cannot be released yet is kept and retried on every poll
        until it is terminal (docs/semantics.md §9.2: DMA may still be live). While it is kept, the
        request's destination blocks must not be reused (``RequestOutcome.unreleased``; the
        request is listed by ``take_released`` once its last such handle is released)."""
        try:
            self.transport.release_xfer_handle(handle)
        except TransportError:
            self._zombies[handle] = request_id
            return False
        if self._zombies.pop(handle, None) is not None and request_id not in self._zombies.values():
            self._released.append(request_id)
        return True

    def _reap_zombies(self) -> None:
        if not self._zombies:
            return
        for handle, rid in list(self._zombies.items()):
            try:
                state = self.transport.check_xfer_state(handle)
            except TransportError:
                state = ERR
            if state != PROC:
                self._release_quietly(handle, rid)

    def take_released(self) -> list[str]:
        """Requests whose last unreleasable handle was released since the last call (their
        quarantined blocks may now be reused)."""
        self._reap_zombies()
        out, self._released = self._released, []
        return out

    def _track(self, flight: _InFlight) -> None:
        rid = flight.request_id
        if rid not in self._in_flight:
            self._order[rid] = self._next_order
            self._next_order += 1
        self._in_flight[rid] = flight
        for h in flight.handles:
            self._handle_rid[h] = rid

    def poll(self, finished: Iterable[int] | None = None) -> list[RequestOutcome]:
        """Check the in-flight requests; return those that reached a terminal state.

        ``finished``: the handles that reached a terminal state since the last poll, when the
        transport can tell (the simulated one can): only their requests are checked, in
        posting order, instead of every request in flight."""
        if finished is None:
            rids = list(self._in_flight)
        elif type(finished) is list and len(finished) <= 1:  # nothing, or one, finished
            rid = self._handle_rid.get(finished[0]) if finished else None
            rids = [] if rid is None else [rid]
        else:
            owners = {self._handle_rid.get(h) for h in finished}
            owners.discard(None)
            rids = sorted(owners, key=self._order.__getitem__)  # type: ignore[arg-type]
        return self._check(rids)

    def _check(self, rids: list[str]) -> list[RequestOutcome]:
        finished: list[RequestOutcome] = []
        self._reap_zombies()
        for rid in rids:
            flight = self._in_flight[rid]
            states = []
            for h in flight.handles:
                try:
                    states.append(self.transport.check_xfer_state(h))
                except TransportError as exc:
                    flight.outcome.reason = str(exc)
                    flight.outcome.failure_class = "transfer_exception"
                    states.append(ERR)
            if self._reports_failed_reads_as_loaded and any(s == ERR for s in states):
                finished.append(self._finish(rid))  # quirk hybrid-failed-read-reported-loaded
            elif any(s == ERR for s in states):
                if flight.outcome.reason is None:
                    failure = getattr(self.transport, "xfer_failure", lambda h: None)
                    errs = [failure(h) for h, s in zip(flight.handles, states) if s == ERR]
                    errs = [e for e in errs if e]
                    flight.outcome.reason = "; ".join(e[1] for e in errs) or "transfer error"
                    flight.outcome.failure_class = errs[0][0] if errs else "transfer_failed"
                finished.append(self._terminate(rid))
            elif all(s == DONE for s in states):
                finished.append(self._finish(rid))
            elif any(s not in (DONE, PROC) for s in states):  # unknown state: treat as failed
                flight.outcome.reason = f"unexpected transfer states {states}"
                flight.outcome.failure_class = "transfer_failed"
                finished.append(self._terminate(rid))
        return finished

    def _finish(self, rid: str) -> RequestOutcome:
        flight = self._in_flight[rid]
        flight.outcome.telemetry = [self.transport.get_xfer_telemetry(h) for h in flight.handles]
        flight.outcome.ok = True
        return self._terminate(rid)

    def _terminate(self, rid: str) -> RequestOutcome:
        flight = self._in_flight.pop(rid)
        self._order.pop(rid, None)
        for h in flight.handles:
            self._handle_rid.pop(h, None)
            self._release_quietly(h, rid)
        flight.outcome.unreleased = self._unreleased(rid)
        return flight.outcome

    def _unreleased(self, request_id: str) -> int:
        return sum(r == request_id for r in self._zombies.values())

    def abort(self, rid: str, reason: str, failure_class: str) -> RequestOutcome | None:
        if rid not in self._in_flight:
            return None
        flight = self._in_flight[rid]
        flight.outcome.reason, flight.outcome.failure_class = reason, failure_class
        return self._terminate(rid)

    def in_flight(self) -> int:
        return len(self._in_flight)

    def pending_releases(self) -> int:
        """Handles of finished requests that could not be released yet (still live): the
        driver must keep polling until they are."""
        return len(self._zombies)

    # ---- notifications (prefill side) ----------------------------------------------------
    def take_messages(self) -> list[bytes]:
        """Every message that arrived since the last call, in arrival order per sender."""
        return [m for messages in self.transport.get_new_notifs().values() for m in messages]

    def take_notifications(self) -> list[tuple[str, int]]:
        """Parsed '{request_id}:{count}' notifications; malformed ones are dropped."""
        parsed = (parse_notification(m) for m in self.take_messages())
        return [p for p in parsed if p is not None]

    # ---- post-processing -----------------------------------------------------------------
    def regroup_heads(self, kernel_blocks: np.ndarray, bsr: int) -> None:
        """After a bsr > 1 pull into HND blocks: bsr P blocks of [H, t_P, 2d] (K and V packed per
        token) become one [H, bsr*t_P, 2d] (docs/semantics.md §6). MLA and NHD blocks are already
        token-contiguous."""
        if bsr == 1 or self.model.attention.is_mla or self.layout.kv_cache_layout != "HND":
            return
        assert self.memory is not None
        attn = self.model.attention
        heads = attn.heads_per_rank(self.layout.tp)
        row = attn.bytes_per_token(self.layout.tp) // heads  # one head's K|V bytes of a token
        t_p = self.layout.kernel_block_size // bsr
        meta = self.metadata
        blocks = np.asarray(kernel_blocks, dtype=np.int64)
        for base, stride, length in zip(meta.base_addrs, meta.block_strides, meta.block_lens):
            off = base - self.memory.base_addr
            starts = off + blocks * stride
            idx = starts[:, None] + np.arange(length, dtype=np.int64)[None, :]
            data = self.memory.array[idx].reshape(blocks.size, bsr, heads, t_p, row)
            self.memory.array[idx] = data.transpose(0, 2, 1, 3, 4).reshape(blocks.size, length)

    def zero_sub_blocks(self, sub_block_ids: np.ndarray, bsr: int) -> None:
        """Zero decode sub-blocks that received nothing (the untransferred tail, #49612)."""
        ids = np.asarray(sub_block_ids, dtype=np.int64)
        if ids.size == 0:
            return
        assert self.memory is not None
        dl, _ = self._local_list(bsr)
        received_in_first = int(ids[0] % bsr)  # sub-blocks of ids[0]'s block that were sent
        if ("mla-bsr-tail-zero-latent" in self.settings.quirks and self.model.is_mla
                and received_in_first):
            self._zero_latent_tail(int(ids[0] // bsr), received_in_first, bsr, dl)
            ids = ids[bsr - received_in_first:]  # the rest are whole blocks: zeroed as usual
        for row in self._attention_rows(dl, ids):
            row[:] = 0

    def _attention_rows(self, dl: DescriptorList, ids: np.ndarray) -> Iterable[np.ndarray]:
        """Views of this rank's memory under the local list's attention rows of ``ids``."""
        assert self.memory is not None
        descs = dl.affine.rows(dl.attention_ids(ids))
        for addr, length in zip(descs[:, 0].tolist(), descs[:, 1].tolist()):
            off = int(addr) - self.memory.base_addr
            yield self.memory.array[off:off + int(length)]

    def _zero_latent_tail(self, kernel_block: int, received: int, bsr: int,
                          dl: DescriptorList) -> None:
        """Quirk mla-bsr-tail-zero-latent (vLLM 0.33.0, docs/vllm.md): the half-covered last
        block's tail zeroed as ``cache[block, :, zero_from:]`` on a cache taken to be (blocks,
        heads, tokens, channels), so on an MLA cache (blocks, tokens, latent) it zeroes every
        token's latent from ``received * (latent // bsr)`` elements on: received tokens lose
        part of their latent, untransferred ones keep the rest stale."""
        attention = self.model.attention
        token_bytes = attention.bytes_per_token(self.layout.tp)
        # the cache's element: uint8 for DeepSeek's packed fp8 rows, else the cache dtype
        stored = attention.stored_dtype
        element = 1 if stored == "fp8_ds_mla" else dtype_bytes(stored)
        zero_from = received * (token_bytes // element // bsr) * element
        subs = kernel_block * bsr + np.arange(bsr, dtype=np.int64)
        for row in self._attention_rows(dl, subs):
            row.reshape(-1, token_bytes)[:, zero_from:] = 0

    def remote_info(self, engine: str) -> Sequence[_RemoteRank]:
        return list(self._remotes.get(engine, {}).values())

    def connect_notify_only(self, agent_metadata: Sequence[bytes]) -> None:
        """Push: decode knows prefill's agents only to send notifications (no descriptors)."""
        for blob in agent_metadata:
            self._notify_agents.add(self.transport.add_remote_agent(blob))

    def evict(self, engine: str) -> None:
        """Drop a remote engine: its prepared lists and agents (stale-engine eviction)."""
        for r in self._remotes.pop(engine, {}).values():
            self.transport.release_dlist_handle(r.remote_handle)
            self.transport.remove_remote_agent(r.agent)

    def shutdown(self) -> None:
        """Release every transfer handle, local/split/remote list and remote agent, then
        deregister memory (docs/semantics.md §9.4). Handles still in flight are kept (not released)."""
        for rid in list(self._in_flight):
            self._terminate(rid)
        self._reap_zombies()
        for engine in list(self._remotes):
            self.evict(engine)
        for agent in self._notify_agents:
            self.transport.remove_remote_agent(agent)
        self._notify_agents.clear()
        for _, handle in list(self._local_lists.values()) + list(self._split_lists.values()):
            self.transport.release_dlist_handle(handle)
        self._local_lists.clear()
        self._split_lists.clear()
        if self.memory is not None:
            self.transport.deregister_memory(self.memory)
            self.memory = None
