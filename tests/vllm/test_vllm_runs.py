"""vLLM's own pull worker on the simulated fabric, checked by hkvsim's oracle."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import types
from pathlib import Path

import pytest

from hkvsim.cli import main
from hkvsim.cluster import run_scenario
from hkvsim.implementations.vllm.engine import release_workers
from hkvsim.scenario import ScenarioError, load_scenarios
from release_expect import (
    BSR_PREFIX_HIT_SHIFTED,
    HYBRID_FAILED_READ_LOADED,
    MLA_BSR_DAMAGE,
    PEER_DEATH_ASSERT,
    PUSH_FAILURE_UNREPORTED,
    PUSH_GEOMETRY_034,
    PUSH_GEOMETRY_REFUSED,
    PUSH_POST_FAILURE_UNREPORTED,
    RELEASES,
    SECOND_READ_CHECK_ASSERT,
    assert_push_refused_by_034,
    completed_as_released,
    completed_outcome,
    push_refused,
    push_sent_unreported,
    releases,
    without_unreported_push,
)

ROOT = Path(__file__).resolve().parents[2]
MATRIX = ROOT / "scenarios" / "vllm" / "tp-matrix-tiny-deepseek.toml"


def _scenario(text: str, tmp_path: Path, name: str = "s.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


PULL = """
[scenario]
name = "t"
seed = 5
[model]
preset = "tiny-deepseek"
[connector]
implementation = "vllm"
[prefill]
tp = {p}
block_size = 64
[decode]
tp = {d}
block_size = 64
[workload]
requests = 2
prompt_tokens = 200
"""


@pytest.mark.timeout(600)
def test_tp_matrix_is_byte_exact_under_vllm(vllm_required: str) -> None:
    scenarios = load_scenarios(MATRIX)
    assert len(scenarios) == 32
    for s in scenarios:
        result = run_scenario(s)
        assert result.implementation == {"name": "vllm", "version": vllm_required}
        assert result.verified and result.outcome == "ok", (s.scenario.name, result.outcome)
        assert all(r.status == "ok" and r.mismatched_words == 0 and r.nbytes > 0
                   for r in result.records), s.scenario.name
        assert result.leaks["after_shutdown"] == 0 and result.leaks["open_handles"] == 0


def test_json_records_the_vllm_release_and_runs_reproduce(vllm_required: str, tmp_path: Path,
                                                          capsys) -> None:
    path = _scenario(PULL.format(p=2, d=4), tmp_path)
    outs = []
    for _ in range(2):
        assert main(["run", str(path), "--json", "--requests"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]  # same bytes, same simulated times
    data = json.loads(outs[0])
    assert data["implementation"] == {"name": "vllm", "version": vllm_required}
    assert data["requests"]["byte_exact"] == 2 and data["outcome"] == "ok"


def test_a_misrouted_block_is_caught_by_the_oracle(vllm_required: str, tmp_path: Path,
                                                   monkeypatch) -> None:
    # planted bug: the adapter hands vLLM prefill's block ids in reverse order; vLLM's READs
    # all complete, and only hkvsim's independent oracle can tell
    from hkvsim.implementations.vllm import worker

    real = worker.VllmConnectorWorker.start_read

    def reversed_blocks(self, req):
        flipped = {g: ids[::-1] for g, ids in req.prefill_blocks.items()}
        return real(self, dataclasses.replace(req, prefill_blocks=flipped))

    monkeypatch.setattr(worker.VllmConnectorWorker, "start_read", reversed_blocks)
    result = run_scenario(load_scenarios(_scenario(PULL.format(p=1, d=1), tmp_path))[0])
    assert all(r.status == "ok" for r in result.records)  # vLLM saw nothing wrong
    assert result.outcome == "corruption"
    assert result.corrupted == 2 and result.verified


def _core_replaying(s, quirk: str):
    """The scenario run by hkvsim's core with one quirk (a replay of a vLLM bug) switched on."""
    from hkvsim.implementations.diff import with_implementation

    core = with_implementation(s, "hkvsim")
    return run_scenario(core.model_copy(update={"connector": core.connector.model_copy(
        update={"quirks": (quirk,)})}))


def _assert_same_damage(bug, vllm, name: str) -> None:
    """Per request, the same number of wrong words with the same explanations."""
    assert [r.mismatched_words for r in bug.records] == [
        r.mismatched_words for r in vllm.records], name
    assert [sorted(r.mismatches) for r in bug.records] == [
        sorted(r.mismatches) for r in vllm.records], name


def _handshaken_tiny_deepseek_pair():
    """(simpy env, VllmHarness) with one tiny-deepseek prefill and one decode rank of vLLM's
    worker on the simulated fabric, prefill's handshake payload delivered to the harness."""
    import simpy

    from hkvsim.fabric import Fabric, load_profile, place_engines
    from hkvsim.geometry.layout import build_layout
    from hkvsim.geometry.presets import preset
    from hkvsim.implementations.vllm.engine import VllmHarness
    from hkvsim.transport.sim import SimWorld

    env = simpy.Environment()
    profile = load_profile("h200-nvlink")
    fabric = Fabric(env, profile, place_engines(profile, [("p", "prefill", 1), ("d", "decode", 1)]))
    world = SimWorld(env, fabric)
    harness = VllmHarness(lambda: env.now)
    layout = build_layout(preset("tiny-deepseek"), tp=1, block_size=64, num_blocks=8,
                          kv_cache_layout="HND", registration_order="sorted")
    for eid in ("p", "d"):
        t = world.create_agent(f"{eid}.0", (eid, 0))
        harness.add_rank(eid, layout, 0, t, t.allocate(layout.total_bytes, mem_type="DRAM"),
                         "prefill" if eid == "p" else "decode")
    # what the coordinator does at Connect: prefill's published payloads answer the handshake
    harness.deliver_handshake("p", {0: harness.engines["p"][0].handshake_payload()})
    return env, harness


