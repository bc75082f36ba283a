"""A built wheel works on its own: installed (not editable) and run from another directory, it
finds its fabric profiles and reports its version. The source tree is not importable there."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAIN_JOB = ROOT / "scenarios" / "kimi-linear" / "pull-2p-tp2-to-d-tp4.toml"


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=100, **kwargs)
    assert done.returncode == 0, f"{cmd}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Build the wheel from a copy of the sources (no build isolation, no index) and install it
    into a target directory of its own."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "hkvsim", src / "hkvsim",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    dist, site = tmp / "dist", tmp / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w",
          str(dist), str(src)])
    (wheel,) = dist.glob("hkvsim-*.whl")
    _run([*pip, "install", "--no-deps", "--no-index", "-q", "--target", str(site), str(wheel)])
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    return {"wheel": wheel, "site": site, "cwd": elsewhere}


def _env(site: Path) -> dict[str, str]:
    # the installed copy comes first on sys.path; the test venv supplies the dependencies
    return {**os.environ, "PYTHONPATH": str(site), "PYTHONDONTWRITEBYTECODE": "1"}


@pytest.mark.slow
def test_wheel_ships_the_fabric_profiles(installed: dict[str, Path]) -> None:
    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    shipped = {p.name for p in (ROOT / "hkvsim" / "fabric" / "profiles").glob("*.toml")}
    assert shipped == {"cpu-ucx-loopback.toml", "h200-cx7-rdma.toml", "h200-nvlink.toml",
                       "pcie-host.toml"}
    assert {f"hkvsim/fabric/profiles/{n}" for n in shipped} <= names


@pytest.mark.slow
def test_installed_wheel_runs_the_main_job_from_another_directory(
        installed: dict[str, Path]) -> None:
    site, cwd, env = installed["site"], installed["cwd"], _env(installed["site"])
    where = _run([sys.executable, "-c", "import hkvsim.fabric.profile as p; print(p.PROFILE_DIR)"],
                 cwd=cwd, env=env).stdout.strip()
    assert Path(where).is_relative_to(site), f"imported {where}, not the installed wheel"

    script = str(site / "bin" / "hkvsim")
    expected = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert _run([script, "--version"], cwd=cwd, env=env).stdout.strip() == f"hkvsim {expected}"

    done = _run([script, "run", str(MAIN_JOB), "--json"], cwd=cwd, env=env)
    result = json.loads(done.stdout)
    assert result["outcome"] == "ok" and result["expectation_met"]
    assert result["requests"]["byte_exact"] == result["requests"]["total"] == 6
    assert result["requests"]["mismatched_bytes"] == 0
