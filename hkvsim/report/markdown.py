"""report.md: the page around the figures. Pure string building from the report's data."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from .data import PHASES, Variant

__all__ = ["table", "page"]


def table(header: list[str], rows: list[list[Any]], align: str | None = None) -> str:
    align = align or "l" + "r" * (len(header) - 1)
    marks = {"l": ":---", "r": "---:", "c": ":---:"}
    lines = ["| " + " | ".join(header) + " |",
             "| " + " | ".join(marks[a] for a in align) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _ms(seconds: float | None, digits: int = 3) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.{digits}f}"


def _delta(new: float, old: float) -> str:
    if not old:
        return "-"
    return f"{100.0 * (new - old) / old:+.1f} %"


def _pair_sort(pair: str) -> tuple[int, int]:
    p, d = pair[1:].split("->D")
    return int(p), int(d)


def _summary(variants: list[Variant], rows: list[dict[str, Any]]) -> str:
    fam: dict[str, list[Variant]] = defaultdict(list)
    for v in variants:
        fam[v.family].append(v)
    out = []
    for name in sorted(fam):
        vs = fam[name]
        reqs = [r for v in vs for r in v.requests]
        ok = [r for v in vs for r in v.ok_requests()]
        outcomes = sorted({v.outcome for v in vs})
        verified = sum(v.verified for v in vs)
        out.append([name, len(vs), f"{len(ok)}/{len(reqs)}", ", ".join(outcomes),
                    sum(v.expectation_met for v in vs),
                    f"{verified}/{len(vs)}" + (" (byte-exact)" if verified and all(
                        v.mismatched_bytes == 0 for v in vs if v.verified) else ""),
                    f"{sum(r['descriptors'] for r in ok):,}",
                    f"{sum(sum(t['descriptors'] for t in r['telemetry']) for r in ok):,}",
                    f"{sum(r['nbytes'] for r in ok) / 1e9:,.3f}"])
    return table(["input", "variants", "requests ok", "outcomes", "expectation met",
                  "bytes verified", "descriptors (per-block plan)", "descriptors posted",
                  "GB moved"], out)


def _prompt_tables(rows: list[dict[str, Any]]) -> str:
    parts = []
    for mode in ("pull", "push"):
        rs = [r for r in rows if r["mode"] == mode and r["hit_tokens"] == 0]
        if not rs:
            continue
        prompts = sorted({r["prompt_tokens"] for r in rs})
        pairs = sorted({r["pair"] for r in rs}, key=_pair_sort)
        cell: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
        for r in rs:
            cell[(r["pair"], r["prompt_tokens"])].append(r)
        t_rows, d_rows = [], []
        for pair in pairs:
            t_rows.append([pair] + [_ms(sum(x["transfer"] for x in cell[(pair, p)])
                                        / len(cell[(pair, p)])) if cell[(pair, p)] else "-"
                                    for p in prompts])
            d_rows.append([pair] + [f"{cell[(pair, p)][0]['descriptors']:,} / "
                                    f"{cell[(pair, p)][0]['transfers']}"
                                    if cell[(pair, p)] else "-" for p in prompts])
        head = ["TP pair"] + [f"{p:,}" for p in prompts]
        parts.append(f"**{mode}: transfer time (ms) by prompt tokens**\n\n" + table(head, t_rows))
        parts.append(f"**{mode}: descriptors / transfers per request by prompt tokens**\n\n"
                     + table(head, d_rows))
    return "\n\n".join(parts)


def _sequential(rows: list[dict[str, Any]]) -> bool:
    """No two requests of a variant were transferring at the same time."""
    by_variant: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for r in rows:
        t = r["variant"].requests[r["index"]]["times"]  # records are kept in index order
        if "transfer_done" in t:
            by_variant[id(r["variant"])].append((t["transfer_done"] - r["transfer"],
                                                 t["transfer_done"]))
    for spans in by_variant.values():
        spans.sort()
        if any(b[0] < a[1] for a, b in zip(spans, spans[1:])):
            return False
    return True


def _paths(variants: list[Variant]) -> dict[str, str]:
    """TP pair -> the kind of link its transfers crossed (NVLink, NIC, HBM)."""
    kinds: dict[str, set[str]] = defaultdict(set)
    for v in variants:
        for r in v.requests:
            for t in r["telemetry"]:
                for link in t.get("path") or []:
                    kinds[v.pair].add({"nvl": "NVLink", "nic": "NIC", "hbm": "HBM"}.get(
                        link.split(".")[1], link.split(".")[1]))
    return {p: "+".join(sorted(k)) for p, k in kinds.items()}


def _breakdown_table(rows: list[dict[str, Any]]) -> str:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["mode"], r["pair"])].append(r)
    out = []
    for (mode, pair) in sorted(groups, key=lambda k: (k[0], _pair_sort(k[1]))):
        rs = groups[(mode, pair)]
        cold = [r for r in rs if r["breakdown"]["handshake"] > 0]
        warm = [r for r in rs if r["breakdown"]["handshake"] == 0]
        mean = ({p: sum(r["breakdown"][p] for r in warm) / len(warm) for p in PHASES}
                if warm else dict.fromkeys(PHASES))
        out.append([mode, pair, _ms(cold[0]["breakdown"]["handshake"], 1) if cold else "-",
                    len(warm)] + [_ms(mean[p]) for p in PHASES[1:]])
    return table(["mode", "TP pair", "handshake (ms, first request)", "warm requests"]
                 + [f"{p} (ms, warm mean)" for p in PHASES[1:]], out)


def _merge_section(comparison: list[dict[str, Any]], figure: str | None,
                   measured: bool) -> str:
    if not comparison:
        return ""
    rows = []
    for fam in comparison:
        m = fam["modes"]
        off = m["off"]
        row = [fam["family"], fam["variants"], off["requests"], f"{off['reference']:,}"]
        for mode in ("contiguous", "strided"):
            if mode in m:
                row.append(f"{m[mode]['posted']:,} ({_delta(m[mode]['posted'], off['posted'])})")
            else:
                row.append("-")
        row.append(_ms(off["transfer_seconds"], 2))
        for mode in ("contiguous", "strided"):
            if mode in m:
                row.append(f"{_ms(m[mode]['transfer_seconds'], 2)} "
                           f"({_delta(m[mode]['transfer_seconds'], off['transfer_seconds'])})")
            else:
                row.append("-")
        verified = sum(m[k]["verified_variants"] for k in m)
        exact = sum(m[k]["byte_exact_variants"] for k in m)
        total = fam["variants"] * len(m)
        row.append(f"{exact}/{verified} verified runs exact" + (
            f" ({total - verified} timing-only)" if verified < total else "")
            if exact == verified else f"NO: {verified - exact} of {verified} runs wrong")
        meas = []
        for mode in ("contiguous", "strided"):
            if mode in m and "measured_seconds" in m[mode] and "measured_seconds" in off:
                meas.append(f"{mode}: {_delta(m[mode]['measured_seconds'], off['measured_seconds'])}")
        row.append("; ".join(meas) if meas else "pending (NIXL backend, #5)")
        rows.append(row)
    head = ["family", "variants", "requests with a transfer",
            "descriptors, per-block plan (reference)",
            "posted, contiguous", "posted, strided (rows)", "sim. transfer time off (ms)",
            "contiguous (ms)", "strided (ms)", "byte-exact (oracle)", "NIXL measured Δ"]
    text = ["## Descriptor merging", "",
            "`[connector] descriptor_merge`: the reference connector posts one descriptor per "
            "(region, kernel block) and per (state sub-region, slot) (`off`). `contiguous` merges "
            "consecutive descriptors that are contiguous on both sides; `strided` then joins "
            "equal-length runs with one constant stride per side into NIXL's strided rows "
            "(addr, len, dev, stride, count). The per-block plan (descriptor ids, pairing) is "
            "computed first and unchanged; the merged rows are posted non-prepped "
            "(`Transport.make_xfer`). Every mode moves exactly the same bytes (the oracle "
            "checks every byte of every verified variant).", "",
            "Simulated time is the sum over requests of the transfer time (handshake excluded). "
            "Posting is charged per descriptor for `contiguous` and per run for `strided` (on "
            "the CPU VM strided lists cut prep time but not post time, docs/semantics.md §10), so "
            "`strided` saves rows, registration and prep, not simulated post time, against "
            "`contiguous`.", "", table(head, rows)]
    if figure:
        text += ["", f"![descriptor merging]({figure})"]
    if not measured:
        text += ["", "The *NIXL measured Δ* column is filled by `hkvsim report ... --measured "
                 "RESULT.json`: saved `hkvsim run --json --requests` outputs of the same scenario "
                 "files on the NIXL backend (variants are matched by scenario name)."]
    by_model = []
    for fam in comparison:
        modes = [k for k in ("off", "contiguous", "strided") if k in fam["modes"]]
        groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
        for r in fam["rows"]:
            groups[(r["model"], r["mode"])].append(r)
        for (model, mode), rs in sorted(groups.items()):
            ref = sum(r["off"]["reference"] for r in rs)
            t_off = sum(r["off"]["transfer_seconds"] for r in rs)
            merged = ("contiguous", "strided")
            by_model.append(
                [fam["family"], model, mode, len(rs), f"{ref:,}"]
                + [f"{sum(r[k]['posted'] for r in rs):,} "
                   f"({_delta(sum(r[k]['posted'] for r in rs), ref)})" if k in modes else "-"
                   for k in merged]
                + [_ms(t_off, 2)]
                + [f"{_ms(sum(r[k]['transfer_seconds'] for r in rs), 2)} "
                   f"({_delta(sum(r[k]['transfer_seconds'] for r in rs), t_off)})"
                   if k in modes else "-" for k in merged])
    if by_model:
        text += ["", "By model and mode within each family:", "",
                 table(["family", "model", "mode", "variants", "per-block plan", "contiguous",
                        "strided (rows)", "time off (ms)", "contiguous (ms)", "strided (ms)"],
                       by_model)]
    details = []
    for fam in comparison:
        modes = [k for k in ("off", "contiguous", "strided") if k in fam["modes"]]
        body = [[r["label"], r["pair"], r["mode"], f"{r['off']['reference']:,}"]
                + [f"{r[k]['posted']:,}" for k in modes[1:]]
                + [_ms(r[k]["transfer_seconds"], 3) for k in modes]
                for r in fam["rows"]]
        details += ["", f"<details><summary>{fam['family']}: every variant</summary>", "",
                    table(["variant", "pair", "mode", "per-block plan"]
                          + [f"posted {k}" for k in modes[1:]]
                          + [f"time {k} (ms)" for k in modes], body), "", "</details>"]
    return "\n".join(text + details)


def page(*, title: str, command: str, variants: list[Variant], rows: list[dict[str, Any]],
         primary: list[dict[str, Any]], caption: str, figures: dict[str, str | None],
         crossover: dict[int, float], geometry: dict[str, Any],
         comparison: list[dict[str, Any]], measured: bool, calibration: list[dict[str, Any]],
         calibration_dir: str, trace_events: int, link_variant: str | None) -> str:
    profiles = sorted({v.profile for v in variants})
    verified = sum(v.verified for v in variants)
    parts = [f"# {title}", "",
             f"Generated by `{command}` on the simulated fabric (profile "
             f"{', '.join(f'`{p}`' for p in profiles)}). Every number on this page is a pure "
             f"function of the scenario files and their seeds: re-running the command reproduces "
             f"it exactly (`report.json` holds the same numbers, `trace.json` every transfer).",
             "",
             (f"All {len(variants)} variants moved real bytes and the oracle verified every "
              f"byte." if verified == len(variants) else
              f"{'None' if not verified else verified} of the {len(variants)} variants "
              f"{'was' if verified == 1 else 'were'} verified byte for byte by the oracle; the "
              f"others ran timing-only (descriptor counts, bytes and simulated times are the "
              f"same either way)."), "",
             "Transfer time = from a request's first READ (pull) or WRITE (push) being "
             "submitted to its transfer completing on decode (every READ DONE; every WRITE "
             "notification in): handshakes are reported apart, and a request that posted "
             "nothing (a full prefix hit: notification only) has none.", "",
             "## Summary", "", _summary(variants, rows)]
    if figures.get("prompt"):
        parts += ["", "## Transfer time and descriptors vs prompt length", "",
                  f"Showing {caption}; one line per (prefill TP, decode TP)"
                  + ("; requests run one at a time, so no two transfers of a variant share a "
                     "link." if _sequential(primary) else
                     "; a variant's requests overlap in time, so its transfers may share "
                     "links."),
                  "", f"![transfer time and descriptors vs prompt length]({figures['prompt']})",
                  "", _prompt_tables(primary)]
    if figures.get("heatmap"):
        kinds = _paths(variants)
        parts += ["", "## P TP x D TP", "", f"![TP heatmap]({figures['heatmap']})", "",
                  "Links crossed per pair (placement of the fabric profile: engines are packed "
                  "onto nodes in order, so a pair that does not fit one node crosses the NIC): "
                  + ", ".join(f"{p} {k}" for p, k in sorted(kinds.items(),
                                                             key=lambda i: _pair_sort(i[0])))
                  + "."]
    if figures.get("kv_state"):
        kv = geometry.get("kv_bytes_per_token", {})
        st = geometry.get("state_bytes_per_request", {})
        body = [[tp, f"{kv[str(tp)]:,}", f"{st[str(tp)]:,}", f"{crossover[tp]:,.0f}"]
                for tp in sorted(crossover)]
        parts += ["", "## Attention KV vs recurrent state", "",
                  f"![KV vs state]({figures['kv_state']})", "",
                  "Per decode rank: MLA KV is replicated on every rank while the KDA state is "
                  "sharded, so the crossover (state bytes = KV bytes) falls as 1/TP "
                  "(docs/semantics.md §2.3). Below it the state dominates what moves.", "",
                  table(["TP", "KV bytes / token / rank", "state bytes / request / rank",
                         "crossover (tokens)"], body)]
    if figures.get("breakdown"):
        parts += ["", "## Time breakdown", "", f"![time breakdown]({figures['breakdown']})", "",
                  "Along each request's last-completing transfer: *handshake* (lazy, first "
                  "request of a pair only), *post wait* (queued behind the rank's posting "
                  "thread), *post* (launch + descriptors x per-descriptor cost), *wire* (bytes "
                  "on the shared links + path latency), *notification* (data complete -> prefill "
                  "frees in pull, decode completes in push).", "", _breakdown_table(primary)]
    if figures.get("links"):
        parts += ["", "## Link utilisation", "", f"![link utilisation]({figures['links']})", "",
                  f"The variant with the most flows sharing a link ({link_variant}); "
                  f"utilisation = "
                  f"aggregate rate / capacity of each link direction (max-min fair sharing); "
                  f"per-link counters for every variant are in `trace.json`."]
    merge = _merge_section(comparison, figures.get("merge"), measured)
    if merge:
        parts += ["", merge]
    parts += ["", "## Simulated vs measured", ""]
    if figures.get("calibration"):
        by_source: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for p in calibration:
            by_source[p["source"]].append(p)
        body = []
        for source, pts in sorted(by_source.items()):
            errors = sorted(abs(p["simulated_seconds"] - p["measured_seconds"])
                            / p["measured_seconds"] for p in pts)
            body.append([f"`{source}`", pts[0].get("transport", "?"), len(pts),
                         f"{100 * errors[len(errors) // 2]:.1f} %",
                         f"{100 * errors[-1]:.1f} %"])
        parts += [f"![simulated vs measured]({figures['calibration']})", "",
                  f"{len(calibration)} measured points from `{calibration_dir}`. Points that "
                  f"carry their own simulated value (a calibration's fitted profile) compare "
                  f"that fit with its measurements, not this page's fabric; saved runs of this "
                  f"page's scenarios on a real backend are matched to its simulated requests.",
                  "", table(["file", "transport / profile", "points", "median abs. error",
                             "max abs. error"], body)]
    else:
        parts += [f"No calibration data in `{calibration_dir}` yet (produced by `hkvsim "
                  f"calibrate` / the NIXL backend): this section fills in when it exists "
                  f"(saved `hkvsim run --json --requests` outputs of the same scenarios on a real "
                  f"backend, or `{{\"points\": [{{\"label\", \"simulated_seconds\", "
                  f"\"measured_seconds\"}}]}}`)."]
    parts += ["", "## Trace", "",
              f"`trace.json` ({trace_events:,} events, Chrome `traceEvents` format): open it in "
              f"https://ui.perfetto.dev or chrome://tracing. One process per variant (simulated "
              f"time from 0), a posting thread per initiating GPU, an async slice per request "
              f"and per transfer (post wait / post / wire), and a GB/s counter per link."]
    if len(variants) <= 100:
        body = [[v.name, v.outcome, "yes" if v.expectation_met else "NO",
                 f"{len(v.ok_requests())}/{len(v.requests)}",
                 "byte-exact" if v.verified and v.mismatched_bytes == 0
                 else ("MISMATCH" if v.verified else "timing only")] for v in variants]
        parts += ["", "<details><summary>Every variant</summary>", "",
                  table(["variant", "outcome", "expectation met", "requests ok", "bytes"], body),
                  "", "</details>"]
    else:
        parts += ["", f"Every variant ({len(variants)}) with its requests: `report.json`."]
    return "\n".join(parts + [""])
