"""hkvsim.scenario: TOML schema, strict one-line errors, sweep expansion, token sampling."""

from __future__ import annotations

import datetime as dt
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hkvsim.connector.quirks import quirk_names
from hkvsim.geometry.presets import preset, preset_names
from hkvsim.scenario import (
    MAX_SWEEP_VARIANTS,
    EngineSection,
    PrefillSection,
    PromptRange,
    Scenario,
    ScenarioError,
    load_scenarios,
    parse_scenarios,
    sweepable_keys,
)

FIXTURES = Path(__file__).parent / "fixtures"
DESIGN_EXAMPLE = FIXTURES / "scenarios" / "design-example.toml"
HF_KIMI = FIXTURES / "hf" / "kimi-linear-48b" / "config.json"

MINIMAL = """\
[scenario]
name = "minimal"

[model]
preset = "tiny-llama"

[workload]
requests = 4
prompt_tokens = 100
"""


def write(tmp_path: Path, text: str, name: str = "scenario.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(text: str, name: str = "case.toml") -> str:
    with pytest.raises(ScenarioError) as info:
        parse_scenarios(text, source=name)
    message = str(info.value)
    assert "\n" not in message
    return message


# --- the DESIGN.md example and defaults --------------------------------------------------------


def test_design_example_parses() -> None:
    (s,) = load_scenarios(DESIGN_EXAMPLE)
    assert s.scenario.name == "kimi-linear 2P(TP2) -> 1D(TP4), pull"
    assert s.scenario.seed == 7
    assert s.model.preset == "kimi-linear-48b" and s.model.hf_config is None
    assert (s.prefill.tp, s.prefill.block_size, s.prefill.num_blocks) == (2, 64, 4096)
    assert s.prefill.prefix_caching is False
    assert s.decode.tp == 4 and s.decode.block_size is None
    assert s.connector.mode == "pull"
    assert s.connector.registration_order == "state-first"
    assert s.connector.quirks == ()
    assert s.fabric.profile == "h200-nvlink"
    assert s.workload.requests == 16
    assert s.workload.prompt_tokens == (1000, 8000)
    assert s.workload.prefix_hit_tokens == 0
    assert len(s.faults) == 1
    assert (s.faults[0].kind, s.faults[0].request) == ("drop-notification", 3)
    assert s.expect.outcome == "ok" and s.expect.byte_exact is True
    assert s.sweep_point == {} and s.source == str(DESIGN_EXAMPLE)
    assert s.model_spec() == preset("kimi-linear-48b")


def test_defaults() -> None:
    (s,) = parse_scenarios(MINIMAL)
    assert s.scenario.seed == 0 and s.scenario.description == ""
    assert s.prefill == PrefillSection() and s.prefill.tokens_per_second is None
    assert s.decode == EngineSection()
    for engine in (s.prefill, s.decode):
        assert (engine.tp, engine.instances, engine.block_size, engine.num_blocks) == (
            1, 1, None, None
        )
        assert engine.prefix_caching is False
        assert engine.kv_cache_layout == "HND" and engine.attention_backend is None
    c = s.connector
    assert (c.mode, c.registration_order, c.quirks) == ("pull", "sorted", ())
    assert (c.kv_load_failure_policy, c.lease_seconds, c.transfer_timeout_seconds) == (
        "fail", 30.0, 60.0
    )
    assert c.enforce_handshake_compat is True
    assert (c.descriptor_merge, c.host_buffer) == ("off", False)
    assert (s.fabric.profile, s.fabric.overrides) == ("h200-nvlink", {})
    w = s.workload
    assert (w.prefix_hit_tokens, w.arrival, w.rate, w.verify, w.max_inflight) == (
        0, "burst", None, True, None
    )
    assert s.faults == ()
    e = s.expect
    assert (e.outcome, e.error_match, e.byte_exact, e.failed_requests, e.reason) == (
        "ok", None, True, None, None
    )
    assert (s.sweep_point, s.source) == ({}, "<string>")


def test_sections_are_frozen() -> None:
    (s,) = parse_scenarios(MINIMAL)
    with pytest.raises(Exception):
        s.prefill.tp = 8  # type: ignore[misc]
    with pytest.raises(Exception):
        s.workload = s.workload  # type: ignore[misc]


def test_to_dict_is_json_and_round_trips() -> None:
    (s,) = load_scenarios(DESIGN_EXAMPLE)
    data = s.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["workload"]["prompt_tokens"] == [1000, 8000]
    assert data["connector"]["quirks"] == []
    assert Scenario.model_validate(data) == s


def test_toml_integer_is_accepted_for_floats() -> None:
    (s,) = parse_scenarios(MINIMAL + "[connector]\nlease_seconds = 5\n")
    assert s.connector.lease_seconds == 5.0 and isinstance(s.connector.lease_seconds, float)


def test_allowed_values_come_from_their_modules() -> None:
    for name in preset_names():
        (s,) = parse_scenarios(MINIMAL.replace('"tiny-llama"', json.dumps(name)))
        assert s.model.preset == name
    quirks = quirk_names()
    (s,) = parse_scenarios(MINIMAL + f"[connector]\nquirks = {json.dumps(quirks)}\n")
    assert s.connector.quirks == tuple(quirks)


def test_hf_config_resolved_relative_to_the_file(tmp_path: Path) -> None:
    pytest.importorskip("hkvsim.geometry.hf_config")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "config.json").write_text(HF_KIMI.read_text())
    text = MINIMAL.replace('preset = "tiny-llama"', 'hf_config = "models/config.json"')
    (s,) = load_scenarios(write(tmp_path, text))
    assert s.model.hf_config == str((tmp_path / "models" / "config.json").resolve())
    spec = s.model_spec()
    assert spec.attention_layers == preset("kimi-linear-48b").attention_layers


