"""scripts/mutation-sample: the mutations it plants, and its verdicts on two known sites."""

from __future__ import annotations

import ast
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "mutation-sample"


def _script() -> SimpleNamespace:
    return SimpleNamespace(**runpy.run_path(str(SCRIPT), run_name="lib"))


SOURCE = '''
def f(a, b, items):
    if a < 0:
        raise ValueError(a)
    if not items and b:
        return a + b
    return a * 2
'''


def test_each_kind_of_mutation_changes_what_it_names() -> None:
    script = _script()
    sites = script.mutation_sites(ast.parse(SOURCE))
    labels = [script.describe(SOURCE, kind, node) for kind, node in sites]
    assert labels == [
        "line 3, raise skipped: a < 0",
        "line 3, comparison: a < 0",
        "line 3, constant + 1: 0",
        "line 5, and/or: not items and b",
        "line 5, not dropped: not items",
        "line 6, operator: a + b",
        "line 7, operator: a * 2",
        "line 7, constant + 1: 2",
    ]
    mutated = [ast.unparse(ast.parse(script.mutant(SOURCE, i)[0])) for i in range(len(sites))]
    original = ast.unparse(ast.parse(SOURCE))
    expected = [("if a < 0:", "if False:"), ("a < 0", "a <= 0"), ("a < 0", "a < 1"),
                ("not items and b", "not items or b"), ("not items and b", "items and b"),
                ("a + b", "a - b"), ("a * 2", "a // 2"), ("a * 2", "a * 3")]
    for text, (before, after) in zip(mutated, expected):
        assert text == original.replace(before, after, 1), (before, after, text)
    with pytest.raises(SystemExit, match="site 8 does not exist: the module has 8 sites"):
        script.mutant(SOURCE, 8)


def test_type_annotations_are_not_mutation_sites() -> None:
    # `int | None` made `int & None` changes nothing at run time: such a site could only survive
    script = _script()
    source = ("def g(a: int | None, *rest: 'x' | None, **kw: dict[str, int | None]\n"
              "      ) -> int | None:\n"
              "    total: int | float = a + 1\n"
              "    return total\n")
    labels = [script.describe(source, kind, node)
              for kind, node in script.mutation_sites(ast.parse(source))]
    assert labels == ["line 3, operator: a + 1", "line 3, constant + 1: 1"]


@pytest.mark.timeout(240)
def test_a_real_bug_is_killed_and_an_equivalent_change_survives(tmp_path: Path) -> None:
    # handshake_targets' rank arithmetic (+ -> -) breaks the TP tests; _first_head's `tp >
    # num_kv_heads` -> `>=` changes nothing (both formulas agree at tp == num_kv_heads)
    script = _script()
    source = (ROOT / "hkvsim/connector/tp.py").read_text()
    labels = [script.describe(source, kind, node)
              for kind, node in script.mutation_sites(ast.parse(source))]
    bug = next(i for i, label in enumerate(labels) if label.endswith("operator: tp_rank * -r + i"))
    same = next(i for i, label in enumerate(labels)
                if label.endswith("comparison: tp > num_kv_heads"))
    out = tmp_path / "mutants.jsonl"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "hkvsim/connector/tp.py", "--sites", f"{bug},{same}",
         "--tests", "tests/connector/test_tp.py", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=230)
    assert done.returncode == 0, done.stderr[-2000:]
    results = {r["site"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert results[bug]["killed"] and "tests/connector/test_tp.py" in results[bug]["by"]
    assert not results[same]["killed"]
    assert f"hkvsim/connector/tp.py: 1 of 2 killed\n    survived: site {same}" in done.stdout
    # the checkout itself is never changed
    assert (ROOT / "hkvsim/connector/tp.py").read_text() == source


def test_bad_arguments_are_refused_with_what_is_allowed() -> None:
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)

    done = run("hkvsim/no_such_module.py")
    assert done.returncode == 2 and "not a Python file" in done.stderr
    done = run("hkvsim/connector/tp.py", "hkvsim/oracle.py", "--sites", "1")
    assert done.returncode == 2 and "give exactly one" in done.stderr
    done = run("hkvsim/connector/tp.py", "--sites", "1,x")
    assert done.returncode == 2 and "comma-separated integers" in done.stderr
    done = run("hkvsim/connector/tp.py", "--sites", "9999")
    assert done.returncode != 0 and "site 9999 does not exist" in done.stderr
    # a test path that does not exist is named before anything runs
    done = run("hkvsim/connector/tp.py", "--sites", "1", "--tests", "tests/connector",
               "tests/no_such_tests")
    assert done.returncode == 2 and "--tests: no such test path tests/no_such_tests" in done.stderr
    # tests that do not pass unchanged judge nothing (here: a test id that names no test)
    done = run("hkvsim/connector/tp.py", "--sites", "1", "--tests",
               "tests/connector/test_tp.py::no_such_test")
    assert done.returncode == 2 and "do not pass on the unchanged tree" in done.stderr


def test_an_interpreter_without_the_test_extras_is_named_before_any_copy(tmp_path: Path) -> None:
    # launched as ./scripts/mutation-sample, the shebang's python3 may lack pytest-xdist: the
    # tests then run with the repository's .venv, and a python that cannot run them is named
    script = _script()
    assert script.missing_test_extras(sys.executable) is None
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'xdist'\" >&2\n"
                    "exit 1\n")
    fake.chmod(0o755)
    why = script.missing_test_extras(str(fake))
    assert why is not None and str(fake) in why and "No module named 'xdist'" in why
    assert "pip install -e '.[test,report]'" in why
    venv = ROOT / ".venv" / "bin" / "python"
    assert script.interpreter_for_tests() == (str(venv) if venv.is_file() else sys.executable)


@pytest.mark.timeout(240)
def test_the_tests_run_with_the_interpreter_named_by_python(tmp_path: Path) -> None:
    # --python picks the interpreter of every test run (tests/vllm needs a scripts/with-vllm
    # environment): a wrapper that logs its arguments, then runs this interpreter, sees the
    # extras probe, the unchanged run and the mutant's run (a relative path is taken from where
    # the script is run, not from the copies); a path that is not an interpreter is refused
    log = tmp_path / "calls.log"
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\necho \"$*\" >> {log}\nexec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    script = _script()
    source = (ROOT / "hkvsim/connector/tp.py").read_text()
    labels = [script.describe(source, kind, node)
              for kind, node in script.mutation_sites(ast.parse(source))]
    bug = next(i for i, label in enumerate(labels) if label.endswith("operator: tp_rank * -r + i"))
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "hkvsim/connector/tp.py", "--sites", str(bug),
         "--tests", "tests/connector/test_tp.py", "--python", os.path.relpath(wrapper, ROOT)],
        cwd=ROOT, capture_output=True, text=True, timeout=230)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "hkvsim/connector/tp.py: 1 of 1 killed" in done.stdout
    calls = log.read_text().splitlines()
    assert sum("import pytest, xdist, pytest_timeout" in c for c in calls) == 1, calls
    assert sum(c.startswith("-m pytest") and "tests/connector/test_tp.py" in c
               for c in calls) == 2, calls
    done = subprocess.run([sys.executable, str(SCRIPT), "hkvsim/connector/tp.py", "--sites",
                           "1", "--python", str(tmp_path / "nowhere")],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--python" in done.stderr
    assert "no such interpreter" in done.stderr
