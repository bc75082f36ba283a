"""Handshake validation rules V1-V10 (docs/semantics.md §4.4) plus the testbed's SSM geometry check.

Every failure raises :class:`HandshakeError` naming the rule, the local and remote values and the
remedy. Pure functions of (local metadata, remote metadata, local settings).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..geometry.specs import ModelSpec
from .metadata import RankMetadata
from .tp import TPError, source_plan, tp_ratio

__all__ = ["HandshakeError", "PairSettings", "REMOTE_LIST_FACTOR", "REMOTE_LIST_FLOOR",
           "block_size_ratio", "check_remote_list_length", "validate_remote_ranks",
           "validate_pair"]

#: The remote list a rank prepares for one remote rank may hold at most REMOTE_LIST_FACTOR times
#: its own full list, and REMOTE_LIST_FLOOR descriptors whatever its own size. Valid pairs stay
#: far below (every scenario under scenarios/: at most 16x); a payload that claims more blocks is
#: refused before its list is built (a hostile 600-byte payload cannot make a rank allocate GBs).
REMOTE_LIST_FACTOR = 64
REMOTE_LIST_FLOOR = 1 << 16


class HandshakeError(Exception):
    """A P/D pair refused at handshake. ``rule`` is 'hash', 'V1'..'V10' or 'SSM'."""

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(f"{rule}: {message}" if not message.startswith(rule) else message)
        self.rule = rule


@dataclass(frozen=True, kw_only=True)
class PairSettings:
    """Local settings that take part in validation."""

    prefix_caching: bool
    skip_hybrid_block_len_check: bool = False  # quirk: pre-#49762 behaviour
    allow_heterogeneous_ppl_with_prefix_cache: bool = False  # quirk: front-trim-with-prefix-cache


def block_size_ratio(*, decode_kernel_tokens: int, prefill_kernel_tokens: int) -> int:
    """bsr = D kernel tokens / P kernel tokens; it must be an exact integer >= 1 (V2)."""
    if decode_kernel_tokens % prefill_kernel_tokens or decode_kernel_tokens < prefill_kernel_tokens:
        raise HandshakeError(
            "V2",
            f"block size ratio not an integer >= 1: decode kernel block {decode_kernel_tokens} "
            f"tokens, prefill kernel block {prefill_kernel_tokens} tokens (prefill's block must "
            f"divide decode's; use equal block sizes or a smaller prefill block)",
        )
    return decode_kernel_tokens // prefill_kernel_tokens


def validate_remote_ranks(remotes: Mapping[int, RankMetadata], *, expected_engine: str) -> None:
    """Checks across the remote ranks of one engine, given as rank -> metadata: V8 engine id,
    rank and TP size (each payload is the rank it was fetched from, every rank reports the same
    TP), V7 num_blocks."""
    sizes = sorted({m.tp_size for m in remotes.values()})
    for rank, meta in remotes.items():
        if meta.engine_id != expected_engine:
            raise HandshakeError(
                "V8", f"unexpected engine_id {meta.engine_id!r:.80} from a rank of "
                f"{expected_engine!r}"
            )
        if meta.tp_rank != rank:
            raise HandshakeError(
                "V8", f"the payload of {expected_engine!r} rank {rank} has tp_rank {meta.tp_rank}"
            )
    if len(sizes) > 1:
        raise HandshakeError(
            "V8", f"tp_size differs across remote ranks of {expected_engine!r}: {sizes}"
        )
    counts = sorted({m.num_blocks for m in remotes.values()})
    if len(counts) > 1:
        raise HandshakeError(
            "V7", f"num_blocks differs across remote ranks of {expected_engine!r}: {counts} "
            f"(every rank must allocate the same kernel-block count)"
        )


def check_remote_list_length(length: int, *, local_length: int, field: str) -> None:
    """Refuse (V8) a remote list longer than this rank accepts, before it is built."""
    limit = max(REMOTE_LIST_FACTOR * local_length, REMOTE_LIST_FLOOR)
    if length > limit:
        raise HandshakeError(
            "V8", f"{field} would make a remote descriptor list of {length} descriptors; this "
            f"rank accepts at most {limit} ({REMOTE_LIST_FACTOR} x its own list of "
            f"{local_length}, and at least {REMOTE_LIST_FLOOR})"
        )


def _heads(num_kv_heads: int, tp: int) -> int:
    return max(1, num_kv_heads // tp)


def validate_pair(*, model: ModelSpec, local: RankMetadata, remote: RankMetadata,
                  local_is_decode: bool, settings: PairSettings) -> int:
    """Validate one (local rank, remote rank) pair; returns the block size ratio."""
    try:
        r = tp_ratio(local.tp_size, remote.tp_size)
    except TPError as exc:
        raise HandshakeError("V1", str(exc)) from None
    decode, prefill = (local, remote) if local_is_decode else (remote, local)
    bsr = block_size_ratio(decode_kernel_tokens=decode.block_size,
                           prefill_kernel_tokens=prefill.block_size)
    if bsr != 1 and (local.host_buffer or remote.host_buffer):
        raise HandshakeError("V2", f"block size ratio {bsr} is not allowed with the host buffer")
    hybrid = model.is_hybrid
    attn = model.attention
    if not attn.is_mla and not hybrid and r < 0 and remote.tp_size > attn.num_kv_heads:  # type: ignore[union-attr]
        raise HandshakeError(
            "V3", f"local TP {local.tp_size} < remote TP {remote.tp_size} with replicated remote KV "
            f"heads (remote TP > {attn.num_kv_heads} KV heads) is not supported"  # type: ignore[union-attr]
        )
    caching = [side for side, on in (("local", settings.prefix_caching or local.prefix_caching),
                                     ("remote", remote.prefix_caching)) if on]
    if hybrid and caching and (
        local.physical_blocks_per_logical != remote.physical_blocks_per_logical
    ) and not settings.allow_heterogeneous_ppl_with_prefix_cache:
        role = {"local": "decode" if local_is_decode else "prefill",
                "remote": "prefill" if local_is_decode else "decode"}
        sides = " and ".join(role[side] for side in caching)
        raise HandshakeError(
            "V4", f"hybrid model with prefix caching and different physical_blocks_per_logical: "
            f"local {local.physical_blocks_per_logical}, remote {remote.physical_blocks_per_logical}; "
            f"disable prefix caching for this pair (it is on for {sides}; prefix hits are whole "
            f"logical blocks, so front-trim would pair prefill's prefix with decode's suffix)"
        )
    if local.num_regions != remote.num_regions:
        raise HandshakeError(
            "V7", f"region count mismatch: local {local.num_regions}, remote {remote.num_regions}"
        )
    for side, meta in (("local", local), ("remote", remote)):
        for i, (length, stride) in enumerate(zip(meta.block_lens, meta.block_strides)):
            if stride < length:
                raise HandshakeError(
                    "V7", f"{side} region {i}: stride {stride} smaller than block_len {length}"
                )
    if not attn.is_mla:
        if local.kv_cache_layout != remote.kv_cache_layout:
            raise HandshakeError(
                "V5", f"KV cache layout mismatch: local {local.kv_cache_layout}, remote "
                f"{remote.kv_cache_layout} (use the same kv_cache_layout on both sides; permute "
                f"is not supported with HMA)"
            )
        if r != 1 and local.kv_cache_layout != "HND":
            raise HandshakeError(
                "V5", f"heterogeneous TP splits heads and needs the HND layout, local layout is "
                f"{local.kv_cache_layout}"
            )
    if bsr > 1 and prefill.tp_size > decode.tp_size and not all(local.region_is_mla):
        splits = len(source_plan(model, local_tp=decode.tp_size, remote_tp=prefill.tp_size,
                                 tp_rank=decode.tp_rank).attention_sources)
        if splits > 1:
            raise HandshakeError(
                "V10", f"block size ratio {bsr} with prefill TP {prefill.tp_size} > decode TP "
                f"{decode.tp_size} needs a single attention split or all regions REPLICATE; this "
                f"pair reads {splits} head splits"
            )
    if not (hybrid and settings.skip_hybrid_block_len_check):
        _check_block_lens(model, local, remote, r, bsr)
    if hybrid:
        _check_ssm_sizes(local, remote)
    return bsr


def _check_block_lens(model: ModelSpec, local: RankMetadata, remote: RankMetadata, r: int,
                      bsr_decode_over_prefill: int) -> None:
    """V6, per region, in the reader's (local) view."""
    # the reader is decode in pull: its block is bsr x prefill's; in push the reader is prefill.
    for i, (len_l, len_r, mla_l) in enumerate(zip(local.block_lens, remote.block_lens,
                                                  local.region_is_mla)):
        if model.is_hybrid and model.attention.is_mla:
            expected, rule = _scaled(len_r, local, remote, bsr_decode_over_prefill), "hybrid MLA"
        elif mla_l:
            expected, rule = _scaled(len_r, local, remote, bsr_decode_over_prefill), "REPLICATE"
        else:
            k = model.attention.num_kv_heads  # type: ignore[union-attr]
            heads_l, heads_r = _heads(k, local.tp_size), _heads(k, remote.tp_size)
            if r < 0 and bsr_decode_over_prefill != 1:
                raise HandshakeError(
                    "V6", f"region {i}: SPLIT region with local TP < remote TP needs block size "
                    f"ratio 1, got {bsr_decode_over_prefill}"
                )
            # remote block = local block x heads_R/heads_L, scaled by the block size ratio
            expected_remote = len_l * heads_r // heads_l
            expected_remote = _unscale(expected_remote, local, remote, bsr_decode_over_prefill)
            if len_r != expected_remote:
                raise HandshakeError(
                    "V6", f"region {i} (SPLIT): block_len local {len_l}, remote {len_r}; expected "
                    f"remote {expected_remote} (heads local {heads_l}, remote {heads_r}, block size "
                    f"ratio {bsr_decode_over_prefill})"
                )
            continue
        if len_l != expected:
            raise HandshakeError(
                "V6", f"region {i} ({rule}): kernel block_len local {len_l}, remote {len_r}; "
                f"expected local == {expected} (remote x block size ratio "
                f"{bsr_decode_over_prefill} as seen from the local side); MLA bytes per token are "
                f"TP-independent, so kernel pages must match exactly"
            )