def test_hf_config_geometry_error_names_the_key(tmp_path: Path) -> None:
    pytest.importorskip("hkvsim.geometry.hf_config")
    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchForCausalLM"]}')
    text = MINIMAL.replace('preset = "tiny-llama"', 'hf_config = "config.json"')
    with pytest.raises(ScenarioError) as info:  # at load time: the engines' geometry is checked
        load_scenarios(write(tmp_path, text, "bad-model.toml"))
    assert str(info.value).startswith(f"{tmp_path / 'bad-model.toml'}: model.hf_config: ")


def test_hf_config_must_exist(tmp_path: Path) -> None:
    text = MINIMAL.replace('preset = "tiny-llama"', 'hf_config = "missing.json"')
    with pytest.raises(ScenarioError) as info:
        load_scenarios(write(tmp_path, text, "m.toml"))
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'm.toml'}: model.hf_config: no such file")
    assert str(tmp_path / "missing.json") in message


# --- errors: each names the file and the dotted key --------------------------------------------


@pytest.mark.parametrize(
    ("text", "prefix", "needles"),
    [
        pytest.param(
            MINIMAL + "[bogus]\nx = 1\n", "case.toml: bogus: unknown key",
            ["allowed: scenario, model, prefill", "sweep"], id="unknown-top-level",
        ),
        pytest.param(
            MINIMAL + "[prefill]\ntpp = 2\n", "case.toml: prefill.tpp: unknown key",
            ["allowed: tp, instances, block_size"], id="unknown-nested",
        ),
        pytest.param(
            MINIMAL + "[[faults]]\nkind = 'kill-rank'\nrank = 0\nwhen = 3\n",
            "case.toml: faults[0].when: unknown key", ["allowed: kind, request"],
            id="unknown-in-fault",
        ),
        pytest.param(
            MINIMAL.replace("prompt_tokens = 100", "prompt_tokens = {min = 2, max = 9, x = 1}"),
            "case.toml: workload.prompt_tokens.x: unknown key", ["allowed: min, max, distribution"],
            id="unknown-in-range",
        ),
        pytest.param(
            MINIMAL + "[prefill]\ntp = \"two\"\n", "case.toml: prefill.tp: expected an integer",
            ["got 'two'"], id="wrong-type-str",
        ),
        pytest.param(
            MINIMAL + "[decode]\ntp = true\n", "case.toml: decode.tp: expected an integer",
            ["got True"], id="wrong-type-bool-for-int",
        ),
        pytest.param(
            MINIMAL + "[connector]\nhost_buffer = 1\n",
            "case.toml: connector.host_buffer: expected true or false", ["got 1"],
            id="wrong-type-int-for-bool",
        ),
        pytest.param(
            MINIMAL + "[prefill]\ntp = 65\n", "case.toml: prefill.tp: expected a value <= 64",
            ["got 65"], id="tp-too-large",
        ),
        pytest.param(
            MINIMAL + "[connector]\nmode = \"pul\"\n", "case.toml: connector.mode: invalid value",
            ["got 'pul'", "allowed: 'pull', 'push'"], id="bad-enum",
        ),
        pytest.param(
            MINIMAL + "[connector]\nregistration_order = \"random\"\n",
            "case.toml: connector.registration_order: unknown registration_order",
            ["allowed: sorted, state-first, attention-first"], id="bad-registration-order",
        ),
        pytest.param(
            MINIMAL + "[connector]\nquirks = [\"no-such-quirk\"]\n",
            "case.toml: connector.quirks[0]: unknown quirk",
            ["got 'no-such-quirk'", "first-registration-mla-flag"], id="bad-quirk",
        ),
        pytest.param(
            MINIMAL + "[connector]\nquirks = [\"attention-only-transfer\", "
            "\"attention-only-transfer\"]\n",
            "case.toml: connector.quirks: quirk(s) listed twice", ["attention-only-transfer"],
            id="duplicate-quirk",
        ),
        pytest.param(
            MINIMAL.replace('"tiny-llama"', '"gpt-5"'),
            "case.toml: model.preset: unknown model preset",
            ["got 'gpt-5'", "allowed: deepseek-v3, kimi-linear-48b"], id="unknown-preset",
        ),
        pytest.param(
            MINIMAL.replace('preset = "tiny-llama"', 'preset = "tiny-llama"\nhf_config = "c.json"'),
            "case.toml: model: set exactly one of model.preset or model.hf_config (both given)",
            [], id="preset-and-hf-config",
        ),
        pytest.param(
            MINIMAL.replace('preset = "tiny-llama"', ""),
            "case.toml: model: set exactly one of model.preset or model.hf_config (neither",
            [], id="neither-preset-nor-hf-config",
        ),
        pytest.param(
            MINIMAL + "[expect]\noutcome = \"handshake-error\"\nerror_match = \"block_len (\"\n",
            "case.toml: expect.error_match: invalid regular expression", ["got 'block_len ('"],
            id="bad-regex",
        ),
        pytest.param(
            MINIMAL + "[expect]\noutcome = \"handshake-error\"\n",
            "case.toml: expect.error_match: required when outcome = 'handshake-error'", [],
            id="handshake-error-without-match",
        ),
        pytest.param(
            MINIMAL + "arrival = \"poisson\"\n",
            "case.toml: workload.rate: required when arrival = 'poisson'", [],
            id="poisson-without-rate",
        ),
        pytest.param(
            MINIMAL + "rate = 5.0\n", "case.toml: workload.rate: only allowed with arrival",
            [], id="rate-without-poisson",
        ),
        pytest.param(
            MINIMAL.replace("prompt_tokens = 100", "prompt_tokens = [100, 50]")
            + "prefix_hit_tokens = [10, 50]\n",
            "case.toml: workload.prefix_hit_tokens: request 1: prefix hit 50 >= prompt length 50",
            [], id="prefix-hit-not-below-prompt",
        ),
        pytest.param(
            MINIMAL.replace("prompt_tokens = 100", "prompt_tokens = 1"),
            "case.toml: workload.prompt_tokens: expected a value >= 2", ["got 1"],
            id="prompt-too-short",
        ),
        pytest.param(
            MINIMAL.replace("prompt_tokens = 100", "prompt_tokens = []"),
            "case.toml: workload.prompt_tokens: expected at least 1 item", [],
            id="prompt-empty-list",
        ),
        pytest.param(
            MINIMAL.replace("prompt_tokens = 100", "prompt_tokens = 1.5"),
            "case.toml: workload.prompt_tokens: expected an int >= 2, a non-empty list", [],
            id="prompt-wrong-shape",
        ),
        pytest.param(
            MINIMAL.replace("prompt_tokens = 100", "prompt_tokens = {min = 9, max = 3}"),
            "case.toml: workload.prompt_tokens.max: expected max >= min (9)", [],
            id="range-reversed",
        ),
        pytest.param(
            MINIMAL.replace("requests = 4\n", ""), "case.toml: workload.requests: required key",
            [], id="missing-required",
        ),
        pytest.param(
            MINIMAL + "[[faults]]\nkind = \"slow-link\"\nfactor = 2.0\n",
            "case.toml: faults[0]: a fault needs a target", [], id="fault-without-target",
        ),
        pytest.param(
            MINIMAL + "[[faults]]\nkind = \"explode\"\nrank = 0\n",
            "case.toml: faults[0].kind: invalid value", ["'drop-notification'", "'kill-rank'"],
            id="bad-fault-kind",
        ),
        pytest.param(
            MINIMAL + "[[faults]]\nkind = \"fail-transfer\"\nrequest = 4\n",
            "case.toml: faults[0].request: request 4 does not exist", [],
            id="fault-request-out-of-range",
        ),
        pytest.param(
            MINIMAL + "[[faults]]\nkind = \"fail-transfer\"\nprobability = 1.5\n",
            "case.toml: faults[0].probability: expected a value <= 1", ["got 1.5"],
            id="probability-above-one",
        ),
        pytest.param(
            MINIMAL + "[[faults]]\nkind = \"expire-lease-early\"\nengine = \"prefill0\"\n",
            "case.toml: faults[0].engine: expire-lease-early acts on a request, not on a rank or "
            "a moment: engine would be ignored", ["allowed: request, probability"],
            id="lease-fault-aimed-at-an-engine",
        ),
        pytest.param(
            MINIMAL + "[[faults]]\nkind = \"abort-request\"\nat_seconds = 1.0\n",
            "case.toml: faults[0].at_seconds: abort-request acts on a request", [],
            id="abort-fault-aimed-at-a-moment",
        ),
        pytest.param(
            MINIMAL + "[[faults]]\nkind = \"kill-rank\"\nat_seconds = 1.0\nrequest = 1\n"
            "engine = \"prefill0\"\n",
            "case.toml: faults[0].request: a timed kill-rank (at_seconds) kills its engine/rank "
            "at that moment, for every request: request would be ignored", [],
            id="timed-kill-with-a-request",
        ),
        pytest.param(
            MINIMAL + "[[faults]]\nkind = \"disconnect-peer\"\nat_seconds = 1.0\n"
            "probability = 0.5\nrank = 0\n",
            "case.toml: faults[0].probability: a timed disconnect-peer", [],
            id="timed-disconnect-with-a-probability",
        ),
        pytest.param(
            MINIMAL + "[[faults]]\nkind = \"kill-rank\"\nat_seconds = 1.0\n",
            "case.toml: faults[0].at_seconds: a timed kill-rank needs engine and/or rank", [],
            id="timed-kill-of-no-one",
        ),
        pytest.param(
            MINIMAL + "[[faults]]\nkind = \"kill-rank\"\nat_seconds = 1.0\nrank = 0\n"
            "window_seconds = 2.0\n",
            "case.toml: faults[0].window_seconds: window_seconds is the length of the window "
            "that at_seconds opens", ["allowed: window_seconds with at_seconds"],
            id="window-on-an-instant",
        ),
        pytest.param(
            MINIMAL + "[[faults]]\nkind = \"slow-link\"\nrequest = 1\nwindow_seconds = 2.0\n",
            "case.toml: faults[0].window_seconds: window_seconds is the length", [],
            id="window-without-a-start",
        ),
        pytest.param(
            MINIMAL + "[[faults]]\nkind = \"slow-link\"\nat_seconds = 1.0\n"
            "duration_seconds = 2.0\n",
            "case.toml: faults[0].duration_seconds: duration_seconds does not apply to kind "
            "'slow-link'; the window after at_seconds is window_seconds",
            ["delay-notification (how late the notification arrives)"],
            id="duration-as-a-window",
        ),
        pytest.param(
            MINIMAL + "[[faults]]\nkind = \"fail-transfer\"\nrequest = 1\nfactor = 2.0\n",
            "case.toml: faults[0].factor: factor (the bandwidth divisor) applies only to "
            "slow-link", [], id="factor-on-a-failure",
        ),
        pytest.param(
            MINIMAL + "[decode]\ninstances = 2\n[[faults]]\nkind = \"slow-link\"\n"
            "engine = \"decode2\"\n",
            "case.toml: faults[0].engine: engine 'decode2' does not exist in this deployment, "
            "so the fault could never hit", ["allowed: prefill0, decode0, decode1"],
            id="fault-engine-that-does-not-exist",
        ),
        pytest.param(
            MINIMAL + "[decode]\ntp = 2\n[[faults]]\nkind = \"slow-link\"\n"
            "engine = \"prefill0\"\nrank = 1\n",
            "case.toml: faults[0].rank: rank 1 does not exist in prefill0 (TP 1)",
            [], id="fault-rank-beyond-its-engines-tp",
        ),
        pytest.param(
            MINIMAL + "[decode]\ntp = 2\n[[faults]]\nkind = \"slow-link\"\nrank = 2\n",
            "case.toml: faults[0].rank: rank 2 does not exist in any engine (TP 2)",
            ["allowed: 0 to 1"], id="fault-rank-beyond-every-tp",
        ),
        pytest.param(
            MINIMAL.replace("prompt_tokens = 100", "prompt_tokens = 100\nprefix_hit_tokens = 1"),
            "case.toml: workload.prefix_hit_tokens: prefix hits need [decode] prefix_caching = "
            "true", [], id="a-one-token-hit-without-prefix-caching",
        ),
        pytest.param(
            MINIMAL + "[connector]\nlease_seconds = inf\n",
            "case.toml: connector.lease_seconds: expected a finite number", [],
            id="infinite-float",
        ),
        pytest.param(
            MINIMAL + "[fabric]\noverrides = { per_descriptor_us = -5.0 }\n",
            "case.toml: fabric.overrides.per_descriptor_us: expected a finite number > 0, "
            "got -5.0", [],
            id="negative-override",
        ),
        pytest.param(
            MINIMAL.replace('name = "minimal"', 'name = "  "'),
            "case.toml: scenario.name: expected a non-empty name", [], id="blank-name",
        ),
        pytest.param(
            MINIMAL + "[prefill]\nblock_size = 8192\n",
            "case.toml: prefill.block_size: expected a power of two from 1 to 4096", [],
            id="block-size-too-large",
        ),
        pytest.param(
            MINIMAL.replace("[model]", "prefill = 4\n[model]"),
            "case.toml: scenario.prefill: unknown key", [], id="key-lands-in-previous-table",
        ),
        pytest.param(
            "prefill = 4\n" + MINIMAL, "case.toml: prefill: expected a table", ["got 4"],
            id="section-not-a-table",
        ),
    ],
)
def test_error_names_file_and_key(text: str, prefix: str, needles: list[str]) -> None:
    message = error_of(text)
    assert message.startswith(prefix), message
    for needle in needles:
        assert needle in message, message


