"""report.md: the page around the figures. Pure string building from the report's data."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from .data import PHASES, Variant

__all__ = ["table", "page", "verification_text"]


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


def verification_text(v: Variant) -> str:
    """One variant's verification, as the tables show it."""
    if v.verification == "timing-only":
        return "timing-only (not checked)"
    if v.verification == "nothing-checked":
        return "nothing checked (no request completed)"
    if v.verification == "failed":
        parts = [f"{v.corrupted} corrupted" if v.corrupted else "",
                 f"{v.mismatched_bytes:,} B wrong" if v.mismatched_bytes else ""]
        return "FAILED: " + ", ".join(p for p in parts if p)
    return "verified"


def _counted(values: list[str]) -> str:
    counts: dict[str, int] = defaultdict(int)
    for x in values:
        counts[x] += 1
    return ", ".join(f"{k} {n}" if len(counts) > 1 or n > 1 else k
                     for k, n in sorted(counts.items()))


def _summary(variants: list[Variant]) -> str:
    fam: dict[str, list[Variant]] = defaultdict(list)
    for v in variants:
        fam[v.family].append(v)
    out = []
    for name in fam:
        vs = fam[name]
        reqs = [r for v in vs for r in v.requests]
        ok = [r for v in vs for r in v.ok_requests()]
        corrupted = sum(v.corrupted or 0 for v in vs)
        shards = {v.sweep_variants for v in vs}
        expected = max(shards)
        out.append([name, f"{len(vs)}" + (f" of {expected}" if len(vs) < expected else ""),
                     f"{len(ok)}/{len(reqs)}", _counted([v.outcome for v in vs]),
                     f"{sum(v.expectation_met for v in vs)}/{len(vs)}",
                     _counted([v.verification for v in vs]), corrupted or "-",
                     f"{sum(r['descriptors'] for r in ok):,}",
                     f"{sum(sum(t['descriptors'] for t in r['telemetry']) for r in ok):,}",
                     _count(_coalesced_total(ok)),
                     f"{sum(r['nbytes'] for r in ok) / 1e9:,.3f}"])
    return table(["input", "variants", "requests ok", "outcomes", "expectation met",
                  "verification", "corrupted requests", "descriptors (per-block plan)",
                  "descriptors posted", "after NIXL coalescing", "GB moved"], out)


def _coalescing_section(variants: list[Variant], limit: int = 40) -> list[str]:
    """Per variant: descriptors posted and left after NIXL's coalescing, and how the coalesced
    count is spread over requests (it follows how fragmented the block ids are)."""
    from ..results import descriptor_counts

    rows = []
    for v in variants:
        ok = [r for r in v.ok_requests() if r["telemetry"]]
        if not ok:
            continue
        c = descriptor_counts(ok)
        d = c["coalesced_per_request"]
        rows.append([v.name, len(ok), f"{c['descriptors_posted']:,}",
                     _count(c["descriptors_coalesced"])]
                    + ([f"{d[k]:,.0f}" for k in ("min", "p50", "p90", "max")] if d
                       else ["-"] * 4))
    if not rows:
        return []
    shown = rows[:limit]
    text = ["", "## Descriptors after NIXL coalescing", "",
            "NIXL merges every run of descriptor pairs adjacent on both sides (prepared and "
            "strided transfers), so what a request pays per descriptor follows how scattered "
            "its block ids are (`[prefill]`/`[decode] block_ids`: `fresh` or `warmed`), not "
            "how many descriptors the connector posts.", "",
            table(["variant", "requests", "posted", "after coalescing", "per request: min",
                   "p50", "p90", "max"], shown)]
    if len(rows) > limit:
        text += ["", f"({len(rows) - limit} more variant(s) in `report.json` / `run --json`.)"]
    return text


def _coalesced_total(requests: list[dict[str, Any]]) -> int | None:
    from ..results import descriptor_counts

    return descriptor_counts(requests)["descriptors_coalesced"]


def _count(value: int | None) -> str:
    return "unknown" if value is None else f"{value:,}"


