"""A request goes to every rank of an engine; the ranks reuse the pairing the first one made
for that very request object (connector/worker.py ``_paired_for``). Verified runs must stay
byte-exact, with the same records as pairing on every rank."""

from __future__ import annotations

import pytest

from hkvsim.cluster import run_scenario
from hkvsim.connector import worker as worker_mod
from hkvsim.results import result_json
from hkvsim.scenario import parse_scenarios

TEXT = """
[scenario]
name = "pairing reuse"
seed = 5
[model]
preset = "{preset}"
[prefill]
tp = 1
instances = 2
[decode]
tp = {d_tp}
instances = 2
[workload]
requests = 16
arrival = "poisson"
rate = 400.0
prompt_tokens = {{ min = 40, max = 700, distribution = "loguniform" }}
max_inflight = 6
verify = true
"""


@pytest.mark.parametrize(("preset", "d_tp"), [("tiny-kimi-linear", 2), ("tiny-llama", 2)])
def test_reused_pairings_move_every_byte_right(preset: str, d_tp: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    (scenario,) = parse_scenarios(TEXT.format(preset=preset, d_tp=d_tp))
    reused = []
    original = worker_mod.ConnectorWorker._pair_blocks

    def counting(self, **kwargs):  # type: ignore[no-untyped-def]
        reused.append(1)
        return original(self, **kwargs)

    monkeypatch.setattr(worker_mod.ConnectorWorker, "_pair_blocks", counting)
    shared = run_scenario(scenario)
    assert shared.outcome == "ok", shared.outcome
    assert all(r.status == "ok" for r in shared.records)
    posted = sum(r.transfers for r in shared.records)
    assert 0 < len(reused) < posted  # some ranks reused a pairing

    def fresh(self, req, *, ppl_p, bsr, remote_blocks):  # type: ignore[no-untyped-def]
        return original(self, prefill_blocks=req.prefill_blocks, decode_blocks=req.decode_blocks,
                        hit_blocks=req.decode_hit_blocks, ppl_p=ppl_p,
                        ppl_d=self.layout.physical_blocks_per_logical, bsr=bsr,
                        remote_blocks=remote_blocks)

    monkeypatch.setattr(worker_mod.ConnectorWorker, "_paired_for", fresh)
    each = run_scenario(scenario)
    assert result_json(each, requests=True) == result_json(shared, requests=True)