def test_a_fault_rank_error_lists_the_ranks_that_exist() -> None:
    one = (MINIMAL + "[decode]\ntp = 4\n[[faults]]\nkind = \"slow-link\"\n"
           "engine = \"%s\"\nrank = 5\n")
    assert error_of(one % "prefill0").endswith("(TP 1), so the fault could never hit; allowed: 0")
    assert error_of(one % "decode0").endswith("(TP 4), so the fault could never hit; "
                                              "allowed: 0 to 3")


def test_long_values_are_truncated() -> None:
    message = error_of(MINIMAL + f"[prefill]\ntp = \"{'x' * 500}\"\n")
    assert message.startswith("case.toml: prefill.tp: expected an integer, got 'xxx")
    shown = message.split(", got ", 1)[1]
    assert len(shown) == 60 and shown.endswith("xx...")
    assert "..." in message and len(message) < 140


def test_xfail_file_must_expect_failure(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL, "xfail-something.toml")
    with pytest.raises(ScenarioError) as info:
        load_scenarios(path)
    assert str(info.value) == (
        f"{path}: expect.outcome: xfail-* scenarios must state the failure they expect "
        "(outcome 'handshake-error' or 'request-failure')"
    )
    ok = write(tmp_path, MINIMAL + "[expect]\noutcome = \"request-failure\"\n", "xfail-ok.toml")
    (s,) = load_scenarios(ok)
    assert s.expect.outcome == "request-failure"
    # The rule is about the file name, not the scenario name or other files.
    (plain,) = load_scenarios(write(tmp_path, MINIMAL, "not-xfail-ok.toml"))
    assert plain.expect.outcome == "ok"