def _verification_sentence(variants: list[Variant]) -> str:
    """What the oracle did, never more."""
    n = len(variants)
    checked = [v for v in variants if v.verification == "verified"]
    failed = [v for v in variants if v.verification == "failed"]
    empty = [v for v in variants if v.verification == "nothing-checked"]
    skipped = n - len(checked) - len(failed) - len(empty)
    incomplete = sum(len(v.requests) - len(v.ok_requests()) for v in checked)
    tail = (f" ({incomplete} request(s) of verified variants did not complete, so they moved "
            f"nothing the oracle could check: see Problems)" if incomplete else "")
    others = []
    if empty:
        others.append(f"{len(empty)} completed no request, so no byte reached the oracle (see "
                      f"Problems)")
    if skipped:
        others.append(f"{skipped} ran timing-only and were not checked (descriptor counts, "
                      f"bytes and simulated times are the same either way)")
    rest = "; ".join(others)
    if failed:
        return (f"**The oracle found wrong bytes in {len(failed)} of the {n} variants** (see "
                f"Problems); {len(checked)} were verified with no wrong byte"
                + (f"; {rest}." if rest else "."))
    if not others:
        return (f"The oracle checked every byte of every completed request in all {n} variants "
                f"and found no wrong byte{tail}.")
    if not checked:
        if not empty:
            return (f"**No byte was verified**: all {n} variants ran timing-only (descriptor "
                    f"counts, bytes and simulated times are the same as with verification, but "
                    f"nothing was checked).")
        return f"**No byte was verified**: of the {n} variants, {rest}."
    return (f"{len(checked)} of the {n} variants were verified byte for byte by the oracle (no "
            f"wrong byte){tail}; of the others, {rest}.")


def _problems(variants: list[Variant], limit: int = 20) -> str:
    """Every variant that did not meet its expectation, did not end ok, or failed
    verification: its outcome, verification, corrupted count, the expectation's problems and
    the run's own explanations."""
    bad = [v for v in variants if not v.expectation_met or v.outcome != "ok"
           or v.verification == "failed" or v.corrupted]
    if not bad:
        return ""
    body = [[v.name, v.outcome, "yes" if v.expectation_met else "**NO**", verification_text(v),
             v.corrupted if v.corrupted is not None else "unknown",
             (v.expectation_problems or v.explanations or ["-"])[0].replace("|", "\\|")]
            for v in bad[:limit]]
    text = ["## Problems", "",
            f"{len(bad)} variant(s) did not end `ok`, did not meet their `[expect]`, or carried "
            f"wrong bytes{'' if len(bad) <= limit else f' (the first {limit} here; every one in report.json)'}.",
            "", table(["variant", "outcome", "expectation met", "verification",
                       "corrupted requests", "first problem"], body)]
    for v in bad[:limit]:
        lines = [f"- expectation: {p}" for p in v.expectation_problems]
        lines += [f"- {e}" for e in v.explanations]
        if lines:
            text += ["", f"<details><summary>{v.name}</summary>", "", *lines, "", "</details>"]
    return "\n".join(text)


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
        row.append(" / ".join(_count(m[k]["coalesced"]) for k in ("off", "contiguous", "strided")
                              if k in m))
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
        row.append("; ".join(meas) if meas else "not measured")
        rows.append(row)
    head = ["family", "variants", "requests with a transfer",
            "descriptors, per-block plan (reference)",
            "posted, contiguous", "posted, strided (rows)",
            "after NIXL coalescing (off / contiguous / strided)", "sim. transfer time off (ms)",
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
            "Posting is charged per descriptor left after NIXL's own coalescing (runs of pairs "
            "adjacent on both sides merge in prepared and strided transfers; docs/semantics.md "
            "§10), the count NIXL's telemetry reports, so merging on the client saves rows, "
            "registration and prep, not simulated post time, wherever NIXL would have "
            "coalesced the same runs itself.", "", table(head, rows)]
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


def _kv_state_text(geometry: dict[str, Any]) -> str:
    """What the KV-vs-state figure shows, in this model's terms."""
    kv = geometry.get("kv_bytes_per_token", {})
    attention = geometry.get("attention_kind", "attention")
    state = geometry.get("state_kind") or "recurrent"
    replicated = len(set(kv.values())) == 1
    kv_text = (f"{attention} KV is the same on every rank (replicated over TP)" if replicated
               else f"{attention} KV is split over TP by KV head (replicated once TP exceeds "
                    f"the KV heads)")
    trend = ("so the crossover (state bytes = KV bytes) falls as 1/TP" if replicated else
             "so the crossover (state bytes = KV bytes) moves with both")
    return (f"Per decode rank: {kv_text}, while the {state} state (conv + recurrent) is sharded "
            f"over TP, {trend} (docs/semantics.md §2.3). Below the crossover the state dominates "
            f"what moves.")


