"""From a scenario to a deployment: engines, their layouts and pools, connector settings, and the
workload's requests. Shared by every driver, so a scenario means the same thing on each."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from ..connector.quirks import check_quirks
from ..connector.worker import ConnectorSettings
from ..geometry.layout import EngineLayout, build_layout
from ..geometry.presets import preset
from ..geometry.specs import GeometryError, ModelSpec
from ..scenario import Scenario
from .pool import engine_pool_blocks

__all__ = ["EngineSpec", "Deployment", "engine_model", "engine_layout", "connector_settings",
           "build_deployment"]


def engine_model(model: ModelSpec, section: object) -> ModelSpec:
    """The model an engine section runs: [model], or its own preset, with its backend and
    cache dtype overrides applied."""
    if section.preset is not None:  # type: ignore[attr-defined]
        model = preset(section.preset)  # type: ignore[attr-defined]
    attention = model.attention
    if section.attention_backend is not None:  # type: ignore[attr-defined]
        attention = dataclasses.replace(attention, backend=section.attention_backend)  # type: ignore[attr-defined]
    cache_dtype = section.cache_dtype  # type: ignore[attr-defined]
    if cache_dtype is not None:
        if attention.is_mla:
            attention = dataclasses.replace(
                attention, cache_dtype=None if cache_dtype == attention.dtype else cache_dtype)
        elif cache_dtype == "fp8_ds_mla":
            raise GeometryError("cache_dtype 'fp8_ds_mla' is only for MLA models")
        else:
            attention = dataclasses.replace(attention, dtype=cache_dtype)
    return model if attention == model.attention else dataclasses.replace(model,
                                                                          attention=attention)


def engine_block_size(engine: ModelSpec, section: object) -> int:
    """The block size an engine section asks for (None: its attention backend's smallest);
    ``engine``: the model as that engine runs it (:func:`engine_model`)."""
    return int(section.block_size  # type: ignore[attr-defined]
               or engine.attention.attention_backend.min_kernel_block)


def engine_layout(model: ModelSpec, section: object, *, num_blocks: int,
                  registration_order: str, quirks: frozenset[str]) -> EngineLayout:
    """The layout an engine section describes (block_size None = the backend's smallest)."""
    model = engine_model(model, section)
    block = engine_block_size(model, section)
    return build_layout(model, tp=section.tp, block_size=block,  # type: ignore[attr-defined]
                        num_blocks=num_blocks,
                        kv_cache_layout=section.kv_cache_layout,  # type: ignore[attr-defined]
                        registration_order=registration_order,
                        first_registration_wins="first-registration-mla-flag" in quirks)


def connector_settings(scenario: Scenario, role: str) -> ConnectorSettings:
    conn = scenario.connector
    section = getattr(scenario, role)
    return ConnectorSettings(mode=conn.mode, quirks=check_quirks(list(conn.quirks)),
                             prefix_caching=section.prefix_caching, host_buffer=conn.host_buffer,
                             enforce_handshake_compat=conn.enforce_handshake_compat,
                             descriptor_merge=conn.descriptor_merge,
                             transfer_extent=conn.transfer_extent)


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    engine_id: str
    role: str  # "prefill" | "decode"
    index: int
    layout: EngineLayout

    @property
    def tp(self) -> int:
        return self.layout.tp


@dataclass(kw_only=True)
class Deployment:
    """Everything a driver and the coordinator need to know before the run starts."""

    scenario: Scenario
    model: ModelSpec
    quirks: frozenset[str]
    engines: dict[str, list[EngineSpec]]  # role -> engines
    prompts: np.ndarray
    hits: np.ndarray
    rng: np.random.Generator  # the scenario's generator, after the workload was drawn
    settings: dict[str, ConnectorSettings] = field(default_factory=dict)  # role -> settings

    @property
    def hybrid(self) -> bool:
        return self.model.is_hybrid

    def prefill_tokens(self, prompt: int) -> int:
        """Tokens prefill computes: N-1 for models with state (§6), else N (quirk
        phantom-token: N for every model)."""
        return prompt - 1 if self.hybrid and "phantom-token" not in self.quirks else prompt

    def decode_load_tokens(self, prompt: int) -> int:
        """Prompt tokens decode loads rather than computes (§6): N-1 for a model with state
        (its state cannot take token N twice), N for a model without state, which decode
        recomputes over the same KV. Quirk phantom-token is prefill's and does not change it."""
        return prompt - 1 if self.hybrid else prompt

    def all_engines(self) -> list[EngineSpec]:
        return [e for role in ("prefill", "decode") for e in self.engines[role]]

    def engine(self, engine_id: str) -> EngineSpec:
        return next(e for e in self.all_engines() if e.engine_id == engine_id)


def build_deployment(scenario: Scenario) -> Deployment:
    """The engines a scenario describes, their layouts and pool sizes, and its requests.
    Raises ScenarioError / GeometryError for a deployment that cannot be built."""
    model = scenario.model_spec()
    quirks = check_quirks(list(scenario.connector.quirks))
    rng = np.random.default_rng(scenario.scenario.seed)
    prompts, hits = scenario.request_lengths(rng)
    conn = scenario.connector
    dep = Deployment(scenario=scenario, model=model, quirks=quirks,
                     engines={"prefill": [], "decode": []}, prompts=prompts, hits=hits, rng=rng)
    for role in ("prefill", "decode"):
        section = getattr(scenario, role)
        dep.settings[role] = connector_settings(scenario, role)
        for i in range(section.instances):
            probe = engine_layout(model, section, num_blocks=1,
                                  registration_order=conn.registration_order, quirks=quirks)
            blocks = engine_pool_blocks(scenario, role, probe, prompts,
                                        prefill_tokens=dep.prefill_tokens(int(prompts.max())))
            layout = engine_layout(model, section, num_blocks=blocks,
                                   registration_order=conn.registration_order, quirks=quirks)
            dep.engines[role].append(EngineSpec(engine_id=f"{role}{i}", role=role, index=i,
                                                layout=layout))
    return dep