def test_an_assert_inside_vllm_is_a_failure_naming_its_line(vllm_required: str,
                                                            tmp_path: Path) -> None:
    # decode asks vLLM to pull more blocks than prefill lists: vLLM's own check refuses it
    env, harness = _handshaken_tiny_deepseek_pair()
    failure = harness.start_load(harness.engines["d"][0], "r", "r", "p", ([1, 2, 3],), ([4, 5],))
    env.run()
    if failure is None:  # vLLM may report it from get_finished instead
        sending, recving = harness.engines["d"][0].worker.get_finished()
        bad = harness.engines["d"][0].worker.get_block_ids_with_load_errors()
        pytest.fail(f"no failure: recving={recving}, load errors={bad}, "
                    f"posted={harness.engines['d'][0].agent.calls.get('transfer', 0)}")
    assert failure.where.startswith("vllm/") and ".py:" in failure.where, failure
    assert str(failure).startswith("vLLM failed at vllm/")
    # 0.33.0: base_worker.py:3791 "assert num_decode_blocks <= len(prefill_group)";
    # 0.26.0: base_worker.py:2263 "assert num_local_blocks <= len(remote_group)"
    assert re.fullmatch(r"assert num_\w+_blocks <= len\(\w+_group\)", failure.what), failure
    assert not failure.what.startswith("assert assert")


def test_without_vllm_a_run_says_how_to_provision_it(tmp_path: Path, capsys,
                                                     monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # vLLM not importable, provisioned or not
    path = _scenario(PULL.format(p=1, d=1), tmp_path)
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"hkvsim: error: {path}: connector.implementation: implementation 'vllm' "
                   f"needs vLLM, which is not importable here (import of vllm halted; None in "
                   f"sys.modules); run it with: scripts/with-vllm 0.34.0 hkvsim run FILE")


def test_unsupported_cases_are_one_line_errors(vllm_required: str, tmp_path: Path,
                                               capsys) -> None:
    text = PULL.format(p=1, d=1).replace('implementation = "vllm"',
                                         'implementation = "vllm"\nquirks = ["phantom-token"]')
    assert main(["run", str(_scenario(text, tmp_path))]) == 2
    err = capsys.readouterr().err
    assert "connector.implementation: quirks replay hkvsim's model of old connector bugs" in err
    assert err.count("\n") == 1
    text = PULL.format(p=1, d=1).replace("prompt_tokens = 200", "prompt_tokens = 200\nverify = false")
    assert main(["run", str(_scenario(text, tmp_path, "k.toml"))]) == 2
    err = capsys.readouterr().err
    assert "connector.implementation: vLLM's connector needs real cache bytes" in err
    assert err.count("\n") == 1


def test_gqa_with_homogeneous_tp_is_byte_exact_under_vllm(vllm_required: str) -> None:
    for s in load_scenarios(ROOT / "scenarios" / "vllm" / "gqa-nhd-tiny-llama.toml"):
        result = run_scenario(s)
        assert result.outcome == "ok" and result.verified, s.scenario.name
        assert result.corrupted == 0 and all(r.nbytes > 0 for r in result.records)


def test_gqa_hetero_tp_is_refused_by_both_and_vllm_leaks_the_refused_agent(
        vllm_required: str) -> None:
    from hkvsim.implementations.diff import compare_results, with_implementation

    path = ROOT / "scenarios" / "vllm" / "xfail-gqa-nhd-hetero-tp.toml"
    for s in load_scenarios(path):
        core = run_scenario(with_implementation(s, "hkvsim", like_vllm=vllm_required))
        vllm = run_scenario(s)
        assert core.handshake_errors and "V5" in core.handshake_errors[0]
        assert vllm.handshake_errors and "requires contiguous heads" in vllm.handshake_errors[0]
        assert "base_worker.py:" in vllm.handshake_errors[0]
        assert compare_results(s.scenario.name, core, vllm) == []
        assert core.leaks["after_shutdown"] == 0
        assert vllm.leaks["after_shutdown"] >= 1  # the vLLM finding (docs/vllm.md)


def test_hybrid_prefix_caching_with_different_ppl_is_refused_by_both(vllm_required: str) -> None:
    """vLLM's own rule (hkvsim's V4) reads the engine's prefix-cache setting from its vLLM
    config: the harness passes each engine's, so vLLM refuses where the core does (with it
    always off, vLLM went ahead and paired prefill's prefix with decode's suffix). 0.34.0's
    push refuses the pair earlier, at its check of the block geometry (any differing ppl)."""
    from hkvsim.implementations.diff import compare_results, with_implementation

    path = ROOT / "scenarios" / "vllm" / "xfail-hybrid-prefix-cache-hetero-ppl.toml"
    for s in load_scenarios(path):
        core = run_scenario(with_implementation(s, "hkvsim"))
        vllm = run_scenario(s)
        assert core.handshake_errors and "V4: " in core.handshake_errors[0]
        why = (PUSH_GEOMETRY_034 if push_refused(s, vllm_required)
               else "heterogeneous physical_blocks_per_logical")
        assert vllm.handshake_errors and why in vllm.handshake_errors[0], vllm.handshake_errors
        assert vllm.corrupted == 0 and vllm.completed == 0
        assert compare_results(s.scenario.name, core, vllm) == []


@pytest.mark.timeout(300)
def test_n_minus_1_on_a_block_boundary_is_byte_exact_without_state(vllm_required: str) -> None:
    """Models without state: decode loads all N prompt tokens, so its list is as long as
    prefill's whatever N is. With N-1-token decode lists, vLLM end-trimmed prefill's list by a
    block whenever N-1 filled whole blocks and every token landed a block early (1,025 tokens:
    decode's token 0 held prefill's token 16), though hkvsim's core, pairing from the front, was
    byte-exact."""
    from hkvsim.implementations.diff import compare_results, with_implementation

    for s in load_scenarios(ROOT / "scenarios" / "vllm" / "block-boundary-no-state.toml"):
        vllm = run_scenario(s)
        assert completed_as_released(vllm), (s.scenario.name, vllm.outcome)
        assert [r.status for r in vllm.records] == ["ok"] * 4
        core = run_scenario(with_implementation(s, "hkvsim"))
        # every prompt block moves: 1,025 tokens need as many blocks as 1,040 (16-token
        # blocks) or 1,088 (64), and one fewer than 1,041 (or 1,089). A push vLLM never
        # reports counts no bytes: then hkvsim's core's counts, the oracle having found every
        # block vLLM wrote byte-exact (completed_as_released)
        counted = core if push_sent_unreported(vllm) else vllm
        first, second, third, _ = (r.nbytes for r in counted.records)
        assert second > first == third > 0
        found = without_unreported_push(vllm, compare_results(s.scenario.name, core, vllm))
        assert found == [], s.scenario.name


