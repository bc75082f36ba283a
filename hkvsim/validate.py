"""``hkvsim validate``: the simulator against real NIXL on scenario files never used for fitting.

Each file (one scenario, no ``[sweep]``) runs once on the simulated fabric (deterministic) and
``repeats`` times on real NIXL (DRAM over UCX, one process per rank), the real runs interleaved
across files (file 1, 2, ..., then again), so a slow minute of a loaded machine spreads over
every file instead of landing on one. ``warm_up`` passes over every file run first and are left
out of every figure (their times are kept apart): on the shared 2-core VM hkvsim is measured on,
the first real runs after an idle spell took 1.3-3.5x as long as the same files a minute later
(a calibration's first pass: 16.2 ms against a median of 4.9 ms on one file). Per file it
reports the steady-state mean per-request transfer time (``hkvsim.results.transfer_span``;
requests that ran a handshake, each run's first request, which pays UCX's wire-up, and
requests that arrived or were in flight while either was alive are left out), simulated and
real (median over the
repeats, with their spread), the relative error, and the descriptors posted and left after
NIXL's coalescing on both backends. The two can differ where block ids depend on the order in
which concurrent requests finish (a warmed-up pool under a burst: each backend allocates from its
own completion order), so the coalescing model is also checked where that cannot matter: on every
real transfer, hkvsim's model applied to the descriptor lists the rank really posted against the
count in NIXL's telemetry (``coalesced_model`` vs ``coalesced``; they must agree). The machine's
load average is recorded before every real run, and runs started above one runnable task per core
are flagged; how fast the host ran against the profile's calibration (the real coordinator's CPU
per call against the profile's, :func:`host_cpu_drift`; the real post calls' bytes per second
against the simulated ones, :func:`host_copy_drift`) is reported and flagged beyond 1.5x. Per
file, the steady requests' time is split on both sides into the post call (the copy inside it
on CPU loopback), the rest to completion and what NIXL's telemetry does not cover.

Nothing is fitted here: the numbers are what the shipped profile predicts.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .pd.cpu import merge_rank_cpu

__all__ = ["ValidationError", "FileResult", "RealRuns", "SimAgainstReal",
           "coalescing_model_check", "host_copy_drift", "host_cpu_drift", "judge", "measure_real",
           "post_call_totals", "resampled_sentence", "resampled_verdict", "steady_phase_means",
           "steady_requests", "steady_transfer_mean", "validate", "with_profile", "within_bounds",
           "write_outputs", "ACCEPT_MEDIAN", "ACCEPT_WORST"]

ACCEPT_MEDIAN = 0.15  # issue #13: median |sim - real| / real over the held-out files
ACCEPT_WORST = 0.40  # and the worst file


def within_bounds(median_abs_error: Any, worst_abs_error: Any) -> Any:
    """Whether a held-out set meets issue #13's bounds: median |error| <= :data:`ACCEPT_MEDIAN`
    and worst <= :data:`ACCEPT_WORST` (floats, or numpy arrays elementwise)."""
    return (median_abs_error <= ACCEPT_MEDIAN) & (worst_abs_error <= ACCEPT_WORST)


class ValidationError(ValueError):
    """Bad input to ``hkvsim validate`` (no files, a file with a sweep, ...)."""


class SimAgainstReal:
    """What a file's simulated time and real runs give (``sim_seconds``, ``real_seconds``)."""

    sim_seconds: float
    real_seconds: tuple[float, ...]

    @property
    def real_median(self) -> float:
        return float(statistics.median(self.real_seconds))

    @property
    def error(self) -> float:
        """(sim - real) / real, signed."""
        return (self.sim_seconds - self.real_median) / self.real_median

    @property
    def spread(self) -> float:
        """(max - min) / median of the real runs."""
        return (max(self.real_seconds) - min(self.real_seconds)) / self.real_median


