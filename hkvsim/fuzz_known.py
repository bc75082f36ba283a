"""Which documented vLLM findings explain a fuzz finding (``hkvsim fuzz`` against vLLM).

Most of what ``hkvsim fuzz --implementation vllm|both`` finds is already known: a documented
vLLM bug, a refusal of a release, a harness limit or a design difference (docs/vllm.md,
"Differences found", and reports/fuzz/README.md). This module names the one that explains a
finding, so a run can say how many of its findings are new.

An entry explains a finding only when both of these hold:

- **The deployment is the documented one.** Mode, model family, TP pair, block sizes, prefix
  hits, faults, and the releases the finding was seen in (:class:`Facts`).
- **The finding has the shape that bug leaves.** That is its kind (a corruption reported as
  success, an ``after_shutdown`` leak, a failure without faults that names the assert's
  location), and for a difference from hkvsim's core, the fields that differ and vLLM's outcome.

Nothing here decides what a run reports: every finding is still listed, with its
explanation. ``--allow-known`` only lets a run whose findings are all explained exit 0.

The limit: a new bug in the same deployment that leaves the same shape would be taken for the
known one. So an entry names its deployment as narrowly as the documentation allows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .implementations.vllm.engine import releases_between as _releases

__all__ = ["Facts", "KnownFinding", "KNOWN", "facts", "explain"]


@dataclass(frozen=True)
class Facts:
    """What a documented finding's deployment is made of, read from a parsed scenario."""

    mode: str  # pull | push
    is_mla: bool
    is_hybrid: bool
    kv_heads: int | None  # GQA KV heads (None for MLA)
    prefill_tp: int
    decode_tp: int
    prefill_instances: int
    prefill_block: int  # tokens per kernel block as configured (the backend's smallest if unset)
    decode_block: int
    decode_prefix_hits: bool  # decode has prefix caching on and some request asks for a hit
    faults: frozenset[tuple[str, str | None]]  # (kind, phase)
    # (kernel block, logical block) in tokens after page unification: hybrids' logical blocks
    # follow the state page, which shrinks with TP, so they can differ at equal kernel blocks
    prefill_blocks: tuple[int, int] = (0, 0)
    decode_blocks: tuple[int, int] = (0, 0)
    uneven_groups: bool = False  # a hybrid whose last cache group holds fewer layers
    # the file's own connector.transfer_extent (None: unset, so hkvsim's core ran beside vLLM
    # with the release's: hkvsim.implementations.diff.core_extent)
    transfer_extent: str | None = None

    @property
    def core_moved_allocated(self) -> bool:
        """Whether hkvsim's core ran with the reference extent beside vLLM 0.34.0 (the only
        release whose extent differs): only when the file chose it."""
        return self.transfer_extent == "allocated"

    @property
    def block_size_ratio(self) -> bool:
        return self.prefill_block != self.decode_block

    @property
    def block_geometry_differs(self) -> bool:
        """Kernel block or kernel blocks per logical block differ between the engines."""
        return self.prefill_blocks != self.decode_blocks

    @property
    def decode_blocks_larger(self) -> bool:
        return self.decode_block > self.prefill_block

    def has_fault(self, kind: str, *phases: str | None) -> bool:
        return any(k == kind and (not phases or p in phases) for k, p in self.faults)


def facts(scenario: Any) -> Facts:
    from .geometry.layout import has_uneven_group, unify_pages
    from .pd.deployment import engine_block_size, engine_model

    model = scenario.model_spec()
    hits = scenario.workload.prefix_hit_tokens

    def blocks(section: Any) -> tuple[int, tuple[int, int]]:
        """The block size asked for, and (kernel, logical) block after page unification."""
        engine = engine_model(model, section)
        block = engine_block_size(engine, section)
        return block, unify_pages(engine, section.tp, block)

    prefill_block, prefill_blocks = blocks(scenario.prefill)
    decode_block, decode_blocks = blocks(scenario.decode)
    return Facts(
        mode=scenario.connector.mode, is_mla=model.attention.is_mla, is_hybrid=model.is_hybrid,
        kv_heads=None if model.attention.is_mla else model.attention.num_kv_heads,
        prefill_tp=scenario.prefill.tp, decode_tp=scenario.decode.tp,
        prefill_instances=scenario.prefill.instances,
        prefill_block=prefill_block, decode_block=decode_block,
        decode_prefix_hits=bool(scenario.decode.prefix_caching and hits and any(hits)),
        faults=frozenset((f.kind, f.phase) for f in scenario.faults),
        prefill_blocks=prefill_blocks, decode_blocks=decode_blocks,
        uneven_groups=has_uneven_group(model),
        transfer_extent=(scenario.connector.transfer_extent
                         if "transfer_extent" in scenario.connector.model_fields_set else None))


