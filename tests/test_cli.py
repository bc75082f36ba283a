"""The command line: plan --json acceptance numbers, run/sweep exit codes, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hkvsim.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _scenario(tmp_path: Path, body: str, name: str = "s.toml") -> Path:
    path = tmp_path / name
    path.write_text(body)
    return path


def _plan(capsys, path: Path) -> dict:
    assert main(["plan", str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


KIMI = """
[scenario]
name = "kimi"
[model]
preset = "kimi-linear-48b"
[prefill]
tp = {p}
[decode]
tp = {d}
[workload]
requests = 1
prompt_tokens = 8192
"""


@pytest.mark.parametrize("p,d", [(1, 2), (4, 8)])
def test_plan_json_reports_kimi_acceptance_numbers(tmp_path, capsys, p, d) -> None:
    plan = _plan(capsys, _scenario(tmp_path, KIMI.format(p=p, d=d)))
    expected = {1: (30, 1920), 2: (15, 960), 4: (8, 512), 8: (4, 256)}
    for side, tp in (("prefill", p), ("decode", d)):
        s = plan[side]
        assert s["tp"] == tp
        assert s["kernel_block_size"] == 64
        assert (s["physical_blocks_per_logical"], s["logical_block_size"]) == expected[tp]
        assert len(s["regions"]) == 7 and all(r["is_mla"] for r in s["regions"])
        assert {r["block_len"] for r in s["regions"]} == {73_728}
        assert s["state_bytes_per_request"] == 20 * 2_170_880 // tp
        assert s["kv_bytes_per_token"] == 8_064
        assert {"stride", "num_blocks"} <= set(s["regions"][0])
    assert plan["handshake"] == {"ok": True, "error": None}
    (req,) = plan["requests"]
    assert req["descriptors"] > 0 and req["bytes"] > 0 and req["transfers"] == d


@pytest.mark.parametrize("model,kv", [("deepseek-v3", 70_272), ("llama-3.1-8b", 131_072),
                                      ("qwen3-next-80b", 24_576)])
def test_plan_json_reports_kv_bytes_per_token(tmp_path, capsys, model, kv) -> None:
    body = KIMI.format(p=1, d=1).replace("kimi-linear-48b", model).replace("8192", "64")
    plan = _plan(capsys, _scenario(tmp_path, body))
    assert plan["prefill"]["kv_bytes_per_token"] == kv


def test_plan_reports_a_refused_handshake(tmp_path, capsys) -> None:
    plan = _plan(capsys, ROOT / "scenarios/handshake/xfail-prefill-block-larger.toml")
    assert plan["handshake"]["ok"] is False
    assert "V2" in plan["handshake"]["error"]


def test_run_exit_status_follows_the_expectation(tmp_path, capsys) -> None:
    ok = _scenario(tmp_path, KIMI.format(p=1, d=1).replace("kimi-linear-48b", "tiny-kimi-linear")
                   .replace("8192", "700"))
    assert main(["run", str(ok), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["outcome"] == "ok" and data["expectation_met"]
    assert data["requests"]["byte_exact"] == 1 and data["requests"]["mismatched_bytes"] == 0
    assert {"prefill_blocks", "decode_blocks", "open_handles", "after_shutdown"} <= set(data["leaks"])
    assert not any(data["leaks"].values()), data["leaks"]
    wrong = _scenario(tmp_path, ok.read_text() + '[expect]\noutcome = "request-failure"\n', "w.toml")
    assert main(["run", str(wrong), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert not data["expectation_met"]
    assert "outcome is 'ok', expected 'request-failure'" in data["expectation_problems"][0]


def test_quirk_makes_run_fail_with_an_explanation(tmp_path, capsys) -> None:
    body = KIMI.format(p=1, d=2).replace("kimi-linear-48b", "tiny-kimi-linear").replace(
        "8192", "700") + '[connector]\nquirks = ["attention-only-transfer"]\n'
    assert main(["run", str(_scenario(tmp_path, body))]) == 1
    out = capsys.readouterr().out
    assert "corruption" in out and "state never arrived" in out


BAD = [
    ("unknown preset", '[model]\npreset = "llama-70b"', "model.preset"),
    ("unknown key", '[model]\npreset = "tiny-llama"\n[prefill]\ntpp = 2', "prefill.tpp"),
    ("wrong type", '[model]\npreset = "tiny-llama"\n[prefill]\ntp = "2"', "prefill.tp"),
    ("malformed", '[model\npreset = "tiny-llama"', "malformed TOML"),
    ("tp vs heads", '[model]\npreset = "tiny-llama"\n[prefill]\ntp = 3', "does not divide"),
]


@pytest.mark.parametrize("label,section,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gives_one_line_and_exit_2(tmp_path, label, section, needle) -> None:
    body = '[scenario]\nname = "bad"\n' + section + "\n[workload]\nrequests = 1\nprompt_tokens = 64\n"
    if label == "malformed":
        body = section
    path = _scenario(tmp_path, body)
    proc = subprocess.run([sys.executable, "-m", "hkvsim.cli", "run", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hkvsim: error: ")
    assert needle in lines[0]
    assert "Traceback" not in proc.stderr


def test_missing_hf_config_field_is_one_line(tmp_path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}))
    path = _scenario(tmp_path, '[scenario]\nname = "x"\n[model]\nhf_config = "config.json"\n'
                               '[workload]\nrequests = 1\nprompt_tokens = 64\n')
    proc = subprocess.run([sys.executable, "-m", "hkvsim.cli", "plan", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "needs field" in proc.stderr and proc.stderr.count("\n") == 1


def test_help_lists_the_commands() -> None:
    proc = subprocess.run([sys.executable, "-m", "hkvsim.cli", "--help"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0
    for command in ("plan", "run", "sweep", "presets", "quirks"):
        assert command in proc.stdout


def _text_of_run(capsys, monkeypatch, path: Path, leaks: dict[str, int] | None = None
                 ) -> str:
    """`hkvsim run FILE` as a terminal shows it (wide, so that no line wraps), optionally with
    the run's leak counters replaced after the run."""
    from hkvsim import results

    if leaks is not None:
        real = results.result_json

        def leaky(*args, **kwargs):
            data = real(*args, **kwargs)
            data["leaks"] = dict(data["leaks"], **leaks)
            return data
        monkeypatch.setattr(results, "result_json", leaky)  # cli imports it when it runs
    monkeypatch.setenv("COLUMNS", "300")
    main(["run", str(path)])
    return capsys.readouterr().out


