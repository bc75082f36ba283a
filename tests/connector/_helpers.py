"""Shared builders for the connector reference tests (no expected numbers live here)."""

from __future__ import annotations

import dataclasses

from hkvsim.connector.metadata import RankMetadata, rank_metadata
from hkvsim.geometry.layout import EngineLayout, build_layout
from hkvsim.geometry.presets import preset
from hkvsim.geometry.specs import ModelSpec

BASE = 1 << 40  # any page-aligned synthetic base address


def layout(model: str | ModelSpec, tp: int, *, block_size: int = 64, num_blocks: int = 4,
           **kw) -> EngineLayout:
    spec = preset(model) if isinstance(model, str) else model
    return build_layout(spec, tp=tp, block_size=block_size, num_blocks=num_blocks, **kw)


def meta(lay: EngineLayout, rank: int = 0, *, engine: str = "eng", base: int = BASE,
         **kw) -> RankMetadata:
    return rank_metadata(layout=lay, engine_id=engine, tp_rank=rank,
                         agent_name=f"{engine}.{rank}", agent_metadata=b"agent", base_addr=base,
                         **kw)


def replace(m: RankMetadata, **kw) -> RankMetadata:
    return dataclasses.replace(m, **kw)


def state_regions(lay: EngineLayout) -> list[int]:
    """Indices of regions that carry a state view (what the worker passes)."""
    state = set(lay.model.state_layers)
    return [i for i, r in enumerate(lay.regions) if state & set(r.layers)]


def scenario_text(*, model: str, p_tp: int, d_tp: int, p_block: int | None = None,
                  d_block: int | None = None, requests: int = 1,
                  prompt_tokens: str = "1000", prefix_hit_tokens: str = "0",
                  verify: bool = True, p_extra: str = "", d_extra: str = "",
                  connector: str = "") -> str:
    pb = f"block_size = {p_block}\n" if p_block else ""
    db = f"block_size = {d_block}\n" if d_block else ""
    return f"""
[scenario]
name = "connector-reference {model} P{p_tp} D{d_tp}"
seed = 1

[model]
preset = "{model}"

[prefill]
tp = {p_tp}
{pb}{p_extra}

[decode]
tp = {d_tp}
{db}{d_extra}

[connector]
{connector}

[workload]
requests = {requests}
prompt_tokens = {prompt_tokens}
prefix_hit_tokens = {prefix_hit_tokens}
verify = {str(verify).lower()}
"""


def run(text: str):
    from hkvsim.cluster import run_scenario
    from hkvsim.scenario import parse_scenarios

    (s,) = parse_scenarios(text)
    return run_scenario(s)
