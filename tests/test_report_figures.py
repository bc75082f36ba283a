"""The report's figures draw what their legends name: no legend entry for a line hidden under
another, no "dashed" without a dashed line, one colour scale across heatmap panels, every link
of the utilisation plot visible; and the transfer time they plot is the transfer's own span."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hkvsim.cluster import run_scenario
from hkvsim.report import build, plots
from hkvsim.report.data import request_rows, variant_from_result
from hkvsim.scenario import parse_scenarios

pytestmark = pytest.mark.timeout(120)

SWEEP = """
[scenario]
name = "figures"
seed = 3
[model]
preset = "{model}"
[workload]
requests = 3
prompt_tokens = [300, 1200, 2500]
max_inflight = 1
[sweep]
connector.mode = ["pull", "push"]
prefill.tp = [1, 2]
decode.tp = [2, 4]
"""
# a fan-in: four prefill ranks write to one decode rank, over links with identical curves
FAN_IN = """
[scenario]
name = "fan-in"
[model]
preset = "tiny-kimi-linear"
[prefill]
tp = 4
[decode]
tp = 1
[connector]
mode = "push"
[workload]
requests = 2
prompt_tokens = 2500
"""


def _variants(text: str, family: str) -> list[Any]:
    scenarios = parse_scenarios(text)
    return [variant_from_result(run_scenario(s, timing_only=True), family=family,
                                position=(i, len(scenarios)))
            for i, s in enumerate(scenarios)]


@pytest.fixture(scope="module")
def qwen() -> list[Any]:
    # GQA with 2 KV heads: the KV per rank is the same at TP 2, 4 and 8
    return _variants(SWEEP.format(model="tiny-qwen3-next"), "qwen")


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The matplotlib figures a report would save, by file name (kept open for inspection)."""
    figures: dict[str, Any] = {}

    def keep(fig: Any, out: Path, name: str) -> str:
        figures[name] = fig
        return name

    monkeypatch.setattr(plots, "_save", keep)
    yield figures
    import matplotlib.pyplot as plt

    plt.close("all")


def _check_legends_match_what_is_drawn(fig: Any) -> None:
    from matplotlib.lines import Line2D

    for ax in fig.axes:
        lines = [ln for ln in ax.get_lines() if ln.get_visible() and len(ln.get_xdata())]
        seen = set()
        for ln in lines:  # a line exactly on top of another is hidden
            key = tuple(f"{float(v):.6g}" for v in (*ln.get_xdata(), *ln.get_ydata()))
            assert key not in seen, f"{ax.get_title()}: {ln.get_label()} hides another line"
            seen.add(key)
        legend = ax.get_legend()
        if legend is None:
            continue
        labels = {ln.get_label() for ln in lines} | {c.get_label() for c in ax.collections}
        for text in legend.get_texts():
            assert text.get_text() in labels, f"legend names {text.get_text()!r}, not drawn"
        title = legend.get_title().get_text()
        if "dashed" in title:
            assert any(isinstance(ln, Line2D) and ln.get_linestyle() == "--" for ln in lines)


def test_prompt_sweep_legends_name_visible_lines_only(qwen, drawn, tmp_path) -> None:
    build.write_report(qwen, tmp_path, title="t", command="c",
                       calibration_dir=tmp_path / "none")
    fig = drawn["transfer-vs-prompt.png"]
    _check_legends_match_what_is_drawn(fig)
    titles = [ax.get_legend().get_title().get_text() for ax in fig.axes if ax.get_legend()]
    assert titles and not any("dashed" in t for t in titles)  # every pair has P TP <= D TP
    # pairs with the same descriptor counts are one line naming both
    labels = [t.get_text() for ax in fig.axes if ax.get_legend()
              for t in ax.get_legend().get_texts()]
    assert any("," in label for label in labels)