# the shapes a finding can take (Finding.kind, plus its gist where the kind is not enough)
CORRUPTION = "corruption"  # reported successful with wrong bytes (not a stray write)
LEAK_AGENTS = "leak:after_shutdown"  # agents or prepared lists left behind at shutdown
LEAK_HELD = "leak:held"  # decode blocks or transfer handles still held (quarantined) at the end
HANG = "hang"  # requests never ended
REFUSED = "not-ok:handshake"  # a handshake refused without faults
LEASE = "not-ok:lease"  # without faults, every request completed but prefill's lease freed some
FAILED = "not-ok:failure"  # requests failed without faults, the detail naming `mentions`
DIFF = "diff"

_ACCOUNTING = frozenset({"descriptors", "nbytes", "per_rank", "sources", "transfers"})
_DAMAGE = frozenset({"outcome", "byte_exact", "wrong_regions"})
_FAILURE = frozenset({"status", "failure_class"})
_REFUSAL = _DAMAGE | _ACCOUNTING | _FAILURE | {"handshake"}


@dataclass(frozen=True)
class KnownFinding:
    name: str
    where: str  # where it is documented
    releases: frozenset[str] | None  # the vLLM releases it was seen in (None: every one)
    applies: Callable[[Facts], bool]
    shapes: frozenset[str]
    diff_fields: frozenset[str] = frozenset()  # fields a difference may show, no others
    vllm_outcomes: frozenset[str] | None = None  # vLLM's run outcome in a difference
    mentions: str | None = None  # FAILED: text the failure's detail must contain
    with_faults: frozenset[str] = frozenset()  # more fields a difference may show under faults
    outcome_with_faults: bool = True  # False: under faults vLLM's outcome is not checked
    same_outcomes: bool = False  # a difference only where both runs ended the same way
    moves_less: bool = False  # a difference only where vLLM moved fewer bytes in every request


def _any(*outcomes: str) -> frozenset[str]:
    return frozenset(outcomes)


