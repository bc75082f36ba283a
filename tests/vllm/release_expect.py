"""What a vLLM release does where it differs from the others, shared by the tests of tests/vllm."""

from __future__ import annotations

from hkvsim.implementations.vllm.engine import releases_between as releases  # the driven ones

# vLLM 0.34.0's push handshake refuses engines whose kernel block size or kernel blocks per
# logical block differ (push_worker.py: "NixlPushConnector requires identical P/D block
# sizes"); earlier releases refused only a kernel block size ratio
PUSH_GEOMETRY_034 = "push_worker.py:149: NotImplementedError: NixlPushConnector requires " \
                    "identical P/D block sizes"


# the releases whose push handshake refuses engines of different block geometry
PUSH_GEOMETRY_REFUSED = frozenset({"0.34.0"})


def push_refused(scenario, version: str) -> bool:
    """Does ``version``'s push handshake refuse ``scenario`` for its block geometry (kernel
    block or kernel blocks per logical block differ between the two sides: a hybrid's logical
    block follows its state page, which shrinks with TP)?"""
    from hkvsim.fuzz_known import facts

    return (version in PUSH_GEOMETRY_REFUSED and scenario.connector.mode == "push"
            and facts(scenario).block_geometry_differs)


def assert_push_refused_by_034(result, name: str) -> None:
    """0.34.0 refuses the push at prefill's handshake with decode, naming its check; every
    request fails as a handshake failure, no byte is moved or corrupted."""
    assert result.outcome == "handshake-error", (name, result.outcome)
    assert result.handshake_errors and all(PUSH_GEOMETRY_034 in e
                                           for e in result.handshake_errors), (
        name, result.handshake_errors)
    assert all(r.status == "failed" and r.failure_class == "handshake_failed"
               for r in result.records), name
    assert result.corrupted == 0 and result.leaks["after_shutdown"] == 0, name


# Every release the harness drives, oldest first: the tests' own record, which
# test_release_expect holds equal to SUPPORTED_VERSIONS (over which `releases(first, last)`
# ranges); each was run through these tests (scripts/vllm-releases, reports/vllm-releases/; CI
# runs 0.26.0, 0.27.0, 0.33.0 and 0.34.0).
RELEASES = ("0.26.0", "0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0",
            "0.34.0")


# Releases that share a behaviour where the releases part ways (docs/vllm.md, "Release by
# release"). 0.27.0, the first release after #49762 on PyPI, keeps 0.26.0's push failure
# handling and 0.33.0's prefix-hit shift, and its MLA pull with a block size ratio is byte-exact.
# a push WRITE that ends in ERR, or whose post or check raises, is never reported failed:
# decode's watchdog calls it a stall and the next poll on that prefill rank asserts ("not found
# in recving_metadata")
PUSH_FAILURE_UNREPORTED = releases("0.26.0", "0.29.0")
# a push WRITE whose post raised is never reported failed either (vLLM releases its handle and
# leaves the request to the lease and to decode's watchdog, which calls it a stall): up to
# 0.30.0, which reports a WRITE that ended in ERR or whose check raised as 0.31.0 does
PUSH_POST_FAILURE_UNREPORTED = releases("0.26.0", "0.30.0")
# a push whose WRITEs all finished is never reported sent on prefill's side (its push worker
# keeps a finished WRITE only for a request in _recving_metadata, which only decode fills;
# fixed in 0.31.0): decode gets every byte and finishes, prefill holds the request's blocks
# until its lease expires (finding-push-sent-unreported-0.30.toml)
PUSH_SENT_UNREPORTED = frozenset({"0.30.0"})
# a failed READ of a hybrid counts as loaded (finding-hybrid-failed-transfer.toml)
HYBRID_FAILED_READ_LOADED = frozenset(RELEASES)
# MLA with a block size ratio, a half-covered last decode block: "latent" (the received tokens'
# latent vector cut and the tail stale), "tail" (the untransferred tail left stale), None
# (byte-exact)
MLA_BSR_DAMAGE = {"0.26.0": "tail", **dict.fromkeys(releases("0.27.0", "0.31.0")),
                  **dict.fromkeys(releases("0.32.0"), "latent")}