def test_kv_vs_state_draws_one_line_per_distinct_kv_size(qwen, drawn, tmp_path) -> None:
    build.write_report(qwen, tmp_path, title="t", command="c",
                       calibration_dir=tmp_path / "none")
    fig = drawn["kv-vs-state.png"]
    _check_legends_match_what_is_drawn(fig)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert any("GQA KV per rank, TP2/4/8" in label for label in labels)
    assert all("MLA" not in label and "KDA" not in label for label in labels)
    assert any("GDN state" in label for label in labels)


def test_heatmap_panels_share_one_colour_scale(qwen, drawn, tmp_path) -> None:
    build.write_report(qwen, tmp_path, title="t", command="c",
                       calibration_dir=tmp_path / "none")
    fig = drawn["tp-heatmap.png"]
    images = [im for ax in fig.axes for im in ax.images]
    assert len(images) == 2  # pull and push
    assert len({(im.norm.vmin, im.norm.vmax) for im in images}) == 1
    values = [v for im in images for v in im.get_array().compressed()]
    assert images[0].norm.vmin == min(values) and images[0].norm.vmax == max(values)
    colour_bars = [ax for ax in fig.axes if not ax.images and ax.get_ylabel().startswith(
        "transfer time")]
    assert len(colour_bars) == 1


# production geometry: posting ~8 ms, the notification ~12 us
KIMI = """
[scenario]
name = "kimi"
[model]
preset = "kimi-linear-48b"
[workload]
requests = 3
prompt_tokens = [4096, 8192, 16384]
max_inflight = 1
[sweep]
decode.tp = [1, 2]
"""


@pytest.mark.parametrize("case", ["qwen", "kimi"])
def test_time_breakdown_legend_says_when_a_phase_is_too_short_to_see(case, qwen, drawn,
                                                                     tmp_path) -> None:
    variants = qwen if case == "qwen" else _variants(KIMI, "kimi")
    build.write_report(variants, tmp_path, title="t", command="c",
                       calibration_dir=tmp_path / "none")
    fig = drawn["time-breakdown.png"]
    (legend,) = fig.legends
    for text in legend.get_texts():
        phase = text.get_text().split(" (")[0]
        # a bar is visible when it is at least 0.5 % of its panel's width
        seen = [p.get_width() >= 0.005 * ax.get_xlim()[1] for ax in fig.axes
                for c in ax.containers if c.get_label() == phase for p in c.patches]
        hidden = "too short to see" in text.get_text() or "zero" in text.get_text()
        assert hidden == (not any(seen)), text.get_text()


def test_link_utilisation_shows_every_link_it_names(drawn, tmp_path) -> None:
    variants = _variants(FAN_IN, "fan-in")
    build.write_report(variants, tmp_path, title="t", command="c",
                       calibration_dir=tmp_path / "none")
    fig = drawn["link-utilisation.png"]
    _check_legends_match_what_is_drawn(fig)
    panels = [ax for ax in fig.axes if ax.get_lines()]
    assert all(len(ax.get_lines()) == 1 for ax in panels)
    named = " ".join(ax.get_title(loc="left") for ax in panels)
    assert "more links with the same curve" in named or named.count(",") >= 1
    assert len(panels) < 8  # the four prefill links share one panel


def test_transfer_time_is_the_transfer_own_span() -> None:
    """A short request queued behind a long one on the same rank is not slower than it."""
    body = """
[scenario]
name = "queued"
[model]
preset = "tiny-kimi-linear"
[workload]
requests = 2
prompt_tokens = [4000, 300]
"""
    (scenario,) = parse_scenarios(body)
    variant = variant_from_result(run_scenario(scenario), family="q")
    rows = {r["prompt_tokens"]: r for r in request_rows([variant])}
    assert rows[300]["transfer"] < rows[4000]["transfer"]
    # and the queueing it left out is still reported, as post wait
    assert rows[300]["breakdown"]["post wait"] > 0


# ---- the values drawn are the rows' values, in the units the axes say -------------------------
def _primary(variants: list[Any]) -> tuple[list[dict[str, Any]], str]:
    return plots.primary_rows(request_rows(variants))


