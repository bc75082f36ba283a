"""Known connector bugs (hkvsim quirks, docs/semantics.md §3.2, §6, §7, §9.5) replayed end to end: each
one must be caught (never outcome "ok"), and the same scenario without the quirk is clean."""

from __future__ import annotations

import pytest

from hkvsim.pd.records import RankSetupError

from ._helpers import run, scenario_text

CASES = [
    # §3.2: first-registered-wins. The KDA view wins every KimiLinear-style region: attention
    # descriptor k addresses k x unified page, out of range beyond num_blocks/ppl -> the
    # transport refuses the rank's own list (outside its registered memory) when the connector
    # prepares it at registration, on both backends (NIXL: NOT_FOUND): the run cannot start.
    pytest.param("first-registration-mla-flag", 2, 1, "0", False, {"rank-setup-refused"},
                 id="first-registration-mla-flag"),
    # §6: remote ids expanded with the local ppl (Qwen3.5 4P2D)
    pytest.param("local-ppl-remote-expansion", 1, 2, "0", False,
                 {"corruption", "request-failure"}, id="local-ppl-remote-expansion"),
    # §9.5 scenario 7: only the MLA half moves; decode runs from zeroed state
    pytest.param("attention-only-transfer", 1, 1, "0", False, {"corruption"},
                 id="attention-only-transfer"),
    # §7: front-trim with prefix caching and heterogeneous ppl (P ppl 5, D ppl 10)
    pytest.param("front-trim-with-prefix-cache", 2, 1, "[0, 700, 5]", True, {"corruption"},
                 id="front-trim-with-prefix-cache"),
]


def _text(quirk, p_tp, d_tp, hits, prefix_caching):
    quirks = f'quirks = ["{quirk}"]' if quirk else ""
    return scenario_text(model="tiny-kimi-linear", p_tp=p_tp, d_tp=d_tp, requests=3,
                         prompt_tokens="[1000, 1500, 700]", prefix_hit_tokens=hits,
                         d_extra="prefix_caching = true" if prefix_caching else "",
                         connector=quirks)


@pytest.mark.parametrize("quirk,p_tp,d_tp,hits,prefix_caching,caught", CASES)
def test_quirk_is_caught(quirk, p_tp, d_tp, hits, prefix_caching, caught):
    if caught == {"rank-setup-refused"}:
        with pytest.raises(RankSetupError, match="outside the registered memory"):
            run(_text(quirk, p_tp, d_tp, hits, prefix_caching))
        return
    result = run(_text(quirk, p_tp, d_tp, hits, prefix_caching))
    assert result.outcome in caught
    assert result.hung == 0
    if result.outcome == "corruption":  # wrong bytes seen by the oracle, or misplaced writes
        assert (sum(r.mismatched_words for r in result.records) > 0
                or result.stray_writes + result.late_landings > 0)
        assert any(r.mismatches for r in result.records) or result.misplaced_write_reports


@pytest.mark.parametrize("quirk,p_tp,d_tp,hits,prefix_caching,caught", CASES[:3])
def test_same_scenario_without_the_quirk_is_clean(quirk, p_tp, d_tp, hits, prefix_caching,
                                                  caught):
    result = run(_text(None, p_tp, d_tp, hits, prefix_caching))
    assert result.outcome == "ok"
    assert sum(r.mismatched_words for r in result.records) == 0


def test_front_trim_scenario_without_the_quirk_is_refused_at_handshake():
    # §7: "So V4 rejects the pair at handshake."
    result = run(_text(None, 2, 1, "[0, 700, 5]", True))
    assert result.outcome == "handshake-error"
    assert "V4:" in result.handshake_errors[0]


def test_attention_only_transfer_zeroes_state():
    result = run(_text("attention-only-transfer", 1, 1, "0", False))
    text = " ".join(m for r in result.records for m in r.mismatches)
    assert "state" in text and "zeros" in text


@pytest.mark.parametrize("quirk,outcome", [(None, "ok"),
                                           ("notify-with-decode-request-id", "lease-expired")])
def test_pure_mla_notification_only_ranks(quirk, outcome):
    # §8.1 "P_TP > D_TP, pure MLA: one rank (tp_rank*P_TP/D_TP); notification-only to the other
    # handshaked P ranks, using P's request id". With decode's id the unread P ranks never
    # match it and free only at lease expiry.
    quirks = f'quirks = ["{quirk}"]' if quirk else ""
    result = run(scenario_text(model="tiny-deepseek", p_tp=4, d_tp=1, requests=2,
                               prompt_tokens="[300, 1000]", connector=quirks))
    assert result.outcome == outcome
    assert [r.transfers for r in result.records] == [1, 1]  # one READ, from P0 only
    assert all(r.mismatched_words == 0 for r in result.records)