def _sizing_section(rows: list[dict[str, Any]], figure: str | None, level: str) -> list[str]:
    if not rows:
        return []
    rates = sorted({r["tokens_per_second"] for r in rows})
    cell: dict[tuple[str, str], dict[int, list[dict[str, Any]]]] = defaultdict(
        lambda: defaultdict(list))
    for r in rows:
        cell[(r["mode"], r["pair"])][r["prompt_tokens"]].append(r)
    prompts = sorted({r["prompt_tokens"] for r in rows})
    body = []
    limited = set()
    for (mode, pair) in sorted(cell, key=lambda k: (k[0], _pair_sort(k[1]))):
        row = [mode, pair]
        for p in prompts:
            rs = cell[(mode, pair)].get(p)
            if not rs:
                row.append("-")
                continue
            share = sum(r["transfer_share"] for r in rs) / len(rs)
            t = sum(r["transfer"] for r in rs) / len(rs)
            pre = sum(r["prefill_seconds"] for r in rs) / len(rs)
            text = f"{100 * share:.0f} % ({_ms(t, 1)} / {_ms(pre, 1)})"
            if t > pre:
                limited.add(f"{mode} {pair}")
                text = f"**{text}**"
            row.append(text)
        body.append(row)
    out = ["", f"{level} P/D sizing: transfer share of TTFT", "",
           f"At {', '.join(f'{x:,.0f}' for x in rates)} prompt tokens per second per prefill "
           f"rank (`[prefill] tokens_per_second`): prefill compute = (prompt - prefix hit) / "
           f"(rate x prefill TP), TTFT = prefill compute + the request's transfer time (queueing "
           f"and decode's first step left out). Each cell: transfer share of TTFT (transfer ms / "
           f"prefill ms); **bold**: the transfer takes longer than prefill, so it, not prefill, "
           f"limits TTFT."]
    if figure:
        out += ["", f"![P/D sizing]({figure})"]
    out += ["", table(["mode", "TP pair"] + [f"{p:,}" for p in prompts], body), "",
            (f"The transfer limits TTFT somewhere for: {', '.join(sorted(limited))}."
             if limited else "Prefill compute exceeds the transfer everywhere here.")]
    return out


def _input_section(section: dict[str, Any], variants: list[Variant], level: str) -> list[str]:
    parts: list[str] = []
    figures = section["figures"]
    primary, caption = section["primary"], section["caption"]
    fam_variants = [v for v in variants if v.family == section["family"]]
    if section["others"]:
        parts += ["", f"The figures and tables below show {caption}; this input also ran "
                  f"{', '.join(section['others'])}: their numbers are in report.json (and in "
                  f"requests.csv with `--csv`)."]
    if figures.get("prompt"):
        parts += ["", f"{level} Transfer time and descriptors vs prompt length", "",
                  f"Showing {caption}; one line per (prefill TP, decode TP)"
                  + ("; requests run one at a time, so no two transfers of a variant share a "
                     "link." if _sequential(primary) else
                     "; a variant's requests overlap in time, so its transfers may share "
                     "links (queueing behind other requests is not counted)."),
                  "", f"![transfer time and descriptors vs prompt length]({figures['prompt']})",
                  "", _prompt_tables(primary)]
    if figures.get("heatmap"):
        kinds = _paths(fam_variants)
        parts += ["", f"{level} P TP x D TP", "", f"![TP heatmap]({figures['heatmap']})", "",
                  "Both panels share one colour scale. Links crossed per pair (placement of the "
                  "fabric profile: engines are packed onto nodes in order, so a pair that does "
                  "not fit one node crosses the NIC): "
                  + ", ".join(f"{p} {k}" for p, k in sorted(kinds.items(),
                                                             key=lambda i: _pair_sort(i[0])))
                  + "."]
    if figures.get("kv_state"):
        geometry, crossover = section["geometry"], section["crossover"]
        kv = geometry.get("kv_bytes_per_token", {})
        st = geometry.get("state_bytes_per_request", {})
        body = [[tp, f"{kv[str(tp)]:,}", f"{st[str(tp)]:,}", f"{crossover[tp]:,.0f}"]
                for tp in sorted(crossover)]
        attention = geometry.get("attention_kind", "attention")
        state = geometry.get("state_kind") or "recurrent"
        parts += ["", f"{level} {attention} KV vs {state} state", "",
                  f"![KV vs state]({figures['kv_state']})", "", _kv_state_text(geometry), "",
                  table(["TP", f"{attention} KV bytes / token / rank",
                         f"{state} state bytes / request / rank", "crossover (tokens)"], body)]
    if figures.get("breakdown"):
        parts += ["", f"{level} Time breakdown", "", f"![time breakdown]({figures['breakdown']})",
                  "", "Along each request's last-completing transfer (the definition `plan`, "
                  "`run` and `sweep` report too): *handshake* (lazy, first request of a pair "
                  "only; push runs decode's notification-only and prefill's reverse one), *post "
                  "wait* (queued behind the rank's posting thread), *post* (launch + descriptors "
                  "after NIXL's coalescing x per-descriptor cost), *wire* (bytes on the shared "
                  "links + path latency), *notification* (data complete -> prefill frees in "
                  "pull, decode completes in push). Handshake and post wait are not part of the "
                  "transfer time.", "", _breakdown_table(primary)]
    parts += _sizing_section(section["sizing"], figures.get("sizing"), level)
    return parts