@dataclass(frozen=True)
class FileResult(SimAgainstReal):
    file: str
    scenario: str
    profile: str
    sim_seconds: float  # steady-state mean per-request transfer time, simulated
    real_seconds: tuple[float, ...]  # the same, one per real run, in run order
    loads: tuple[float, ...]  # 1-minute load average before each real run
    descriptors_posted: tuple[int, int]  # (sim, real), summed over the run's requests
    descriptors_coalesced: tuple[int | None, int | None]
    outcomes: tuple[str, ...]  # sim, then each real run
    # median over steady requests of transfer time - (post + wire of the critical transfer):
    # what NIXL's own telemetry does not explain (completion seen by the rank's poll loop, the
    # rank -> coordinator message, process scheduling); sim, then each real run
    unexplained: tuple[float, ...] = ()
    # means over steady requests of the critical transfer's post call and of what follows it
    # to completion (NIXL telemetry on the real backend); sim, then each real run
    post_seconds: tuple[float, ...] = ()
    wire_seconds: tuple[float, ...] = ()
    # every transfer's bytes and post call, summed per run (:func:`post_call_totals`): sim,
    # then each real run
    post_calls: tuple[tuple[int, float], ...] = ()
    # every real run's transfers: (checked, mismatching) where hkvsim's coalescing model on the
    # lists really posted and NIXL's telemetry were both known
    coalescing_model: tuple[int, int] = (0, 0)
    # whether every run of the file (sim and real) ran the oracle (False: timing-only runs)
    verified: bool = True
    # the real runs' rank CPU per operation kind and in post calls, summed (pd/cpu.py), and the
    # transfers they posted
    rank_cpu: dict[str, Any] = field(default_factory=dict)
    transfers: int = 0
    # the warm-up passes' real runs (steady-state means, in run order): left out of every figure
    warm_up_seconds: tuple[float, ...] = ()
    # the simulated profile's coordinator CPU per call (us; 0: not modelled), measured when it
    # was calibrated: set against the real runs' own figure, it tells how fast the host ran
    profile_coordinator_call_us: float = 0.0