def _scaled(len_remote: int, local: RankMetadata, remote: RankMetadata, bsr: int) -> int:
    """The local block_len a remote REPLICATE block implies: x bsr if local is decode."""
    return len_remote * bsr if local.block_size >= remote.block_size else len_remote // bsr


def _unscale(len_remote_full: int, local: RankMetadata, remote: RankMetadata, bsr: int) -> int:
    return len_remote_full // bsr if local.block_size >= remote.block_size else len_remote_full * bsr


def _check_ssm_sizes(local: RankMetadata, remote: RankMetadata) -> None:
    """Testbed addition: remote (conv, recurrent) == local x local_TP / remote_TP, exactly, and
    the same of every state sub-region (equal totals split differently would be read at the
    local side's offsets)."""
    def expect_scaled(what: str, l_val: int, r_val: int, note: str = "") -> None:
        if r_val * remote.tp_size != l_val * local.tp_size:
            raise HandshakeError(
                "SSM", f"{what}: local {l_val} at TP {local.tp_size}, remote {r_val} at TP "
                f"{remote.tp_size}; expected remote == local x {local.tp_size}/{remote.tp_size}"
                + note)

    for name, l_val, r_val in zip(("conv", "recurrent"), local.ssm_sizes, remote.ssm_sizes):
        expect_scaled(f"{name} state bytes", l_val, r_val)
    if len(local.ssm_subregion_sizes) != len(remote.ssm_subregion_sizes):
        raise HandshakeError(
            "SSM", f"state sub-region count: local {len(local.ssm_subregion_sizes)}, remote "
            f"{len(remote.ssm_subregion_sizes)}"
        )
    for i, (l_val, r_val) in enumerate(zip(local.ssm_subregion_sizes, remote.ssm_subregion_sizes)):
        expect_scaled(f"state sub-region {i} bytes", l_val, r_val,
                      " (same totals, different split: the offsets read would not be the "
                      "remote's)")