@pytest.mark.timeout(300)
def test_a_prefix_hit_with_a_block_size_ratio_is_shifted_by_vllm(vllm_required: str) -> None:
    """A vLLM finding (docs/vllm.md): with decode blocks twice prefill's and a decode prefix
    hit, vLLM splits decode's uncached blocks into sub-blocks and end-trims prefill's list to
    their count; when the prompt ends in the first half of a decode block the empty sub-block
    pulls in one prefill block from before the hit, every token lands 16 places late, and vLLM
    reports success. hkvsim's core pairs from the hit's position and is byte-exact. Fixed in
    0.34.0, which pairs the lists by the request's last token (``remote_num_tokens``, which the
    harness forwards as vLLM's proxy does): byte-exact, nothing differs from hkvsim's core."""
    from hkvsim.implementations.diff import compare_results, with_implementation

    # request 0: 737 tokens, hit 64 (shifted); 1: 753, hit 64; 2: 737, no hit; 3: 768, hit 64
    wrong = BSR_PREFIX_HIT_SHIFTED.get(vllm_required)
    if wrong is None:
        pytest.fail(f"no expectation recorded for vLLM {vllm_required} (add it here)")
    for s in load_scenarios(ROOT / "scenarios" / "vllm" / "finding-bsr-prefix-hit.toml"):
        name = s.scenario.name
        core = run_scenario(with_implementation(s, "hkvsim"))
        assert core.outcome == "ok" and core.mismatched_bytes == 0, name
        vllm = run_scenario(s)
        assert [r.status for r in vllm.records] == ["ok"] * 4, name  # success reported
        if not wrong:  # fixed: byte-exact, the same descriptors and bytes as the core
            assert vllm.outcome == "ok" and vllm.verified and vllm.mismatched_bytes == 0, name
            assert compare_results(name, core, vllm) == [], name
            continue
        assert [r.index for r in vllm.records if r.mismatched_words] == wrong, name
        assert vllm.outcome == "corruption" and vllm.corrupted == len(wrong), name
        shifted = vllm.records[0]
        # one prefill block more than the core moves, and wrong K/V beyond the stale tail
        assert shifted.nbytes * 43 == core.records[0].nbytes * 44, name
        assert any("(K/V)" in m for m in shifted.mismatches), shifted.mismatches[:2]
        # 0.26.0 also leaves the untransferred tail of request 2 stale (its finding above)
        assert {d.request for d in compare_results(name, core, vllm)} == {None, *wrong}, name
        # hkvsim's replay of the bug (quirk bsr-prefix-end-trim) moves the same descriptors and
        # puts the same wrong K/V bytes where vLLM does (it still zeroes the last sub-block,
        # which vLLM counts as received and leaves holding data)
        bug = _core_replaying(s, "bsr-prefix-end-trim")
        assert [r.descriptors for r in bug.records] == [r.descriptors for r in vllm.records]
        assert [r.nbytes for r in bug.records] == [r.nbytes for r in vllm.records], name
        assert [r.index for r in bug.records if r.mismatched_words] == [0], name
        kv = [m for m in shifted.mismatches if "(K/V)," in m]
        found = bug.records[0].mismatches
        assert kv and set(kv) <= set(found), (kv[:1], found[:1])


@pytest.mark.timeout(300)
def test_mla_with_a_block_size_ratio_damages_a_half_covered_last_block(vllm_required: str
                                                                       ) -> None:
    """A vLLM finding (docs/vllm.md): MLA (triton-mla) with decode blocks twice prefill's. When
    the request's prefill blocks end half way into a decode block, 0.33.0 zeroes that block's
    tail along the latent dimension (its post-process takes every cache as (blocks, heads,
    tokens, channels)), damaging the received token and leaving the tail stale; 0.26.0 leaves
    the tail stale and the received tokens intact; 0.34.0 does as 0.33.0; 0.27.0 is byte-exact,
    with the descriptors and bytes of hkvsim's core. hkvsim's core is byte-exact."""
    from hkvsim.implementations.diff import compare_results, with_implementation

    if vllm_required not in MLA_BSR_DAMAGE:
        pytest.fail(f"no expectation recorded for vLLM {vllm_required} (add it here)")
    damage = MLA_BSR_DAMAGE[vllm_required]
    received_damaged = damage == "latent"
    path = ROOT / "scenarios" / "vllm" / "finding-mla-block-size-ratio.toml"
    for s in load_scenarios(path):
        name = s.scenario.name
        core = run_scenario(with_implementation(s, "hkvsim"))
        assert core.outcome == "ok" and core.mismatched_bytes == 0, name
        vllm = run_scenario(s)
        assert [r.status for r in vllm.records] == ["ok"] * 4, name  # success reported
        if damage is None:
            assert vllm.outcome == "ok" and vllm.verified and vllm.mismatched_bytes == 0, name
            assert compare_results(name, core, vllm) == [], name
            continue
        # 737 and 745 tokens: 47 prefill blocks, the last decode block half covered
        assert [r.index for r in vllm.records if r.mismatched_words] == [0, 3], name
        assert [r.nbytes for r in vllm.records] == [r.nbytes for r in core.records], name
        for rec in (vllm.records[0], vllm.records[3]):
            kinds = {m.split("(")[1].split(")")[0] for m in rec.mismatches}
            assert kinds == ({"MLA", "MLA untransferred tail"} if received_damaged
                             else {"MLA untransferred tail"}), (name, rec.mismatches[:2])
        if received_damaged:
            # hkvsim's replay (quirk mla-bsr-tail-zero-latent) damages the same words with the
            # same explanations
            _assert_same_damage(_core_replaying(s, "mla-bsr-tail-zero-latent"), vllm, name)


@pytest.mark.timeout(300)
def test_a_second_remote_rank_of_a_smaller_block_size_leaks_a_list_in_0_26(vllm_required: str
                                                                           ) -> None:
    """A vLLM finding (docs/vllm.md), found by hkvsim fuzz: 0.26.0 prepares a local descriptor
    list per remote rank registration with a block size ratio and keeps only the last under its
    block size, so one prepared list per extra remote rank (a second prefill rank, or a second
    prefill instance) is left after shutdown; 0.27.0, 0.33.0 and 0.34.0 prepare it once. All
    byte-exact, as is hkvsim's core, which leaves nothing behind."""
    from hkvsim.implementations.diff import with_implementation

    leaked = {"0.26.0": 1, **dict.fromkeys(releases("0.27.0"), 0)}.get(vllm_required)
    if leaked is None:
        pytest.fail(f"no expectation recorded for vLLM {vllm_required} (add it here)")
    path = ROOT / "scenarios" / "vllm" / "finding-bsr-local-list-leak.toml"
    variants = load_scenarios(path)
    assert len(variants) == 2
    for s in variants:
        name = s.scenario.name
        core = run_scenario(with_implementation(s, "hkvsim"))
        assert core.outcome == "ok" and not any(core.leaks.values()), name
        vllm = run_scenario(s)
        assert vllm.mismatched_bytes == 0 and [r.status for r in vllm.records] == ["ok"] * 2
        assert vllm.leaks["after_shutdown"] == leaked, (name, vllm.leaks)
        assert vllm.outcome == ("ok" if not leaked else "leak"), name


