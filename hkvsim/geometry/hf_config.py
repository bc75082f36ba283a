"""Build a :class:`ModelSpec` from a Hugging Face ``config.json``.

Four architectures are understood, chosen by ``architectures[0]`` through :data:`BUILDERS` (a
registry, not an if-chain): ``KimiLinearForCausalLM``, ``Qwen3NextForCausalLM``,
``DeepseekV3ForCausalLM`` and ``LlamaForCausalLM``. Only cache-relevant fields are read; every
other field is ignored. Every problem (unreadable file, bad JSON, unknown architecture, missing or
mistyped field, inconsistent layer lists) is one :class:`HFConfigError` line that names the file.

dtype: ``torch_dtype`` (or ``dtype``) sets the attention cache dtype and the conv state dtype;
the recurrent state stays float32 (docs/semantics.md §2.3: adopt fp32). Default bfloat16.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .specs import (
    GeometryError,
    GQAAttentionSpec,
    MLAAttentionSpec,
    ModelSpec,
    gdn_state,
    kda_state,
)

__all__ = ["HFConfigError", "BUILDERS", "load_hf_config", "model_from_hf_dict"]

_MISSING: Any = object()
_MODEL_DTYPES = ("bfloat16", "float16", "float32")


class HFConfigError(GeometryError):
    """A Hugging Face config that cannot be turned into a model spec."""


class _Fields:
    """Typed access to one config dict; every failure is an HFConfigError naming the file."""

    def __init__(self, config: dict[str, Any], *, source: str, architecture: str,
                 prefix: str = "") -> None:
        self.config = config
        self.source = source
        self.architecture = architecture
        self.prefix = prefix

    def error(self, message: str) -> HFConfigError:
        return HFConfigError(f"{self.source}: architecture {self.architecture} {message}")

    def _get(self, key: str, default: Any) -> Any:
        if key in self.config and self.config[key] is not None:
            return self.config[key]
        if default is _MISSING:
            raise self.error(f"needs field {self.prefix + key!r} (missing)")
        return default

    def _type_error(self, key: str, value: Any, expected: str) -> HFConfigError:
        return self.error(
            f"field {self.prefix + key!r} = {value!r} has type {type(value).__name__}; "
            f"expected {expected}"
        )

    def integer(self, key: str, default: Any = _MISSING) -> int:
        """A positive integer field (bool is not an int here)."""
        value = self._get(key, default)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self._type_error(key, value, "int")
        if value <= 0:
            raise self.error(f"field {self.prefix + key!r} = {value!r} must be a positive int")
        return value

    def int_list(self, key: str) -> list[int]:
        """A list of integers."""
        value = self._get(key, _MISSING)
        if not isinstance(value, list) or any(
            not isinstance(v, int) or isinstance(v, bool) for v in value
        ):
            raise self._type_error(key, value, "list of int")
        return value

    def str_list(self, key: str) -> list[str] | None:
        """An optional list of strings (None when absent)."""
        value = self._get(key, None)
        if value is None:
            return None
        if not isinstance(value, list) or any(not isinstance(v, str) for v in value):
            raise self._type_error(key, value, "list of str")
        return value

    def sub(self, key: str) -> _Fields:
        """A nested dict field, with dotted names in its errors."""
        value = self._get(key, _MISSING)
        if not isinstance(value, dict):
            raise self._type_error(key, value, "object")
        return _Fields(value, source=self.source, architecture=self.architecture,
                       prefix=f"{self.prefix}{key}.")

    def dtype(self) -> str:
        """Model dtype from ``torch_dtype`` (or ``dtype``); bfloat16 when neither is set."""
        key = "torch_dtype" if self.config.get("torch_dtype") is not None else "dtype"
        value = self._get(key, "bfloat16")
        if not isinstance(value, str):
            raise self._type_error(key, value, "str")
        if value not in _MODEL_DTYPES:
            raise self.error(
                f"field {key!r} = {value!r} is not supported; allowed: {', '.join(_MODEL_DTYPES)}"
            )
        return value


def _llama(f: _Fields, name: str, dtype: str) -> ModelSpec:
    layers = f.integer("num_hidden_layers")
    hidden = f.integer("hidden_size")
    heads = f.integer("num_attention_heads")
    kv_heads = f.integer("num_key_value_heads", heads)
    head_dim = f.integer("head_dim", hidden // heads if hidden % heads == 0 else _MISSING)
    return ModelSpec(
        name=name, architecture=f.architecture, num_layers=layers, hidden_size=hidden, dtype=dtype,
        attention=GQAAttentionSpec(num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype),
        attention_layers=tuple(range(layers)),
    )


def _deepseek_v3(f: _Fields, name: str, dtype: str) -> ModelSpec:
    layers = f.integer("num_hidden_layers")
    return ModelSpec(
        name=name, architecture=f.architecture, num_layers=layers,
        hidden_size=f.integer("hidden_size"), dtype=dtype,
        attention=MLAAttentionSpec(kv_lora_rank=f.integer("kv_lora_rank"),
                                   rope_dim=f.integer("qk_rope_head_dim"), dtype=dtype),
        attention_layers=tuple(range(layers)),
    )


def _qwen3_next(f: _Fields, name: str, dtype: str) -> ModelSpec:
    layers = f.integer("num_hidden_layers")
    layer_types = f.str_list("layer_types")
    if layer_types is not None:
        allowed = ("full_attention", "linear_attention")
        bad = sorted({t for t in layer_types if t not in allowed})
        if len(layer_types) != layers or bad:
            raise f.error(
                f"field 'layer_types' must list {layers} entries from {', '.join(allowed)}; "
                f"got {len(layer_types)} entries" + (f" with unknown {bad}" if bad else "")
            )
        attention_layers = tuple(i for i, t in enumerate(layer_types) if t == "full_attention")
    else:
        interval = f.integer("full_attention_interval")
        attention_layers = tuple(range(interval - 1, layers, interval))
    return ModelSpec(
        name=name, architecture=f.architecture, num_layers=layers,
        hidden_size=f.integer("hidden_size"), dtype=dtype,
        attention=GQAAttentionSpec(num_kv_heads=f.integer("num_key_value_heads"),
                                   head_dim=f.integer("head_dim"), dtype=dtype),
        attention_layers=attention_layers,
        state=gdn_state(num_k_heads=f.integer("linear_num_key_heads"),
                        num_v_heads=f.integer("linear_num_value_heads"),
                        k_head_dim=f.integer("linear_key_head_dim"),
                        v_head_dim=f.integer("linear_value_head_dim"),
                        conv_kernel=f.integer("linear_conv_kernel_dim"), conv_dtype=dtype),
    )


def _kimi_linear(f: _Fields, name: str, dtype: str) -> ModelSpec:
    layers = f.integer("num_hidden_layers")
    lin = f.sub("linear_attn_config")
    kda, full = lin.int_list("kda_layers"), lin.int_list("full_attn_layers")
    everything = range(1, layers + 1)
    problems = []
    if overlap := sorted(set(kda) & set(full)):
        problems.append(f"in both lists: {overlap}")
    if dup := sorted({i for i in kda + full if (kda + full).count(i) > 1} - set(overlap)):
        problems.append(f"listed twice: {dup}")
    if outside := sorted(set(kda + full) - set(everything)):
        problems.append(f"outside 1..{layers}: {outside}")
    if absent := sorted(set(everything) - set(kda + full)):
        problems.append(f"in neither list: {absent}")
    if problems:
        raise f.error(
            "fields 'linear_attn_config.kda_layers' and 'linear_attn_config.full_attn_layers' "
            f"must split the 1-based layers 1..{layers} (num_hidden_layers) exactly; layers "
            + "; ".join(problems)
        )
    return ModelSpec(
        name=name, architecture=f.architecture, num_layers=layers,
        hidden_size=f.integer("hidden_size"), dtype=dtype,
        attention=MLAAttentionSpec(kv_lora_rank=f.integer("kv_lora_rank"),
                                   rope_dim=f.integer("qk_rope_head_dim"), dtype=dtype),
        attention_layers=tuple(sorted(i - 1 for i in full)),
        state=kda_state(num_heads=lin.integer("num_heads"), head_dim=lin.integer("head_dim"),
                        conv_kernel=lin.integer("short_conv_kernel_size"), conv_dtype=dtype),
    )


Builder = Callable[[_Fields, str, str], ModelSpec]

#: ``architectures[0]`` -> builder. Add an architecture by adding an entry.
BUILDERS: dict[str, Builder] = {
    "KimiLinearForCausalLM": _kimi_linear,
    "Qwen3NextForCausalLM": _qwen3_next,
    "DeepseekV3ForCausalLM": _deepseek_v3,
    "LlamaForCausalLM": _llama,
}


def _architecture(config: dict[str, Any], source: str) -> str:
    archs = config.get("architectures")
    if archs is None:
        raise HFConfigError(f"{source}: needs field 'architectures' (missing)")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise HFConfigError(
            f"{source}: field 'architectures' = {archs!r} must be a non-empty list of str"
        )
    if archs[0] not in BUILDERS:
        raise HFConfigError(
            f"{source}: unsupported architecture {archs[0]!r}; supported: "
            f"{', '.join(sorted(BUILDERS))}"
        )
    return archs[0]


def model_from_hf_dict(config: dict[str, Any], *, name: str, source: str = "<dict>") -> ModelSpec:
    """Build a ModelSpec from an already-parsed HF config dict.

    ``source`` only labels error messages (normally the file path).
    """
    if not isinstance(config, dict):
        raise HFConfigError(
            f"{source}: top level must be a JSON object, got {type(config).__name__}"
        )
    arch = _architecture(config, source)
    fields = _Fields(config, source=source, architecture=arch)
    try:
        return BUILDERS[arch](fields, name, fields.dtype())
    except HFConfigError:
        raise
    except GeometryError as exc:  # a spec rejected the values the config gave
        raise HFConfigError(
            f"{source}: architecture {arch} gives an invalid model: {exc}"
        ) from None


def _default_name(config: dict[str, Any], path: Path) -> str:
    for key in ("_name_or_path", "model_type"):
        value = config.get(key)
        if isinstance(value, str) and value:
            return value
    # ".../kimi-linear-48b/config.json" -> "kimi-linear-48b": the stem "config" names nothing.
    if path.stem == "config" and path.parent.name:
        return path.parent.name
    return path.stem


def load_hf_config(path: str | os.PathLike[str], *, name: str | None = None) -> ModelSpec:
    """Read ``config.json`` at ``path`` and build its ModelSpec.

    The name is ``name``, else the config's ``_name_or_path`` or ``model_type``, else the file
    stem (the folder's name for a file called ``config.json``).
    """
    p = Path(path)
    source = str(p)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise HFConfigError(f"{source}: cannot read config: {reason}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise HFConfigError(
            f"{source}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    if not isinstance(config, dict):
        raise HFConfigError(
            f"{source}: top level must be a JSON object, got {type(config).__name__}"
        )
    return model_from_hf_dict(config, name=name or _default_name(config, p), source=source)