def test_malformed_toml_names_file_and_position(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + "[prefill\ntp = 2\n", "broken.toml")
    with pytest.raises(ScenarioError) as info:
        load_scenarios(path)
    message = str(info.value)
    assert message.startswith(f"{path}: malformed TOML: ")
    assert "line 10" in message


def test_unreadable_and_non_utf8_files(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ScenarioError, match=r"nope\.toml: cannot read file"):
        load_scenarios(missing)
    with pytest.raises(ScenarioError, match=r"cannot read file"):
        load_scenarios(tmp_path)  # a directory
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe[scenario]\n")
    with pytest.raises(ScenarioError, match=r"binary\.toml: not UTF-8 text"):
        load_scenarios(binary)


def test_error_attributes() -> None:
    with pytest.raises(ScenarioError) as info:
        parse_scenarios(MINIMAL + "[prefill]\ntp = 65\n", source="f.toml")
    err = info.value
    assert isinstance(err, ValueError)
    assert (err.source, err.key) == ("f.toml", "prefill.tp")
    assert err.problem == "expected a value <= 64, got 65"


# --- sweeps ------------------------------------------------------------------------------------


SWEEP = MINIMAL + """
[sweep]
prefill.tp = [1, 2, 4]
decode.tp = [1, 2]
"""


