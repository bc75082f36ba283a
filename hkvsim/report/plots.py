"""The report's PNG figures (matplotlib, Agg backend; imported only here, and only when a report
is written). Every function takes plain rows/variants, writes one file into ``out`` and returns
its name, or None when the data has nothing to show (e.g. a single prompt length)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from .data import PHASES, Variant

__all__ = ["primary_rows", "prompt_sweep", "tp_heatmap", "kv_vs_state", "time_breakdown",
           "link_utilisation", "merge_comparison", "simulated_vs_measured", "crossovers"]

_DPI = 110
_PHASE_COLORS = {"handshake": "#9e9e9e", "post wait": "#f4b183", "post": "#c55a11",
                 "wire": "#2e75b6", "notification": "#70ad47"}


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 9, "axes.titlesize": 10, "figure.dpi": _DPI,
                         "savefig.dpi": _DPI, "axes.grid": True, "grid.alpha": 0.3})
    return plt


def _save(fig: Any, out: Path, name: str) -> str:
    fig.savefig(out / name, bbox_inches="tight", metadata={"Software": None})
    import matplotlib.pyplot as plt

    plt.close(fig)
    return name


def _pair_key(row: dict[str, Any]) -> tuple[int, int]:
    return (row["prefill_tp"] or 0, row["decode_tp"] or 0)


def primary_rows(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """The rows the sweep figures show: descriptor_merge "off" when present (the reference
    plan), then the (input, model) covering the most TP pairs (then the most requests), and a
    caption saying so."""
    if not rows:
        return [], ""
    merges = {r["merge"] for r in rows}
    merge = "off" if "off" in merges else sorted(merges)[0]
    counts: dict[tuple[str, str], int] = defaultdict(int)
    pairs: dict[tuple[str, str], set] = defaultdict(set)
    for r in rows:
        if r["merge"] == merge:
            counts[(r["family"], r["model"])] += 1
            pairs[(r["family"], r["model"])].add((r["prefill_tp"], r["decode_tp"]))
    family, model = max(sorted(counts), key=lambda k: (len(pairs[k]), counts[k]))
    chosen = [r for r in rows if r["merge"] == merge and r["family"] == family
              and r["model"] == model]
    families = {r["family"] for r in rows}
    where = f"{family}: " if len(families) > 1 else ""
    return chosen, f"{where}{model}, descriptor_merge = {merge}"


def _modes(rows: list[dict[str, Any]]) -> list[str]:
    return [m for m in ("pull", "push") if any(r["mode"] == m for r in rows)]


def prompt_sweep(rows: list[dict[str, Any]], out: Path, caption: str) -> str | None:
    """Transfer time and descriptors vs prompt length, one line per TP pair, per mode."""
    modes = _modes(rows)
    series: dict[tuple[str, tuple[int, int]], dict[int, list[dict[str, Any]]]] = defaultdict(
        lambda: defaultdict(list))
    for r in rows:
        if r["hit_tokens"] == 0:
            series[(r["mode"], _pair_key(r))][r["prompt_tokens"]].append(r)
    if not any(len(points) >= 2 for points in series.values()):
        return None
    plt = _plt()
    fig, axes = plt.subplots(len(modes), 2, figsize=(11, 3.6 * len(modes)), squeeze=False)
    pairs = sorted({p for _, p in series})
    cmap = plt.get_cmap("tab20", max(len(pairs), 1))
    for i, mode in enumerate(modes):
        ax_t, ax_d = axes[i]
        for j, pair in enumerate(pairs):
            points = series.get((mode, pair))
            if not points or len(points) < 2:
                continue
            xs = sorted(points)
            t = [1e3 * sum(r["transfer"] for r in points[x]) / len(points[x]) for x in xs]
            d = [sum(r["descriptors"] for r in points[x]) / len(points[x]) for x in xs]
            style = dict(color=cmap(j), marker="o", ms=3, lw=1.2,
                         ls="-" if pair[0] <= pair[1] else "--", label=f"P{pair[0]}->D{pair[1]}")
            ax_t.plot(xs, t, **style)
            ax_d.plot(xs, d, **style)
        for ax, what in ((ax_t, "transfer time (ms)"), (ax_d, "descriptors per request")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel(what)
            ax.set_title(f"{mode}: {what}")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8,
               title="TP pair (dashed: P TP > D TP)")
    fig.suptitle(f"Transfer time and descriptors vs prompt length ({caption})")
    fig.tight_layout()
    return _save(fig, out, "transfer-vs-prompt.png")


def heatmap_prompt(rows: list[dict[str, Any]]) -> int | None:
    """The largest prompt length every TP pair of a mode ran (no prefix hit)."""
    by_pair: dict[tuple[str, tuple[int, int]], set[int]] = defaultdict(set)
    for r in rows:
        if r["hit_tokens"] == 0:
            by_pair[(r["mode"], _pair_key(r))].add(r["prompt_tokens"])
    if len(by_pair) < 2:
        return None
    common = set.intersection(*by_pair.values())
    return max(common) if common else None


def tp_heatmap(rows: list[dict[str, Any]], out: Path, caption: str) -> str | None:
    """P TP x D TP heatmap of the transfer time at one prompt length, per mode."""
    prompt = heatmap_prompt(rows)
    if prompt is None:
        return None
    modes = _modes(rows)
    p_tps = sorted({r["prefill_tp"] for r in rows})
    d_tps = sorted({r["decode_tp"] for r in rows})
    plt = _plt()
    import numpy as np

    fig, axes = plt.subplots(1, len(modes), figsize=(4.6 * len(modes), 3.9), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        grid = np.full((len(p_tps), len(d_tps)), np.nan)
        for r in rows:
            if r["mode"] == mode and r["prompt_tokens"] == prompt and r["hit_tokens"] == 0:
                i, j = p_tps.index(r["prefill_tp"]), d_tps.index(r["decode_tp"])
                grid[i, j] = 1e3 * r["transfer"] if np.isnan(grid[i, j]) else min(
                    grid[i, j], 1e3 * r["transfer"])
        im = ax.imshow(grid, cmap="viridis_r", origin="lower", aspect="auto")
        for i in range(len(p_tps)):
            for j in range(len(d_tps)):
                if not np.isnan(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.1f}", ha="center", va="center", fontsize=8,
                            color="white" if grid[i, j] > np.nanmean(grid) else "black")
        ax.set_xticks(range(len(d_tps)), [str(t) for t in d_tps])
        ax.set_yticks(range(len(p_tps)), [str(t) for t in p_tps])
        ax.set_xlabel("decode TP")
        ax.set_ylabel("prefill TP")
        ax.set_title(f"{mode}: transfer time (ms), {prompt:,} tokens")
        ax.grid(False)
        fig.colorbar(im, ax=ax, shrink=0.85)
    fig.suptitle(f"P TP x D TP ({caption})")
    fig.tight_layout()
    return _save(fig, out, "tp-heatmap.png")


def crossovers(geometry: dict[str, Any]) -> dict[int, float]:
    """Tokens at which a rank's attention KV bytes equal its recurrent-state bytes, by TP."""
    kv = geometry.get("kv_bytes_per_token", {})
    state = geometry.get("state_bytes_per_request", {})
    return {int(tp): state[tp] / kv[tp] for tp in kv if state.get(tp) and kv[tp]}