def test_transfer_times_drawn_are_the_rows_in_ms(qwen, drawn, tmp_path) -> None:
    rows, caption = _primary(qwen)
    plots.prompt_sweep(rows, tmp_path, caption)
    fig = drawn["transfer-vs-prompt.png"]
    panels = [ax for ax in fig.axes if ax.get_ylabel() == "transfer time (ms)"]
    assert len(panels) == 2  # pull and push
    per: dict[tuple, dict[int, list[float]]] = {}
    for r in rows:
        if r["hit_tokens"] == 0:
            key = (r["mode"], r["prefill_tp"], r["decode_tp"])
            per.setdefault(key, {}).setdefault(r["prompt_tokens"], []).append(r["transfer"])
    expected = {(x, round(1e3 * sum(ts) / len(ts), 9)) for points in per.values()
                for x, ts in points.items()}
    got = {(float(x), round(float(y), 9)) for ax in panels for ln in ax.get_lines()
           for x, y in zip(ln.get_xdata(), ln.get_ydata())}
    assert got and got <= expected and {x for x, _ in got} == {x for x, _ in expected}

    _check_heatmap_cells(rows, drawn, tmp_path, caption)


def test_a_heatmap_cell_of_several_requests_is_their_fastest_in_ms(drawn, tmp_path) -> None:
    # two requests of each pair share the heatmap's prompt: the cell is the faster one
    variants = _variants(SWEEP.format(model="tiny-llama").replace(
        "prompt_tokens = [300, 1200, 2500]", "prompt_tokens = [2500, 300, 2500]"), "llama")
    rows, caption = _primary(variants)
    shared = [r for r in rows if r["prompt_tokens"] == 2500]
    assert len(shared) == 2 * len({(r["mode"], r["prefill_tp"], r["decode_tp"]) for r in shared})
    _check_heatmap_cells(rows, drawn, tmp_path, caption)


def _check_heatmap_cells(rows, drawn, tmp_path, caption) -> None:
    plots.tp_heatmap(rows, tmp_path, caption)
    prompt = plots.heatmap_prompt(rows)
    images = {ax.get_title().split(":")[0]: ax.images[0] for ax in drawn["tp-heatmap.png"].axes
              if ax.images}
    assert set(images) == {"pull", "push"}
    checked = 0
    for mode, image in images.items():
        cells = image.get_array()
        for r in rows:
            if r["mode"] == mode and r["prompt_tokens"] == prompt and r["hit_tokens"] == 0:
                i = sorted({x["prefill_tp"] for x in rows}).index(r["prefill_tp"])
                j = sorted({x["decode_tp"] for x in rows}).index(r["decode_tp"])
                assert cells[i, j] <= 1e3 * r["transfer"] + 1e-9, (mode, i, j)
                checked += 1
                assert any(abs(cells[i, j] - 1e3 * x["transfer"]) < 1e-9 for x in rows
                           if x["mode"] == mode and x["prompt_tokens"] == prompt
                           and (x["prefill_tp"], x["decode_tp"]) == (r["prefill_tp"],
                                                                     r["decode_tp"]))
    assert checked >= 4


def test_the_bytes_scattered_are_per_decode_rank(qwen, drawn, tmp_path) -> None:
    rows, caption = _primary(qwen)
    plots.kv_vs_state(qwen, rows, tmp_path, caption)
    ax = drawn["kv-vs-state.png"].axes[0]
    (dots,) = [c for c in ax.collections if c.get_label().startswith("moved per decode rank")]
    pull = [r for r in rows if r["mode"] == "pull" and r["hit_tokens"] == 0]
    assert sorted(map(tuple, dots.get_offsets().tolist())) == sorted(
        (float(r["prompt_tokens"]), r["nbytes"] / r["decode_tp"]) for r in pull)