def test_sweep_product_order_names_and_values() -> None:
    variants = parse_scenarios(SWEEP, source="s.toml")
    expected = [(p, d) for p in (1, 2, 4) for d in (1, 2)]  # first key varies slowest
    assert [(v.prefill.tp, v.decode.tp) for v in variants] == expected
    assert [v.sweep_point for v in variants] == [
        {"prefill.tp": p, "decode.tp": d} for p, d in expected
    ]
    assert [v.scenario.name for v in variants] == [
        f"minimal [prefill.tp={p}, decode.tp={d}]" for p, d in expected
    ]
    assert all(v.source == "s.toml" and v.scenario.seed == 0 for v in variants)
    assert list(variants[0].sweep_point) == ["prefill.tp", "decode.tp"]  # file order
    # Deterministic: parsing again gives the same list.
    assert parse_scenarios(SWEEP, source="s.toml") == variants


def test_sweep_nested_table_form_is_the_same() -> None:
    nested = MINIMAL + "[sweep.prefill]\ntp = [1, 2, 4]\n[sweep.decode]\ntp = [1, 2]\n"
    assert [v.sweep_point for v in parse_scenarios(nested)] == [
        v.sweep_point for v in parse_scenarios(SWEEP)
    ]


def test_sweep_zip() -> None:
    text = MINIMAL + """
[sweep]
mode = "zip"
prefill.tp = [1, 2, 4]
connector.mode = ["pull", "push", "pull"]
"""
    variants = parse_scenarios(text)
    assert [(v.prefill.tp, v.connector.mode) for v in variants] == [
        (1, "pull"), (2, "push"), (4, "pull")
    ]
    assert variants[1].scenario.name == "minimal [prefill.tp=2, connector.mode=push]"


