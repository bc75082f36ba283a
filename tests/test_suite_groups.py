"""The suite's worker groups (tests/conftest.py): the tests that start real rank processes run
on one xdist worker, one after another; everything else may run beside them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REAL_PROCESS_GROUP, pytest_collection_modifyitems, real_process_test

TESTS = Path(__file__).resolve().parent


def test_real_process_files_are_grouped_and_the_rest_is_not() -> None:
    assert real_process_test(TESTS / "nixl" / "test_nixl_runs.py")
    assert real_process_test(TESTS / "lab" / "test_lab_torchrun.py")
    assert real_process_test(TESTS / "vllm" / "test_nixl_backend.py")
    assert not real_process_test(TESTS / "vllm" / "test_connector_on_fabric.py")
    assert not real_process_test(TESTS / "test_cli.py")
    assert not real_process_test(TESTS / "nixl_notes.py")  # a name that only starts like one
    assert not real_process_test(TESTS.parent / "benchmarks" / "nixl" / "x.py")  # outside tests/


def test_every_file_that_launches_ranks_is_grouped() -> None:
    # a file that starts rank processes (torchrun, the rank entry point, a real-NIXL run) and is
    # not in the group would run beside another such file on a 2-core machine
    launches = ("run_scenario_nixl(", "torchrun", "_rank_launcher")
    for path in sorted(TESTS.rglob("test_*.py")):
        if path == Path(__file__).resolve():
            continue
        text = path.read_text()
        if any(marker in text for marker in launches):
            assert real_process_test(path), f"{path.relative_to(TESTS)} launches ranks"


class _Item:
    def __init__(self, path: Path) -> None:
        self.path, self.marks = path, []

    def add_marker(self, mark) -> None:
        self.marks.append(mark)


class _Config:
    def __init__(self, xdist: bool) -> None:
        self.pluginmanager = self
        self.xdist = xdist

    def hasplugin(self, name: str) -> bool:
        return name == "xdist" and self.xdist


def test_the_group_marker_goes_to_real_process_tests_only_and_only_under_xdist() -> None:
    grouped, free = _Item(TESTS / "nixl" / "test_nixl_faults.py"), _Item(TESTS / "test_cli.py")
    pytest_collection_modifyitems(_Config(xdist=True), [grouped, free])  # type: ignore[arg-type]
    assert [(m.name, m.args) for m in grouped.marks] == [("xdist_group", (REAL_PROCESS_GROUP,))]
    assert free.marks == []
    # without xdist the marker is unknown (--strict-markers): nothing is marked
    alone = _Item(TESTS / "nixl" / "test_nixl_faults.py")
    pytest_collection_modifyitems(_Config(xdist=False), [alone])  # type: ignore[arg-type]
    assert alone.marks == []


@pytest.mark.timeout(120)
def test_xdist_really_runs_the_group_on_one_worker(tmp_path: Path) -> None:
    """The marker alone proves nothing: xdist must see it when it names the tests it schedules
    (it does not when a conftest hook runs after its own, nor under pytest 9.2, where its renaming
    of node ids stopped taking effect). A copy of this suite's conftest, four slow tests under
    nixl/ and four elsewhere, run on two workers: the nixl/ ones all on one worker."""
    tests = tmp_path / "tests"
    (tests / "nixl").mkdir(parents=True)
    (tests / "conftest.py").write_text((TESTS / "conftest.py").read_text())
    body = "import time\n" + "".join(f"def test_{i}():\n    time.sleep(0.3)\n" for i in range(4))
    (tests / "nixl" / "test_ranks.py").write_text(body)
    (tests / "test_free.py").write_text(body)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v",
         "-p", "no:cacheprovider", "-p", "no:randomly", "tests"],
        cwd=tmp_path, capture_output=True, text=True, timeout=100)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    ran = re.findall(r"\[(gw\d+)\].*?PASSED (tests/\S+)", run.stdout)
    grouped = {(worker, test) for worker, test in ran if test.startswith("tests/nixl/")}
    assert len(grouped) == 4 and len(ran) == 8, run.stdout
    assert all(test.endswith("@" + REAL_PROCESS_GROUP) for _, test in grouped), grouped
    assert len({worker for worker, _ in grouped}) == 1, grouped
