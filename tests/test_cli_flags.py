"""Global flags: ``--version`` from the package metadata, and ``--debug`` / ``-v`` accepted before
or after the command."""

from __future__ import annotations

import logging
from importlib.metadata import version
from pathlib import Path

import pytest

from hkvsim.cli import build_parser, main

BAD_TP = """
[scenario]
name = "bad tp"
[model]
preset = "tiny-kimi-linear"
[prefill]
tp = 3
[workload]
requests = 1
prompt_tokens = 100
"""


def test_version_comes_from_the_package_metadata(capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"hkvsim {version('hkvsim')}"


@pytest.mark.parametrize("argv", [["run", "F", "--debug"], ["--debug", "run", "F"],
                                  ["plan", "F", "--debug"], ["sweep", "--debug", "F"]])
def test_debug_before_or_after_the_command(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    assert args.debug is True and args.verbose is False


@pytest.mark.parametrize("argv", [["run", "F", "-v"], ["-v", "run", "F"],
                                  ["report", "F", "--verbose"], ["-v", "presets"]])
def test_verbose_before_or_after_the_command(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    assert args.verbose is True and args.debug is False


def test_flags_default_off() -> None:
    args = build_parser().parse_args(["run", "F"])
    assert args.debug is False and args.verbose is False


def test_debug_after_the_command_shows_the_traceback(tmp_path: Path, capsys) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(BAD_TP)
    assert main(["run", str(path)]) == 2  # one line, no traceback
    assert capsys.readouterr().err.startswith("hkvsim: error: ")
    with pytest.raises(ValueError, match="does not divide"):
        main(["run", str(path), "--debug"])


def test_verbose_after_the_command_logs_info(tmp_path: Path, monkeypatch) -> None:
    seen: list[int] = []
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: seen.append(kw["level"]))
    path = tmp_path / "bad.toml"
    path.write_text(BAD_TP)
    main(["run", str(path), "-v"])
    main(["run", str(path)])
    assert seen == [logging.INFO, logging.WARNING]


@pytest.mark.parametrize("extra, envelope", [([], False), (["--shard", "0/1"], True),
                                             (["--jobs", "2"], True)])
def test_a_file_without_a_sweep_prints_one_object_unless_sharded_or_parallel(
        tmp_path: Path, capsys, extra: list[str], envelope: bool) -> None:
    """Merging the outputs of --shard / --jobs runs needs the envelope whatever the file: one
    object only for a plain run of a file without [sweep]."""
    import json

    path = tmp_path / "one.toml"
    path.write_text(BAD_TP.replace("tp = 3", "tp = 1"))
    capsys.readouterr()
    assert main(["run", str(path), "--json", *extra]) == 0
    data = json.loads(capsys.readouterr().out)
    if envelope:
        assert data["variants"] == 1 and len(data["scenarios"]) == 1
        assert data["shard"] == ("0/1" if "--shard" in extra else None)
    else:
        assert "scenarios" not in data and data["outcome"] == "ok"


@pytest.mark.parametrize("flag", [[], ["--progress-thread"]])
def test_run_passes_the_progress_thread_to_every_nixl_rank(tmp_path: Path, monkeypatch,
                                                           capsys, flag: list[str]) -> None:
    import hkvsim.drivers.nixl as drivers
    import hkvsim.transport.nixl as transport
    from hkvsim.cluster import run_scenario

    seen = []

    def fake(scenario, *, timing_only=False, options=None):
        seen.append(options.progress_thread)
        return run_scenario(scenario)  # the simulator stands in for the ranks

    monkeypatch.setattr(transport, "load_nixl", lambda: None)
    monkeypatch.setattr(drivers, "run_scenario_nixl", fake)
    path = tmp_path / "one.toml"
    path.write_text(BAD_TP.replace("tp = 3", "tp = 1"))
    assert main(["run", str(path), "--backend", "nixl", *flag]) == 0
    assert seen == [bool(flag)]


def test_the_progress_thread_is_refused_on_the_simulated_fabric(tmp_path: Path, capsys) -> None:
    path = tmp_path / "one.toml"
    path.write_text(BAD_TP.replace("tp = 3", "tp = 1"))
    assert main(["sweep", str(path), "--progress-thread"]) == 2
    assert ("--progress-thread is NIXL's: use it with --backend nixl"
            in capsys.readouterr().err)
