"""Every quirk (a replay of a real connector bug) is caught by a scenario under scenarios/quirks.

For each quirk, ``scenarios/quirks/<quirk>.toml`` (or ``xfail-<quirk>.toml``) meets its
expectation as written and fails it with the quirk switched on. A quirk added without such a
scenario fails this test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hkvsim.cluster import run_scenario
from hkvsim.connector.quirks import QUIRKS, check_quirks, quirk_names
from hkvsim.pd.records import RankSetupError
from hkvsim.results import expectation_problems, result_json
from hkvsim.scenario import Scenario, load_scenarios

QUIRK_DIR = Path(__file__).resolve().parents[1] / "scenarios" / "quirks"


def _catching_scenario(quirk: str) -> Scenario:
    candidates = [QUIRK_DIR / f"{quirk}.toml", QUIRK_DIR / f"xfail-{quirk}.toml"]
    found = [p for p in candidates if p.exists()]
    assert found, f"quirk {quirk!r} has no catching scenario in {QUIRK_DIR}"
    (scenario,) = load_scenarios(found[0])
    return scenario


def _with_quirk(scenario: Scenario, quirk: str) -> Scenario:
    connector = scenario.connector.model_copy(update={"quirks": (*scenario.connector.quirks, quirk)})
    return scenario.model_copy(update={"connector": connector})


@pytest.mark.parametrize("quirk", sorted(QUIRKS))
def test_quirk_is_caught(quirk: str) -> None:
    scenario = _catching_scenario(quirk)
    assert quirk not in scenario.connector.quirks
    clean = run_scenario(scenario)
    assert expectation_problems(clean) == [], "the catching scenario must pass without the quirk"
    try:
        buggy = run_scenario(_with_quirk(scenario, quirk))
    except RankSetupError as exc:  # caught loudly: a rank could not register its cache
        assert "outside the registered memory" in str(exc), exc
        return
    problems = expectation_problems(buggy)
    assert problems, f"quirk {quirk!r} went unnoticed"
    data = result_json(buggy)
    # an explanation a connector engineer recognises: a semantic mismatch, a failure reason,
    # a wrong accept, or prefill freed by its lease
    explained = (data["mismatches"] or data["failures"] or data["requests"]["freed_by_lease"]
                 or data["misplaced_writes"]
                 or (scenario.expect.outcome == "handshake-error" and not buggy.handshake_errors))
    assert explained, problems


def test_every_quirk_file_names_a_quirk() -> None:
    names = {p.stem.removeprefix("xfail-") for p in QUIRK_DIR.glob("*.toml")}
    assert names == set(QUIRKS)


def test_a_corrupted_request_counts_every_wrong_word_and_explains_eight() -> None:
    # attention-only-transfer leaves all of decode's state unwritten: every state word of each
    # request on each of decode's two ranks is wrong (the geometry's state bytes / 8 per rank),
    # and the record keeps the first eight explanations of all its ranks together (each rank
    # reports up to eight), not an unbounded list
    scenario = _catching_scenario("attention-only-transfer")
    scenario = scenario.model_copy(update={"decode": scenario.decode.model_copy(update={"tp": 2})})
    buggy = run_scenario(_with_quirk(scenario, "attention-only-transfer"))
    assert buggy.outcome == "corruption" and buggy.corrupted == len(buggy.records) == 2
    state_words = 2 * scenario.model_spec().state_bytes_per_request(2) // 8
    for record in buggy.records:
        assert record.mismatched_words == state_words
        assert len(record.mismatches) == 8
        assert record.mismatches[0].startswith("decode0 rank 0, layer 0 (conv[0] state)")


def test_unknown_quirk_names_are_refused_with_the_allowed_ones() -> None:
    # the scenario schema refuses them first; a rank process builds its settings from the
    # scenario it is sent, through this check alone
    assert check_quirks(["phantom-token"]) == frozenset({"phantom-token"})
    assert check_quirks([]) == frozenset()
    with pytest.raises(ValueError) as exc:
        check_quirks(["phantom-token", "no-such-quirk", "other"])
    assert str(exc.value) == (f"unknown quirk(s) 'no-such-quirk', 'other'; allowed: "
                              f"{', '.join(quirk_names())}")
    assert quirk_names() == sorted(QUIRKS) and "phantom-token" in quirk_names()


@pytest.mark.parametrize(("decode_block", "wrong_words"), [
    # decode block 32 = 2 sub-blocks; the last (tokens 736..767) received 1: latent from
    # element 32 (word 8) zeroed: token 736 loses 8 words, tokens 752..767 keep 8 stale
    (32, 4 * (1 * 8 + 16 * 8)),
    # decode block 64 = 4 sub-blocks; the last (704..767) received 3: from element 48 (word
    # 12): tokens 704..736 lose 4 words each, tokens 752..767 keep 12 stale
    (64, 4 * (33 * 4 + 16 * 12)),
])
def test_mla_tail_quirk_zeroes_along_the_latent_not_the_tokens(decode_block: int,
                                                              wrong_words: int) -> None:
    """vLLM 0.33.0's receive post-process on an MLA cache (docs/vllm.md): what the replay
    damages, counted from the geometry by hand: tiny-deepseek rows are 64 bf16 latent
    elements (16 words) per token and layer, 4 layers; 737 tokens send 47 prefill blocks of 16
    (tokens 0..751), decode checks tokens 0..736 and that 752..767 are zero."""
    scenario = _catching_scenario("mla-bsr-tail-zero-latent")
    scenario = scenario.model_copy(update={
        "decode": scenario.decode.model_copy(update={"tp": 1, "block_size": decode_block})})
    buggy = run_scenario(_with_quirk(scenario, "mla-bsr-tail-zero-latent"))
    first, whole = buggy.records
    assert first.status == "ok" and first.mismatched_words == wrong_words
    assert whole.mismatched_words == 0  # 768 tokens: whole decode blocks, nothing zeroed
    received = [m for m in first.mismatches if "(MLA)," in m]
    tail = [m for m in first.mismatches if "(MLA untransferred tail)" in m]
    assert len(received) == len(tail) == 4  # every layer
    assert all(f"tokens {736 if decode_block == 32 else 704}..736:" in m for m in received)
    assert all("tokens 752..767 (must be zeroed)" in m for m in tail)
    assert run_scenario(scenario).mismatched_bytes == 0  # the core without the quirk: exact


def test_failed_read_quirk_applies_to_hybrids_only() -> None:
    """vLLM records load errors for models without its hybrid memory allocator (a failed READ
    of tiny-deepseek fails its request under vLLM too): the replay must not hide those."""
    scenario = _catching_scenario("hybrid-failed-read-reported-loaded")
    scenario = scenario.model_copy(update={"model": scenario.model.model_copy(
        update={"preset": "tiny-deepseek"})})
    buggy = run_scenario(_with_quirk(scenario, "hybrid-failed-read-reported-loaded"))
    assert [r.status for r in buggy.records] == ["ok", "failed", "ok"]
    assert buggy.records[1].failure_class == "transfer_failed" and buggy.mismatched_bytes == 0