def test_sweep_zip_needs_equal_lengths() -> None:
    text = MINIMAL + "[sweep]\nmode = \"zip\"\nprefill.tp = [1, 2]\ndecode.tp = [1]\n"
    message = error_of(text)
    assert message.startswith("case.toml: sweep: mode = 'zip' needs lists of equal length")
    assert "prefill.tp: 2, decode.tp: 1" in message


def test_sweep_adds_keys_absent_from_the_base_and_overrides_present_ones() -> None:
    text = MINIMAL + """
[prefill]
block_size = 16
[sweep]
prefill.block_size = [32]
fabric.overrides.per_descriptor_us = [1.0, 2.5]
workload.prompt_tokens = [64, [10, 20], { min = 2, max = 8 }]
"""
    variants = parse_scenarios(text)
    assert len(variants) == 6
    assert {v.prefill.block_size for v in variants} == {32}
    assert [v.fabric.overrides for v in variants[::3]] == [
        {"per_descriptor_us": 1.0}, {"per_descriptor_us": 2.5}
    ]
    assert [v.workload.prompt_tokens for v in variants[:3]] == [
        64, (10, 20), PromptRange(min=2, max=8)
    ]


def test_sweep_error_names_the_variant() -> None:
    message = error_of(SWEEP.replace("decode.tp = [1, 2]", "decode.tp = [2, 65]"), "s.toml")
    assert message.startswith("s.toml [prefill.tp=1, decode.tp=65]: decode.tp: expected a value <= 64")


def test_xfail_rule_applies_per_variant(tmp_path: Path) -> None:
    text = MINIMAL + "[sweep]\nexpect.outcome = [\"request-failure\", \"ok\"]\n"
    with pytest.raises(ScenarioError) as info:
        load_scenarios(write(tmp_path, text, "xfail-mixed.toml"))
    assert "xfail-mixed.toml [expect.outcome=ok]: expect.outcome: xfail-*" in str(info.value)


@pytest.mark.parametrize(
    ("sweep", "prefix"),
    [
        ("prefill.tpx = [1]", "case.toml: sweep.prefill.tpx: not a sweepable key; allowed: "),
        ("faults = [1]", "case.toml: sweep.faults: not a sweepable key"),
        ("prefill = [1]", "case.toml: sweep.prefill: not a sweepable key"),
        ("prefill.tp = 2", "case.toml: sweep.prefill.tp: expected a non-empty list of values"),
        ("prefill.tp = []", "case.toml: sweep.prefill.tp: expected a non-empty list of values"),
        ("mode = \"diagonal\"\nprefill.tp = [1]", "case.toml: sweep.mode: invalid value"),
        ("mode = \"zip\"", "case.toml: sweep: no keys to sweep"),
    ],
)
def test_sweep_structure_errors(sweep: str, prefix: str) -> None:
    message = error_of(MINIMAL + "[sweep]\n" + sweep + "\n")
    assert message.startswith(prefix), message


def test_sweep_variant_limit() -> None:
    text = MINIMAL + f"""
[sweep]
scenario.seed = {list(range(101))}
prefill.instances = {list(range(1, 101))}
"""
    message = error_of(text)
    assert message.startswith(
        f"case.toml: sweep: 10100 variants exceed the limit of {MAX_SWEEP_VARIANTS}"
    )


def test_sweepable_keys_cover_sections_not_faults() -> None:
    keys = sweepable_keys()
    assert "prefill.tp" in keys and "decode.kv_cache_layout" in keys
    assert "connector.quirks" in keys and "fabric.overrides.*" in keys
    assert not any(k.startswith("faults") for k in keys)


# --- token lengths -----------------------------------------------------------------------------


def workload_with(prompt: str, hits: str = "0", requests: int = 1000) -> Any:
    text = MINIMAL.replace("requests = 4", f"requests = {requests}").replace(
        "prompt_tokens = 100", f"prompt_tokens = {prompt}\nprefix_hit_tokens = {hits}"
    ) + "[decode]\nprefix_caching = true\n"
    (s,) = parse_scenarios(text)
    return s