# a pull after a decode prefix hit with a block size ratio: the requests vLLM shifts by a
# prefill block (finding-bsr-prefix-hit.toml; 0.26.0 also leaves request 2's tail stale)
BSR_PREFIX_HIT_SHIFTED = {"0.26.0": [0, 2], **{v: [0] for v in releases("0.27.0", "0.33.0")},
                          "0.34.0": []}
# push after a partial decode prefix hit head-trims prefill's list: silent corruption
PUSH_PREFIX_HEAD_TRIM = releases("0.26.0", "0.27.0")
# a decode rank with two READs of a request whose checks both raise: where the second check
# asserts ("not found in recving_metadata list"), None where the request fails alone
SECOND_READ_CHECK_ASSERT = {"0.26.0": "base_worker.py:1985", "0.27.0": "base_worker.py:2081",
                            "0.28.0": "base_worker.py:2095", "0.29.0": "base_worker.py:2245",
                            "0.30.0": None,
                            **dict.fromkeys(releases("0.31.0"))}
# a prefill peer that dies as a decode rank posts to it: where that rank then asserts for the
# requests it is receiving from other prefill instances, None where it fails the one request
PEER_DEATH_ASSERT = {"0.29.0": "base_worker.py:2245",
                     **dict.fromkeys(set(RELEASES) - {"0.29.0"})}
# the #49762 asserts: a hybrid pull with prefill TP > decode TP (pull_worker.py:167) and a
# hybrid MLA push with prefill TP < decode TP (push_worker.py:518)
ASSERTS_BEFORE_49762 = frozenset({"0.26.0"})


def push_sent_unreported(result) -> bool:
    """``result`` is a push run by vLLM's connector under a release of PUSH_SENT_UNREPORTED."""
    return (result.scenario.connector.mode == "push"
            and result.implementation.get("name") == "vllm"
            and result.implementation.get("version") in PUSH_SENT_UNREPORTED)


def completed_outcome(result) -> str:
    """The outcome of a run whose every request completed byte-exact: "ok", or, for a push under
    a release that never reports a push sent, "lease-expired" (every request's prefill blocks
    freed by its lease instead of on completion)."""
    return "lease-expired" if push_sent_unreported(result) else "ok"


def completed_as_released(result) -> bool:
    """Every request completed byte-exact, as the release completes a request it moved whole.
    Where the release never reports a push sent: the outcome "lease-expired", each request's
    prefill blocks freed by its lease and no transfer counted (hkvsim counts a request's
    transfers when its connector reports them). Elsewhere: "ok", bytes counted, no lease. No
    blocks left held either way (vLLM releases the WRITEs' handles, so decode's are reused)."""
    held = push_sent_unreported(result)
    return (result.outcome == completed_outcome(result) and result.verified
            and result.corrupted == 0 and bool(result.records)
            and all(r.status == "ok" and r.mismatched_words == 0 and r.freed_by_lease == held
                    and (r.transfers == r.nbytes == 0 if held else r.nbytes > 0)
                    for r in result.records)
            and result.leaks["decode_blocks"] == result.leaks["prefill_blocks"] == 0)


_COUNTED = frozenset({"transfers", "descriptors", "nbytes", "sources", "per_rank"})


def without_unreported_push(result, found: list) -> list:
    """hkvsim's core beside vLLM (``compare_results``): the differences left once, where the
    release never reports a push sent, the run's outcome ("lease-expired" against "ok") and,
    for each request it completed and whose prefill blocks its lease freed, the counts of the
    transfers vLLM never reported (none on its side) are set aside."""
    if not push_sent_unreported(result):
        return found
    held = {i for i, r in enumerate(result.records) if r.status == "ok" and r.freed_by_lease}
    return [d for d in found
            if not (d.request is None and d.field == "outcome"
                    and (d.hkvsim, d.vllm) == ("ok", "lease-expired"))
            and not (d.request in held and d.field in _COUNTED and not d.vllm)]
assert set(MLA_BSR_DAMAGE) == set(BSR_PREFIX_HIT_SHIFTED) == set(SECOND_READ_CHECK_ASSERT) \
    == set(PEER_DEATH_ASSERT) == set(RELEASES)