KNOWN: tuple[KnownFinding, ...] = (
    KnownFinding(
        "mla-block-size-ratio-last-block",
        "docs/vllm.md: MLA with a block size ratio damages the last decode block",
        frozenset({"0.26.0"}) | _releases("0.32.0"),  # 0.27.0-0.31.0 byte-exact
        lambda f: f.mode == "pull" and f.is_mla and not f.is_hybrid and f.decode_blocks_larger,
        frozenset({CORRUPTION, DIFF}), _DAMAGE | _ACCOUNTING,
        with_faults=_FAILURE),
    KnownFinding(
        "block-size-ratio-tail-stale",
        "docs/vllm.md: 0.26.0 leaves the untransferred tail of a decode block stale",
        frozenset({"0.26.0"}),
        lambda f: f.mode == "pull" and not f.is_hybrid and f.decode_blocks_larger,
        frozenset({CORRUPTION, DIFF}), _DAMAGE, with_faults=_FAILURE | _ACCOUNTING),
    KnownFinding(
        "block-size-ratio-prefix-hit-shift",
        "docs/vllm.md: a decode prefix-cache hit with a block size ratio shifts the request",
        _releases("0.26.0", "0.33.0"),
        lambda f: (f.mode == "pull" and not f.is_hybrid and f.decode_blocks_larger
                   and f.decode_prefix_hits),
        frozenset({CORRUPTION, DIFF}), _DAMAGE | _ACCOUNTING,
        with_faults=_FAILURE),
    KnownFinding(
        "gqa-push-replicated-decode-heads",
        "docs/vllm.md: GQA push to a decode TP larger than the KV-head count corrupts silently",
        _releases("0.26.0", "0.33.0"),  # 0.34.0 refuses these pairs (next entry)
        lambda f: (f.mode == "push" and f.kv_heads is not None and f.decode_tp > f.kv_heads
                   and f.prefill_tp < f.decode_tp),
        frozenset({CORRUPTION, DIFF}), _DAMAGE | _ACCOUNTING,
        with_faults=_FAILURE),
    KnownFinding(
        "push-block-geometry-refused-0.34",
        "docs/vllm.md: 0.34.0 refuses push between engines of different kernel block size or "
        "kernel blocks per logical block (push_worker.py:149)",
        frozenset({"0.34.0"}),
        lambda f: f.mode == "push" and f.block_geometry_differs,
        frozenset({REFUSED, DIFF}), _REFUSAL, vllm_outcomes=_any("handshake-error")),
    KnownFinding(
        "push-block-size-ratio-refused",
        "docs/vllm.md: push with a block size ratio is refused at prefill's reverse handshake",
        _releases("0.26.0", "0.33.0"),  # 0.34.0: the entry before
        lambda f: f.mode == "push" and f.block_size_ratio,
        frozenset({LEAK_AGENTS, REFUSED, DIFF}), _REFUSAL,
        vllm_outcomes=_any("handshake-error")),
    KnownFinding(
        "hybrid-pull-block-size-ratio-refused",
        "docs/vllm.md: 0.26.0 refuses a hybrid pull with a block size ratio (base_worker.py:1716)",
        frozenset({"0.26.0"}),
        lambda f: f.mode == "pull" and f.is_hybrid and f.block_size_ratio,
        frozenset({LEAK_AGENTS, REFUSED, DIFF}), _REFUSAL,
        vllm_outcomes=_any("handshake-error")),
    KnownFinding(
        "hybrid-failed-read-reported-loaded",
        "docs/vllm.md: a READ that fails on a hybrid model is reported as loaded",
        _releases("0.26.0"),
        lambda f: (f.mode == "pull" and f.is_hybrid
                   and (f.has_fault("fail-transfer") or f.has_fault("stall-transfer"))),
        frozenset({CORRUPTION, DIFF}), _DAMAGE | _ACCOUNTING | _FAILURE),
    KnownFinding(
        "pr49762-hybrid-mla-pull-assert",
        "docs/vllm.md: the #49762 scenarios (0.26.0 asserts at pull_worker.py:167)",
        frozenset({"0.26.0"}),
        lambda f: (f.mode == "pull" and f.is_hybrid and f.is_mla
                   and f.prefill_tp > f.decode_tp),
        frozenset({FAILED, DIFF}), _DAMAGE | _ACCOUNTING | _FAILURE,
        vllm_outcomes=_any("request-failure"), mentions="pull_worker.py:167",
        outcome_with_faults=False),
    KnownFinding(
        "pr49762-hybrid-mla-push-assert",
        "docs/vllm.md: the #49762 scenarios (0.26.0 asserts at push_worker.py:518)",
        frozenset({"0.26.0"}),
        lambda f: (f.mode == "push" and f.is_hybrid and f.is_mla
                   and f.prefill_tp < f.decode_tp),
        frozenset({FAILED, DIFF}), _DAMAGE | _ACCOUNTING | _FAILURE,
        vllm_outcomes=_any("request-failure"), mentions="push_worker.py:518",
        outcome_with_faults=False),
    KnownFinding(
        "push-failed-write-unreported-0.26",
        "docs/vllm.md: 0.26.0 to 0.29.0 never report a push WRITE that failed (a failed push "
        "WRITE went unseen)",
        _releases("0.26.0", "0.29.0"),
        lambda f: (f.mode == "push"  # a WRITE that fails, stalls, or whose post raises
                   and any(f.has_fault(k) for k in ("fail-transfer", "stall-transfer",
                                                     "disconnect-peer", "kill-rank"))),
        # its requests end failed, or never, but not with wrong bytes
        frozenset({HANG, LEAK_HELD, DIFF}),
        frozenset({"outcome", "byte_exact"}) | _ACCOUNTING | _FAILURE),
    KnownFinding(
        "push-post-failure-unreported-0.30",
        "docs/vllm.md: 0.30.0 never reports a push WRITE whose post raised (decode's watchdog "
        "calls it a stall)",
        frozenset({"0.30.0"}),
        lambda f: (f.mode == "push"  # a post that raises
                   and (f.has_fault("fail-transfer", "setup") or f.has_fault("disconnect-peer"))),
        # the request fails as a stall instead, never with wrong bytes
        frozenset({DIFF}), frozenset({"outcome"}) | _ACCOUNTING | _FAILURE),
    KnownFinding(
        "push-sent-unreported-0.30",
        "docs/vllm.md: 0.30.0 never reports a finished push as sent: decode gets every byte, "
        "prefill's blocks wait for the lease (finding-push-sent-unreported-0.30.toml)",
        frozenset({"0.30.0"}),
        lambda f: f.mode == "push",
        # vLLM's outcome lease-expired (or, under faults, what the faults made it), and no
        # transfer counted for the requests it completed (fewer bytes): never wrong bytes
        frozenset({LEASE, DIFF}), frozenset({"outcome"}) | _ACCOUNTING,
        vllm_outcomes=_any("lease-expired", "request-failure"), moves_less=True),
    KnownFinding(
        "pull-second-read-check-assert",
        "docs/vllm.md: 0.26.0 to 0.29.0 assert when a second READ of a request they already "
        "failed reports its raising check (finding-pull-poll-exception-two-reads.toml)",
        _releases("0.26.0", "0.29.0"),
        # a decode rank posts more than one READ per request: every prefill rank of a larger
        # TP (each holds part of the heads, or of the state), but pure MLA reads one
        lambda f: (f.mode == "pull" and f.has_fault("fail-transfer", "poll")
                   and f.prefill_tp > f.decode_tp and not (f.is_mla and not f.is_hybrid)),
        # other requests fail (or are recomputed) by vLLM's assert: never wrong bytes
        frozenset({DIFF}), frozenset({"outcome"}) | _ACCOUNTING | _FAILURE),
    KnownFinding(
        "pull-peer-death-assert-0.29",
        "docs/vllm.md: 0.29.0 asserts on the decode rank that saw a prefill peer die during its "
        "post, failing that rank's other requests (finding-peer-death-assert-0.29.toml)",
        frozenset({"0.29.0"}),
        lambda f: f.mode == "pull" and f.has_fault("disconnect-peer"),
        # other requests fail (or are recomputed) by vLLM's assert: never wrong bytes
        frozenset({DIFF}), frozenset({"outcome", "byte_exact"}) | _ACCOUNTING | _FAILURE),
    KnownFinding(
        "push-partial-prefix-hit-0.26",
        "docs/vllm.md: push after a partial decode prefix-cache hit corrupts in 0.26.0 and 0.27.0",
        frozenset({"0.26.0", "0.27.0"}),
        lambda f: f.mode == "push" and f.decode_prefix_hits,
        frozenset({CORRUPTION, DIFF}), _DAMAGE, with_faults=_FAILURE | _ACCOUNTING),
    KnownFinding(
        "block-size-ratio-local-list-leak-0.26",
        "docs/vllm.md: 0.26.0 leaks a prepared local list per extra remote rank of a smaller "
        "block size",
        frozenset({"0.26.0"}),
        lambda f: (f.mode == "pull" and f.decode_blocks_larger
                   and (f.prefill_tp > f.decode_tp or f.prefill_instances > 1)),
        frozenset({LEAK_AGENTS})),
    KnownFinding(
        "harness-push-early-abort-not-driven",
        "docs/vllm.md: not driven yet: push with decode aborting before scheduling or during "
        "the handshake (a harness limit)",
        None,
        lambda f: (f.mode == "push"
                   and f.has_fault("abort-request", "before-scheduling", "during-handshake")),
        frozenset({DIFF}), frozenset({"outcome"}) | _ACCOUNTING),
    KnownFinding(
        "unheld-state-slots-0.34",
        "docs/vllm.md: 0.34.0 moves no state for cache-group slots that hold no layer (a "
        "difference in bytes moved, no corruption), where the file ran hkvsim's core with "
        "transfer_extent \"allocated\" (beside 0.34.0 it otherwise moves what 0.34.0 moves)",
        frozenset({"0.34.0"}),
        lambda f: f.is_hybrid and f.uneven_groups and f.core_moved_allocated,
        frozenset({DIFF}), _ACCOUNTING, same_outcomes=True, moves_less=True),
    KnownFinding(
        "sub-blocks-past-last-token-0.34",
        "docs/vllm.md: 0.34.0 pairs blocks of different sizes by the last token and moves no "
        "kernel block past it (a difference in bytes moved, no corruption), where the file ran "
        "hkvsim's core with transfer_extent \"allocated\"",
        frozenset({"0.34.0"}),
        lambda f: (f.mode == "pull" and f.is_hybrid and f.block_geometry_differs
                   and f.core_moved_allocated),
        frozenset({DIFF}), _ACCOUNTING, same_outcomes=True, moves_less=True),
    KnownFinding(
        "design-push-registration-dropped",
        "reports/fuzz/README.md: hkvsim's coordinator drops a push registration of a request "
        "decode gave up on; vLLM's prefill writes it (a design difference, no corruption)",
        None,
        lambda f: (f.mode == "push" and f.prefill_tp > 1
                   and any(f.has_fault(k) for k in ("fail-transfer", "stall-transfer",
                                                     "disconnect-peer", "kill-rank"))),
        frozenset({DIFF}), _ACCOUNTING, same_outcomes=True),
)