@pytest.mark.timeout(300)
def test_a_full_prefix_hit_on_a_hybrid_pulls_nothing(vllm_required: str) -> None:
    """A pull after a decode hit on all N-1 tokens of KimiLinear, ending on a logical block
    boundary: hkvsim's core and vLLM (0.26.0 and 0.33.0) read nothing, free prefill's blocks by
    the notification and complete, byte-exact (0 differences). vLLM's worker must get the
    scheduler's shape for "nothing to read" (no groups), and the request must not wait for a
    load the scheduler does not wait for: with one empty list per group 0.26.0 planned a read
    and failed ("SSM can only have one local block"; docs/vllm.md, retracted)."""
    from hkvsim.implementations.diff import compare_results, with_implementation

    for s in load_scenarios(ROOT / "scenarios" / "vllm" / "pull-full-prefix-hit-hybrid.toml"):
        name = s.scenario.name
        core = run_scenario(with_implementation(s, "hkvsim", like_vllm=vllm_required))
        assert core.outcome == "ok" and core.verified and core.mismatched_bytes == 0, name
        assert core.records[1].transfers == 0 and core.records[1].nbytes == 0, name  # the hit
        assert core.records[2].nbytes > 0, name  # a hit on 1,280 of 1,399 tokens still reads
        vllm = run_scenario(s)
        assert vllm.outcome == "ok" and vllm.mismatched_bytes == 0, name  # freed by notification
        assert vllm.records[1].transfers == 0, name
        found = compare_results(name, core, vllm)
        assert found == [], [str(d) for d in found]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("phase", ["before-scheduling", "during-handshake"])
def test_a_request_decode_gives_up_before_reading_frees_prefill_by_notification(
        vllm_required: str, phase: str) -> None:
    """Pull, decode aborts request 1 before reading it: vLLM's worker notifies prefill, which
    frees the blocks at once (outcome ok, no lease expiry), under 0.26.0 and 0.33.0 as in
    hkvsim's core; the harness hands vLLM the scheduler's "nothing to read" (no groups)."""
    from hkvsim.implementations.diff import diff_scenario

    for s in load_scenarios(ROOT / "scenarios" / "vllm" / "abort-empty-receive.toml"):
        faults = [f.model_copy(update={"phase": phase}) for f in s.faults]
        s = s.model_copy(update={"faults": faults})
        name = s.scenario.name
        found, core, vllm = diff_scenario(s)
        assert found == [], [str(d) for d in found]
        assert vllm.outcome == "ok" and vllm.counters["lease_expiries"] == 0, name
        assert [r.status for r in vllm.records] == ["ok", "aborted", "ok"], name
        assert "lease_expired" not in vllm.records[1].times, name


@pytest.mark.timeout(300)
def test_cache_dtypes_reach_vllm_as_cache_dtypes(vllm_required: str) -> None:
    """fp8 and float16 caches (GQA and MLA, pull and push) run byte-exact under vLLM as under
    hkvsim's core, and a pair whose cache dtypes differ is refused by vLLM's compatibility hash
    as by hkvsim's: the harness gives vLLM the cache dtype as a cache dtype, not as the model's
    (an fp8 model dtype failed vLLM's config; a cache dtype vLLM does not see could not enter
    its hash)."""
    from hkvsim.implementations.diff import compare_results, with_implementation

    for s in load_scenarios(ROOT / "scenarios" / "vllm" / "cache-dtypes.toml"):
        core = run_scenario(with_implementation(s, "hkvsim"))
        vllm = run_scenario(s)
        assert completed_as_released(vllm), (s.scenario.name, vllm.outcome)
        found = without_unreported_push(vllm, compare_results(s.scenario.name, core, vllm))
        assert found == [], s.scenario.name
    for s in load_scenarios(ROOT / "scenarios" / "vllm" / "xfail-cache-dtype-mismatch.toml"):
        core = run_scenario(with_implementation(s, "hkvsim"))
        assert core.outcome == "handshake-error", s.scenario.name
        vllm = run_scenario(s)
        assert vllm.outcome == "handshake-error" and vllm.corrupted == 0, s.scenario.name
        assert any("compatibility hash mismatch" in e for e in vllm.handshake_errors), (
            vllm.handshake_errors)


def test_a_packed_deepseek_cache_of_another_geometry_is_refused_for_vllm(
        vllm_required: str) -> None:
    from hkvsim.implementations.diff import with_implementation

    (s,) = load_scenarios(ROOT / "scenarios" / "vllm" / "xfail-cache-dtype-mismatch.toml")[2:]
    s = s.model_copy(update={
        role: getattr(s, role).model_copy(update={"cache_dtype": "fp8_ds_mla",
                                                  "attention_backend": "flashmla"})
        for role in ("prefill", "decode")})
    assert run_scenario(with_implementation(s, "hkvsim")).outcome == "ok"  # hkvsim's own format
    with pytest.raises(ScenarioError, match="656-byte row.*tiny-deepseek has 56 and 8"):
        run_scenario(s)


@pytest.mark.timeout(300)
def test_a_failed_read_of_a_hybrid_is_reported_as_loaded_by_vllm(vllm_required: str) -> None:
    """A vLLM finding (docs/vllm.md): request 1's READ ends in ERR. For a hybrid model vLLM
    (0.26.0, 0.27.0, 0.33.0 and 0.34.0) logs the failure but records no load errors for models that need its
    hybrid memory allocator, so the request counts as loaded and its blocks hold no KV or state;
    hkvsim's core fails it as transfer_failed. The harness reports what vLLM says."""
    from hkvsim.implementations.diff import with_implementation

    if vllm_required not in HYBRID_FAILED_READ_LOADED:
        pytest.fail(f"no expectation recorded for vLLM {vllm_required} (add it here)")
    path = ROOT / "scenarios" / "vllm" / "finding-hybrid-failed-transfer.toml"
    for s in load_scenarios(path):
        name = s.scenario.name
        core = run_scenario(with_implementation(s, "hkvsim"))
        assert [r.status for r in core.records] == ["ok", "failed", "ok"], name
        assert core.records[1].failure_class == "transfer_failed", name
        assert core.mismatched_bytes == 0, name
        vllm = run_scenario(s)
        assert [r.status for r in vllm.records] == ["ok"] * 3, name  # success reported
        assert [r.index for r in vllm.records if r.mismatched_words] == [1], name
        assert vllm.outcome == "corruption" and vllm.corrupted == 1, name
        # what decode holds is zeros or request 0's leftovers, never request 1's bytes
        got = [m.split("got the bytes of ")[1] for m in vllm.records[1].mismatches]
        assert got and all(g.startswith(("zeros", "request#0")) for g in got), got[:2]
        # hkvsim's replay (quirk hybrid-failed-read-reported-loaded) leaves the same words wrong
        bug = _core_replaying(s, "hybrid-failed-read-reported-loaded")
        assert [r.status for r in bug.records] == ["ok"] * 3, name
        _assert_same_damage(bug, vllm, name)