def test_run_text_names_what_leaked_and_says_none_otherwise(tmp_path, capsys,
                                                            monkeypatch) -> None:
    path = _scenario(tmp_path, KIMI.format(p=1, d=2).replace("kimi-linear-48b", "tiny-kimi-linear")
                     .replace("8192", "300"))
    clean = _text_of_run(capsys, monkeypatch, path)
    assert "leaks: none" in clean, clean
    leaked = _text_of_run(capsys, monkeypatch, path, {"decode_blocks": 3, "open_handles": 1})
    line = next(ln for ln in leaked.splitlines() if "leaks:" in ln)
    assert line.split("leaks: ")[1].strip() == "decode_blocks 3, open_handles 1", line


def test_sweep_text_of_a_single_variant(tmp_path, capsys, monkeypatch) -> None:
    body = (KIMI.format(p=1, d=1).replace("kimi-linear-48b", "tiny-llama").replace("8192", "40")
            + "[sweep]\ndecode.tp = [2]\n")
    monkeypatch.setenv("COLUMNS", "300")
    assert main(["sweep", str(_scenario(tmp_path, body))]) == 0
    out = capsys.readouterr().out
    assert "kimi: 1 variant(s)" in out
    row = next(ln for ln in out.splitlines() if "D.tp=2" in ln)
    assert row.split()[1:8:2] == ["D.tp=2", "ok", "met", "1/1"] and "exact" in row, row
    assert "D.tp = decode.tp" in out