def _shape(finding: Any) -> str | None:
    if finding.kind == "corruption":
        return CORRUPTION if "wrong bytes" in finding.signature else None
    if finding.kind == "leak":
        what = set(finding.signature.split(" | ")[0].split("leak: ", 1)[1].split(", "))
        if what == {"after_shutdown"}:
            return LEAK_AGENTS
        held = {"decode_blocks", "open_handles", "quarantined_blocks"}
        return LEAK_HELD if what <= held else None
    if finding.kind == "hang":
        return HANG
    if finding.kind == "not-ok":
        if "handshake refused" in finding.signature:
            return REFUSED
        return LEASE if ": lease-expired (lease expired)" in finding.signature else FAILED
    if finding.kind == "diff":
        return DIFF
    return None  # crashes, timeouts, stray writes, nondeterminism: never known


def explain(finding: Any, f: Facts, version: str | None) -> str | None:
    """The name of the documented finding that explains ``finding`` (a fuzz Finding of vLLM's
    run or of a difference) in deployment ``f`` under vLLM ``version``, or None: new. Where
    two entries fit, the first in :data:`KNOWN` wins (the narrower shape comes first)."""
    if finding.implementation == "hkvsim":
        return None  # hkvsim's own findings are never excused
    shape = _shape(finding)
    if shape is None:
        return None
    faulty = bool(f.faults)
    for known in KNOWN:
        if known.releases is not None and version not in known.releases:
            continue
        if shape not in known.shapes or not known.applies(f):
            continue
        if shape == FAILED and (known.mentions is None or known.mentions not in finding.detail):
            continue
        if shape == DIFF:
            allowed = known.diff_fields | (known.with_faults if faulty else frozenset())
            if not set(finding.fields) <= allowed:
                continue
            checks_outcome = known.vllm_outcomes is not None and (
                not faulty or known.outcome_with_faults)
            if checks_outcome and (finding.outcomes is None
                                   or finding.outcomes[1] not in known.vllm_outcomes):
                continue
            if known.same_outcomes and (finding.outcomes is None
                                        or finding.outcomes[0] != finding.outcomes[1]):
                continue
            if known.moves_less and finding.vllm_moved_less is not True:
                continue
        return known.name
    return None
