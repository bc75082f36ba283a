"""hkvsim.geometry.hf_config: HF config.json -> ModelSpec, checked against the presets."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from hkvsim.geometry.hf_config import (
    BUILDERS,
    HFConfigError,
    load_hf_config,
    model_from_hf_dict,
)
from hkvsim.geometry.presets import preset
from hkvsim.geometry.specs import GeometryError

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
MODELS = ["kimi-linear-48b", "qwen3-next-80b", "deepseek-v3", "llama-3.1-8b"]


def fixture_path(model: str) -> Path:
    return FIXTURES / model / "config.json"


def fixture_dict(model: str) -> dict[str, Any]:
    return json.loads(fixture_path(model).read_text())


def write(tmp_path: Path, config: Any, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(config) if not isinstance(config, str) else config)
    return path


# --- fixtures against presets ---------------------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
def test_fixture_matches_preset(model: str) -> None:
    loaded = load_hf_config(fixture_path(model))
    expected = preset(model)
    assert loaded.architecture == expected.architecture
    assert loaded.num_layers == expected.num_layers
    assert loaded.hidden_size == expected.hidden_size
    assert loaded.attention == expected.attention
    assert loaded.attention_layers == expected.attention_layers
    assert loaded.state == expected.state
    assert loaded.dtype == expected.dtype
    # Nothing else differs either: the whole spec equals the preset once the name is aligned.
    assert dataclasses.replace(loaded, name=expected.name) == expected


def test_kimi_layout_and_sizes() -> None:
    kimi = load_hf_config(fixture_path("kimi-linear-48b"))
    # 1-based 4, 8, ..., 24, 27 -> 0-based.
    assert kimi.attention_layers == (3, 7, 11, 15, 19, 23, 26)
    assert len(kimi.state_layers) == 20
    assert kimi.kv_bytes_per_token(1) == 8064
    assert kimi.state_bytes_per_request(1) == 43_417_600
    assert kimi.state is not None
    assert kimi.state.conv_dtype == "bfloat16" and kimi.state.recurrent_dtype == "float32"
    assert kimi.state.page_bytes(1) == 2_170_880  # docs/semantics.md §2.3, TP1 mamba page


def test_qwen3_next_layout_and_sizes() -> None:
    qwen = load_hf_config(fixture_path("qwen3-next-80b"))
    assert qwen.attention_layers == tuple(range(3, 48, 4))
    assert qwen.kv_bytes_per_token(1) == 24_576
    assert qwen.state is not None
    # GDN conv Q|K|V = 2048 | 2048 | 4096 columns; page 2,146,304 B at TP1 (docs/semantics.md §2.4).
    assert qwen.state.conv_subprojections == (("Q", 2048), ("K", 2048), ("V", 4096))
    assert qwen.state.page_bytes(1) == 2_146_304


def test_deepseek_and_llama_sizes() -> None:
    deepseek = load_hf_config(fixture_path("deepseek-v3"))
    llama = load_hf_config(fixture_path("llama-3.1-8b"))
    assert deepseek.kv_bytes_per_token(1) == 70_272
    assert deepseek.state is None and deepseek.state_bytes_per_request(1) == 0
    assert llama.kv_bytes_per_token(1) == 131_072
    # The Llama fixture has no head_dim: it must come from hidden_size // num_attention_heads.
    assert "head_dim" not in fixture_dict("llama-3.1-8b")
    assert llama.attention.head_dim == 128  # type: ignore[union-attr]


def test_registry_lists_exactly_the_four_architectures() -> None:
    assert set(BUILDERS) == {
        "KimiLinearForCausalLM", "Qwen3NextForCausalLM", "DeepseekV3ForCausalLM",
        "LlamaForCausalLM",
    }


# --- names, extra fields, optional fields, dtype --------------------------------------------


def test_name_resolution(tmp_path: Path) -> None:
    path = fixture_path("deepseek-v3")
    assert load_hf_config(path, name="my-model").name == "my-model"
    assert load_hf_config(path).name == "deepseek_v3"  # model_type
    config = fixture_dict("deepseek-v3")
    config["_name_or_path"] = "deepseek-ai/DeepSeek-V3"
    assert load_hf_config(write(tmp_path, config)).name == "deepseek-ai/DeepSeek-V3"
    del config["_name_or_path"], config["model_type"]
    assert load_hf_config(write(tmp_path, config, "dsv3.json")).name == "dsv3"
    assert model_from_hf_dict(config, name="x").name == "x"


def test_extra_fields_are_ignored() -> None:
    config = fixture_dict("kimi-linear-48b")
    config["some_future_field"] = {"nested": [1, "two"]}
    config["linear_attn_config"]["gate_lower_bound"] = -5.0
    config["architectures"].append("SomethingElse")  # only architectures[0] counts
    spec = model_from_hf_dict(config, name="kimi-linear-48b")
    assert spec == preset("kimi-linear-48b")


def test_qwen_layer_types_override_interval() -> None:
    config = fixture_dict("qwen3-next-80b")
    types = ["linear_attention"] * 48
    for i in (0, 5, 47):
        types[i] = "full_attention"
    config["layer_types"] = types  # disagrees with full_attention_interval=4 on purpose
    spec = model_from_hf_dict(config, name="q")
    assert spec.attention_layers == (0, 5, 47)
    assert len(spec.state_layers) == 45


def test_qwen_interval_is_one_based() -> None:
    config = fixture_dict("qwen3-next-80b")
    config["num_hidden_layers"] = 10
    config["full_attention_interval"] = 3
    assert model_from_hf_dict(config, name="q").attention_layers == (2, 5, 8)


def test_llama_kv_heads_default_to_attention_heads() -> None:
    config = fixture_dict("llama-3.1-8b")
    del config["num_key_value_heads"]
    spec = model_from_hf_dict(config, name="mha")
    assert spec.attention.num_kv_heads == 32  # type: ignore[union-attr]
    config["head_dim"] = 64  # an explicit head_dim wins over hidden_size // heads
    spec = model_from_hf_dict(config, name="mha")
    assert spec.attention.head_dim == 64  # type: ignore[union-attr]


@pytest.mark.parametrize("model", ["kimi-linear-48b", "qwen3-next-80b"])
@pytest.mark.parametrize("key", ["torch_dtype", "dtype"])
def test_dtype_sets_attention_and_conv_not_recurrent(key: str, model: str) -> None:
    config = fixture_dict(model)
    del config["torch_dtype"]
    config[key] = "float16"
    spec = model_from_hf_dict(config, name="k")
    assert spec.dtype == "float16"
    assert spec.attention.dtype == "float16"
    assert spec.state is not None
    assert spec.state.conv_dtype == "float16"
    assert spec.state.recurrent_dtype == "float32"


def test_dtype_defaults_to_bfloat16() -> None:
    config = fixture_dict("qwen3-next-80b")
    del config["torch_dtype"]
    spec = model_from_hf_dict(config, name="q")
    assert spec.attention.dtype == "bfloat16" and spec.dtype == "bfloat16"


def test_float32_model_doubles_kv_bytes() -> None:
    config = fixture_dict("llama-3.1-8b")
    config["torch_dtype"] = "float32"
    assert model_from_hf_dict(config, name="l").kv_bytes_per_token(1) == 2 * 131_072


# --- errors ---------------------------------------------------------------------------------


def load_error(path: Path) -> str:
    with pytest.raises(HFConfigError) as info:
        load_hf_config(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: "), message
    return message


def test_error_is_a_geometry_error() -> None:
    assert issubclass(HFConfigError, GeometryError)


def test_unsupported_architecture(tmp_path: Path) -> None:
    config = fixture_dict("llama-3.1-8b")
    config["architectures"] = ["MistralForCausalLM"]
    message = load_error(write(tmp_path, config))
    assert "'MistralForCausalLM'" in message
    for arch in BUILDERS:
        assert arch in message


def test_missing_architectures(tmp_path: Path) -> None:
    config = fixture_dict("llama-3.1-8b")
    del config["architectures"]
    assert "'architectures' (missing)" in load_error(write(tmp_path, config))
    config["architectures"] = []
    assert "'architectures'" in load_error(write(tmp_path, config))


@pytest.mark.parametrize(
    ("model", "field"),
    [
        ("deepseek-v3", "kv_lora_rank"),
        ("deepseek-v3", "qk_rope_head_dim"),
        ("kimi-linear-48b", "kv_lora_rank"),
        ("kimi-linear-48b", "linear_attn_config"),
        ("qwen3-next-80b", "linear_num_value_heads"),
        ("qwen3-next-80b", "full_attention_interval"),
        ("llama-3.1-8b", "num_hidden_layers"),
    ],
)
def test_missing_field(tmp_path: Path, model: str, field: str) -> None:
    config = fixture_dict(model)
    del config[field]
    path = write(tmp_path, config)
    arch = config["architectures"][0]
    assert load_error(path) == f"{path}: architecture {arch} needs field {field!r} (missing)"


def test_missing_nested_field_is_named_with_its_parent(tmp_path: Path) -> None:
    config = fixture_dict("kimi-linear-48b")
    del config["linear_attn_config"]["short_conv_kernel_size"]
    message = load_error(write(tmp_path, config))
    assert "'linear_attn_config.short_conv_kernel_size' (missing)" in message


def test_null_required_field_counts_as_missing(tmp_path: Path) -> None:
    config = fixture_dict("deepseek-v3")
    config["kv_lora_rank"] = None
    assert "'kv_lora_rank' (missing)" in load_error(write(tmp_path, config))


@pytest.mark.parametrize(
    ("model", "field", "value", "expected"),
    [
        ("kimi-linear-48b", "hidden_size", "2304", "int"),
        ("deepseek-v3", "kv_lora_rank", 512.0, "int"),
        ("llama-3.1-8b", "num_key_value_heads", True, "int"),
        ("qwen3-next-80b", "layer_types", "full_attention", "list of str"),
        ("kimi-linear-48b", "linear_attn_config", [1, 2], "object"),
    ],
)
def test_wrong_type(tmp_path: Path, model: str, field: str, value: Any, expected: str) -> None:
    config = fixture_dict(model)
    config[field] = value
    message = load_error(write(tmp_path, config))
    assert f"field {field!r} = {value!r}" in message
    assert f"has type {type(value).__name__}; expected {expected}" in message


def test_wrong_type_nested_list(tmp_path: Path) -> None:
    config = fixture_dict("kimi-linear-48b")
    config["linear_attn_config"]["kda_layers"] = ["1", "2"]
    message = load_error(write(tmp_path, config))
    assert "'linear_attn_config.kda_layers' = ['1', '2']" in message
    assert "expected list of int" in message


def test_non_positive_int(tmp_path: Path) -> None:
    config = fixture_dict("deepseek-v3")
    config["qk_rope_head_dim"] = 0
    assert "'qk_rope_head_dim' = 0 must be a positive int" in load_error(write(tmp_path, config))


def test_unsupported_dtype(tmp_path: Path) -> None:
    config = fixture_dict("llama-3.1-8b")
    config["torch_dtype"] = "int8"
    message = load_error(write(tmp_path, config))
    assert "'torch_dtype' = 'int8'" in message and "bfloat16" in message


def test_invalid_json(tmp_path: Path) -> None:
    text = '{\n  "architectures": ["LlamaForCausalLM"],\n  "hidden_size": 4096,,\n}'
    path = write(tmp_path, text)
    message = load_error(path)
    assert "invalid JSON at line 3 column" in message


def test_top_level_not_an_object(tmp_path: Path) -> None:
    assert "must be a JSON object, got list" in load_error(write(tmp_path, [1, 2]))


def test_unreadable_file(tmp_path: Path) -> None:
    message = load_error(tmp_path / "nope" / "config.json")
    assert "cannot read config" in message
    assert "cannot read config" in load_error(tmp_path)  # a directory, not a file


@pytest.mark.parametrize(
    ("kda", "full", "needle"),
    [
        ([1, 2, 3, 4, 5], [4, 6], "in both lists: [4]"),
        ([1, 2, 3, 5], [4, 6], ""),  # exact split of 1..6: no error
        ([1, 2, 3], [4, 6], "in neither list: [5]"),
        ([0, 1, 2, 3, 5], [4, 6], "outside 1..6: [0]"),
        ([1, 2, 3, 5, 7], [4, 6], "outside 1..6: [7]"),
        ([1, 2, 3, 5, 5], [4, 6], "listed twice: [5]"),
    ],
)
def test_kimi_layer_lists_must_split_all_layers(
    tmp_path: Path, kda: list[int], full: list[int], needle: str
) -> None:
    config = fixture_dict("kimi-linear-48b")
    config["num_hidden_layers"] = 6
    config["linear_attn_config"].update(kda_layers=kda, full_attn_layers=full)
    path = write(tmp_path, config)
    if not needle:
        assert load_hf_config(path).attention_layers == (3, 5)
        return
    message = load_error(path)
    assert needle in message
    assert "kda_layers" in message and "full_attn_layers" in message


def test_kimi_with_no_attention_layer_is_a_clear_error(tmp_path: Path) -> None:
    config = fixture_dict("kimi-linear-48b")
    config["num_hidden_layers"] = 3
    config["linear_attn_config"].update(kda_layers=[1, 2, 3], full_attn_layers=[])
    assert "no attention layers" in load_error(write(tmp_path, config))


def test_qwen_bad_layer_types(tmp_path: Path) -> None:
    config = fixture_dict("qwen3-next-80b")
    config["layer_types"] = ["linear_attention", "full_attention"]
    message = load_error(write(tmp_path, config))
    assert "'layer_types'" in message and "48 entries" in message and "got 2" in message
    config["layer_types"] = ["sliding_attention"] * 48
    assert "'sliding_attention'" in load_error(write(tmp_path, config))


def test_spec_rejections_are_wrapped(tmp_path: Path) -> None:
    config = fixture_dict("kimi-linear-48b")
    config["linear_attn_config"]["short_conv_kernel_size"] = 1  # conv_kernel must be >= 2
    message = load_error(write(tmp_path, config))
    assert "conv_kernel" in message


def test_dict_source_labels_errors() -> None:
    config = copy.deepcopy(fixture_dict("deepseek-v3"))
    del config["kv_lora_rank"]
    with pytest.raises(HFConfigError, match=r"^<dict>: architecture DeepseekV3ForCausalLM"):
        model_from_hf_dict(config, name="d")
    with pytest.raises(HFConfigError, match=r"^src\.json: "):
        model_from_hf_dict(config, name="d", source="src.json")
