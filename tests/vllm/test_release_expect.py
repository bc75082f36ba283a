"""The releases hkvsim's fuzz entries (hkvsim/fuzz_known.py) name for a vLLM finding are the
releases the tests of tests/vllm record it in (release_expect.py), which each release's own run
checks. Runs in the ordinary suite (no vLLM needed): an entry that forgets a release would call
that release's documented finding new, one that names a release too many would excuse a
difference there."""

from __future__ import annotations

import pytest

from hkvsim.fuzz_known import KNOWN
from hkvsim.implementations.vllm.engine import SUPPORTED_VERSIONS
from release_expect import (
    ASSERTS_BEFORE_49762,
    BSR_PREFIX_HIT_SHIFTED,
    HYBRID_FAILED_READ_LOADED,
    MLA_BSR_DAMAGE,
    PEER_DEATH_ASSERT,
    PUSH_FAILURE_UNREPORTED,
    PUSH_GEOMETRY_REFUSED,
    PUSH_POST_FAILURE_UNREPORTED,
    PUSH_PREFIX_HEAD_TRIM,
    PUSH_SENT_UNREPORTED,
    RELEASES,
    SECOND_READ_CHECK_ASSERT,
    releases,
)

# fuzz entry -> the releases the tests record the finding in
RECORDED = {
    "mla-block-size-ratio-last-block": {v for v, damage in MLA_BSR_DAMAGE.items() if damage},
    "block-size-ratio-tail-stale": {v for v, damage in MLA_BSR_DAMAGE.items()
                                    if damage == "tail"},
    "block-size-ratio-prefix-hit-shift": {v for v, shifted in BSR_PREFIX_HIT_SHIFTED.items()
                                          if shifted},
    "hybrid-failed-read-reported-loaded": set(HYBRID_FAILED_READ_LOADED),
    "push-failed-write-unreported-0.26": set(PUSH_FAILURE_UNREPORTED),
    # 0.26.0 to 0.29.0 leave every failed WRITE unreported (the entry above): 0.30.0 only those
    # whose post raised
    "push-post-failure-unreported-0.30": PUSH_POST_FAILURE_UNREPORTED - PUSH_FAILURE_UNREPORTED,
    "push-sent-unreported-0.30": set(PUSH_SENT_UNREPORTED),
    "pull-second-read-check-assert": {v for v, where in SECOND_READ_CHECK_ASSERT.items()
                                      if where},
    "pull-peer-death-assert-0.29": {v for v, where in PEER_DEATH_ASSERT.items() if where},
    "push-partial-prefix-hit-0.26": set(PUSH_PREFIX_HEAD_TRIM),
    # 0.34.0 refuses every push between engines of different block geometry; before it, a block
    # size ratio was refused at the reverse handshake and GQA above the KV heads corrupted
    "push-block-geometry-refused-0.34": set(PUSH_GEOMETRY_REFUSED),
    "push-block-size-ratio-refused": set(RELEASES) - PUSH_GEOMETRY_REFUSED,
    "gqa-push-replicated-decode-heads": set(RELEASES) - PUSH_GEOMETRY_REFUSED,
    "pr49762-hybrid-mla-pull-assert": set(ASSERTS_BEFORE_49762),
    "pr49762-hybrid-mla-push-assert": set(ASSERTS_BEFORE_49762),
}


def test_release_expectations_cover_every_driven_release() -> None:
    assert RELEASES == SUPPORTED_VERSIONS
    assert releases("0.28.0", "0.31.0") == {"0.28.0", "0.29.0", "0.30.0", "0.31.0"}
    assert releases("0.34.0") == {"0.34.0"}
    with pytest.raises(ValueError):
        releases("0.25.0")


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_a_fuzz_entry_names_the_releases_the_tests_record(name: str) -> None:
    (known,) = [k for k in KNOWN if k.name == name]
    assert known.releases is not None and set(known.releases) == RECORDED[name], (
        name, sorted(known.releases or ()), sorted(RECORDED[name]))
