"""Named replays of real connector bugs. All are off by default.

Each quirk switches one piece of the connector core back to a known-bad behaviour so that a
scenario can prove the testbed catches it. ``QUIRKS`` maps the name to the real-world bug.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Quirk", "QUIRKS", "quirk_names", "check_quirks"]


@dataclass(frozen=True, kw_only=True)
class Quirk:
    name: str
    reproduces: str  # the real bug, with its public reference
    symptom: str  # what a connector engineer sees


QUIRKS: dict[str, Quirk] = {
    q.name: q
    for q in (
        Quirk(
            name="first-registration-mla-flag",
            reproduces="pre-vLLM#49762 register_kv_caches: a shared (dual-purpose) region keeps the "
            "MLA flag and geometry of whichever layer registered first (KDA before MLA in KimiLinear)",
            symptom="MLA blocks head-sliced as SPLIT under heterogeneous TP, attention descriptors "
            "strided by the unified page: the rank's own list runs past its registered memory and "
            "the transport refuses it at registration (the run cannot start; where it stayed in "
            "range, the KV would be read from wrong offsets)",
        ),
        Quirk(
            name="push-single-source-assert",
            reproduces="pre-vLLM#49762 push worker: replicated-MLA WRITE asserts a single target "
            "source rank, which hybrid MLA+SSM with P_TP < D_TP violates",
            symptom="the push path crashes (AssertionError) for hybrid models with P_TP < D_TP",
        ),
        Quirk(
            name="skip-hybrid-block-len-check",
            reproduces="pre-vLLM#49762 handshake validation: every FA block_len check skipped for "
            "models with mamba/state layers",
            symptom="a wrong MLA kernel block_len is accepted and the transfer runs at mismatched "
            "geometry",
        ),
        Quirk(
            name="local-ppl-remote-expansion",
            reproduces="remote logical block ids expanded with the local physical_blocks_per_logical "
            "(Qwen3.5 heterogeneous-TP 4P2D silent accuracy corruption)",
            symptom="decode receives the wrong / too few attention kernel blocks",
        ),
        Quirk(
            name="front-trim-with-prefix-cache",
            reproduces="heterogeneous-ppl front-trim applied with prefix caching on instead of "
            "refusing the pair at handshake (what vLLM PR #51527 would align by token offset)",
            symptom="P's prefix blocks land in D's suffix blocks: silent KV corruption",
        ),
        Quirk(
            name="attention-only-transfer",
            reproduces="only the attention half of a hybrid model moves; decode runs from zeroed "
            "KDA/GDN state while its text stays fluent (ROCm/ATOM PR #2154)",
            symptom="state digests differ from prefill's (all zeros on decode)",
        ),
        Quirk(
            name="phantom-token",
            reproduces="prefill of a model with state computes all N prompt tokens instead of "
            "N-1, and decode recomputes token N on top: the state absorbs the handoff token twice "
            "(vLLM xfail_tp_qwen35_ssm_2p2d, ROCm/ATOM PR #2154)",
            symptom="decode's received state is the state after N tokens, not N-1",
        ),
        Quirk(
            name="bsr-prefix-end-trim",
            reproduces="vLLM 0.26.0-0.33.0 pull with a block size ratio after a decode prefix "
            "hit: decode's sub-blocks clipped to prefill's whole list, then prefill's list "
            "end-trimmed to their count (found by hkvsim diff; docs/vllm.md)",
            symptom="a request whose prompt ends in the first part of a decode block gets prefill "
            "blocks from before the hit, one place early per empty sub-block: silent KV "
            "corruption",
        ),
        Quirk(
            name="mla-bsr-tail-zero-latent",
            reproduces="vLLM 0.33.0 pull of an MLA cache with a block size ratio: the receive "
            "post-process zeroes a half-covered last block as cache[block, :, zero_from:], "
            "written for (blocks, heads, tokens, channels) caches (found by hkvsim diff; "
            "docs/vllm.md)",
            symptom="every token of that block loses the second part of its latent vector, "
            "the received ones included, and the untransferred tokens keep the first part "
            "stale; success is reported: silent KV corruption",
        ),
        Quirk(
            name="hybrid-failed-read-reported-loaded",
            reproduces="vLLM 0.26.0-0.33.0 pull of a hybrid model (hybrid memory allocator): a "
            "READ that ends in ERR is logged but its blocks are not recorded as load errors (a "
            "TODO in vLLM's receive path; found by hkvsim diff; docs/vllm.md)",
            symptom="the request counts as loaded and decode's blocks hold zeros or an earlier "
            "request's KV and state: silent corruption, whatever the failure policy",
        ),
        Quirk(
            name="notify-with-decode-request-id",
            reproduces="pure-MLA P_TP > D_TP broadcast notifications carry decode's request id "
            "instead of prefill's",
            symptom="the non-read prefill ranks never match the notification and hold their "
            "blocks until the lease expires",
        ),
    )
}


def quirk_names() -> list[str]:
    return sorted(QUIRKS)


def check_quirks(names: list[str] | tuple[str, ...]) -> frozenset[str]:
    unknown = [n for n in names if n not in QUIRKS]
    if unknown:
        raise ValueError(
            f"unknown quirk(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(quirk_names())}"
        )
    return frozenset(names)