def steady_requests(details: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The steady-state requests of one run: completed with a transfer time, not warm-up.

    Warm-up requests are the run's first and every request that ran a handshake: they pay the
    handshake and, on real NIXL, UCX's wire-up of a new connection on its first transfers. A
    request that arrived while a warm-up request was alive (arrival to transfer done), or whose
    transfer (first post to transfer done) overlaps that life, waited on or shared the warm-up
    and is left out too: on CPU loopback the requests of a run's first burst measured 8-19 ms
    against 1-7 ms for the same sizes later, since the wire-up delays every transfer posted
    before it completes (~10 ms), which the simulator does not model. Requests without times
    (hand-built records) are judged by the first two rules only."""
    if not details:
        return []
    first = min(r["index"] for r in details)
    warm = [r for r in details if r["index"] == first or r["phases"]["handshake"] != 0.0]
    lives = [(r["times"]["start"], r["times"]["transfer_done"]) for r in warm
             if "start" in r.get("times", {}) and "transfer_done" in r.get("times", {})]

    def during_warm_up(r: Mapping[str, Any]) -> bool:
        times = r.get("times", {})
        if "transfer_done" not in times:
            return False
        end = times["transfer_done"]
        begin = end - r["transfer_seconds"]
        arrival = times.get("start", begin)
        return any(w_begin <= arrival < w_end or (begin < w_end and w_begin < end)
                   for w_begin, w_end in lives)

    warm_indexes = {r["index"] for r in warm}
    return [r for r in details
            if r["status"] == "ok" and r["transfer_seconds"] is not None
            and r["index"] not in warm_indexes and not during_warm_up(r)]


def steady_transfer_mean(data: dict[str, Any]) -> float | None:
    """Mean transfer time of the steady-state requests of one ``result_json(...,
    requests=True)`` (:func:`steady_requests`: completed, not the run's first, no handshake,
    not arrived or in flight during either). A mean, not a median: a run has a handful of
    steady requests whose times often fall in two groups (a request alone on its ranks, one
    sharing them), and the median of six such values jumps between the groups with the
    smallest change; the run-to-run noise is left to the median over repeated runs."""
    times = [r["transfer_seconds"] for r in steady_requests(data.get("request_details") or [])]
    return float(statistics.fmean(times)) if times else None


def steady_unexplained_mean(data: dict[str, Any]) -> float | None:
    """Mean over the steady-state requests of transfer_seconds - (post + wire) of the
    critical transfer (see :func:`steady_transfer_mean` for which requests count)."""
    rest = [r["transfer_seconds"] - r["phases"]["post"] - r["phases"]["wire"]
            for r in steady_requests(data.get("request_details") or [])]
    return float(statistics.fmean(rest)) if rest else None


def steady_phase_means(data: dict[str, Any]) -> tuple[float, float] | None:
    """Means over the steady-state requests of their critical transfer's post call and of
    the time from its end to completion (``phases.post`` / ``phases.wire``): where the transfer
    time goes, to set the simulator's split against NIXL's telemetry."""
    steady = steady_requests(data.get("request_details") or [])
    if not steady:
        return None
    return (float(statistics.fmean(r["phases"]["post"] for r in steady)),
            float(statistics.fmean(r["phases"]["wire"] for r in steady)))


def post_call_totals(data: dict[str, Any]) -> tuple[int, float]:
    """(bytes, seconds) of every transfer of one run with a post time: the bytes its post
    calls moved and the time they took (on CPU loopback the copy runs inside the call)."""
    nbytes, seconds = 0, 0.0
    for r in data.get("request_details") or []:
        for t in r.get("telemetry") or []:
            if t.get("post_seconds") is not None:
                nbytes += int(t["nbytes"])
                seconds += float(t["post_seconds"])
    return nbytes, seconds


def shown_path(path: Path | str) -> str:
    """``path`` as reports show it: relative to the working directory when inside it (a
    committed report must not carry the checkout's location), else as given."""
    resolved = Path(path).resolve()
    try:
        return str(resolved.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _shown_profile(profile: Path) -> str:
    shown = shown_path(profile)
    if Path(shown).is_absolute():  # e.g. calibrate's candidate in a temporary folder
        return f"{Path(profile).name} (a file outside the working directory)"
    return shown


def coalescing_model_check(data: dict[str, Any]) -> tuple[int, int]:
    """(transfers checked, transfers where hkvsim's coalescing model on the really posted lists
    differs from NIXL's telemetry) over one real run's ``request_details``."""
    checked = mismatched = 0
    for r in data.get("request_details") or []:
        for t in r.get("telemetry") or []:
            model, real = t.get("coalesced_model"), t.get("coalesced")
            if model is None or real is None:
                continue
            checked += 1
            mismatched += int(model) != int(real)
    return checked, mismatched


def _load(files: Sequence[Path]) -> list[Any]:
    from .scenario import load_scenarios

    if not files:
        raise ValidationError("no validation scenario files given (and none found in "
                              "scenarios/validation/); allowed: scenario .toml files without "
                              "[sweep]")
    scenarios = []
    for f in files:
        found = load_scenarios(f)
        if len(found) != 1:
            raise ValidationError(f"{f}: {len(found)} variants; allowed: a scenario file "
                                  f"without [sweep] (one variant)")
        scenarios.append(found[0])
    return scenarios


def with_profile(scenario: Any, profile: Path | None = None,
                 overrides: dict[str, Any] | None = None) -> Any:
    """``scenario`` simulated on another fabric profile file and/or with extra profile overrides
    (the scenario's own overrides kept, ``overrides`` win)."""
    fabric = scenario.fabric
    update: dict[str, Any] = {}
    if profile is not None:
        from .fabric.profile import load_profile

        load_profile(profile, overrides=dict(fabric.overrides))  # fail here, with the file named
        update["profile"] = str(Path(profile).resolve())
    if overrides:
        update["overrides"] = {**fabric.overrides, **overrides}
    if not update:
        return scenario
    return scenario.model_copy(update={"fabric": fabric.model_copy(update=update)})


@dataclass
class RealRuns:
    """One file's real NIXL runs (:func:`measure_real`): every measured run's
    ``result_json(..., requests=True)``, the 1-minute load average before each, and the
    steady-state means of its warm-up runs (left out of every figure)."""

    runs: list[dict[str, Any]] = field(default_factory=list)
    loads: list[float] = field(default_factory=list)
    warm_up_seconds: list[float] = field(default_factory=list)


def _check_counts(repeats: int, warm_up: int) -> None:
    if repeats < 1:
        raise ValidationError(f"--repeats {repeats}: expected an integer >= 1")
    if warm_up < 0:
        raise ValidationError(f"--warm-up {warm_up}: expected an integer >= 0")


def measure_real(files: Sequence[Path], *, repeats: int = 3,
                 progress: Callable[[str], None] | None = None, timing_only: bool = False,
                 warm_up: int = 0) -> list[RealRuns]:
    """Run every file on real NIXL: ``warm_up`` passes over all of them first (left out),
    then ``repeats`` passes, interleaved across the files (file 1, 2, ..., then again), so a
    slow minute of the machine spreads over every file instead of landing on one. One
    :class:`RealRuns` per file, in ``files`` order."""
    from .drivers.nixl import run_scenario_nixl
    from .results import result_json

    _check_counts(repeats, warm_up)
    scenarios = _load(files)
    say = progress or (lambda _text: None)
    out = [RealRuns() for _ in scenarios]
    for rep in range(warm_up):
        for f, s, real in zip(files, scenarios, out):
            data = result_json(run_scenario_nixl(s, timing_only=timing_only), requests=True)
            t = steady_transfer_mean(data)
            if t is not None:
                real.warm_up_seconds.append(float(t))
            say(f"nixl {f.name} (warm-up {rep + 1}/{warm_up}, left out)")
    for rep in range(repeats):
        for f, s, real in zip(files, scenarios, out):
            real.loads.append(os.getloadavg()[0])
            real.runs.append(result_json(run_scenario_nixl(s, timing_only=timing_only),
                                         requests=True))
            say(f"nixl {f.name} ({rep + 1}/{repeats})")
    return out


def judge(files: Sequence[Path], reals: Sequence[RealRuns], *,
          progress: Callable[[str], None] | None = None, profile: Path | None = None,
          timing_only: bool = False) -> list[FileResult]:
    """Simulate every file (with ``profile`` instead of the one each scenario names, when
    given) and set it against its real runs (:func:`measure_real`, same order)."""
    from .drivers.sim import run_scenario
    from .fabric.profile import load_profile
    from .results import result_json

    scenarios = _load(files)
    if len(reals) != len(scenarios):
        raise ValidationError(f"{len(scenarios)} files but {len(reals)} sets of real runs; "
                              "allowed: one set per file, in the same order")
    say = progress or (lambda _text: None)
    out = []
    for f, s, measured in zip(files, scenarios, reals):
        simulated = with_profile(s, profile)
        call = load_profile(simulated.fabric.profile,
                            overrides=dict(simulated.fabric.overrides)).coordinator_call * 1e6
        sim = result_json(run_scenario(simulated, timing_only=timing_only), requests=True)
        say(f"sim {f.name}")
        real = measured.runs
        sim_t = steady_transfer_mean(sim)
        real_t = [steady_transfer_mean(r) for r in real]
        bad = [d["outcome"] for d in [sim, *real] if d["outcome"] != "ok"]
        if not real or sim_t is None or any(t is None for t in real_t) or bad:
            raise ValidationError(f"{f}: a run did not complete its steady-state requests "
                                  f"(outcomes: sim {sim['outcome']}, real "
                                  f"{', '.join(r['outcome'] for r in real) or 'none'}); a "
                                  "validation file must run cleanly on both backends")
        checks = [coalescing_model_check(r) for r in real]
        phases = [steady_phase_means(d) or (0.0, 0.0) for d in [sim, *real]]
        verified = {bool(d.get("verified")) for d in [sim, *real]}
        if len(verified) > 1:  # a comparison of a verified run with a timing-only one is void
            did = "did" if sim.get("verified") else "did not"
            other = "did not" if sim.get("verified") else "did"
            raise ValidationError(f"{f}: the simulated run {did} verify bytes but a real run "
                                  f"{other}; every run of a file must be verified, or every "
                                  f"run timing-only")
        out.append(FileResult(
            file=shown_path(f), scenario=s.scenario.name,
            profile=_shown_profile(profile) if profile is not None else s.fabric.profile,
            sim_seconds=sim_t, real_seconds=tuple(float(t) for t in real_t if t is not None),
            loads=tuple(measured.loads),
            descriptors_posted=(sim["requests"]["descriptors_posted"],
                                real[0]["requests"]["descriptors_posted"]),
            descriptors_coalesced=(sim["requests"]["descriptors_coalesced"],
                                   real[0]["requests"]["descriptors_coalesced"]),
            outcomes=tuple(d["outcome"] for d in [sim, *real]),
            unexplained=tuple(float(steady_unexplained_mean(d) or 0.0)
                              for d in [sim, *real]),
            post_calls=tuple(post_call_totals(d) for d in [sim, *real]),
            post_seconds=tuple(post for post, _ in phases),
            wire_seconds=tuple(wire for _, wire in phases),
            coalescing_model=(sum(c for c, _ in checks), sum(m for _, m in checks)),
            verified=verified.pop(),
            rank_cpu=merge_rank_cpu([r["rank_cpu"] for r in real if r.get("rank_cpu")]),
            transfers=sum(len(q.get("telemetry") or []) for r in real
                          for q in r.get("request_details") or []),
            warm_up_seconds=tuple(measured.warm_up_seconds),
            profile_coordinator_call_us=float(call)))
    return out


def validate(files: Sequence[Path], *, repeats: int = 3,
             progress: Callable[[str], None] | None = None,
             profile: Path | None = None, timing_only: bool = False,
             warm_up: int = 0) -> list[FileResult]:
    """Run every file on both backends (see the module docstring): :func:`measure_real`, then
    :func:`judge`. ``profile``: simulate with this profile file instead of the one each
    scenario names (the real runs are unaffected). ``timing_only``: both backends move the
    bytes but run no oracle, so the real ranks spend no CPU on filling and checking pages
    while other requests' copies run (what a deployment does; the default measures the
    verified runs). ``warm_up``: passes over every file on real NIXL before the measured ones,
    left out of every figure (``FileResult.warm_up_seconds``)."""
    _check_counts(repeats, warm_up)
    for s in _load(files):  # bad input (a profile that does not load) fails before real runs
        with_profile(s, profile)
    reals = measure_real(files, repeats=repeats, progress=progress, timing_only=timing_only,
                         warm_up=warm_up)
    return judge(files, reals, progress=progress, profile=profile, timing_only=timing_only)


#: Host CPU per coordinator call this many times the profile's (or its inverse) is flagged.
HOST_DRIFT_FLAG = 1.5


def host_cpu_drift(results: Sequence[FileResult]) -> dict[str, float] | None:
    """How fast the host ran during the real runs against when the simulated profile was
    calibrated: the real coordinator's CPU per call it sent a rank (every real run of every
    file), the profile's ``coordinator_call_us`` (measured the same way in its calibration's
    FIT runs) and their ratio. The coordinator's work per call is the same in every scenario,
    so the ratio follows the host's speed: 1.0 in the calibration that wrote the shipped
    profile (215 us per call on its held-out runs against 219 us on its FIT runs), 2.0-3.1 in
    validations hours later whose errors were 2-3 times as large. None when the profile models
    no coordinator CPU or no real run counted any."""
    calls = sum(int((r.rank_cpu.get("coordinator") or {}).get("calls", 0)) for r in results)
    cpu = sum(float((r.rank_cpu.get("coordinator") or {}).get("cpu_seconds", 0.0))
              for r in results)
    profiled = [r.profile_coordinator_call_us for r in results if r.profile_coordinator_call_us]
    if not calls or cpu <= 0 or not profiled:
        return None
    real_us = cpu / calls * 1e6
    profile_us = float(statistics.median(profiled))
    return {"real_coordinator_call_us": round(real_us, 1),
            "profile_coordinator_call_us": round(profile_us, 1),
            "ratio": round(real_us / profile_us, 2)}


def host_copy_drift(results: Sequence[FileResult]) -> dict[str, float] | None:
    """The post calls' pace on each side: bytes over the time of every post call of every
    file (sim: the simulated run; real: every real run), in GB/s, and how many times as long
    the real calls took for their bytes (``ratio``, > 1: the real copy was slower). On CPU
    loopback the copy runs inside the call on both backends, so this follows the host's copy
    speed against the profile's, apart from the coordinator's CPU (:func:`host_cpu_drift`).
    None without a post call on either side."""
    sim = [r.post_calls[0] for r in results if len(r.post_calls) >= 2]
    real = [c for r in results if len(r.post_calls) >= 2 for c in r.post_calls[1:]]
    sim_b, sim_s = sum(b for b, _ in sim), sum(t for _, t in sim)
    real_b, real_s = sum(b for b, _ in real), sum(t for _, t in real)
    if not (sim_b and sim_s > 0 and real_b and real_s > 0):
        return None
    sim_gbps, real_gbps = sim_b / sim_s / 1e9, real_b / real_s / 1e9
    return {"sim_post_gbps": round(sim_gbps, 3), "real_post_gbps": round(real_gbps, 3),
            "ratio": round(sim_gbps / real_gbps, 2)}


#: Resamples of the real runs behind :func:`resampled_verdict` (seeded: reports reproduce).
RESAMPLES = 2000


def resampled_verdict(results: Sequence[FileResult], *, draws: int = RESAMPLES,
                      seed: int = 0) -> dict[str, Any] | None:
    """How firmly the real runs decide the acceptance: each draw resamples every file's real
    runs with replacement (as many as it has), takes their median and the file's error, then
    the median and the worst |error| over the files. Returns the 5th-95th percentile range of
    both and the share of draws that meet both bounds (1.0 or 0.0: a firm verdict; in between,
    which side of a bound the set lands on is decided by run-to-run noise). None without a
    file. A file with one real run has no spread to resample."""
    import numpy as np

    if not results:
        return None
    rng = np.random.default_rng(seed)
    errors = np.empty((draws, len(results)))
    for j, r in enumerate(results):
        real = np.asarray(r.real_seconds, dtype=float)
        picks = real[rng.integers(0, real.size, size=(draws, real.size))]
        errors[:, j] = np.abs(r.sim_seconds / np.median(picks, axis=1) - 1.0)
    median, worst = np.median(errors, axis=1), errors.max(axis=1)
    met = within_bounds(median, worst)
    return {"draws": draws,
            "median_abs_error_p5_p95": [float(x) for x in np.percentile(median, [5, 95])],
            "worst_abs_error_p5_p95": [float(x) for x in np.percentile(worst, [5, 95])],
            "met_share": float(met.mean())}


def summary(results: Sequence[FileResult]) -> dict[str, Any]:
    errors = [abs(r.error) for r in results]
    cores = os.cpu_count() or 1
    return {"files": len(results),
            "median_abs_error": float(statistics.median(errors)) if errors else None,
            "worst_abs_error": max(errors) if errors else None,
            "accept_median": ACCEPT_MEDIAN, "accept_worst": ACCEPT_WORST,
            "accepted": bool(errors and within_bounds(statistics.median(errors), max(errors))),
            "cores": cores,
            "loaded_runs": sum(load > cores for r in results for load in r.loads),
            "real_runs": sum(len(r.real_seconds) for r in results),
            "coalesced_agree": all(r.descriptors_coalesced[0] == r.descriptors_coalesced[1]
                                   for r in results),
            "coalescing_model_checked": sum(r.coalescing_model[0] for r in results),
            "coalescing_model_mismatches": sum(r.coalescing_model[1] for r in results),
            "host_cpu_drift": host_cpu_drift(results),
            "host_copy_drift": host_copy_drift(results),
            "resampled": resampled_verdict(results)}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def _n(count: int | None) -> str:
    return "unknown" if count is None else f"{count:,}"


def _sim_real(values: tuple[float, ...]) -> str:
    """``sim / median of the real runs`` in ms, or ``-`` without both."""
    if len(values) < 2:
        return "-"
    return f"{_ms(values[0])} / {_ms(statistics.median(values[1:]))}"


def _oracle_sentence(results: Sequence[FileResult]) -> str:
    if all(r.verified for r in results):
        return ("Verified runs: the oracle fills every prefill page and checks every decode byte "
                "inside the rank processes, on the same cores as the copies.")
    if not any(r.verified for r in results):
        return ("Timing-only runs (`--timing-only`): the bytes move, but no rank spends CPU on "
                "filling or checking them, and nothing was verified.")
    return "Some files ran verified and some timing-only (see the JSON)."


def _coalescing_sentence(results: Sequence[FileResult], s: dict[str, Any]) -> str:
    differ = [Path(r.file).name for r in results
              if r.descriptors_coalesced[0] != r.descriptors_coalesced[1]]
    totals = ("Coalesced descriptor totals agree between the simulator and NIXL's telemetry on "
              "every file." if not differ else
              f"Coalesced descriptor totals differ between the simulator and NIXL's telemetry on "
              f"{', '.join(f'`{d}`' for d in differ)} (block ids there depend on the order in "
              f"which concurrent requests finish, which differs between the backends).")
    checked, bad = s["coalescing_model_checked"], s["coalescing_model_mismatches"]
    if not checked:
        return totals + " The coalescing model was not checked on the real lists (no counts)."
    verdict = "agrees with" if not bad else f"DISAGREES on {bad:,} transfers with"
    return (f"{totals} hkvsim's coalescing model, applied to the descriptor lists the real ranks "
            f"posted, {verdict} NIXL's telemetry ({checked:,} transfers checked).")


def _flagged(ratio: float) -> bool:
    """A drift ratio beyond :data:`HOST_DRIFT_FLAG` either way."""
    return ratio > HOST_DRIFT_FLAG or ratio < 1 / HOST_DRIFT_FLAG


def _drift_sentence(drift: dict[str, float] | None) -> str:
    if drift is None:
        return ("The host's speed against the profile's calibration is unknown (the profile "
                "models no coordinator CPU, or no real run counted it).")
    ratio = drift["ratio"]
    said = (f"The real coordinator spent {drift['real_coordinator_call_us']:g} us of CPU per call "
            f"it sent a rank, {ratio:.2f}x the {drift['profile_coordinator_call_us']:g} us the "
            "profile's calibration measured for the same work")
    if _flagged(ratio):
        pace = "slower" if ratio > 1 else "faster"
        return (f"{said}: **the host ran {pace} than when the profile was calibrated**, so the "
                "errors above measure that drift as well as the model (recalibrate with "
                "`hkvsim calibrate --host` to judge the model on this host as it runs now).")
    return f"{said}: the host ran at about its calibration's speed."


def resampled_sentence(resampled: dict[str, Any] | None) -> str:
    """One sentence on how firmly the real runs decide the verdict (:func:`resampled_verdict`)."""
    if resampled is None:
        return ""
    (m_lo, m_hi), (w_lo, w_hi) = (resampled["median_abs_error_p5_p95"],
                                  resampled["worst_abs_error_p5_p95"])
    share = resampled["met_share"]
    firm = ("the verdict holds in every draw" if share in (0.0, 1.0) else
            f"the bounds are met in {100 * share:.0f} % of the draws: run-to-run noise decides "
            "the verdict as much as the model")
    return (f"Resampling each file's real runs ({resampled['draws']:,} draws): median |error| "
            f"{100 * m_lo:.0f}-{100 * m_hi:.0f} %, worst {100 * w_lo:.0f}-{100 * w_hi:.0f} % "
            f"(5th-95th percentiles); {firm}.")


def _copy_sentence(drift: dict[str, float] | None) -> str:
    if drift is None:
        return "The post calls' pace is unknown (no post time on one side)."
    ratio = drift["ratio"]
    said = (f"The real post calls moved {drift['real_post_gbps']:g} GB/s (bytes over their "
            f"time, every transfer of every run), the simulated ones {drift['sim_post_gbps']:g} "
            f"GB/s")
    if _flagged(ratio):
        return (f"{said}: **the real calls took {ratio:.2f}x as long for their bytes** (the "
                "copy runs inside them on CPU loopback).")
    return f"{said} ({ratio:.2f}x as long on the real side)."


def _warm_up_clause(passes: int) -> str:
    if not passes:
        return ""
    return (f", after {passes} warm-up pass{'es' if passes > 1 else ''} over every file whose "
            "runs are left out (their times are in the JSON)")


def markdown(results: Sequence[FileResult], meta: dict[str, Any]) -> str:
    s = summary(results)
    rows = []
    for r in results:
        rows.append(f"| `{Path(r.file).name}` | {_ms(r.sim_seconds)} | {_ms(r.real_median)} | "
                    f"{', '.join(_ms(t) for t in r.real_seconds)} | {100 * r.spread:.0f} % | "
                    f"{100 * r.error:+.0f} % | {r.descriptors_posted[0]:,} / "
                    f"{r.descriptors_posted[1]:,} | {_n(r.descriptors_coalesced[0])} / "
                    f"{_n(r.descriptors_coalesced[1])} | {max(r.loads):.1f} | "
                    f"{_sim_real(r.post_seconds)} | {_sim_real(r.wire_seconds)} | "
                    f"{_sim_real(r.unexplained)} | "
                    f"{r.coalescing_model[1]} / {r.coalescing_model[0]:,} |")
    verdict = ("met" if s["accepted"] else "NOT met")
    lines = [
        "# Held-out validation: simulator vs real NIXL (CPU loopback)", "",
        f"Written by `hkvsim validate` ({meta.get('when', '?')}; {meta.get('machine', '?')}). "
        f"{s['files']} scenario files that no calibration ever used "
        f"(`{meta.get('source', 'scenarios/validation/')}`), each run once on the simulator "
        "with the shipped "
        f"profile and {meta.get('repeats', '?')} times on real NIXL (DRAM over UCX, one "
        "process per rank), real runs interleaved across files"
        f"{_warm_up_clause(meta.get('warm_up', 0))}. "
        f"{_oracle_sentence(results)} Time = steady-state mean "
        "per-request transfer time (first post to transfer done; each run's first request, "
        "requests that ran a handshake and requests that arrived or were in flight meanwhile left "
        "out; a run's value is the mean over its steady requests, a file's the median over its "
        "runs). Nothing was tuned to these numbers.", "",
        "| file | sim (ms) | real median (ms) | real runs (ms) | real spread | error "
        "(sim - real) / real | descriptors posted sim / real | after NIXL coalescing sim / "
        "real | max load before a run | post call, sim / real (ms) | post end to "
        "completion, sim / real (ms) | not explained by NIXL telemetry, sim / real "
        "(ms) | coalescing model on the real lists: mismatches / transfers |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows, "",
        f"Median |error| {100 * s['median_abs_error']:.0f} %, worst {100 * s['worst_abs_error']:.0f} %"
        f" (acceptance: median <= {100 * ACCEPT_MEDIAN:.0f} %, worst <= "
        f"{100 * ACCEPT_WORST:.0f} %: **{verdict}**). {resampled_sentence(s['resampled'])} "
        f"{_coalescing_sentence(results, s)} "
        f"{s['loaded_runs']} of {s['real_runs']} real runs started "
        f"with a 1-minute load average above the {s['cores']} core(s). "
        f"{_drift_sentence(s['host_cpu_drift'])} {_copy_sentence(s['host_copy_drift'])}", "",
        "Where the time goes, per steady request (means; real: the median over runs): the "
        "post call of its critical (last-completing) transfer, on CPU loopback the copy "
        "included (UCX cma copies inside the call, and the simulator's host path does the "
        "same); then from the call's end to completion (NIXL's telemetry on the real backend: "
        "the wait for the remote rank's progress until the rank's own poll sees it); then the "
        "part of the transfer time that neither covers: on the simulator the notification "
        "(push) or path latency; on the real backend also the rank's poll loop seeing "
        "completion, its message to the coordinator and process scheduling on a shared "
        "machine, which the simulator models only with a profile that carries the host-path "
        "model (`hkvsim calibrate --host`), inside its post-to-completion time.",
    ]
    return "\n".join(lines) + "\n"


def write_outputs(results: Sequence[FileResult], out_dir: Path, meta: dict[str, Any]
                  ) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "held-out-cpu" if all(r.verified for r in results) else "held-out-cpu-timing-only"
    md = out_dir / f"{stem}.md"
    js = out_dir / f"{stem}.json"
    md.write_text(markdown(results, meta))
    js.write_text(json.dumps({"meta": meta, "summary": summary(results),
                              "files": [{**asdict(r), "real_median": r.real_median,
                                         "error": r.error, "spread": r.spread}
                                        for r in results]}, indent=1) + "\n")
    return [md, js]