def kv_vs_state(variants: list[Variant], rows: list[dict[str, Any]], out: Path,
                caption: str) -> str | None:
    """Bytes of attention KV vs recurrent state per decode rank, with the crossover marked
    (DOMAIN.md §2.3: 5,384 tokens at TP1 for KimiLinear)."""
    model = rows[0]["model"] if rows else None
    geometry = next((v.geometry for v in variants if v.model == model and v.geometry), {})
    if not geometry.get("is_hybrid"):
        return None
    cross = crossovers(geometry)
    if not cross:
        return None
    plt = _plt()
    import numpy as np

    prompts = [r["prompt_tokens"] for r in rows] or [1024, 65536]
    lo, hi = max(64, min(prompts) // 4), max(prompts) * 2
    x = np.geomspace(lo, hi, 200)
    fig, ax = plt.subplots(figsize=(8.5, 4.8))
    cmap = plt.get_cmap("tab10")
    kv = geometry["kv_bytes_per_token"]
    state = geometry["state_bytes_per_request"]
    replicated = len({kv[str(tp)] for tp in cross}) == 1
    if replicated:
        tp0 = min(cross)
        ax.plot(x, x * kv[str(tp0)], color="black", lw=1.6,
                label=f"attention KV per rank ({kv[str(tp0)]:,} B/token at every TP)")
    for k, tp in enumerate(sorted(cross)):
        color = cmap(k)
        if not replicated:
            ax.plot(x, x * kv[str(tp)], color=color, lw=1.6,
                    label=f"attention KV per rank, TP{tp} ({kv[str(tp)]:,} B/token)")
        ax.axhline(state[str(tp)], color=color, lw=1.2, ls="--",
                   label=f"recurrent + conv state per rank, TP{tp}: {state[str(tp)] / 2**20:.1f} "
                         f"MiB")
        ax.axvline(cross[tp], color=color, lw=0.8, ls=":")
        ax.annotate(f"{cross[tp]:,.0f}", (cross[tp], state[str(tp)]), textcoords="offset points",
                    xytext=(4, -12), fontsize=8, color=color)
    pull = [r for r in rows if r["mode"] == "pull" and r["hit_tokens"] == 0]
    if pull:
        ax.scatter([r["prompt_tokens"] for r in pull],
                   [r["nbytes"] / max(r["decode_tp"] or 1, 1) for r in pull], s=10, color="0.3",
                   zorder=3, label="moved per decode rank in the sweep (KV + state, pull)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("bytes per decode rank")
    ax.set_title(f"Attention KV vs recurrent state; dotted: crossover tokens by TP ({caption})")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return _save(fig, out, "kv-vs-state.png")


def _cold_warm(rows: list[dict[str, Any]]) -> dict[str, dict[tuple[int, int], tuple]]:
    """Per mode and TP pair: (cold breakdown, warm mean breakdown, warm count)."""
    groups: dict[tuple[str, tuple[int, int]], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["mode"], _pair_key(r))].append(r)
    out: dict[str, dict[tuple[int, int], tuple]] = defaultdict(dict)
    for (mode, pair), rs in sorted(groups.items()):
        cold = [r for r in rs if r["breakdown"]["handshake"] > 0]
        warm = [r for r in rs if r["breakdown"]["handshake"] == 0]
        c = cold[0]["breakdown"] if cold else None
        w = ({p: sum(r["breakdown"][p] for r in warm) / len(warm) for p in PHASES}
             if warm else None)
        out[mode][pair] = (c, w, len(warm))
    return out


def time_breakdown(rows: list[dict[str, Any]], out: Path, caption: str) -> str | None:
    """Stacked phases per TP pair: the cold first request (with the handshake) and the mean of
    the warm ones."""
    table = _cold_warm(rows)
    if not table:
        return None
    plt = _plt()
    modes = [m for m in ("pull", "push") if m in table]
    npairs = max(len(v) for v in table.values())
    fig, axes = plt.subplots(len(modes), 2, figsize=(12, 0.28 * npairs * len(modes) + 2.2),
                             squeeze=False)
    for i, mode in enumerate(modes):
        pairs = sorted(table[mode])
        labels = [f"P{p}->D{d}" for p, d in pairs]
        for col, (which, title) in enumerate(((0, "cold: first request of the pair"),
                                              (1, "warm: mean of the other requests"))):
            ax = axes[i][col]
            left = [0.0] * len(pairs)
            for phase in PHASES:
                if which == 1 and phase == "handshake":
                    continue
                vals = [1e3 * (table[mode][p][which] or {}).get(phase, 0.0) for p in pairs]
                ax.barh(labels, vals, left=left, color=_PHASE_COLORS[phase], label=phase,
                        height=0.7)
                left = [a + b for a, b in zip(left, vals)]
            ax.set_xlabel("ms")
            ax.set_title(f"{mode} - {title}")
            ax.invert_yaxis()
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(PHASES),
               bbox_to_anchor=(0.5, 1.02))
    fig.suptitle(f"Time breakdown per request ({caption})", y=1.06)
    fig.tight_layout()
    return _save(fig, out, "time-breakdown.png")


