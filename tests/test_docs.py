"""The project's own docs stay true: docs/scenarios.md lists exactly the scenario schema (keys,
defaults, allowed values), docs/semantics.md keeps its section numbering (code cites it by §),
and nothing shipped points outside the repository."""

from __future__ import annotations

import re
import tomllib
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from hkvsim.connector.quirks import quirk_names
from hkvsim.fabric.profile import MEMORY_KINDS, PLACEMENTS, TOML_KEYS
from hkvsim.geometry.layout import KV_CACHE_LAYOUTS, REGISTRATION_ORDERS
from hkvsim.geometry.presets import preset_names
from hkvsim.geometry.specs import ATTENTION_BACKENDS
from hkvsim.scenario import (
    FAULT_KINDS,
    FAULT_PHASES,
    MAX_SWEEP_VARIANTS,
    ScenarioDocument,
    parse_scenarios,
    sweepable_keys,
)
from hkvsim.traces import CSV_HEADER, MOONCAKE_BLOCK_TOKENS, MOONCAKE_KEYS, TRACE_FORMATS

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS_DOC = ROOT / "docs" / "scenarios.md"
SEMANTICS_DOC = ROOT / "docs" / "semantics.md"


def _sections(text: str) -> dict[str, str]:
    """Markdown text by '## ' heading (the heading line without '## ')."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def _table(text: str) -> dict[str, list[str]]:
    """The first markdown table in ``text``: first-column key (backticks removed) -> cells."""
    rows: dict[str, list[str]] = {}
    started = False
    for line in text.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if set(cells[0]) <= {"-"}:
                started = True
                continue
            if started:
                rows[cells[0].strip("`")] = cells
        elif started:
            break
    return rows


def _model(annotation: typing.Any) -> type[BaseModel]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    raise AssertionError(f"no model in {annotation}")


def _literals(annotation: typing.Any) -> list[str]:
    """The allowed strings of a Literal annotation (through Optional / Annotated)."""
    if typing.get_origin(annotation) is typing.Literal:
        return [a for a in typing.get_args(annotation) if isinstance(a, str)]
    found: list[str] = []
    for arg in typing.get_args(annotation):
        found += _literals(arg)
    return found


# values the schema reads from other modules (not visible as Literal annotations)
DELEGATED = {
    ("model", "preset"): preset_names(),
    ("engine", "preset"): preset_names(),
    ("engine", "kv_cache_layout"): list(KV_CACHE_LAYOUTS),
    ("engine", "attention_backend"): sorted(ATTENTION_BACKENDS),
    ("connector", "registration_order"): list(REGISTRATION_ORDERS),
    ("connector", "quirks"): quirk_names(),
}
HEADINGS = {"scenario": "`[scenario]`", "model": "`[model]`",
            "prefill": "`[prefill]` and `[decode]`", "decode": "`[prefill]` and `[decode]`",
            "connector": "`[connector]`", "fabric": "`[fabric]`", "workload": "`[workload]`",
            "faults": "`[[faults]]`", "expect": "`[expect]`"}


@pytest.fixture(scope="module")
def doc() -> dict[str, str]:
    return _sections(SCENARIOS_DOC.read_text())


@pytest.mark.parametrize("section", list(ScenarioDocument.model_fields))
def test_every_schema_key_is_documented_with_its_default(doc, section: str) -> None:
    model = _model(ScenarioDocument.model_fields[section].annotation)
    rows = _table(doc[HEADINGS[section]])
    if section == "decode":  # [prefill] and [decode] share one table; a few keys are prefill's
        rows = {k: v for k, v in rows.items() if not v[3].startswith("`[prefill]` only")}
    assert sorted(rows) == sorted(model.model_fields), f"[{section}] keys differ from the schema"
    for name, field in model.model_fields.items():
        default_cell = rows[name][2]
        if field.is_required():
            assert default_cell == "required", (section, name)
        elif field.default is None:
            assert default_cell == "—", (section, name)
        else:
            value = field.default if field.default is not PydanticUndefined else (
                field.default_factory())  # type: ignore[misc]
            literal = default_cell.strip("`")
            documented = tomllib.loads(f"v = {literal}")["v"]
            expected = list(value) if isinstance(value, tuple) else value
            assert documented == expected and type(documented) is type(expected), (
                section, name, default_cell)


@pytest.mark.parametrize("section", list(ScenarioDocument.model_fields))
def test_every_allowed_value_is_documented(doc, section: str) -> None:
    model = _model(ScenarioDocument.model_fields[section].annotation)
    rows = _table(doc[HEADINGS[section]])
    kind = "engine" if section in ("prefill", "decode") else section
    for name, field in model.model_fields.items():
        if (section, name) == ("faults", "kind"):
            continue  # the kinds table: test_fault_kinds_and_phases_are_documented
        allowed = _literals(field.annotation) + list(DELEGATED.get((kind, name), []))
        meaning = rows[name][3]
        missing = [v for v in allowed if f"`{v}`" not in meaning]
        assert not missing, f"{section}.{name}: {missing} not in the doc"


def test_fault_kinds_and_phases_are_documented(doc) -> None:
    text = doc[HEADINGS["faults"]]
    kinds = _table(text.split("| kind | effect |", 1)[1].join(["| kind | effect |", ""]))
    assert sorted(kinds) == sorted(FAULT_KINDS)
    assert all(f"`{p}`" in _table(text)["phase"][3] for p in FAULT_PHASES)


def test_profile_keys_are_documented(doc) -> None:
    text = doc[HEADINGS["fabric"]]
    keys = _table(text.split("| profile key |", 1)[1].join(["| profile key |", ""]))
    assert list(keys) == list(TOML_KEYS)
    assert all(f"`{v}`" in keys["placement"][2] for v in PLACEMENTS)
    assert all(f"`{v}`" in keys["memory"][2] for v in MEMORY_KINDS)


def test_sweeps_and_traces_are_documented(doc) -> None:
    sweep = doc["`[sweep]`"]
    assert set(_table(sweep)) == {"mode"}
    assert f"{MAX_SWEEP_VARIANTS:,}" in sweep
    assert all(f"`{k}`" in doc[HEADINGS["workload"]] for k in MOONCAKE_KEYS)
    assert ",".join(CSV_HEADER) in doc[HEADINGS["workload"]]
    assert f"{MOONCAKE_BLOCK_TOKENS}-token block" in doc[HEADINGS["workload"]]
    assert all(f"`{suffix}`" in doc[HEADINGS["workload"]] for suffix in TRACE_FORMATS)
    # the sweepable keys the doc names exist
    named = re.findall(r"`((?:[a-z_]+\.)+[a-z_]+)`", sweep)
    allowed = set(sweepable_keys())
    assert named and all(k in allowed or k.startswith("fabric.overrides.") for k in named), named


def test_the_doc_examples_parse() -> None:
    """The TOML snippets of docs/scenarios.md are valid scenario fragments."""
    text = SCENARIOS_DOC.read_text()
    (sweep,) = re.findall(r"```toml\n(.*?)```", text, flags=re.S)
    base = ('[scenario]\nname = "doc"\n[model]\npreset = "tiny-llama"\n[workload]\n'
            "requests = 1\nprompt_tokens = 64\n")
    assert len(parse_scenarios(base + sweep)) == 3 * 2 * 2


# --- docs/semantics.md --------------------------------------------------------------------------

# the numbering code comments cite ("§6", "§9.5"); kept so citations can be rewritten mechanically
SEMANTICS_SECTIONS = [
    "1", "2", "2.1", "2.2", "2.3", "2.4", "3", "3.1", "3.2", "3.3", "3.4",
    "4", "4.1", "4.2", "4.3", "4.4", "4.5", "5", "5.1", "5.2", "5.3", "5.4", "6", "7",
    "8", "8.1", "8.2", "9", "9.1", "9.2", "9.3", "9.4", "9.5", "10", "11", "11.1", "11.2", "11.3",
    "11.4",
]


def _semantics_numbers() -> list[str]:
    return re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", SEMANTICS_DOC.read_text(), flags=re.M)


def test_semantics_keeps_its_section_numbering() -> None:
    assert _semantics_numbers() == SEMANTICS_SECTIONS


def test_every_section_citation_resolves() -> None:
    """'§N' citations in the code, tests, scenarios and docs name a section that exists."""
    sections = set(_semantics_numbers())
    files = [p for pattern in ("hkvsim/**/*.py", "tests/**/*.py", "benchmarks/*.py",
                               "scenarios/**/*.toml", "*.md", "docs/*.md", "hardware/*.md")
             for p in ROOT.glob(pattern)]
    cited: dict[str, set[str]] = {}
    for path in files:
        for match in re.finditer(r"(?:DOMAIN|semantics)\.md[^§\n]{0,20}((?:§\s*[\d.]+[-,\s]*)+)",
                                 path.read_text()):
            for number in re.findall(r"(\d+(?:\.\d+)?)", match.group(1)):
                cited.setdefault(number.rstrip("."), set()).add(path.name)
    assert cited, "no citations found: the pattern is broken"
    unknown = {n: sorted(f) for n, f in cited.items() if n not in sections}
    assert not unknown, f"cited sections missing from docs/semantics.md: {unknown}"


# --- nothing shipped points outside the repository -----------------------------------------------

OUTSIDE = re.compile(r"\.\./shared|shared/docs|DOMAIN\.md|DESIGN\.md|VLLM_HARNESS\.md")


def _shipped_texts() -> list[Path]:
    patterns = ("*.md", "docs/*.md", "hardware/*.md", "reports/**/*.md", "reports/**/*.json",
                "scenarios/**/*.toml", "hkvsim/**/*.py", "hkvsim/**/*.toml", "hkvsim/**/*.txt",
                "scripts/*", "benchmarks/*.py")
    return [p for pattern in patterns for p in ROOT.glob(pattern)]


def test_nothing_shipped_points_outside_the_repository() -> None:
    """README, docs, reports, scenarios, the package's code and data, scripts and benchmarks."""
    files = _shipped_texts()
    assert any(p.name == "README.md" for p in files) and any(p.suffix == ".toml" for p in files)
    offenders = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
                 for p in files for i, line in enumerate(p.read_text().splitlines(), start=1)
                 if OUTSIDE.search(line)]
    assert not offenders, "\n".join(offenders[:10])