def _axis_section(axis: dict[str, Any], figure: str | None, limit: int = 60) -> list[str]:
    values, base = axis["values"], axis["baseline"]
    if len(values) < 2:
        return ["", f"## Side by side: {axis['axis']}", "",
                f"Only one value of `{axis['axis']}` ({base}) in these inputs: nothing to "
                f"compare."]
    ratio = "; ".join(f"{v}: {axis['geomean_ratio'][v]:.3f}x over "
                      f"{axis['matched_requests'][v]} requests"
                      if axis["geomean_ratio"][v] is not None else f"{v}: no matched request"
                      for v in values[1:])
    body = []
    for row in axis["rows"][:limit]:
        cells = row["cells"]
        b = cells.get(base, {}).get("transfer_seconds_mean")
        line = [row["label"].replace("|", "\\|")]
        for v in values:
            c = cells.get(v)
            if c is None:
                line.append("-")
                continue
            t = c["transfer_seconds_mean"]
            text = _ms(t)
            if v != base and t is not None and b:
                text += f" ({t / b:.2f}x)"
            flags = [x for x in (c["outcome"] if c["outcome"] != "ok" else "",
                                 "FAILED verification" if c["verification"] == "failed" else "",
                                 "not verified" if c["verification"] == "timing-only" else "",
                                 "nothing checked" if c["verification"] == "nothing-checked"
                                 else "",
                                 "expectation NOT met" if not c["expectation_met"] else "") if x]
            if flags:
                text += " — " + ", ".join(flags)
            line.append(text)
        body.append(line)
    out = ["", f"## Side by side: {axis['axis']}", "",
           f"Baseline `{axis['axis']} = {base}`. Variants are paired across the values by "
           f"everything else that was swept ({'across inputs' if axis['axis'] == 'input' else 'within an input'}), "
           f"requests by index; each cell is the mean transfer time (ms) of the variant's "
           f"completed requests, with its ratio to the baseline. Geometric mean of the "
           f"per-request ratio to the baseline: {ratio}."]
    if figure:
        out += ["", f"![side by side]({figure})"]
    out += ["", table(["variant"] + [f"{axis['axis']} = {v}" for v in values], body)]
    if len(axis["rows"]) > limit:
        out += ["", f"The first {limit} of {len(axis['rows'])} rows; every row is in "
                f"report.json (`comparison`)."]
    return out