def busiest(variants: list[Variant]) -> Variant | None:
    with_links = [v for v in variants if v.link_segments]
    if not with_links:
        return None
    # the most link sharing first (concurrent flows on one link), then the most bytes moved
    return max(with_links, key=lambda v: (max(s["flows"] for s in v.link_segments),
                                          sum(r["nbytes"] for r in v.requests), v.name))


def link_utilisation(variants: list[Variant], out: Path, *, top: int = 8) -> str | None:
    """Utilisation (rate / capacity) over simulated time of the busiest links of the variant
    with the most link sharing (then the most bytes)."""
    v = busiest(variants)
    if v is None:
        return None
    moved: dict[str, float] = defaultdict(float)
    for s in v.link_segments:
        moved[s["link"]] += s["rate"] * (s["t_end"] - s["t_start"])
    links = sorted(moved, key=lambda k: (-moved[k], k))[:top]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(11, 4.2))
    cmap = plt.get_cmap("tab10")
    for k, link in enumerate(links):
        segs = sorted((s for s in v.link_segments if s["link"] == link),
                      key=lambda s: s["t_start"])
        xs: list[float] = []
        ys: list[float] = []
        for s in segs:
            if xs and 1e3 * s["t_start"] > xs[-1]:  # idle gap
                xs += [xs[-1], 1e3 * s["t_start"]]
                ys += [0.0, 0.0]
            xs += [1e3 * s["t_start"], 1e3 * s["t_end"]]
            ys += [s["rate"] / s["capacity"]] * 2
        ax.plot(xs, ys, color=cmap(k % 10), lw=1.0,
                label=f"{link} ({moved[link] / 1e9:.2f} GB)")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("simulated time (ms)")
    ax.set_ylabel("utilisation")
    ax.set_title(f"Link utilisation: {v.name}")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    return _save(fig, out, "link-utilisation.png")