@pytest.mark.timeout(300)
def test_a_failed_write_fails_its_push_request(vllm_required: str) -> None:
    """Push, request 1's WRITE ends in ERR. 0.33.0 counts it failed once its WRITEs ended (and
    empties its own record of that in the same call): the harness sees it through vLLM's checks
    of its WRITEs, so the request fails as in hkvsim's core instead of the run hanging. 0.26.0
    never reports it (hkvsim's watchdog fails it as a stall), and its next poll on that prefill
    rank trips an assert that fails the next request (docs/vllm.md); 0.27.0 does as 0.26.0.
    0.34.0 does as 0.33.0,
    and refuses the KimiLinear pair (P TP2 -> D TP1: different kernel blocks per logical
    block) at the handshake."""
    from hkvsim.implementations.diff import compare_results, with_implementation

    if vllm_required not in RELEASES:
        pytest.fail(f"no expectation recorded for vLLM {vllm_required} (add it here)")
    expected = ((["ok", "failed", "failed"], "stall") if vllm_required in PUSH_FAILURE_UNREPORTED
                else (["ok", "failed", "ok"], "transfer_failed"))
    statuses, failure = expected
    for s in load_scenarios(ROOT / "scenarios" / "vllm" / "fail-write-push.toml"):
        name = s.scenario.name
        core = run_scenario(with_implementation(s, "hkvsim"))
        assert [r.status for r in core.records] == ["ok", "failed", "ok"], name
        vllm = run_scenario(s)
        if push_refused(s, vllm_required):
            assert_push_refused_by_034(vllm, name)
            continue
        assert vllm.hung == 0 and vllm.mismatched_bytes == 0, name
        assert [r.status for r in vllm.records] == statuses, name
        assert vllm.records[1].failure_class == failure, name
        if vllm_required not in PUSH_FAILURE_UNREPORTED:
            assert without_unreported_push(vllm, compare_results(name, core, vllm)) == [], name
        else:
            assert "not found in recving_metadata" in (vllm.records[2].reason or ""), name
            # 0.26.0 to 0.29.0 list the request as sent although its WRITE ended in ERR: the harness
            # reports no telemetry for it (it completed no transfer), as hkvsim's core
            assert vllm.records[1].telemetry == core.records[1].telemetry == [], name


@pytest.mark.timeout(300)
def test_a_read_stalled_past_the_watchdog_is_waited_out_as_in_hkvsims_core(
        vllm_required: str) -> None:
    """hkvsim's watchdog gives up on request 1's READ at 1 s; vLLM still holds the READ until
    NIXL ends it (ERR at 2 s) and it releases the handle. The coordinator recomputes into the
    request's blocks (or reuses them) only then, as with hkvsim's core, and the abandoned
    request reports no telemetry. Before the harness counted vLLM's live handles, the vLLM run
    recomputed at 1 s into blocks the READ could still write."""
    from hkvsim.implementations.diff import diff_scenario

    for s in load_scenarios(ROOT / "scenarios" / "vllm" / "watchdog-stall.toml"):
        name = s.scenario.name
        found, core, vllm = diff_scenario(s)
        assert found == [], [str(d) for d in found]
        stalled, expected = vllm.records[1], core.records[1]
        assert stalled.telemetry == [] and expected.telemetry == [], name
        assert stalled.failure_class == "stall" or stalled.recovered_from == "stall", name
        assert stalled.times == expected.times, name  # the same waits, to the simulated second
        released = stalled.times["transfer_start"] + 2.0  # the stall's end
        if s.connector.kv_load_failure_policy == "recompute":
            assert stalled.status == "ok" and stalled.times["done"] >= released, name
        else:
            assert stalled.times["unquarantined"] >= released, name
        assert vllm.mismatched_bytes == 0 and vllm.leaks == core.leaks, name


@pytest.mark.timeout(300)
def test_a_request_vllm_failed_is_classed_by_what_nixl_told_it(vllm_required: str) -> None:
    """A state check that raises fails its request as transfer_exception and a post that raises
    as transfer_setup_failed (the failure_type in vLLM's log), pull and push, as hkvsim's core
    classes them; vLLM's load errors and failed sends alone would say transfer_failed. 0.26.0's
    push fails such a WRITE its own way (a finding, docs/vllm.md): a raising check trips its
    assert at base_worker.py:1985 (where a prefill rank posts one WRITE, on the next request),
    and a WRITE whose post raised is never reported (hkvsim's watchdog calls it a stall; 0.30.0
    leaves it unreported too, though it reports a raising check as 0.31.0 does). The one-WRITE
    push variant (found by hkvsim fuzz): 0.33.0 records the request failed and forgets that in
    the same call; the harness must still fail it, and leave no decode block quarantined."""
    from hkvsim.implementations.diff import diff_scenario

    if vllm_required not in RELEASES:
        pytest.fail(f"no expectation recorded for vLLM {vllm_required} (add it here)")
    old_push = {"poll": "vllm_failure", "setup": "stall"}
    for phase, failure in (("poll", "transfer_exception"), ("setup", "transfer_setup_failed")):
        for s in load_scenarios(ROOT / "scenarios" / "vllm" / f"failure-class-{phase}.toml"):
            name = s.scenario.name
            found, core, vllm = diff_scenario(s)
            assert [r.failure_class for r in core.records] == [None, failure, None], name
            assert vllm.mismatched_bytes == 0, name
            if vllm_required in PUSH_FAILURE_UNREPORTED and s.connector.mode == "push":
                if phase == "poll" and s.decode.tp == s.prefill.tp:
                    # one WRITE per prefill rank: 0.26.0 releases the WRITE whose check raised
                    # and lists the request as sent (its bytes did land here; no telemetry), and
                    # its next poll asserts on the failure it queued (base_worker.py:1985, "not
                    # found in recving_metadata", as after a WRITE that ended in ERR): request
                    # 2 fails there with its two WRITEs never released, so decode's blocks they
                    # targeted stay quarantined (DMA under an unreleased handle may be live)
                    assert [r.status for r in vllm.records] == ["ok", "ok", "failed"], name
                    assert vllm.records[1].telemetry == [], name
                    assert "not found in recving_metadata" in (vllm.records[2].reason or ""), name
                    assert vllm.hung == 0 and vllm.leaks["open_handles"] == 2, (name, vllm.leaks)
                    assert not any(core.leaks.values()), name
                    continue
                assert vllm.records[1].failure_class == old_push[phase], name
                continue
            if (vllm_required in PUSH_POST_FAILURE_UNREPORTED and s.connector.mode == "push"
                    and phase == "setup"):  # 0.30.0: only the check that raised is reported
                assert [r.failure_class for r in vllm.records] == [None, "stall", None], name
                found = [d for d in without_unreported_push(vllm, found)
                         if (d.request, d.field, d.vllm) != (1, "failure_class", "stall")]
                assert found == [], [str(d) for d in found]
                assert not any(vllm.leaks.values()), (name, vllm.leaks)
                continue
            assert [r.failure_class for r in vllm.records] == [None, failure, None], name
            found = without_unreported_push(vllm, found)
            assert found == [], [str(d) for d in found]
            assert not any(vllm.leaks.values()), (name, vllm.leaks)