def test_the_breakdown_bars_add_up_to_each_request_in_ms(qwen, drawn, tmp_path) -> None:
    rows, caption = _primary(qwen)
    plots.time_breakdown(rows, tmp_path, caption)
    fig = drawn["time-breakdown.png"]
    for ax in fig.axes:
        mode, _, which = ax.get_title().partition(" - ")
        pairs = sorted({(r["prefill_tp"], r["decode_tp"]) for r in rows if r["mode"] == mode})
        ends: dict[int, float] = {}
        for bar in ax.patches:
            k = round(bar.get_y() + bar.get_height() / 2)
            ends[k] = max(ends.get(k, 0.0), bar.get_x() + bar.get_width())
        for k, pair in enumerate(pairs):
            mine = [r for r in rows if r["mode"] == mode
                    and (r["prefill_tp"], r["decode_tp"]) == pair]
            cold = [r for r in mine if r["breakdown"]["handshake"] > 0]
            warm = [r for r in mine if r["breakdown"]["handshake"] == 0]
            if which.startswith("cold"):
                want = 1e3 * sum(cold[0]["breakdown"].values()) if cold else 0.0
            else:
                want = 1e3 * sum(sum(r["breakdown"].values()) for r in warm) / len(warm) \
                    if warm else 0.0
            assert ends.get(k, 0.0) == pytest.approx(want, rel=1e-9, abs=1e-9), (mode, which,
                                                                                 pair)


def test_utilisation_steps_are_in_ms_with_idle_gaps_at_zero() -> None:
    segs = [{"t_start": 0.002, "t_end": 0.003, "rate": 5.0, "capacity": 10.0},
            {"t_start": 0.001, "t_end": 0.002, "rate": 10.0, "capacity": 10.0},
            {"t_start": 0.005, "t_end": 0.006, "rate": 2.5, "capacity": 10.0}]
    xs, ys = plots._utilisation_steps(segs)
    assert xs == pytest.approx([1, 2, 2, 3, 3, 5, 5, 6])
    assert ys == pytest.approx([1, 1, 0.5, 0.5, 0, 0, 0.25, 0.25])


def test_the_comparison_scatter_is_each_request_in_ms(drawn, tmp_path) -> None:
    comparison = {"axis": "decode.tp", "baseline": "1",
                  "pairs": {"2": [(0.001, 0.002), (0.004, 0.003)], "4": [(0.002, 0.0005)],
                            "8": []}}
    plots.axis_comparison(comparison, tmp_path)
    ax = drawn["compare.png"].axes[0]
    dots = {c.get_label(): sorted(map(tuple, c.get_offsets().tolist())) for c in ax.collections}
    assert dots == {"2 (2 requests)": [(1.0, 2.0), (4.0, 3.0)], "4 (1 requests)": [(2.0, 0.5)]}


def test_merge_bars_stand_side_by_side_at_their_values(drawn, tmp_path) -> None:
    families = [{"family": "a", "modes": {"off": {"posted": 100, "transfer_seconds": 0.004},
                                          "contiguous": {"posted": 40, "transfer_seconds": 0.003},
                                          "strided": {"posted": 10, "transfer_seconds": 0.002}}},
                {"family": "b", "modes": {"off": {"posted": 50, "transfer_seconds": 0.002},
                                          "contiguous": {"posted": 50,
                                                         "transfer_seconds": 0.002}}}]
    plots.merge_comparison(families, tmp_path)
    ax_d, ax_t = drawn["descriptor-merging.png"].axes[:2]
    for ax, values in ((ax_d, [100, 50, 40, 50, 10, 0]),
                       (ax_t, [100.0, 100.0, 75.0, 100.0, 50.0, 0.0])):
        bars = ax.patches
        assert [b.get_height() for b in bars] == pytest.approx(values)
        spans = sorted((b.get_x(), b.get_x() + b.get_width()) for b in bars)
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:]))  # none overlaps
        ticks = ax.get_xticks()
        for f in range(2):  # a family's bars stand together, centred on its label
            centres = [b.get_x() + b.get_width() / 2 for b in bars[f::2]]
            assert sum(centres) / len(centres) == pytest.approx(ticks[f])
            assert max(centres) - min(centres) < 1.0
