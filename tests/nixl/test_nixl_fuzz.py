"""hkvsim fuzz --backend nixl: drawn deployments run over real NIXL agents (a process per rank,
DRAM over UCX on loopback), and the checks read the bytes UCX moved: a clean core finds
nothing, a replayed bug is found there as on the simulated fabric."""

from __future__ import annotations

import json

import pytest

from hkvsim import cli
from hkvsim.fuzz import FuzzOptions, fuzz


@pytest.mark.timeout(300)
def test_fuzz_on_real_nixl_checks_the_bytes_ucx_moved(nixl_required, tmp_path, capsys) -> None:
    report = fuzz(FuzzOptions(seed=0, count=3, backend="nixl", max_ranks=32))  # 28, 3, 2 ranks
    assert [c.status for c in report.cases] == ["checked"] * 3
    assert report.findings == [] and {c.outcomes["hkvsim"] for c in report.cases} == {"ok"}
    # the replayed bug (state never moved) leaves KimiLinear's state wrong on real NIXL too
    out = tmp_path / "fz"
    status = cli.main(["fuzz", "--backend", "nixl", "--count", "2", "--presets",
                       "tiny-kimi-linear", "--quirk", "attention-only-transfer", "--max-ranks",
                       "16", "--out", str(out)])
    assert status == 1
    assert "on real NIXL" in capsys.readouterr().out
    data = json.loads((out / "fuzz.json").read_text())
    assert data["backend"] == "nixl" and data["findings"] == 2
    assert all(c["outcomes"]["hkvsim"] == "corruption" for c in data["cases"])
    header = (out / "finding-0000.toml").read_text().splitlines()
    assert "real NIXL" in header[0]
    assert any(line.startswith("# reproduce: hkvsim run --backend nixl ") for line in header)