def merge_comparison(families: list[dict[str, Any]], out: Path) -> str | None:
    """Descriptors posted and simulated transfer time per family, per merge mode."""
    if not families:
        return None
    plt = _plt()
    import numpy as np

    modes = [m for m in ("off", "contiguous", "strided")
             if any(m in f["modes"] for f in families)]
    names = [f["family"] for f in families]
    x = np.arange(len(names))
    width = 0.8 / len(modes)
    fig, (ax_d, ax_t) = plt.subplots(1, 2, figsize=(12, 4.2))
    colors = {"off": "#7f7f7f", "contiguous": "#2e75b6", "strided": "#c55a11"}
    for k, mode in enumerate(modes):
        d = [f["modes"].get(mode, {}).get("posted", 0) for f in families]
        t = [100.0 * f["modes"].get(mode, {}).get("transfer_seconds", 0.0)
             / (f["modes"]["off"]["transfer_seconds"] or 1.0) for f in families]
        ax_d.bar(x + k * width, d, width, label=mode, color=colors[mode])
        ax_t.bar(x + k * width, t, width, label=mode, color=colors[mode])
    ax_t.set_ylim(0, 125)
    for ax, what in ((ax_d, "descriptors posted (sum over requests)"),
                     (ax_t, "simulated transfer time, % of descriptor_merge = off")):
        ax.set_xticks(x + width * (len(modes) - 1) / 2, names, rotation=20, ha="right")
        ax.set_title(what)
        ax.legend(title="descriptor_merge", fontsize=8, ncol=len(modes), loc="upper center")
    ax_d.set_yscale("log")
    top = max((f["modes"]["off"]["posted"] for f in families), default=1)
    ax_d.set_ylim(top=max(top, 1) * 30)  # room for the legend above the bars
    fig.tight_layout()
    return _save(fig, out, "descriptor-merging.png")


def simulated_vs_measured(points: list[dict[str, Any]], out: Path) -> str | None:
    """Scatter of simulated vs measured transfer time (calibration data), with y = x."""
    pts = [p for p in points if p.get("simulated_seconds") and p.get("measured_seconds")]
    if not pts:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 5))
    xs = [1e3 * p["simulated_seconds"] for p in pts]
    ys = [1e3 * p["measured_seconds"] for p in pts]
    for source in sorted({p["source"] for p in pts}):
        mine = [p for p in pts if p["source"] == source]
        ax.scatter([1e3 * p["simulated_seconds"] for p in mine],
                   [1e3 * p["measured_seconds"] for p in mine], s=14,
                   label=f"{source} ({mine[0].get('transport', '?')})")
    lo, hi = min(xs + ys) * 0.8, max(xs + ys) * 1.25
    ax.plot([lo, hi], [lo, hi], color="0.4", lw=1, ls="--", label="simulated = measured")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("simulated transfer time (ms)")
    ax.set_ylabel("measured transfer time (ms)")
    ax.set_title("Simulated vs measured")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, out, "simulated-vs-measured.png")