LOCAL_PATH = re.compile(r"(?<![\w.~-])/(?:work|tmp|root|home|Users|var/folders)/")


def test_committed_reports_carry_no_machine_paths() -> None:
    """A committed report names files relative to the repository, never where one checkout
    happened to live (``/work/...``) or a temporary file (``/tmp/...``)."""
    files = [p for pattern in ("reports/**/*.md", "reports/**/*.json", "docs/*.md", "*.md")
             for p in ROOT.glob(pattern)]
    assert any(p.name == "host-path.json" for p in files)
    offenders = [f"{p.relative_to(ROOT)}:{i}: {line.strip()[:120]}"
                 for p in files for i, line in enumerate(p.read_text().splitlines(), start=1)
                 if LOCAL_PATH.search(line)]
    assert not offenders, "\n".join(offenders[:10])


def test_generated_report_points_inside_the_repository(tmp_path: Path) -> None:
    """A report with the KV-vs-state and descriptor-merging sections (their text cites §§)."""
    pytest.importorskip("matplotlib")
    from hkvsim.cli import main

    family = tmp_path / "family.toml"
    family.write_text("""
[scenario]
name = "tiny kimi merging"
[model]
preset = "tiny-kimi-linear"
[decode]
tp = 2
[workload]
requests = 1
prompt_tokens = [300]
[sweep]
connector.descriptor_merge = ["off", "contiguous", "strided"]
""")
    out = tmp_path / "report"
    assert main(["report", str(family), "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert "## Descriptor merging" in text and re.search(r"#+ MLA KV vs KDA state", text)
    assert "docs/semantics.md §10" in text and "docs/semantics.md §2.3" in text
    assert not OUTSIDE.search(text) and not OUTSIDE.search((out / "report.json").read_text())
