"""Issue #10: outputs never claim what was not checked. A timing-only run (``--timing-only`` or
``[workload] verify = false``) reports its bytes as not verified (``null`` in JSON, "not
verified" in text) and cannot meet ``[expect] byte_exact = true``; the corrupted count shows
whatever the outcome; ``hkvsim report`` follows the exit-status rule and states, per variant,
what the oracle found. Only ``hkvsim.cli.main`` and the run loop are used, so this file runs
unchanged against older versions (where it fails)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hkvsim.cli import main
from hkvsim.cluster import run_scenario
from hkvsim.results import result_json
from hkvsim.scenario import load_scenarios

pytestmark = pytest.mark.timeout(120)

TINY = """
[scenario]
name = "{name}"
[model]
preset = "tiny-kimi-linear"
[prefill]
tp = 1
[decode]
tp = 2
[workload]
requests = 2
prompt_tokens = 700
"""
# decode gets the attention KV but never the state: every request is corrupted
CORRUPTING = TINY + '[connector]\nquirks = ["attention-only-transfer"]\n'
# one request fails, the other is silently corrupted
MIXED = CORRUPTING + """
[[faults]]
kind = "fail-transfer"
request = 1
[expect]
outcome = "request-failure"
failed_requests = 1
"""
NOT_VERIFIED = "no byte was verified"


def _file(tmp_path: Path, body: str, name: str = "s.toml") -> Path:
    path = tmp_path / name
    path.write_text(body)
    return path


def _run_json(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, dict]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


# ---- issue #10 item 2: a timing-only run verified nothing, and says so ---------------------------
def test_timing_only_run_of_a_corrupting_scenario_claims_no_bytes(tmp_path, capsys) -> None:
    path = _file(tmp_path, CORRUPTING.format(name="corrupting"))
    code, data = _run_json(capsys, "run", str(path), "--timing-only")
    assert code == 1
    assert data["verified"] is False and data["verification"] == "timing-only"
    req = data["requests"]
    assert req["byte_exact"] is None and req["mismatched_bytes"] is None
    assert req["corrupted"] is None
    (problem,) = data["expectation_problems"]
    assert NOT_VERIFIED in problem and "--timing-only" in problem
    assert "set [expect] byte_exact = false" in problem
    # the same file with the bytes checked is caught
    code, data = _run_json(capsys, "run", str(path))
    assert code == 1 and data["verified"] is True and data["requests"]["corrupted"] == 2


def test_timing_only_text_says_not_verified(tmp_path, capsys) -> None:
    path = _file(tmp_path, CORRUPTING.format(name="corrupting"))
    assert main(["run", str(path), "--timing-only"]) == 1
    out = capsys.readouterr().out
    assert "not verified" in out and "byte-exact" not in out
    assert "EXPECTATION NOT MET" in out and "expectation met" not in out
    reason = [line for line in out.splitlines() if line.startswith("expectation:")]
    assert len(reason) == 1 and "set [expect] byte_exact = false" in reason[0]


def test_verify_false_meets_only_an_expectation_that_does_not_ask_for_exact_bytes(
        tmp_path, capsys) -> None:
    body = TINY.format(name="timing") + "verify = false\n"
    path = _file(tmp_path, body)
    code, data = _run_json(capsys, "run", str(path))
    assert code == 1 and len(data["expectation_problems"]) == 1
    assert NOT_VERIFIED in data["expectation_problems"][0]
    path = _file(tmp_path, body + "[expect]\nbyte_exact = false\n", "ok.toml")
    code, data = _run_json(capsys, "run", str(path))
    assert code == 0 and data["expectation_met"] and data["verified"] is False


def test_run_result_says_whether_the_oracle_ran(tmp_path) -> None:
    (scenario,) = load_scenarios(_file(tmp_path, TINY.format(name="t")))
    assert run_scenario(scenario).verified is True
    assert run_scenario(scenario, timing_only=True).verified is False
    (quiet,) = load_scenarios(_file(tmp_path, TINY.format(name="q") + "verify = false\n", "q.toml"))
    assert run_scenario(quiet).verified is False


def test_sweep_json_says_verified_per_variant(tmp_path, capsys) -> None:
    body = TINY.format(name="sw") + '[sweep]\nworkload.verify = [true, false]\n'
    code, data = _run_json(capsys, "sweep", str(_file(tmp_path, body)))
    assert code == 1  # the unverified variant cannot meet byte_exact = true
    assert [d["verified"] for d in data["scenarios"]] == [True, False]
    assert data["verified"] is False and data["expectation_met"] is False


# ---- issue #10 item 2: the corrupted count, whatever the outcome ---------------------------------
def test_corrupted_requests_are_shown_when_others_failed(tmp_path, capsys) -> None:
    path = _file(tmp_path, MIXED.format(name="mixed"))
    code, data = _run_json(capsys, "run", str(path))
    assert code == 1
    assert data["requests"]["failed"] == 1 and data["requests"]["corrupted"] == 1
    assert main(["run", str(path)]) == 1
    assert "1 corrupted" in capsys.readouterr().out
    sweep = _file(tmp_path, MIXED.format(name="mixed") + '[sweep]\nprefill.tp = [1]\n', "w.toml")
    assert main(["sweep", str(sweep)]) == 1
    assert "1 corrupted" in capsys.readouterr().out




# ---- issue #10 item 3: `hkvsim report` follows the exit-status rule and tells the truth ---------
def _report(tmp_path: Path, *inputs: Path, extra: tuple[str, ...] = ()) -> tuple[int, str, dict]:
    out = tmp_path / "out"
    code = main(["report", *map(str, inputs), "--out", str(out),
                 "--calibration", str(tmp_path / "no-calibration"), *extra])
    return code, (out / "report.md").read_text(), json.loads((out / "report.json").read_text())


def test_report_of_a_corrupting_run_exits_1_and_says_what_the_oracle_found(tmp_path) -> None:
    body = CORRUPTING.format(name="corrupting") + '[sweep]\nconnector.mode = ["pull", "push"]\n'
    code, text, data = _report(tmp_path, _file(tmp_path, body))
    assert code == 1
    assert "verified every byte" not in text and "found no wrong byte" not in text
    assert ("The oracle found wrong bytes in 2 of the 2 variants** (see Problems); 0 were "
            "verified with no wrong byte.\n") in text
    assert "## Problems" in text and "corruption" in text and "state never arrived" in text
    assert data["expectation_met"] is False
    assert [v["verification"] for v in data["variants"]] == ["failed", "failed"]
    assert [v["corrupted"] for v in data["variants"]] == [2, 2]
    assert all(any("state never arrived" in e for e in v["explanations"])
               for v in data["variants"])


def test_report_shows_corrupted_requests_beside_a_failure(tmp_path) -> None:
    code, text, data = _report(tmp_path, _file(tmp_path, MIXED.format(name="mixed")))
    assert code == 1
    (variant,) = data["variants"]
    # whichever outcome wins (request-failure, or corruption once that takes precedence), the
    # corrupted request is counted
    assert variant["outcome"] in ("request-failure", "corruption") and variant["corrupted"] == 1
    row = next(line for line in text.splitlines() if line.startswith("| mixed | "))
    assert f"| {variant['outcome']} |" in row and "| 1 |" in row


def test_report_of_a_hung_run_exits_1(tmp_path, capsys) -> None:
    assert main(["run", str(_file(tmp_path, TINY.format(name="t"))), "--json", "--requests"]) == 0
    saved = json.loads(capsys.readouterr().out)
    # what a run with a request left pending looks like (the simulator's watchdogs make one
    # hard to provoke on purpose)
    saved.update(outcome="hang", expectation_met=False,
                 expectation_problems=["1 request(s) never reached a terminal state"])
    saved["requests"].update(hung=1, completed=1, byte_exact=1)
    pending = saved["request_details"][1]
    pending["status"] = "pending"
    pending["times"].pop("done", None)
    path = tmp_path / "hung.json"
    path.write_text(json.dumps(saved))
    code, text, data = _report(tmp_path, path)
    assert code == 1
    assert "hang" in text.split("## Summary")[0] and "## Problems" in text
    assert "never reached a terminal state" in text
    assert "did not complete" in text and "in all 1 variants and found no wrong byte." not in text
    assert data["variants"][0]["outcome"] == "hang"


def test_timing_only_report_says_nothing_was_verified(tmp_path) -> None:
    path = _file(tmp_path, TINY.format(name="t"))
    code, text, data = _report(tmp_path, path, extra=("--timing-only",))
    assert code == 1  # [expect] byte_exact = true (the default) cannot be met
    assert "No byte was verified" in text and "oracle checked every byte" not in text
    assert "all 1 variants ran timing-only" in text
    assert [v["verification"] for v in data["variants"]] == ["timing-only"]
    assert data["variants"][0]["mismatched_bytes"] is None
    path.write_text(TINY.format(name="t") + "[expect]\nbyte_exact = false\n")
    code, text, _ = _report(tmp_path, path, extra=("--timing-only",))
    assert code == 0 and "No byte was verified" in text


# ---- a run where no request completed checked nothing, and says so ------------------------------
# prefill and decode of a model with attention heads disagree on the KV cache layout: the
# handshake is refused (V5), every request fails, and not one byte reaches the oracle
REFUSED = TINY.replace("tiny-kimi-linear", "tiny-llama").replace(
    "[prefill]\ntp = 1\n", '[prefill]\ntp = 1\nkv_cache_layout = "NHD"\n')


def test_a_run_where_no_request_completed_is_not_called_verified(tmp_path, capsys) -> None:
    body = REFUSED.format(name="refused") + (
        '[expect]\noutcome = "handshake-error"\nerror_match = "V5"\n')
    path = _file(tmp_path, body)
    code, data = _run_json(capsys, "run", str(path))
    assert code == 0 and data["outcome"] == "handshake-error"  # as expected: that is not the lie
    assert data["requests"]["completed"] == 0
    assert data["verification"] == "nothing-checked"
    assert main(["run", str(path)]) == 0
    text = capsys.readouterr().out
    assert "not verified" in text and "nothing reached the oracle" in text
    code, text, report = _report(tmp_path, path)
    assert code == 0
    assert ("**No byte was verified**: of the 1 variants, 1 completed no request, so no byte "
            "reached the oracle (see Problems).\n") in text
    assert report["verification"] == {"verified": 0, "nothing-checked": 1, "timing-only": 0,
                                      "failed": 0}
    assert [v["verification"] for v in report["variants"]] == ["nothing-checked"]


def test_a_sweep_says_which_variants_checked_nothing(tmp_path) -> None:
    """One variant completes its requests (verified), the other is refused (nothing checked):
    the page counts them apart and does not say every variant was checked."""
    body = TINY.replace("tiny-kimi-linear", "tiny-llama").format(name="mixed") + (
        '[sweep]\nprefill.kv_cache_layout = ["HND", "NHD"]\n')
    code, text, report = _report(tmp_path, _file(tmp_path, body))
    assert code == 1  # the NHD variant's outcome is handshake-error, not ok
    assert [v["verification"] for v in report["variants"]] == ["verified", "nothing-checked"]
    assert ("1 of the 2 variants were verified byte for byte by the oracle (no wrong byte); of "
            "the others, 1 completed no request, so no byte reached the oracle") in text
    assert "in all 2 variants" not in text
    sentence = next(line for line in text.splitlines() if line.startswith("**Verification.**"))
    assert "timing-only" not in sentence, sentence


# ---- [expect]: each check judges what it names ---------------------------------------------------
def _expect(tmp_path: Path, capsys: pytest.CaptureFixture, expect: str) -> dict:
    """MIXED (request 1's transfer fails, request 0 completes with wrong bytes) under ``expect``."""
    body = MIXED.format(name="mixed").split("[expect]")[0] + "[expect]\n" + expect
    _, data = _run_json(capsys, "run", str(_file(tmp_path, body)))
    return data


def test_expected_wrong_bytes_leave_the_rest_of_the_outcome_to_judge(tmp_path, capsys) -> None:
    """byte_exact = false: the corruption is expected, so the outcome judged is the one besides
    it (a request failed); the corrupted request is still reported."""
    data = _expect(tmp_path, capsys, 'outcome = "request-failure"\nbyte_exact = false\n')
    assert data["outcome"] == "corruption" and data["requests"]["corrupted"] == 1
    assert data["expectation_met"], data["expectation_problems"]
    data = _expect(tmp_path, capsys, 'outcome = "ok"\nbyte_exact = false\n')
    assert not data["expectation_met"]
    assert data["expectation_problems"][0].startswith(
        "outcome is 'request-failure', expected 'ok': request 1 transfer_failed: injected")


def test_reason_and_error_match_judge_the_failed_requests_only(tmp_path, capsys) -> None:
    met = _expect(tmp_path, capsys, 'outcome = "request-failure"\nbyte_exact = false\n'
                  'reason = "transfer_failed"\nerror_match = "^transfer_failed: injected"\n')
    assert met["expectation_met"], met["expectation_problems"]
    unmet = _expect(tmp_path, capsys, 'outcome = "request-failure"\nbyte_exact = false\n'
                    'reason = "stall"\nerror_match = "stall"\n')
    assert unmet["expectation_problems"] == [
        "error does not match /stall/: transfer_failed: injected transfer failure (state ERR)",
        "request 1 failed with 'transfer_failed', expected 'stall'"]


def test_one_wrong_word_makes_a_completed_request_corrupted(tmp_path) -> None:
    """The smallest corruption the oracle reports (one 8-byte word of one completed request)
    turns the run into a corruption: counted, failed verification, expectation not met."""
    (scenario,) = load_scenarios(_file(tmp_path, TINY.format(name="one word")))
    result = run_scenario(scenario)
    assert result.outcome == "ok" and result.corrupted == 0
    result.records[0].mismatched_words = 1
    data = result_json(result)
    assert data["outcome"] == "corruption" and data["verification"] == "failed"
    assert data["requests"]["corrupted"] == 1 and data["requests"]["mismatched_bytes"] == 8
    assert data["requests"]["byte_exact"] == 1
    assert not data["expectation_met"]