@pytest.mark.timeout(300)
def test_push_with_a_block_size_ratio_is_refused_by_vllm(vllm_required: str) -> None:
    """vLLM's push refuses a decode block larger than prefill's at the reverse handshake (an
    assert in its block-size-ratio helper), loudly; 0.34.0 refuses any push between engines of
    different block geometry, naming its own check. hkvsim's core writes the sub-blocks."""
    from hkvsim.implementations.diff import with_implementation

    for s in load_scenarios(ROOT / "scenarios" / "vllm" / "xfail-push-block-size-ratio.toml"):
        core = run_scenario(with_implementation(s, "hkvsim"))
        assert core.outcome == "ok" and core.verified and core.mismatched_bytes == 0
        vllm = run_scenario(s)
        assert vllm.outcome == "handshake-error" and vllm.corrupted == 0
        (error,) = vllm.handshake_errors
        if vllm_required in PUSH_GEOMETRY_REFUSED:
            assert PUSH_GEOMETRY_034 in error and "local (16, 1), remote engine" in error, error
        else:
            assert "utils.py:" in error and "not divisible by remote block size 32" in error
        assert [r.failure_class for r in vllm.records] == ["handshake_failed"] * 2


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_no_vllm_thread_runs(vllm_required: str, tmp_path: Path, monkeypatch, mode: str) -> None:
    # determinism: vLLM's handshake executor is replaced by a synchronous one, push's writer
    # thread is never started, and nothing else starts a thread, so nothing races the clock
    import threading

    started: list[str] = []
    real_start = threading.Thread.start

    def start(self):
        started.append(self.name)
        return real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    text = PULL.format(p=2, d=1).replace('implementation = "vllm"',
                                         f'implementation = "vllm"\nmode = "{mode}"')
    result = run_scenario(load_scenarios(_scenario(text, tmp_path))[0])
    assert result.outcome == completed_outcome(result)
    assert started == []


def test_vllm_refusing_to_build_a_rank_is_one_line(vllm_required: str, tmp_path: Path, capsys,
                                                   monkeypatch) -> None:
    # a step inside vLLM's worker constructor raises (standing in for vLLM refusing a config)
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    def refuse(self, *args, **kwargs):
        raise RuntimeError("cpu with cpu kv_buffer is not supported.")

    monkeypatch.setattr(base_worker.NixlBaseConnectorWorker, "_sync_block_size_with_kernel",
                        refuse)
    path = _scenario(PULL.format(p=1, d=1), tmp_path)
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hkvsim: error: {path}: connector.implementation: prefill0 rank 0: "
                          f"vLLM failed at vllm/distributed/kv_transfer/kv_connector/v1/nixl/"
                          f"base_worker.py:")
    assert "RuntimeError: cpu with cpu kv_buffer is not supported." in err
    assert err.count("\n") == 1


