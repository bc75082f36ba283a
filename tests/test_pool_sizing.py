"""A pool that cannot hold the largest request is bad input, not a hang (issue #10, item 8)."""

from __future__ import annotations

import pytest

from hkvsim.cli import main
from hkvsim.cluster import run_scenario
from hkvsim.pd.pool import blocks_per_request
from hkvsim.geometry import build_layout, preset
from hkvsim.scenario import ScenarioError, parse_scenarios

TEXT = """
[scenario]
name = "small pool"
[model]
preset = "tiny-kimi-linear"
[prefill]
tp = 1
{prefill}
[decode]
tp = 2
{decode}
[workload]
requests = 3
prompt_tokens = [700, 1500, 300]
"""


def _minimum(role: str) -> int:
    model = preset("tiny-kimi-linear")
    layout = build_layout(model, tp=1 if role == "prefill" else 2,
                          block_size=model.attention.attention_backend.min_kernel_block,
                          num_blocks=1)
    return blocks_per_request(layout, 1499 if role == "prefill" else 1500)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_undersized_pool_is_refused_naming_key_value_and_minimum(role: str) -> None:
    need = _minimum(role)
    assert need > 2
    text = TEXT.format(**{role: f"num_blocks = {need - 1}",
                          ("decode" if role == "prefill" else "prefill"): ""})
    (scenario,) = parse_scenarios(text)
    with pytest.raises(ScenarioError) as info:
        run_scenario(scenario)
    message = str(info.value)
    assert f"{role}.num_blocks" in message
    assert f"{need - 1} logical block(s)" in message and f">= {need}" in message
    # the minimum itself is enough: every request completes
    (ok,) = parse_scenarios(TEXT.format(**{role: f"num_blocks = {need}",
                                           ("decode" if role == "prefill" else "prefill"): ""}))
    result = run_scenario(ok)
    assert result.outcome == "ok" and result.completed == 3


@pytest.mark.parametrize("command", ["plan", "run"])
def test_cli_exits_2_with_one_line(tmp_path, capsys, command: str) -> None:
    path = tmp_path / "pool.toml"
    path.write_text(TEXT.format(prefill="", decode="num_blocks = 1"))
    assert main([command, str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert str(path) in err and "decode.num_blocks" in err and "allowed: >=" in err
