"""hkvsim fuzz against vLLM names the documented finding that explains each of its findings, and
only that one: the deployment must be the documented one, the release one it was seen in, and the
finding the shape that bug leaves; hkvsim's own findings and hangs, crashes, stray writes are
never explained. The committed vLLM fuzz reports are re-explained from their regenerated files."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from hkvsim import cli
from hkvsim.fuzz import Finding, FuzzOptions, generate
from hkvsim.fuzz_known import KNOWN, Facts, explain, facts
from hkvsim.scenario import parse_scenarios

REPORTS = Path(__file__).resolve().parent.parent / "reports" / "fuzz"
VLLM_REPORTS = ("vllm-0.33.0", "vllm-0.26.0", "vllm-0.33.0-faults", "vllm-0.33.0-seed11",
                "vllm-0.26.0-faults", "vllm-0.33.0-kimi-faults", "vllm-0.34.0",
                "vllm-0.34.0-faults", "vllm-0.34.0-kimi", "vllm-0.34.0-kimi-faults",
                "vllm-0.34.0-seed11", "vllm-0.34.0-faults-seed31", "vllm-0.34.0-qwen",
                "vllm-0.34.0-qwen-faults", "nixl-vllm-0.34.0", "vllm-0.27.0",
                "vllm-0.27.0-faults", "vllm-0.32.0", "vllm-0.28.0-faults",
                "vllm-0.29.0-faults", "vllm-0.31.0-faults", "vllm-0.30.0", "vllm-0.30.0-faults")
# scenarios whose findings no entry explains, each triaged in reports/fuzz/README.md
TRIAGED_NEW = {"vllm-0.26.0-faults": {39}}


def _facts(**kw) -> Facts:
    base = dict(mode="pull", is_mla=False, is_hybrid=False, kv_heads=8, prefill_tp=1,
                decode_tp=1, prefill_instances=1, prefill_block=16, decode_block=16,
                decode_prefix_hits=False,
                faults=frozenset())
    return Facts(**(base | kw))


def _corrupt(impl: str = "vllm") -> Finding:
    return Finding("corruption", impl, "reported successful with wrong bytes: 1 request(s): 0",
                   f"{impl}: corruption: reported successful with wrong bytes | m pull")


def _diff(fields: tuple[str, ...], outcomes=("ok", "corruption")) -> Finding:
    return Finding("diff", "both", "...", f"both: diff: {', '.join(fields)} | m pull",
                   fields=fields, outcomes=outcomes)


MLA_BSR = _facts(is_mla=True, kv_heads=None, decode_block=32)


def test_a_documented_deployment_and_shape_is_explained_by_name() -> None:
    assert explain(_corrupt(), MLA_BSR, "0.33.0") == "mla-block-size-ratio-last-block"
    damage = _diff(("byte_exact", "outcome", "wrong_regions"))
    assert explain(damage, MLA_BSR, "0.33.0") == "mla-block-size-ratio-last-block"
    # GQA push above the KV heads (tiny-qwen3-next, 2 heads, P TP2 -> D TP4)
    push = _facts(mode="push", kv_heads=2, prefill_tp=2, decode_tp=4)
    assert explain(_corrupt(), push, "0.33.0") == "gqa-push-replicated-decode-heads"
    assert explain(_corrupt(), push, "0.26.0") == "gqa-push-replicated-decode-heads"
    assert explain(_corrupt(), push, "0.34.0") is None  # 0.34.0 refuses the pair instead
    # at homogeneous TP 4 vLLM writes every replica itself: a corruption there is new
    assert explain(_corrupt(), dataclasses.replace(push, prefill_tp=4), "0.33.0") is None


def test_anything_else_is_new() -> None:
    # another deployment: equal blocks, push, decode blocks smaller, a hybrid
    for other in (_facts(is_mla=True, kv_heads=None), dataclasses.replace(MLA_BSR, mode="push"),
                  dataclasses.replace(MLA_BSR, prefill_block=64),
                  dataclasses.replace(MLA_BSR, is_hybrid=True)):
        assert explain(_corrupt(), other, "0.33.0") is None, other
    # a release it was not seen in, or none known
    assert explain(_corrupt(), MLA_BSR, "0.40.0") is None
    assert explain(_corrupt(), MLA_BSR, None) is None
    # hkvsim's own corruption is never excused
    assert explain(_corrupt("hkvsim"), MLA_BSR, "0.33.0") is None
    # shapes no documented finding leaves
    stray = Finding("corruption", "vllm", "1 late landing(s), 0 stray write(s)",
                    "vllm: corruption: bytes landed in blocks the request did not own | m pull")
    hang = Finding("hang", "vllm", "never ended", "vllm: hang: requests never ended | m pull")
    crash = Finding("crash", "vllm", "x.py:1: boom", "vllm: crash: x.py:1 | m pull")
    leak = Finding("leak", "vllm", "left behind", "vllm: leak: decode_blocks | m push")
    push_bsr = _facts(mode="push", decode_block=32)
    for finding in (stray, hang, crash):
        assert explain(finding, MLA_BSR, "0.33.0") is None, finding
    assert explain(leak, push_bsr, "0.33.0") is None
    # a difference in a field the documented finding does not touch
    assert explain(_diff(("byte_exact", "outcome", "handshake")), MLA_BSR, "0.33.0") is None
    # the refusal explains a difference only when vLLM's run was refused
    refused = _diff(("handshake", "outcome"), outcomes=("ok", "handshake-error"))
    assert explain(refused, push_bsr, "0.33.0") == "push-block-size-ratio-refused"
    assert explain(dataclasses.replace(refused, outcomes=("ok", "corruption")), push_bsr,
                   "0.33.0") is None


def test_a_release_assert_is_known_only_where_its_detail_names_the_location() -> None:
    kimi = _facts(is_mla=True, is_hybrid=True, kv_heads=None, prefill_tp=4, decode_tp=2)
    failed = Finding("not-ok", "vllm", "outcome request-failure without faults: {...}; request "
                     "0: vllm_failure: vLLM failed at pull_worker.py:167: AssertionError",
                     "vllm: not-ok: request-failure (vllm_failure) | tiny-kimi-linear pull")
    assert explain(failed, kimi, "0.26.0") == "pr49762-hybrid-mla-pull-assert"
    assert explain(failed, kimi, "0.33.0") is None  # fixed there: new if 0.33.0 fails
    other = dataclasses.replace(failed, detail=failed.detail.replace("pull_worker.py:167",
                                                                     "base_worker.py:99"))
    assert explain(other, kimi, "0.26.0") is None


def test_faults_widen_only_the_entries_that_say_so() -> None:
    fields = ("byte_exact", "failure_class", "outcome", "status", "wrong_regions")
    faulted = dataclasses.replace(MLA_BSR, faults=frozenset({("fail-transfer", "completion")}))
    assert explain(_diff(fields), faulted, "0.33.0") == "mla-block-size-ratio-last-block"
    assert explain(_diff(fields), MLA_BSR, "0.33.0") is None
    # the push design difference: accounting only, same outcomes, a failing prefill rank
    accounting = _diff(("descriptors", "nbytes", "transfers"),
                       outcomes=("lease-expired", "lease-expired"))
    push = _facts(mode="push", prefill_tp=2, decode_tp=8,
                  faults=frozenset({("fail-transfer", "setup")}))
    assert explain(accounting, push, "0.33.0") == "design-push-registration-dropped"
    for other in (dataclasses.replace(push, prefill_tp=1),
                  dataclasses.replace(push, faults=frozenset({("drop-notification", None)}))):
        assert explain(accounting, other, "0.33.0") is None
    parted = dataclasses.replace(accounting, outcomes=("ok", "lease-expired"))
    assert explain(parted, push, "0.33.0") is None


def test_an_unreported_push_write_explains_held_blocks_and_hangs_but_no_other_leak() -> None:
    """0.26.0 never reports a failed push WRITE: decode's blocks stay held, or the request never
    ends. A leak of anything else (prefill's blocks, a registration) is new."""
    push = _facts(mode="push", prefill_tp=2, faults=frozenset({("fail-transfer", "setup")}))

    def leak(what: str) -> Finding:
        return Finding("leak", "vllm", "left behind", f"vllm: leak: {what} | m push")

    hang = Finding("hang", "vllm", "never ended", "vllm: hang: requests never ended | m push")
    for finding in (leak("decode_blocks, quarantined_blocks"), leak("open_handles"), hang):
        assert explain(finding, push, "0.26.0") == "push-failed-write-unreported-0.26"
        assert explain(finding, push, "0.33.0") is None  # fixed there
    for what in ("prefill_blocks", "decode_blocks, prefill_blocks",
                 "after_shutdown, decode_blocks"):
        assert explain(leak(what), push, "0.26.0") is None, what
    # without a fault that fails a WRITE, a hang is new even under 0.26.0
    assert explain(hang, dataclasses.replace(push, faults=frozenset()), "0.26.0") is None


def test_0_30_push_lease_and_post_failure_are_known_only_in_0_30_push() -> None:
    """0.30.0 never reports a finished push as sent (prefill's lease frees its blocks, no
    transfer counted) nor a WRITE whose post raised (decode's watchdog: a stall)."""
    push, pull = _facts(mode="push"), _facts()
    lease = Finding("not-ok", "vllm", "outcome lease-expired without faults: {}, 3 freed by lease",
                    "vllm: not-ok: lease-expired (lease expired) | m push")
    counted = dataclasses.replace(
        _diff(("descriptors", "nbytes", "outcome", "per_rank", "sources", "transfers"),
              outcomes=("ok", "lease-expired")), vllm_moved_less=True)  # none counted
    assert explain(dataclasses.replace(counted, vllm_moved_less=False), push, "0.30.0") is None
    for finding in (lease, counted):
        assert explain(finding, push, "0.30.0") == "push-sent-unreported-0.30"
        assert explain(finding, push, "0.31.0") is None  # fixed there
        assert explain(finding, pull, "0.30.0") is None
    # wrong bytes, a hang or another outcome are not that finding
    assert explain(_corrupt(), push, "0.30.0") is None
    assert explain(_diff(("byte_exact", "outcome")), push, "0.30.0") is None
    assert explain(_diff(("nbytes", "outcome"), outcomes=("ok", "hang")), push, "0.30.0") is None
    failed = Finding("not-ok", "vllm", "outcome request-failure without faults: ...",
                     "vllm: not-ok: request-failure (stall) | m push")
    assert explain(failed, push, "0.30.0") is None
    # a post that raised, failed by decode's watchdog as a stall
    stall = _diff(("failure_class", "nbytes"), outcomes=("request-failure", "request-failure"))
    post = dataclasses.replace(push, faults=frozenset({("fail-transfer", "setup")}))
    assert explain(stall, post, "0.30.0") == "push-post-failure-unreported-0.30"
    assert explain(stall, post, "0.31.0") is None
    check = dataclasses.replace(push, faults=frozenset({("fail-transfer", "poll")}))
    assert explain(stall, check, "0.30.0") is None  # 0.30.0 reports a raising check


def test_every_entry_names_where_it_is_documented() -> None:
    docs = (Path(__file__).resolve().parent.parent / "docs" / "vllm.md").read_text()
    triage = (REPORTS / "README.md").read_text()
    names = [k.name for k in KNOWN]
    assert len(set(names)) == len(names)
    for known in KNOWN:
        path, _, _ = known.where.partition(":")
        assert path in ("docs/vllm.md", "reports/fuzz/README.md"), known.name
        assert known.name in (docs + triage), f"{known.name} is not named in {path}"


ONE_ENTRY = {"vllm-0.34.0-kimi": 1, "vllm-0.34.0-qwen": 1, "nixl-vllm-0.34.0": 1}


@pytest.mark.parametrize("folder", VLLM_REPORTS)
def test_the_committed_vllm_reports_are_explained_as_they_say(folder) -> None:
    """Every finding of the committed runs against vLLM, explained again from its regenerated
    scenario file, gets the name the report stored; the only new ones are those triaged."""
    data = json.loads((REPORTS / folder / "fuzz.json").read_text())
    options = FuzzOptions(seed=data["seed"], count=data["count"], presets=tuple(data["presets"]),
                          faults=data["faults"], implementation=data["implementation"])
    assert data["findings"] > 0
    seen, new = set(), set()
    for case in data["cases"]:
        if not case["findings"]:
            continue
        (scenario,) = parse_scenarios(generate(options.seed, case["index"], options)[0])
        deployment = facts(scenario)
        for stored in case["findings"]:
            finding = Finding(stored["kind"], stored["implementation"], stored["detail"],
                              stored["signature"], fields=tuple(stored.get("fields", ())),
                              vllm_moved_less=stored.get("vllm_moved_less"),
                              outcomes=tuple(stored["outcomes"]) if stored.get("outcomes")
                              else None)
            assert explain(finding, deployment, data["vllm_version"]) == stored["known"], (
                case["index"], stored["signature"])
            seen.add(stored["known"])
            if stored["known"] is None:
                new.add(case["index"])
    assert new == TRIAGED_NEW.get(folder, set())
    assert data["new_findings"] == sum(f["known"] is None for c in data["cases"]
                                       for f in c["findings"])
    # every report exercises more than one entry, but the 0.34.0 runs that one entry
    # explains whole (the push refusal: KimiLinear and Qwen3-Next only, and over real NIXL)
    assert len(seen - {None}) >= ONE_ENTRY.get(folder, 2)
    if data.get("hkvsim_transfer_extent") == "needed":  # the core moved what 0.34.0 moves
        assert not seen & {"unheld-state-slots-0.34", "sub-blocks-past-last-token-0.34"}


def test_allow_known_lets_a_run_whose_findings_are_all_explained_exit_0(monkeypatch,
                                                                          capsys) -> None:
    from hkvsim import fuzz as fuzz_module

    def fake(options, *, out_dir=None, on_case=None, run=None):
        case = fuzz_module.FuzzCase(index=0, text="", preset="tiny-deepseek", mode="pull",
                                    faulty=False, status="checked")
        case.findings = [dataclasses.replace(_corrupt(), known=known)]
        return fuzz_module.FuzzReport(options, [case], 0.1, False, "0.33.0")

    monkeypatch.setattr(fuzz_module, "fuzz", fake)
    for known, allow, status in (("mla-block-size-ratio-last-block", True, 0),
                                 ("mla-block-size-ratio-last-block", False, 1),
                                 (None, True, 1)):
        argv = ["fuzz", "--implementation", "both", "--count", "1"] + (
            ["--allow-known"] if allow else [])
        assert cli.main(argv) == status, (known, allow)
        out = capsys.readouterr().out
        assert ("1 new" if known is None else "0 new") in out
        assert ("NEW" if known is None else f"[{known}]") in out


def test_the_0_34_entries_need_their_release_deployment_and_shape() -> None:
    """0.34.0 refuses push between engines of different block geometry (a hybrid's logical
    block follows its TP) and moves fewer bytes than hkvsim's core in two hybrid cases; each
    entry needs 0.34.0, its deployment and its shape."""
    kimi = _facts(is_mla=True, is_hybrid=True, kv_heads=None, prefill_block=64, decode_block=64,
                  prefill_blocks=(64, 640), decode_blocks=(64, 320), uneven_groups=True,
                  transfer_extent="allocated")
    refused = _diff(("handshake", "outcome", "status"), outcomes=("ok", "handshake-error"))
    push = dataclasses.replace(kimi, mode="push", prefill_tp=1, decode_tp=2)
    assert explain(refused, push, "0.34.0") == "push-block-geometry-refused-0.34"
    # 0.33.0 ran this pair (equal kernel blocks): a refusal there is new
    assert explain(refused, push, "0.33.0") is None
    same = dataclasses.replace(push, decode_blocks=(64, 640), decode_tp=1)
    assert explain(refused, same, "0.34.0") is None  # equal geometry: a refusal is new
    assert explain(refused, dataclasses.replace(push, mode="pull"), "0.34.0") is None
    # fewer bytes, same outcomes: the unheld group slots of an uneven hybrid, push or pull
    fewer = dataclasses.replace(_diff(("descriptors", "nbytes", "per_rank"), outcomes=("ok", "ok")),
                                vllm_moved_less=True)
    # vLLM moving more, or a report that did not record which, is not a smaller transfer
    for more in (False, None):
        assert explain(dataclasses.replace(fewer, vllm_moved_less=more), same, "0.34.0") is None
    assert explain(fewer, same, "0.34.0") == "unheld-state-slots-0.34"
    assert explain(fewer, same, "0.33.0") is None
    # only where the file ran the core with the reference extent: beside 0.34.0 the core
    # otherwise moves what 0.34.0 moves, so fewer bytes under vLLM are new
    for extent in (None, "needed"):
        assert explain(fewer, dataclasses.replace(same, transfer_extent=extent), "0.34.0") is None
    even = dataclasses.replace(same, uneven_groups=False)
    assert explain(fewer, even, "0.34.0") is None
    parted = _diff(("descriptors", "nbytes"), outcomes=("ok", "request-failure"))
    assert explain(parted, same, "0.34.0") is None  # a smaller transfer leaves outcomes alone
    # ... or kernel blocks past the last token, pulled between different block geometries
    qwen = _facts(is_hybrid=True, kv_heads=2, prefill_blocks=(16, 16), decode_blocks=(64, 64),
                  decode_block=64, transfer_extent="allocated")
    assert explain(fewer, qwen, "0.34.0") == "sub-blocks-past-last-token-0.34"
    for extent in (None, "needed"):
        assert explain(fewer, dataclasses.replace(qwen, transfer_extent=extent), "0.34.0") is None
    assert explain(fewer, dataclasses.replace(qwen, decode_blocks=(16, 16)), "0.34.0") is None
    assert explain(fewer, dataclasses.replace(qwen, is_hybrid=False), "0.34.0") is None
    # a push across those geometries is refused in 0.34.0: one that ran and moved less is new
    assert explain(fewer, dataclasses.replace(qwen, mode="push"), "0.34.0") is None
    # damage, or outcomes that part, are not a smaller transfer
    assert explain(_diff(("byte_exact", "nbytes")), qwen, "0.34.0") is None
    assert explain(_diff(("nbytes",), outcomes=("ok", "request-failure")), qwen, "0.34.0") is None


def test_facts_read_block_geometry_and_uneven_groups_from_a_scenario() -> None:
    text = ('[scenario]\nname = "f"\n[model]\npreset = "{p}"\n[prefill]\ntp = 1\n'
            '[decode]\ntp = 2\n[workload]\nrequests = 1\nprompt_tokens = [100]\n')
    kimi = facts(parse_scenarios(text.format(p="tiny-kimi-linear"), source="f.toml")[0])
    # MLA pages do not shrink with TP, KDA state does: the logical block halves (640 -> 320)
    assert (kimi.prefill_blocks, kimi.decode_blocks) == ((64, 640), (64, 320))
    assert kimi.block_geometry_differs and kimi.uneven_groups  # 3 MLA, 7 KDA in groups of 3
    qwen = facts(parse_scenarios(text.format(p="tiny-qwen3-next"), source="f.toml")[0])
    assert not qwen.uneven_groups  # 3 attention, 9 GDN
    llama = facts(parse_scenarios(text.format(p="tiny-llama"), source="f.toml")[0])
    assert not llama.block_geometry_differs and not llama.uneven_groups
    # the file's own transfer extent, None where it leaves it to the release
    assert kimi.transfer_extent is None and not kimi.core_moved_allocated
    for extent in ("allocated", "needed"):
        chosen = text.replace("[workload]", f'[connector]\ntransfer_extent = "{extent}"\n'
                              "[workload]")
        got = facts(parse_scenarios(chosen.format(p="tiny-kimi-linear"), source="f.toml")[0])
        assert got.transfer_extent == extent
        assert got.core_moved_allocated == (extent == "allocated")


def test_vllm_moved_less_only_where_every_request_whose_bytes_differ_moved_less() -> None:
    from hkvsim.fuzz import vllm_moved_less
    from hkvsim.implementations.diff import Difference

    def nbytes(request: int, core: int, vllm: int) -> Difference:
        return Difference("v", request, "nbytes", core, vllm)

    descriptors = Difference("v", 0, "descriptors", 126, 118)
    assert vllm_moved_less([descriptors, nbytes(0, 1410048, 1260544), nbytes(2, 918528, 769024)])
    assert not vllm_moved_less([nbytes(0, 1410048, 1260544), nbytes(2, 918528, 918529)])
    assert not vllm_moved_less([descriptors])  # no request's bytes differ
    assert not vllm_moved_less([])


def test_a_second_raising_read_check_is_known_in_0_26_and_0_27_where_a_rank_reads_twice() -> None:
    """pull-second-read-check-assert: a poll-phase fail-transfer where a decode rank posts more
    than one READ per request (prefill TP above decode TP, not pure MLA), failures or
    accounting differences only; 0.33.0 and 0.34.0 do not do it."""
    poll = frozenset({("fail-transfer", "poll")})
    gqa = _facts(prefill_tp=2, decode_tp=1, faults=poll)
    failed = _diff(("failure_class", "status"), outcomes=("request-failure", "request-failure"))
    recomputed = _diff(("per_rank", "sources"), outcomes=("ok", "ok"))
    for version in ("0.26.0", "0.27.0"):
        for finding in (failed, recomputed):
            assert explain(finding, gqa, version) == "pull-second-read-check-assert"
    for version in ("0.33.0", "0.34.0"):
        assert explain(failed, gqa, version) is None
    # one READ per decode rank: pure MLA with a larger prefill TP, or equal / smaller TPs
    assert explain(failed, dataclasses.replace(gqa, is_mla=True, kv_heads=None),
                   "0.27.0") is None
    # (a hybrid's failed READ is the earlier, wider hybrid-failed-read-reported-loaded entry's)
    hybrid_mla = dataclasses.replace(gqa, is_mla=True, is_hybrid=True, kv_heads=None)
    assert explain(failed, hybrid_mla, "0.27.0") == "hybrid-failed-read-reported-loaded"
    for tps in ((1, 1), (1, 2)):
        assert explain(failed, dataclasses.replace(gqa, prefill_tp=tps[0], decode_tp=tps[1]),
                       "0.27.0") is None
    # another fault, another phase, push, or wrong bytes: not this finding
    for faults in (frozenset({("fail-transfer", "completion")}),
                   frozenset({("stall-transfer", None)}), frozenset()):
        assert explain(failed, dataclasses.replace(gqa, faults=faults), "0.27.0") is None
    # (push: that is 0.26.0's and 0.27.0's unreported failed WRITE)
    assert explain(failed, dataclasses.replace(gqa, mode="push"), "0.27.0") == (
        "push-failed-write-unreported-0.26")
    assert explain(failed, dataclasses.replace(gqa, mode="push"), "0.33.0") is None
    assert explain(_diff(("byte_exact", "outcome")), gqa, "0.27.0") is None


def test_every_entry_names_only_releases_the_harness_drives() -> None:
    """A finding recorded for a release the harness does not drive could never be checked."""
    from hkvsim.implementations.vllm.engine import SUPPORTED_VERSIONS

    for known in KNOWN:
        if known.releases is not None:
            assert known.releases <= set(SUPPORTED_VERSIONS), (known.name, known.releases)


def test_a_release_the_harness_does_not_drive_is_refused_naming_why() -> None:
    from hkvsim.geometry.presets import preset
    from hkvsim.implementations.vllm.engine import SUPPORTED_VERSIONS, unsupported

    model = preset("tiny-deepseek")
    for version in ("0.25.0", "0.35.0", "0.30.1"):  # x.y.0 releases from 0.26.0 to 0.34.0
        why = unsupported(model, "pull", version)
        assert why is not None and f"vLLM {version} is not driven" in why, why
        assert why.endswith("(runnable: " + ", ".join(SUPPORTED_VERSIONS) + ")"), why
    for version in SUPPORTED_VERSIONS:
        assert unsupported(model, "pull", version) is None, version
    assert SUPPORTED_VERSIONS == ("0.26.0", "0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0",
                                  "0.32.0", "0.33.0", "0.34.0")
    # scripts/with-vllm provisions exactly these (and scripts/vllm-releases runs them)
    script = (Path(__file__).resolve().parent.parent / "scripts" / "with-vllm").read_text()
    (line,) = [x for x in script.splitlines() if x.startswith("supported=")]
    assert tuple(line.split("=", 1)[1].strip('"').split()) == SUPPORTED_VERSIONS


def test_vllms_outcome_is_checked_as_each_entry_says_with_and_without_faults() -> None:
    # push-sent-unreported-0.30 checks vLLM's outcome under faults too: a hang is not it
    counted = dataclasses.replace(_diff(("nbytes", "outcome"), outcomes=("ok", "hang")),
                                  vllm_moved_less=True)
    faulted = _facts(mode="push", faults=frozenset({("drop-notification", None)}))
    assert explain(counted, faulted, "0.30.0") is None
    assert explain(dataclasses.replace(counted, outcomes=("ok", "lease-expired")), faulted,
                   "0.30.0") == "push-sent-unreported-0.30"
    # 0.26.0's hybrid MLA pull assert checks it only without faults (faults may make it another)
    kimi = _facts(is_mla=True, is_hybrid=True, kv_heads=None, prefill_tp=4, decode_tp=2)
    other = _diff(("outcome", "transfers"), outcomes=("ok", "lease-expired"))
    assert explain(other, kimi, "0.26.0") is None
    assert explain(dataclasses.replace(other, outcomes=("ok", "request-failure")), kimi,
                   "0.26.0") == "pr49762-hybrid-mla-pull-assert"
    dropped = dataclasses.replace(kimi, faults=frozenset({("drop-notification", None)}))
    assert explain(other, dropped, "0.26.0") == "pr49762-hybrid-mla-pull-assert"


def test_0_26_leaks_a_local_list_only_in_a_pull_from_smaller_blocks_over_several_lists() -> None:
    leak = Finding("leak", "vllm", "left behind", "vllm: leak: after_shutdown | m pull")
    ratio = _facts(decode_block=32, prefill_tp=2, decode_tp=1)
    assert explain(leak, ratio, "0.26.0") == "block-size-ratio-local-list-leak-0.26"
    assert explain(leak, dataclasses.replace(ratio, prefill_tp=1, prefill_instances=2),
                   "0.26.0") == "block-size-ratio-local-list-leak-0.26"
    assert explain(leak, ratio, "0.27.0") is None
    for other in (dataclasses.replace(ratio, mode="push", decode_block=16),  # push
                  dataclasses.replace(ratio, decode_block=16),  # equal blocks
                  dataclasses.replace(ratio, prefill_tp=1)):  # one remote list
        assert explain(leak, other, "0.26.0") is None, other
