"""Paths and values a user writes: profile paths resolve against the scenario file, override
values keep their TOML type, and every error of a deployment that cannot be built reads
``<file>[ [variant]]: <key>: <problem>; allowed: ...``."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from hkvsim.cli import main
from hkvsim.cluster import SimDriver
from hkvsim.fabric.profile import PROFILE_DIR
from hkvsim.scenario import ScenarioError, load_scenarios, parse_scenarios

BASE = """\
[scenario]
name = "inputs"
[model]
preset = "{model}"
[prefill]
tp = {p}
[decode]
tp = {d}
[workload]
requests = 1
prompt_tokens = 100
"""
SHIPPED = "cpu-ucx-loopback, h200-cx7-rdma, h200-nvlink, pcie-host"
ONE_LINE = re.compile(r"^(?P<file>[^:\[]+)(?: \[(?P<variant>[^\]]+)\])?: (?P<key>[a-z_.]+): "
                      r"(?P<problem>.+); allowed: (?P<allowed>.+)$")


def body(model: str = "tiny-llama", p: int = 1, d: int = 1, extra: str = "") -> str:
    return BASE.format(model=model, p=p, d=d) + extra


def error_of(text: str, name: str = "case.toml") -> str:
    with pytest.raises(ScenarioError) as info:
        parse_scenarios(text, source=name)
    message = str(info.value)
    assert "\n" not in message
    return message


# --- fabric.profile paths ---------------------------------------------------------------------


def _own_profile(directory: Path, name: str = "lab") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    text = (PROFILE_DIR / "h200-nvlink.toml").read_text()
    path = directory / f"{name}.toml"
    path.write_text(text.replace('name = "h200-nvlink"', f'name = "{name}"')
                    .replace("gpus_per_node = 8", "gpus_per_node = 4"))
    return path


def test_profile_path_resolves_against_the_scenario_file(tmp_path: Path, monkeypatch) -> None:
    own = _own_profile(tmp_path / "suite" / "profiles")
    scenario_file = tmp_path / "suite" / "s.toml"
    scenario_file.write_text(body(extra='[fabric]\nprofile = "profiles/lab.toml"\n'))
    elsewhere = tmp_path / "elsewhere"
    _own_profile(elsewhere / "profiles")  # a decoy where the working directory would look
    (elsewhere / "profiles" / "lab.toml").write_text("broken = ")
    monkeypatch.chdir(elsewhere)
    (s,) = load_scenarios(Path("..") / "suite" / "s.toml")
    assert s.fabric.profile == str(own.resolve())
    profile = SimDriver(s, timing_only=True).profile
    assert (profile.name, profile.gpus_per_node) == ("lab", 4)


def test_missing_profile_path_names_the_resolved_file(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "suite").mkdir()
    path = tmp_path / "suite" / "s.toml"
    path.write_text(body(extra='[fabric]\nprofile = "profiles/none.toml"\n'))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ScenarioError) as info:
        load_scenarios("suite/s.toml")
    assert str(info.value) == (f"suite/s.toml: fabric.profile: no such fabric profile file: "
                               f"{tmp_path / 'suite' / 'profiles' / 'none.toml'}")


def test_profile_name_stays_a_name_whatever_the_working_directory(tmp_path, monkeypatch) -> None:
    (tmp_path / "h200-nvlink").write_text("not a profile")  # a file named like the profile
    monkeypatch.chdir(tmp_path)
    (s,) = parse_scenarios(body(extra='[fabric]\nprofile = "h200-nvlink"\n'), source="case.toml")
    assert s.fabric.profile == "h200-nvlink"
    assert SimDriver(s, timing_only=True).profile.name == "h200-nvlink"


def test_unknown_profile_names_file_key_and_the_shipped_profiles() -> None:
    message = error_of(body(extra='[fabric]\nprofile = "h100-nvlink"\n'))
    match = ONE_LINE.match(message)
    assert match, message
    assert (match["file"], match["key"]) == ("case.toml", "fabric.profile")
    assert "unknown fabric profile 'h100-nvlink'" in match["problem"]
    assert match["allowed"].startswith(SHIPPED)


# --- fabric.overrides keep their TOML type --------------------------------------------------------


def test_integer_override_of_an_integer_key() -> None:
    (s,) = parse_scenarios(body(extra="[fabric]\noverrides = { gpus_per_node = 16 }\n"))
    assert s.fabric.overrides == {"gpus_per_node": 16}
    profile = SimDriver(s, timing_only=True).profile
    assert profile.gpus_per_node == 16 and isinstance(profile.gpus_per_node, int)


def test_number_and_string_overrides() -> None:
    extra = ('[fabric]\noverrides = { per_descriptor_us = 5, intra_node_bandwidth_gbps = 100.5, '
             'placement = "split" }\n')
    (s,) = parse_scenarios(body(extra=extra))
    profile = SimDriver(s, timing_only=True).profile
    assert profile.per_descriptor == 5e-6
    assert profile.intra_node_bandwidth == 100.5e9
    assert profile.placement == "split"


@pytest.mark.parametrize(("override", "key", "problem"), [
    ("gpus_per_node = 16.0", "gpus_per_node", "expected an integer > 0, got 16.0"),
    ("gpus_per_node = true", "gpus_per_node", "expected an integer"),
    ("per_descriptor_us = \"5\"", "per_descriptor_us", "expected a finite number > 0, got '5'"),
    ("placement = 3", "placement", "expected one of 'pack', 'split', got 3"),
    ("bogus_us = 1.0", "bogus_us", "unknown override key; allowed: name, description"),
])
def test_override_errors_name_the_override_key(override: str, key: str, problem: str) -> None:
    message = error_of(body(extra=f"[fabric]\noverrides = {{ {override} }}\n"))
    assert message.startswith(f"case.toml: fabric.overrides.{key}: "), message
    assert problem in message


def test_override_error_in_a_sweep_names_the_variant() -> None:
    extra = ("[fabric]\noverrides = { gpus_per_node = 8 }\n"
             "[sweep]\nfabric.overrides.gpus_per_node = [8, 4.0]\n")
    message = error_of(body(extra=extra))
    assert message.startswith("case.toml [fabric.overrides.gpus_per_node=4.0]: "
                              "fabric.overrides.gpus_per_node: expected an integer > 0"), message


# --- engine geometry: file, variant, key, allowed ------------------------------------------------


@pytest.mark.parametrize(("text", "key", "problem", "allowed"), [
    (body("tiny-kimi-linear", p=3), "prefill.tp",
     "TP 3 does not divide the 512 conv columns of kda sub-projection Q (tiny-kimi-linear)",
     "1, 2, 4, 8, 16"),
    (body("tiny-llama", d=3), "decode.tp",
     "TP 3 does not divide the 8 KV heads (tiny-llama)", "1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64"),
    (body("tiny-llama", extra="[decode]\nblock_size = 8\n").replace("[decode]\ntp = 1\n", ""),
     "decode.block_size", "needs block_size >= 16 and a multiple of 16; got 8",
     "16, 32, 64, 128, 256, 512, 1024, 2048, 4096"),
    (body("tiny-kimi-linear").replace("tp = 1\n[decode]",
                                      'tp = 1\nattention_backend = "flash-attn"\n[decode]'),
     "prefill.attention_backend", "attention backend 'flash-attn' cannot run MLA layers",
     "flashmla, triton-mla"),
    (body("tiny-llama").replace("[decode]\ntp = 1", '[decode]\ntp = 1\ncache_dtype = "fp8_ds_mla"'),
     "decode.cache_dtype", "cache_dtype 'fp8_ds_mla' is only for MLA models",
     "bfloat16, float16, fp8"),
])
def test_geometry_errors_name_file_key_and_allowed(text: str, key: str, problem: str,
                                                   allowed: str) -> None:
    message = error_of(text)
    match = ONE_LINE.match(message)
    assert match, message
    assert (match["file"], match["variant"], match["key"]) == ("case.toml", None, key)
    assert problem in match["problem"], message
    assert match["allowed"] == allowed


def test_geometry_error_in_a_sweep_names_the_variant() -> None:
    message = error_of(body("tiny-kimi-linear") + "[sweep]\ndecode.tp = [2, 6]\n")
    match = ONE_LINE.match(message)
    assert match, message
    assert (match["variant"], match["key"]) == ("decode.tp=6", "decode.tp")
    assert match["allowed"] == "1, 2, 4, 8, 16"


def test_cli_prints_the_one_line_error(tmp_path: Path, capsys) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(body("tiny-kimi-linear", p=3))
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"hkvsim: error: {path}: prefill.tp: TP 3 does not divide")
    assert err.endswith("; allowed: 1, 2, 4, 8, 16")


def test_scenarios_directory_still_loads() -> None:
    # every shipped scenario passes the load-time geometry check
    root = Path(__file__).resolve().parents[1] / "scenarios"
    files = sorted(root.rglob("*.toml"))
    assert len(files) > 40
    for f in files:
        assert load_scenarios(f), f


def test_copied_suite_keeps_working_from_another_directory(tmp_path, monkeypatch) -> None:
    # a scenario directory moved elsewhere, with its own profile beside it
    suite = tmp_path / "suite"
    _own_profile(suite)
    shutil.copy2(Path(__file__).resolve().parents[1] / "scenarios" / "kimi-linear"
                 / "pull-2p-tp2-to-d-tp4.toml", suite / "main.toml")
    text = (suite / "main.toml").read_text().replace('profile = "h200-nvlink"',
                                                     'profile = "lab.toml"')
    (suite / "main.toml").write_text(text)
    monkeypatch.chdir(tmp_path)
    (s,) = load_scenarios(suite / "main.toml")
    assert Path(s.fabric.profile) == (suite / "lab.toml").resolve()
