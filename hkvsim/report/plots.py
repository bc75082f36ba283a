"""The report's PNG figures (matplotlib, Agg backend; imported only here, and only when a report
is written). Every function takes plain rows/variants, writes one file into ``out`` and returns
its name, or None when the data has nothing to show (e.g. a single prompt length)."""

from __future__ import annotations

import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Any

from .data import PHASES, Variant

__all__ = ["primary_rows", "prompt_sweep", "tp_heatmap", "kv_vs_state", "time_breakdown",
           "link_utilisation", "merge_comparison", "simulated_vs_measured", "crossovers",
           "axis_comparison", "sizing", "figure_name"]

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


def figure_name(stem: str, suffix: str = "") -> str:
    """``stem.png``, or ``stem-<suffix>.png`` for one input of several (a file-name-safe
    suffix)."""
    if not suffix:
        return f"{stem}.png"
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in suffix).strip("-")
    return f"{stem}-{safe}.png"


def _coincident(series: dict[Any, list[float]], *, relative: float = 0.05,
                absolute: float = 0.0) -> list[tuple[list[Any], list[float]]]:
    """Series that would be drawn on top of each other (every point within ``relative`` of
    the first series' point, or within ``absolute``) drawn once: [(keys, values)] in first-seen
    order, so every legend entry names a line that can be seen."""
    groups: list[tuple[list[Any], list[float]]] = []
    for key, ys in series.items():
        for keys, ref in groups:
            if len(ref) == len(ys) and all(abs(a - b) <= max(absolute, relative * max(abs(a),
                                                                                     abs(b)))
                                           for a, b in zip(ref, ys)):
                keys.append(key)
                break
        else:
            groups.append(([key], ys))
    return groups


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def _plain_log_axes(ax: Any) -> None:
    """Log axes labelled with plain numbers at the major ticks only (no overlapping minor
    labels)."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(NullFormatter())


def _pair_key(row: dict[str, Any]) -> tuple[int, int]:
    return (row["prefill_tp"] or 0, row["decode_tp"] or 0)


def primary_rows(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """The rows a set of sweep figures shows: descriptor_merge "off" when present (the reference
    plan), then the model covering the most TP pairs (then the most requests), and a caption
    saying so. Called once per input, so several inputs each get their figures."""
    if not rows:
        return [], ""
    merges = {r["merge"] for r in rows}
    merge = "off" if "off" in merges else sorted(merges)[0]
    counts: dict[str, int] = defaultdict(int)
    pairs: dict[str, set] = defaultdict(set)
    for r in rows:
        if r["merge"] == merge:
            counts[r["model"]] += 1
            pairs[r["model"]].add((r["prefill_tp"], r["decode_tp"]))
    model = max(sorted(counts), key=lambda k: (len(pairs[k]), counts[k]))
    chosen = [r for r in rows if r["merge"] == merge and r["model"] == model]
    return chosen, f"{rows[0]['family']}: {model}, descriptor_merge = {merge}"


def _modes(rows: list[dict[str, Any]]) -> list[str]:
    return [m for m in ("pull", "push") if any(r["mode"] == m for r in rows)]


def prompt_sweep(rows: list[dict[str, Any]], out: Path, caption: str,
                 name: str = "transfer-vs-prompt.png") -> str | None:
    """Transfer time and descriptors vs prompt length, one line per TP pair, per mode. Each
    panel has its own legend; pairs whose lines coincide are drawn once and named together."""
    modes = _modes(rows)
    series: dict[tuple[str, tuple[int, int]], dict[int, list[dict[str, Any]]]] = defaultdict(
        lambda: defaultdict(list))
    for r in rows:
        if r["hit_tokens"] == 0:
            series[(r["mode"], _pair_key(r))][r["prompt_tokens"]].append(r)
    if not any(len(points) >= 2 for points in series.values()):
        return None
    plt = _plt()
    fig, axes = plt.subplots(len(modes), 2, figsize=(13, 3.9 * len(modes)), squeeze=False)
    pairs = sorted({p for _, p in series})
    cmap = plt.get_cmap("tab20", max(len(pairs), 1))
    for i, mode in enumerate(modes):
        ax_t, ax_d = axes[i]
        drawn = {pair: series[(mode, pair)] for pair in pairs
                 if len(series.get((mode, pair), {})) >= 2}
        xs = {pair: sorted(points) for pair, points in drawn.items()}
        for ax, what, value in (
                (ax_t, "transfer time (ms)", lambda rs: 1e3 * sum(r["transfer"] for r in rs)),
                (ax_d, "descriptors per request", lambda rs: sum(r["descriptors"] for r in rs))):
            per_pair = {pair: [value(points[x]) / len(points[x]) for x in xs[pair]]
                        for pair, points in drawn.items()}
            by_x: dict[tuple, dict[tuple[int, int], list[float]]] = defaultdict(dict)
            for pair, ys in per_pair.items():
                by_x[tuple(xs[pair])][pair] = ys
            dashed = merged = False
            for x, group in by_x.items():
                for keys, ys in _coincident(group):
                    first = keys[0]
                    style = "-" if first[0] <= first[1] else "--"
                    dashed |= style == "--"
                    merged |= len(keys) > 1
                    ax.plot(list(x), ys, color=cmap(pairs.index(first)), marker="o", ms=3,
                            lw=1.2, ls=style, label=textwrap.fill(
                                ", ".join(f"P{p}->D{d}" for p, d in keys), 44))
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel(what)
            ax.set_title(f"{mode}: {what}")
            ax.legend(fontsize=6.5, loc="center left", bbox_to_anchor=(1.0, 0.5),
                      title="TP pair" + (" (dashed: P TP > D TP)" if dashed else "")
                      + ("\npairs within 5 %: one line" if merged else ""), title_fontsize=7)
    fig.suptitle(f"Transfer time and descriptors vs prompt length ({caption})")
    fig.tight_layout()
    return _save(fig, out, name)


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


def tp_heatmap(rows: list[dict[str, Any]], out: Path, caption: str,
               name: str = "tp-heatmap.png") -> str | None:
    """P TP x D TP heatmap of the transfer time at one prompt length, per mode, on one colour
    scale shared by the panels (one colour bar)."""
    prompt = heatmap_prompt(rows)
    if prompt is None:
        return None
    modes = _modes(rows)
    p_tps = sorted({r["prefill_tp"] for r in rows})
    d_tps = sorted({r["decode_tp"] for r in rows})
    plt = _plt()
    import numpy as np
    from matplotlib.colors import Normalize

    grids = {}
    for mode in modes:
        grid = np.full((len(p_tps), len(d_tps)), np.nan)
        for r in rows:
            if r["mode"] == mode and r["prompt_tokens"] == prompt and r["hit_tokens"] == 0:
                i, j = p_tps.index(r["prefill_tp"]), d_tps.index(r["decode_tp"])
                grid[i, j] = 1e3 * r["transfer"] if np.isnan(grid[i, j]) else min(
                    grid[i, j], 1e3 * r["transfer"])
        grids[mode] = grid
    every = np.concatenate([g[~np.isnan(g)] for g in grids.values()])
    norm = Normalize(vmin=float(every.min()), vmax=float(every.max()))
    middle = float(every.mean())
    fig, axes = plt.subplots(1, len(modes), figsize=(4.4 * len(modes) + 1.2, 3.9),
                             squeeze=False)
    im = None
    for ax, mode in zip(axes[0], modes):
        grid = grids[mode]
        im = ax.imshow(grid, cmap="viridis_r", norm=norm, origin="lower", aspect="auto")
        for i in range(len(p_tps)):
            for j in range(len(d_tps)):
                if not np.isnan(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.1f}", ha="center", va="center", fontsize=8,
                            color="white" if grid[i, j] > middle else "black")
        ax.set_xticks(range(len(d_tps)), [str(t) for t in d_tps])
        ax.set_yticks(range(len(p_tps)), [str(t) for t in p_tps])
        ax.set_xlabel("decode TP")
        ax.set_ylabel("prefill TP")
        ax.set_title(f"{mode}: transfer time (ms), {prompt:,} tokens")
        ax.grid(False)
    fig.suptitle(f"P TP x D TP ({caption})")
    fig.tight_layout()
    fig.colorbar(im, ax=list(axes[0]), shrink=0.85, label="transfer time (ms), all panels")
    return _save(fig, out, name)


def crossovers(geometry: dict[str, Any]) -> dict[int, float]:
    """Tokens at which a rank's attention KV bytes equal its recurrent-state bytes, by TP."""
    kv = geometry.get("kv_bytes_per_token", {})
    state = geometry.get("state_bytes_per_request", {})
    return {int(tp): state[tp] / kv[tp] for tp in kv if state.get(tp) and kv[tp]}