def page(*, title: str, command: str, variants: list[Variant], rows: list[dict[str, Any]],
         inputs: list[dict[str, Any]], figures: dict[str, str | None],
         comparison: list[dict[str, Any]], measured: bool, calibration: list[dict[str, Any]],
         calibration_dir: str, trace_events: int, link_variant: str | None,
         axis: dict[str, Any] | None = None, csv: str | None = None) -> str:
    profiles = sorted({v.profile for v in variants})
    real = sorted({v.backend for v in variants if v.backend != "sim"})
    unmet = [v for v in variants if not v.expectation_met]
    where = (f"on the simulated fabric (profile {', '.join(f'`{p}`' for p in profiles)})"
             if not real else f"from runs on the simulated fabric and on {', '.join(real)} "
             f"(wall-clock times, which vary from run to run)")
    parts = [f"# {title}", "",
             f"Generated by `{command}` {where}. "
             + ("Every number on this page is a pure function of the scenario files and their "
                "seeds: re-running the command reproduces it exactly " if not real else "")
             + "(`report.json` holds the same numbers, `trace.json` every transfer"
             + (f", `{csv}` every request" if csv else "") + ").", "",
             "**Verification.** " + _verification_sentence(variants), "",
             "**Expectations.** " + (f"All {len(variants)} variants met their `[expect]`."
                                     if not unmet else
                                     f"**{len(unmet)} of the {len(variants)} variants did not "
                                     f"meet their `[expect]`** (see Problems); `hkvsim "
                                     f"report` exits 1."), "",
             "Transfer time = a request's own transfer: from its first READ (pull) or WRITE "
             "(push) starting to post to its transfer completing on decode (every READ DONE; "
             "every WRITE notification in). Waiting for a slot, for blocks, for a handshake or "
             "behind other requests' posts is not counted; handshakes are reported apart, and a "
             "request that posted nothing (a full prefix hit: notification only) has none."]
    problems = _problems(variants)
    if problems:
        parts += ["", problems]
    parts += ["", "## Summary", "", _summary(variants)]
    if axis is not None:
        parts += _axis_section(axis, figures.get("compare"))
    several = len(inputs) > 1
    for section in inputs:
        body = _input_section(section, variants, "###" if several else "##")
        if several and body:
            parts += ["", f"## Input `{section['family']}`"]
        parts += body
    if not any(section["sizing"] for section in inputs):
        parts += ["", "P/D sizing (the transfer's share of time-to-first-token): set "
                  "`[prefill] tokens_per_second` (prompt tokens per second per prefill rank) in "
                  "the scenario."]
    if figures.get("links"):
        parts += ["", "## Link utilisation", "", f"![link utilisation]({figures['links']})", "",
                  f"The variant with the most flows sharing a link ({link_variant}); "
                  f"utilisation = aggregate rate / capacity of each link direction (max-min fair "
                  f"sharing); links with identical curves share a panel. Per-link counters for "
                  f"every variant are in `trace.json`."]
    merge = _merge_section(comparison, figures.get("merge"), measured)
    if merge:
        parts += ["", merge]
    parts += _coalescing_section(variants)
    parts += ["", "## Simulated vs measured", ""]
    if figures.get("calibration"):
        by_source: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for p in calibration:
            by_source[p["source"]].append(p)
        body = []
        for source, pts in sorted(by_source.items()):
            errors = sorted(abs(p["simulated_seconds"] - p["measured_seconds"])
                            / p["measured_seconds"] for p in pts)
            body.append([f"`{source}`", pts[0]["profile"], pts[0].get("transport", "?"),
                         len(pts), f"{100 * errors[len(errors) // 2]:.1f} %",
                         f"{100 * errors[-1]:.1f} %"])
        parts += [f"![simulated vs measured]({figures['calibration']})", "",
                  f"{len(calibration)} measured points from `{calibration_dir}` for the "
                  f"profile(s) this page uses. Points that carry their own simulated value (a "
                  f"calibration's fitted profile) compare that fit with its measurements; saved "
                  f"runs of this page's scenarios on a real backend are matched to its simulated "
                  f"requests.", "",
                  table(["file", "profile", "transport / backend", "points",
                         "median abs. error", "max abs. error"], body)]
    else:
        parts += [f"No measurements in `{calibration_dir}` for the profile(s) of this page "
                  f"({', '.join(f'`{p}`' for p in profiles)}): a calibration tests only the "
                  f"profile it measured (`hkvsim calibrate` fits `cpu-ucx-loopback`). This "
                  f"section fills in with `{{\"points\": [...]}}` files named after one of "
                  f"these profiles, or saved `hkvsim run --json --requests` outputs of the same "
                  f"scenarios on a real backend."]
    parts += ["", "## Trace", "",
              f"`trace.json` ({trace_events:,} events, Chrome `traceEvents` format): open it in "
              f"https://ui.perfetto.dev or chrome://tracing. One process per variant (its clock "
              f"from 0), a posting thread per initiating GPU, an async slice per request "
              f"and per transfer (post wait / post / wire), and a GB/s counter per link."]
    if len(variants) <= 100:
        body = [[v.name, v.outcome, "yes" if v.expectation_met else "**NO**",
                 f"{len(v.ok_requests())}/{len(v.requests)}", verification_text(v),
                 v.corrupted if v.corrupted is not None else "unknown"] for v in variants]
        parts += ["", "<details><summary>Every variant</summary>", "",
                  table(["variant", "outcome", "expectation met", "requests ok",
                         "verification", "corrupted requests"], body),
                  "", "</details>"]
    else:
        parts += ["", f"Every variant ({len(variants)}) with its requests: `report.json`."]
    return "\n".join(parts + [""])