@pytest.mark.parametrize("distribution", ["uniform", "loguniform"])
def test_prompt_lengths_deterministic_and_bounded(distribution: str) -> None:
    s = workload_with(f'{{ min = 100, max = 5000, distribution = "{distribution}" }}')
    a = s.workload.prompt_lengths(1000, np.random.default_rng(11))
    b = s.workload.prompt_lengths(1000, np.random.default_rng(11))
    c = s.workload.prompt_lengths(1000, np.random.default_rng(12))
    assert a.dtype == np.int64 and a.shape == (1000,)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert a.min() >= 100 and a.max() <= 5000
    assert a.min() < 200 and a.max() > 4000  # the range is actually used


def test_loguniform_favours_small_values() -> None:
    s = workload_with('{ min = 10, max = 100000, distribution = "loguniform" }')
    lengths = s.workload.prompt_lengths(20000, np.random.default_rng(0))
    # Log-uniform: about half of the samples below the geometric mean (~1000).
    below = np.mean(lengths < math.sqrt(10 * 100000))
    assert 0.45 < below < 0.55
    uniform = workload_with("{ min = 10, max = 100000 }")
    assert np.mean(uniform.workload.prompt_lengths(20000, np.random.default_rng(0)) < 1000) < 0.02


def test_loguniform_gives_each_value_its_log_share() -> None:
    """Log-uniform over [0, 3] samples x + 1 log-uniformly on [1, 5): value v has probability
    log((v + 2) / (v + 1)) / log(5), the largest value no more than its share."""
    s = workload_with("100", '{ min = 0, max = 3, distribution = "loguniform" }')
    hits = s.workload.prefix_hit_lengths(40000, np.random.default_rng(3))
    share = np.bincount(hits, minlength=4) / hits.size
    want = np.log((np.arange(4) + 2) / (np.arange(4) + 1)) / np.log(5)
    assert np.allclose(share, want, atol=0.012), (share, want)


def test_range_with_equal_bounds_and_zero_prefix_minimum() -> None:
    s = workload_with('{ min = 7, max = 7, distribution = "loguniform" }',
                      '{ min = 0, max = 1, distribution = "loguniform" }')
    assert set(s.workload.prompt_lengths(100, np.random.default_rng(1)).tolist()) == {7}
    assert set(s.workload.prefix_hit_lengths(500, np.random.default_rng(1)).tolist()) == {0, 1}


def test_fixed_and_cycled_lengths() -> None:
    s = workload_with("[100, 200, 300]", "[0, 50]", requests=7)
    rng = np.random.default_rng(0)
    assert s.workload.prompt_lengths(7, rng).tolist() == [100, 200, 300, 100, 200, 300, 100]
    assert s.workload.prefix_hit_lengths(5, rng).tolist() == [0, 50, 0, 50, 0]
    assert workload_with("64").workload.prompt_lengths(3, rng).tolist() == [64, 64, 64]


def test_sampled_prefix_hit_not_below_prompt_names_request(tmp_path: Path) -> None:
    text = MINIMAL.replace("prompt_tokens = 100", "prompt_tokens = [1000, 1000, 10]\n"
                           "prefix_hit_tokens = { min = 0, max = 100 }")
    text += "[decode]\nprefix_caching = true\n"
    (s,) = load_scenarios(write(tmp_path, text, "hits.toml"))
    with pytest.raises(ScenarioError) as info:
        s.request_lengths(np.random.default_rng(3))
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'hits.toml'}: workload.prefix_hit_tokens: request 2: ")
    prompts = np.array([10, 10], dtype=np.int64)
    with pytest.raises(ScenarioError, match=r"workload\.prefix_hit_tokens: request 0: prefix hit"):
        workload_with("10", "{ min = 10, max = 11 }").workload.prefix_hit_lengths(
            2, np.random.default_rng(0), prompt_lengths=prompts
        )


def test_request_lengths_use_the_seed() -> None:
    text = MINIMAL.replace("prompt_tokens = 100", "prompt_tokens = { min = 2, max = 10000 }")
    (s,) = parse_scenarios(text)
    prompts, hits = s.request_lengths()
    again, _ = s.request_lengths()
    assert prompts.shape == (4,) and np.array_equal(prompts, again)
    assert np.array_equal(prompts, s.workload.prompt_lengths(4, np.random.default_rng(0)))
    assert hits.tolist() == [0, 0, 0, 0]


# --- property: garbage never escapes as another exception --------------------------------------

_SCHEMA_KEYS = [k for k in sweepable_keys() if not k.endswith(".*")] + [
    "faults.kind", "faults.request", "faults.probability", "sweep.prefill.tp", "sweep.mode",
]
_SECTIONS = ["scenario", "model", "prefill", "decode", "connector", "fabric", "workload",
             "faults", "expect", "sweep", "bogus"]