def test_timing_only_vllm_on_the_nixl_backend_is_refused_with_one_line(
        nixl_available, tmp_path: Path, capsys) -> None:
    # vLLM's tensors need real bytes: refused before any rank process starts (no vLLM needed)
    path = _scenario(PULL.format(p=1, d=1), tmp_path)
    with pytest.raises(SystemExit) as stop:  # the nixl backend's setup errors exit 2
        main(["run", str(path), "--backend", "nixl", "--timing-only"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err == (f"hkvsim: error: {path}: connector.implementation: vLLM's connector needs "
                   f"real cache bytes: run with the oracle (workload.verify = true, no "
                   f"--timing-only)\n")


def test_a_failed_transfer_fails_its_request_under_vllm(vllm_required: str) -> None:
    from hkvsim.implementations.diff import compare_results, with_implementation

    s = load_scenarios(ROOT / "scenarios" / "vllm" / "fail-transfer-tiny-deepseek.toml")[0]
    vllm = run_scenario(s)
    assert [r.status for r in vllm.records] == ["ok", "failed", "ok"]
    assert vllm.records[1].failure_class == "transfer_failed"
    assert "vLLM reported load errors for blocks" in vllm.records[1].reason
    assert vllm.corrupted == 0 and vllm.verified
    assert compare_results("f", run_scenario(with_implementation(s, "hkvsim")), vllm) == []


def test_vllm_reads_the_simulated_clock(vllm_required: str) -> None:
    # leases, heartbeats and engine TTLs inside vLLM must follow simulated time, not wall time
    import importlib

    env, harness = _handshaken_tiny_deepseek_pair()
    env.run(until=1234.5)
    nixl = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
    for name in ("base_worker", "pull_worker"):
        assert importlib.import_module(f"{nixl}.{name}").time.perf_counter() == 1234.5
    assert harness.start_load(harness.engines["d"][0], "r", "r", "p", ([1],), ([2],)) is None
    worker = harness.engines["d"][0].worker
    assert worker._engine_last_active["p"] == 1234.5  # stamped at the handshake


@pytest.mark.timeout(300)
def test_kill_rank_fails_the_same_requests_as_hkvsims_core(vllm_required: str) -> None:
    # a prefill rank dies as request 1 starts: requests 1 and 2 fail as remote_disconnect under
    # vLLM too. vLLM learns of a READ it could not post only in its next get_finished, which the
    # harness must call (an engine steps again; the simulated fabric has no event to trigger it)
    # or the request hangs until the watchdog calls it a stall.
    from hkvsim.implementations.diff import diff_scenario

    for s in load_scenarios(ROOT / "scenarios" / "vllm" / "kill-rank.toml"):
        found, core, vllm = diff_scenario(s)
        if vllm_required == "0.26.0" and s.model.preset == "tiny-kimi-linear" \
                and s.connector.mode == "push":  # its #49762 push assert fires first
            assert all(r.failure_class == "vllm_failure" for r in vllm.records)
            continue
        if push_refused(s, vllm_required):
            assert_push_refused_by_034(vllm, s.scenario.name)
            continue
        found = without_unreported_push(vllm, found)
        assert found == [], [str(d) for d in found]
        assert [r.failure_class for r in vllm.records] == [
            None, "remote_disconnect", "remote_disconnect"], s.scenario.name
        assert vllm.records[0].status == "ok" and vllm.records[0].mismatched_words == 0


def test_a_harness_replaced_by_the_next_ends_its_workers_once(vllm_required: str) -> None:
    # a harness driven directly, a READ still in flight: the next harness shuts its workers
    # down (once) as it starts, and collecting them later raises nothing. vLLM's __del__ used
    # to shut them down again, failing on the handle in flight, from inside whatever later run
    # collected them (and pytest's hook for that error then held the worker: the test below
    # failed whenever one of these direct-harness tests ran just before it on its xdist worker)
    import gc
    import weakref

    env, harness = _handshaken_tiny_deepseek_pair()
    assert harness.start_load(harness.engines["d"][0], "r", "r", "p", ([1],), ([2],)) is None
    workers = [weakref.ref(r.worker) for ranks in harness.engines.values()
               for r in ranks.values()]
    del harness, env
    errors: list[str] = []
    hook = sys.unraisablehook
    sys.unraisablehook = lambda u: errors.append(f"{u.exc_type.__name__}: {u.exc_value}")
    try:
        _handshaken_tiny_deepseek_pair()  # the next harness
        gc.collect()
    finally:
        sys.unraisablehook = hook
        release_workers()
    assert errors == [], errors
    assert [w() for w in workers] == [None, None]


def _referrer(obj) -> str:
    """What holds a leftover worker, in a line (frames by function and line)."""
    if isinstance(obj, types.FrameType):
        return f"frame {obj.f_code.co_name} at {obj.f_code.co_filename}:{obj.f_lineno}"
    return f"{type(obj).__name__} {repr(obj)[:120]}"


def test_a_run_leaves_no_vllm_worker_for_a_later_collection(vllm_required: str) -> None:
    # vLLM's worker shuts down in its __del__ too (releasing handles that may still be active,
    # which raises): a run's workers must end inside the run, not at whatever moment a later
    # garbage collection finds them (CPython 3.11 then failed an unrelated ast.parse)
    import gc

    # a fault run: a transfer is still active when vLLM shuts down
    (scenario,) = load_scenarios(ROOT / "scenarios" / "vllm" / "fail-transfer-tiny-deepseek.toml")
    gc.disable()  # no automatic collection may hide a worker left behind
    try:
        run_scenario(scenario)
        left = [o for o in gc.get_objects()
                if any(c.__name__ == "NixlBaseConnectorWorker" or
                       c.__name__ == "NixlConnectorWorker" for c in type(o).__mro__)]
        held = [[_referrer(r) for r in gc.get_referrers(o)] for o in left]
    finally:
        gc.enable()
    assert left == [], f"{len(left)} vLLM worker(s) still alive after the run, held by {held}"


def test_a_run_that_raises_still_ends_its_vllm_workers(vllm_required: str) -> None:
    # a run interrupted by an exception (here its progress callback's, after the first request)
    # ends its vLLM workers as it unwinds; once the exception is dropped none is left for a
    # later collection to shut down a second time
    import gc

    class Stop(Exception):
        pass

    def stop(record) -> None:
        raise Stop(record.request_id)

    # prefill TP1 -> decode TP2, three requests
    scenario = load_scenarios(ROOT / "scenarios" / "vllm" / "tp-matrix-tiny-deepseek.toml")[1]
    errors: list[str] = []
    hook = sys.unraisablehook
    sys.unraisablehook = lambda u: errors.append(f"{u.exc_type.__name__}: {u.exc_value}")
    gc.disable()  # no automatic collection may hide a worker left behind
    try:
        with pytest.raises(Stop):
            run_scenario(scenario, progress=stop)
        gc.collect()  # the unwound frames' cycles: garbage now, and nothing may raise
        left = [o for o in gc.get_objects()
                if any(c.__name__ in ("NixlBaseConnectorWorker", "NixlConnectorWorker")
                       for c in type(o).__mro__)]
        held = [[_referrer(r) for r in gc.get_referrers(o) if r is not left] for o in left]
        count = len(left)
        del left
    finally:
        gc.enable()
        sys.unraisablehook = hook
        release_workers()
    assert count == 0, f"{count} vLLM worker(s) alive after the raising run, held by {held}"
    assert errors == [], errors


@pytest.mark.timeout(300)
@pytest.mark.parametrize("forwarded", [True, False])
def test_the_harness_forwards_remote_num_tokens_as_vllms_proxy_does(
        vllm_required: str, monkeypatch, forwarded: bool) -> None:
    """vLLM's proxy hands decode prefill's ``kv_transfer_params``, ``remote_num_tokens`` (the
    tokens prefill computed: N for a model without state) among them. 0.34.0 pairs blocks of
    different sizes by it and declines such a pull without it, recording no failure, so the
    request waits for hkvsim's watchdog. The harness forwards it; earlier releases do not need
    it here."""
    from hkvsim.implementations.vllm import engine

    real = engine.VllmHarness.start_load
    seen: list[int | None] = []

    def start_load(self, rank, rid, prid, prefill, local, remote, prefill_tokens=None):
        seen.append(prefill_tokens)
        return real(self, rank, rid, prid, prefill, local, remote,
                    prefill_tokens=prefill_tokens if forwarded else None)

    monkeypatch.setattr(engine.VllmHarness, "start_load", start_load)
    s = load_scenarios(ROOT / "scenarios" / "vllm" / "gqa-hnd-block-size-ratio.toml")[0]
    assert (s.prefill.block_size, s.decode.block_size) == (16, 32)
    result = run_scenario(s)
    assert seen == list(s.workload.prompt_tokens)  # one decode rank, N tokens each
    if vllm_required == "0.34.0" and not forwarded:
        assert [(r.status, r.failure_class) for r in result.records] == [("failed", "stall")] * 3
        assert result.corrupted == 0
    elif vllm_required == "0.26.0":  # its own finding, with or without the count: a stale tail
        assert [r.status for r in result.records] == ["ok"] * 3
        assert result.outcome == "corruption" and all(
            "untransferred tail" in m for r in result.records for m in r.mismatches)
    else:
        assert result.outcome == "ok" and result.verified and result.mismatched_bytes == 0


@pytest.mark.timeout(300)
def test_a_second_raising_read_check_asserts_in_0_26_and_0_27(vllm_required: str) -> None:
    """A vLLM finding (docs/vllm.md; found by hkvsim fuzz under 0.27.0): a decode rank with two
    READs for request 1 (GQA, prefill TP 2 -> decode TP 1), both of whose state checks raise.
    0.26.0 and 0.27.0 fail request 1 as transfer_exception, then, at the second check, assert
    that request 1 is "not found in recving_metadata", failing request 2 (nothing corrupted).
    0.33.0 and 0.34.0 fail request 1 alone, as hkvsim's core does (0 differences)."""
    from hkvsim.implementations.diff import diff_scenario

    asserts = SECOND_READ_CHECK_ASSERT
    if vllm_required not in asserts:
        pytest.fail(f"no expectation recorded for vLLM {vllm_required} (add it here)")
    (s,) = load_scenarios(ROOT / "scenarios" / "vllm" /
                          "finding-pull-poll-exception-two-reads.toml")
    found, core, vllm = diff_scenario(s)
    assert [r.failure_class for r in core.records] == [None, "transfer_exception", None]
    assert core.mismatched_bytes == vllm.mismatched_bytes == 0 and vllm.hung == 0
    where = asserts[vllm_required]
    if where is None:
        assert found == [], [str(d) for d in found]
        return
    assert [r.failure_class for r in vllm.records] == [None, "transfer_exception",
                                                       "vllm_failure"]
    reason = vllm.records[2].reason or ""
    assert where in reason and "not found in recving_metadata list" in reason, reason
    assert f"({vllm.records[1].request_id} not found" in reason, reason  # the one it failed
    assert {d.request for d in found} == {2}, [str(d) for d in found]
    assert not any(vllm.leaks.values()), vllm.leaks


@pytest.mark.timeout(300)
def test_a_peer_dying_during_a_post_asserts_in_0_29(vllm_required: str) -> None:
    """A vLLM finding (docs/vllm.md; found by hkvsim fuzz under 0.29.0, seed 30 scenario 91):
    prefill instance 1 dies as decode rank 0 posts request 1's READ to it. Every release fails
    request 1 as remote_disconnect; 0.29.0 then asserts on decode rank 0 ("not found in
    recving_metadata list") for the requests it is receiving from the other prefill instances
    (0, 2, 3), failing them as vllm_failure, with nothing corrupted. The others fail request 1
    alone, as hkvsim's core does (0 differences)."""
    from hkvsim.implementations.diff import diff_scenario

    if vllm_required not in PEER_DEATH_ASSERT:
        pytest.fail(f"no expectation recorded for vLLM {vllm_required} (add it here)")
    (s,) = load_scenarios(ROOT / "scenarios" / "vllm" / "finding-peer-death-assert-0.29.toml")
    found, core, vllm = diff_scenario(s)
    assert [r.failure_class for r in core.records] == [None, "remote_disconnect", None, None]
    assert core.mismatched_bytes == 0 and vllm.hung == 0
    assert vllm.records[1].failure_class == "remote_disconnect"
    where = PEER_DEATH_ASSERT[vllm_required]
    if where is None and MLA_BSR_DAMAGE[vllm_required] == "tail":
        # 0.26.0: its own block-size-ratio finding (decode blocks 4x prefill's here) leaves the
        # untransferred tail of a decode block stale; the peer's death fails request 1 alone
        assert [r.failure_class for r in vllm.records] == [None, "remote_disconnect", None, None]
        assert all("untransferred tail" in m for r in vllm.records for m in r.mismatches)
        return
    assert vllm.corrupted == 0
    if where is None:
        assert found == [], [str(d) for d in found]
        return
    assert [r.failure_class for r in vllm.records] == ["vllm_failure", "remote_disconnect",
                                                       "vllm_failure", "vllm_failure"]
    for rec in (vllm.records[0], vllm.records[2], vllm.records[3]):
        reason = rec.reason or ""
        assert where in reason and "not found in recving_metadata list" in reason, reason
    assert {d.request for d in found} == {0, 2, 3}, [str(d) for d in found]


@pytest.mark.timeout(300)
def test_a_finished_push_is_reported_sent_except_by_0_30(vllm_required: str) -> None:
    """A vLLM finding (docs/vllm.md): 0.30.0's push worker never lists a finished push as sent.
    Decode receives every byte; prefill's blocks are freed by the lease, not at completion; no
    transfer is counted for the request (the harness counts what vLLM reports), and nothing is
    left held (vLLM releases the WRITEs' handles). Every other release completes the push as
    hkvsim's core does: 0 differences, no lease."""
    from hkvsim.implementations.diff import diff_scenario
    from hkvsim.results import expectation_problems

    (s,) = load_scenarios(ROOT / "scenarios" / "vllm" / "finding-push-sent-unreported-0.30.toml")
    found, core, vllm = diff_scenario(s)
    assert core.outcome == "ok" and not any(r.freed_by_lease for r in core.records)
    assert completed_as_released(vllm), (vllm.outcome, vllm.leaks)
    assert without_unreported_push(vllm, found) == [], [str(d) for d in found]
    if not push_sent_unreported(vllm):
        assert found == [] and expectation_problems(vllm) == []
        return
    lease = s.connector.lease_seconds
    for rec in vllm.records:  # held for the lease from the end of its prefill, not freed on time
        assert rec.times["lease_expired"] == pytest.approx(rec.times["prefill_done"] + lease)
        assert rec.times["done"] < rec.times["lease_expired"] and "prefill_freed" not in rec.times
    assert {(d.request, d.field) for d in found if d.request is not None} == {
        (i, f) for i in range(3) for f in ("transfers", "sources", "descriptors", "nbytes",
                                           "per_rank")}
    assert [p.split(",")[0] for p in expectation_problems(vllm)] == [
        "outcome is 'lease-expired'"]