def kv_vs_state(variants: list[Variant], rows: list[dict[str, Any]], out: Path,
                caption: str, name: str = "kv-vs-state.png") -> str | None:
    """Bytes of attention KV vs recurrent state per decode rank, with the crossover marked
    (5,384 tokens at TP1 for Kimi-Linear-48B)."""
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
    attention = geometry.get("attention_kind", "attention")
    state_kind = geometry.get("state_kind") or "recurrent"
    # one line per distinct KV size (TPs that replicate the KV share one), one state line per TP
    by_size: dict[int, list[int]] = defaultdict(list)
    for tp in sorted(cross):
        by_size[kv[str(tp)]].append(tp)
    every_tp = len(by_size) == 1
    for k, (size, tps) in enumerate(sorted(by_size.items(), reverse=True)):
        which = "at every TP" if every_tp else "TP" + "/".join(str(t) for t in tps)
        ax.plot(x, x * size, color="black", lw=1.6, ls=("-", "-.", ":", (0, (5, 1)))[k % 4],
                label=f"{attention} KV per rank, {which} ({size:,} B/token)")
    for k, tp in enumerate(sorted(cross)):
        color = cmap(k)
        ax.axhline(state[str(tp)], color=color, lw=1.2, ls="--",
                   label=f"{state_kind} state (conv + recurrent) per rank, TP{tp}: "
                         f"{_size(state[str(tp)])}")
        ax.annotate(f"{cross[tp]:,.0f}", (cross[tp], state[str(tp)]), textcoords="offset points",
                    xytext=(4, -12), fontsize=8, color=color)
    at: dict[float, list[int]] = defaultdict(list)  # TPs whose crossovers fall together
    for tp in sorted(cross):
        at[round(cross[tp], 6)].append(tp)
    for tokens, tps in at.items():
        ax.axvline(tokens, color=cmap(sorted(cross).index(tps[0])), lw=0.8, ls=":")
    pull = [r for r in rows if r["mode"] == "pull" and r["hit_tokens"] == 0]
    if pull:
        ax.scatter([r["prompt_tokens"] for r in pull],
                   [r["nbytes"] / max(r["decode_tp"] or 1, 1) for r in pull], s=10, color="0.3",
                   zorder=3, label="moved per decode rank in the sweep (KV + state, pull)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("bytes per decode rank")
    ax.set_title(f"{attention} KV vs {state_kind} state; dotted: crossover tokens by TP "
                 f"({caption})")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return _save(fig, out, name)


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


def time_breakdown(rows: list[dict[str, Any]], out: Path, caption: str,
                   name: str = "time-breakdown.png") -> str | None:
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
    # a phase too short to show as a bar anywhere says so in the legend, with its size
    from matplotlib.patches import Patch

    largest = {phase: max((1e3 * (table[m][p][w] or {}).get(phase, 0.0) for m in modes
                           for p in table[m] for w in (0, 1)), default=0.0) for phase in PHASES}
    # visible: at least 0.5 % of the width of some panel it is drawn in
    visible = {phase: any(1e3 * (table[m][p][w] or {}).get(phase, 0.0)
                          >= 0.005 * axes[i][w].get_xlim()[1]
                          for i, m in enumerate(modes) for p in table[m] for w in (0, 1))
               for phase in PHASES}
    handles = []
    for phase in PHASES:
        label = phase
        if largest[phase] == 0.0:
            label += " (zero in every request)"
        elif not visible[phase]:
            label += f" (too short to see: at most {largest[phase]:.3g} ms)"
        handles.append(Patch(color=_PHASE_COLORS[phase], label=label))
    fig.legend(handles=handles, loc="upper center", ncol=3, bbox_to_anchor=(0.5, 1.03),
               fontsize=8)
    fig.suptitle(f"Time breakdown per request ({caption})", y=1.07)
    fig.tight_layout()
    return _save(fig, out, name)


def busiest(variants: list[Variant]) -> Variant | None:
    with_links = [v for v in variants if v.link_segments]
    if not with_links:
        return None
    # the most link sharing first (concurrent flows on one link), then the most bytes moved
    return max(with_links, key=lambda v: (max(s["flows"] for s in v.link_segments),
                                          sum(r["nbytes"] for r in v.requests), v.name))


def _utilisation_steps(segments: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    xs: list[float] = []
    ys: list[float] = []
    for seg in sorted(segments, key=lambda x: x["t_start"]):
        if xs and 1e3 * seg["t_start"] > xs[-1]:  # idle gap
            xs += [xs[-1], 1e3 * seg["t_start"]]
            ys += [0.0, 0.0]
        xs += [1e3 * seg["t_start"], 1e3 * seg["t_end"]]
        ys += [seg["rate"] / seg["capacity"]] * 2
    return xs, ys


def link_utilisation(variants: list[Variant], out: Path, *, top: int = 8) -> str | None:
    """Utilisation (rate / capacity) over simulated time of the busiest links of the variant
    with the most link sharing (then the most bytes): one panel per distinct curve, links with
    identical curves (e.g. every prefill NIC of a fan-in) named together in one panel, so every
    series listed is one that can be seen."""
    v = busiest(variants)
    if v is None:
        return None
    moved: dict[str, float] = defaultdict(float)
    by_link: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for seg in v.link_segments:
        moved[seg["link"]] += seg["rate"] * (seg["t_end"] - seg["t_start"])
        by_link[seg["link"]].append(seg)
    links = sorted(moved, key=lambda k: (-moved[k], k))[:top]
    curves: dict[tuple, list[str]] = {}
    steps: dict[tuple, tuple[list[float], list[float]]] = {}
    for link in links:
        xs, ys = _utilisation_steps(by_link[link])
        sig = (tuple(round(x, 6) for x in xs), tuple(round(y, 4) for y in ys))
        curves.setdefault(sig, []).append(link)
        steps.setdefault(sig, (xs, ys))
    plt = _plt()
    fig, axes = plt.subplots(len(curves), 1, figsize=(11, 1.5 * len(curves) + 1.2),
                             sharex=True, squeeze=False)
    cmap = plt.get_cmap("tab10")
    for k, (sig, names) in enumerate(curves.items()):
        ax = axes[k][0]
        xs, ys = steps[sig]
        label = ", ".join(names) if len(names) <= 3 else f"{names[0]} and {len(names) - 1} more " \
            f"links with the same curve"
        ax.plot(xs, ys, color=cmap(k % 10), lw=1.0)
        ax.set_ylim(0, 1.1)
        ax.set_ylabel("util.")
        each = moved[names[0]]
        amount = f"{each / 1e9:.2f} GB" if each >= 1e8 else f"{each / 1e6:.2f} MB"
        ax.set_title(f"{label} ({amount}{' each' if len(names) > 1 else ''})", fontsize=8,
                     loc="left")
    axes[-1][0].set_xlabel(f"{'simulated' if v.clock == 'simulated' else 'wall-clock'} time (ms)")
    fig.suptitle(textwrap.fill(f"Link utilisation (rate / capacity): {v.name}", 130),
                 fontsize=9)
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
    profiles = ", ".join(sorted({p.get("profile", "?") for p in pts}))
    ax.set_title(f"Simulated vs measured (profile {profiles})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, out, "simulated-vs-measured.png")


def axis_comparison(comparison: dict[str, Any], out: Path) -> str | None:
    """Per request, transfer time with each compared value against the baseline's (log-log,
    with y = x): points above the line are slower than the baseline."""
    pairs = {k: v for k, v in comparison["pairs"].items() if v}
    if not pairs:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.2, 5.4))
    every = []
    for k, (value, pts) in enumerate(pairs.items()):
        xs = [1e3 * a for a, _ in pts]
        ys = [1e3 * b for _, b in pts]
        every += xs + ys
        ax.scatter(xs, ys, s=12, color=plt.get_cmap("tab10")(k % 10), label=f"{value} "
                   f"({len(pts)} requests)")
    lo, hi = min(every) * 0.8, max(every) * 1.25
    ax.plot([lo, hi], [lo, hi], color="0.4", lw=1, ls="--", label="same time as baseline")
    ax.set_xscale("log")
    ax.set_yscale("log")
    _plain_log_axes(ax)
    ax.set_xlabel(f"transfer time (ms), {comparison['axis']} = {comparison['baseline']}")
    ax.set_ylabel("transfer time (ms), compared value")
    ax.set_title(f"{comparison['axis']}: each value vs {comparison['baseline']}, per request")
    ax.legend(fontsize=8, title=comparison["axis"], title_fontsize=8)
    fig.tight_layout()
    return _save(fig, out, "compare.png")


def sizing(rows: list[dict[str, Any]], out: Path, caption: str,
           name: str = "pd-sizing.png") -> str | None:
    """Transfer share of TTFT (prefill compute + transfer) vs prompt length, one line per TP
    pair and mode; above 50 % the transfer, not prefill, limits TTFT."""
    series: dict[tuple[str, tuple[int, int]], dict[int, list[float]]] = defaultdict(
        lambda: defaultdict(list))
    for r in rows:
        series[(r["mode"], _pair_key(r))][r["prompt_tokens"]].append(r["transfer_share"])
    series = {k: v for k, v in series.items() if len(v) >= 2}
    if not series:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 4.6))
    keys = sorted(series)
    cmap = plt.get_cmap("tab20", max(len(keys), 1))
    curves: dict[tuple, dict[tuple[str, tuple[int, int]], list[float]]] = defaultdict(dict)
    for key in keys:
        xs = tuple(sorted(series[key]))
        curves[xs][key] = [100 * sum(series[key][x]) / len(series[key][x]) for x in xs]
    for xs, group in curves.items():
        for members, ys in _coincident(group, relative=0.0, absolute=0.5):
            first = members[0]
            ax.plot(list(xs), ys, marker="o", ms=3, lw=1.2, color=cmap(keys.index(first)),
                    ls="-" if first[0] == "pull" else "--",
                    label=", ".join(f"{m} P{p}->D{d}" for m, (p, d) in members))
    ax.axhline(50, color="0.3", lw=1, ls=":", label="transfer = prefill compute")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 100)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("transfer share of TTFT (%)")
    rates = sorted({r["tokens_per_second"] for r in rows})
    ax.set_title(f"P/D sizing at {', '.join(f'{x:,.0f}' for x in rates)} prompt tokens/s per "
                 f"prefill rank ({caption})", fontsize=9)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    return _save(fig, out, name)