_scalars = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["pull", "HND", "tiny-llama", "poisson", "handshake-error", "(", "kill-rank"]),
    st.datetimes(min_value=dt.datetime(1900, 1, 1)),
    st.dates(),
    st.times(),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.text(max_size=8), inner, max_size=4),
    ),
    max_leaves=10,
)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    assert isinstance(value, dict)
    return "{ " + ", ".join(f"{_toml_value(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"


def _base_document() -> dict[str, Any]:
    return {
        "scenario": {"name": "garbage"},
        "model": {"preset": "tiny-llama"},
        "workload": {"requests": 4, "prompt_tokens": 100},
    }


def _toml_document(doc: dict[str, Any]) -> str:
    lines = []
    for key, value in doc.items():
        if key == "faults" and isinstance(value, dict):
            value = [value]
        lines.append(f"{_toml_value(key)} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    edits=st.lists(
        st.tuples(
            st.one_of(st.sampled_from(_SCHEMA_KEYS),
                      st.tuples(st.sampled_from(_SECTIONS), st.text(max_size=8)).map(".".join)),
            _values,
        ),
        min_size=1,
        max_size=4,
    )
)
def test_garbage_values_raise_scenario_error_or_parse(edits: list[tuple[str, Any]]) -> None:
    doc = _base_document()
    for key, value in edits:
        section, _, name = key.partition(".")
        table = doc.setdefault(section, {})
        if not isinstance(table, dict):
            doc[section] = table = {}
        if name.startswith("prefill.") and section == "sweep":  # nested sweep key
            table.setdefault("prefill", {})[name.split(".", 1)[1]] = value
        else:
            table[name] = value
    text = _toml_document(doc)
    try:
        scenarios = parse_scenarios(text, source="garbage.toml")
    except ScenarioError as exc:
        assert str(exc).startswith("garbage.toml") and "\n" not in str(exc)
    else:
        assert scenarios and all(isinstance(s, Scenario) for s in scenarios)
        for s in scenarios:
            json.dumps(s.to_dict())


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=200))
def test_garbage_text_raises_scenario_error_or_parses(text: str) -> None:
    try:
        parse_scenarios(text, source="t.toml")
    except ScenarioError as exc:
        assert str(exc).startswith("t.toml")


def test_prefix_hits_need_decode_prefix_caching() -> None:
    text = MINIMAL.replace("prompt_tokens = 100", "prompt_tokens = 100\nprefix_hit_tokens = 64")
    message = error_of(text, "case.toml")
    assert message.startswith("case.toml: workload.prefix_hit_tokens: prefix hits need [decode] "
                              "prefix_caching = true")
    (ok,) = parse_scenarios(text + "[decode]\nprefix_caching = true\n")
    assert ok.decode.prefix_caching


def test_expected_counts_of_zero_are_checked_not_ignored() -> None:
    # 0 is a real expectation ("no request fails"), distinct from leaving the key out
    counts = ("failed_requests", "lease_expiries", "recomputed", "aborted_requests")
    text = MINIMAL + "\n[expect]\n" + "".join(f"{key} = 0\n" for key in counts)
    (s,) = parse_scenarios(text)
    assert [getattr(s.expect, key) for key in counts] == [0, 0, 0, 0]
    from hkvsim.cluster import run_scenario
    from hkvsim.results import expectation_problems

    assert expectation_problems(run_scenario(s)) == []
    failing = text + '\n[[faults]]\nkind = "fail-transfer"\nrequest = 1\n'
    (s,) = parse_scenarios(failing.replace("[expect]\n", '[expect]\noutcome = "request-failure"\n'))
    assert "1 failed request(s), expected 0" in expectation_problems(run_scenario(s))
    for key in counts:
        message = error_of(MINIMAL + f"\n[expect]\n{key} = -1\n")
        assert f"expect.{key}: expected a value >= 0, got -1" in message, message


def test_sweep_keys_of_one_section_vary_together_as_toml_groups_them() -> None:
    """TOML gathers the dotted keys of one section: connector.descriptor_merge, written after
    prefill.tp, still varies before it (docs/scenarios.md says so)."""
    text = MINIMAL + ('[sweep]\nconnector.mode = ["pull", "push"]\nprefill.tp = [1, 2]\n'
                      'connector.descriptor_merge = ["off", "strided"]\n')
    points = [s.sweep_point for s in parse_scenarios(text)]
    assert [list(p) for p in points] == [
        ["connector.mode", "connector.descriptor_merge", "prefill.tp"]] * 8
    assert [tuple(p.values()) for p in points[:4]] == [
        ("pull", "off", 1), ("pull", "off", 2), ("pull", "strided", 1), ("pull", "strided", 2)]
