"""vLLM's own NIXL connector workers on hkvsim's simulated fabric.

From an hkvsim :class:`EngineLayout` this builds what a vLLM engine rank hands its connector: a
``VllmConfig`` (from a small Hugging Face config written for the model), a ``KVCacheConfig`` and
CPU tensors that are views into the rank's transport memory, so hkvsim's oracle writes and checks
the same bytes through its own independent views. It then runs vLLM's real pull worker
(``NixlPullConnectorWorker``): registration, the handshake (vLLM's own ``_nixl_handshake``, with
its zmq socket replaced by an in-process one and its background executor by a synchronous one),
``start_load_kv`` and ``get_finished``; the bytes move through :mod:`.agent` over the simulated
fabric.

Determinism: vLLM's agent name (a random uuid) is replaced by the transport agent's; no vLLM
thread runs (handshakes complete synchronously); vLLM's ``time.perf_counter`` reads the simulated
clock. A failure inside vLLM (an assert, an exception) becomes a rank failure naming vLLM's
file:line (:class:`VllmFailure`), never an hkvsim crash.

Push: every rank runs vLLM's push worker without its writer thread; the harness calls its
``_do_start_push_kv`` once hkvsim's coordinator has matched a registration (:meth:`start_push`).

Scope today (docs/vllm.md): each x.y.0 release of vLLM from 0.26.0 to 0.34.0, pull and
push; MLA, GQA (HND and NHD caches), and the hybrids with KDA or GDN state (handed to vLLM as a GDN
``MambaSpec`` over the shared tensors).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import logging
import os
import sys
import tempfile
import traceback
import types
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import msgpack

from ...geometry.layout import EngineLayout
from ...geometry.specs import GeometryError, MLAAttentionSpec, ModelSpec
from ...transport.base import Memory
from .agent import TransportNixlAgent

__all__ = ["VllmUnavailable", "VllmFailure", "SUPPORTED_VERSIONS", "releases_between",
           "load_vllm", "vllm_version", "release_transfer_extent", "VllmRank", "VllmHarness",
           "unsupported"]

log = logging.getLogger("hkvsim.vllm")

# the versions this harness drives, oldest first
SUPPORTED_VERSIONS = ("0.26.0", "0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0",
                      "0.33.0", "0.34.0")
PROVISION_HINT = "scripts/with-vllm 0.34.0 hkvsim run FILE"
_CONV_LAYOUT = "VLLM_SSM_CONV_STATE_LAYOUT"  # vLLM's SSM conv state layout: hkvsim's is "DS"
# Releases whose model runner hands a GQA cache over as (blocks, tokens, heads, K|V) whatever
# its physical layout (their receive-side block-size post-processing permutes to "physical
# order" first); from 0.32.0 on the dims follow the layout. (Layout *names* changed earlier,
# at 0.29.0: legacy_layout_names.)
_TOKENS_FIRST_DIMS = frozenset({"0.26.0", "0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0"})
# what each release moves per request, as hkvsim's core transfer_extent names it (docs/vllm.md,
# "vLLM 0.34.0"): 0.34.0 moves no state over shared tensors no layer of the slot's group holds,
# and stops a pull between engines of different block sizes at the last computed token
_TRANSFER_EXTENT = {"0.34.0": "needed"}
_NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
_CLOCK_MODULES = ("base_worker", "pull_worker", "push_worker", "base_scheduler",
                  "pull_scheduler", "push_scheduler")


def release_transfer_extent(version: str) -> str:
    """The core's transfer_extent that moves what vLLM ``version`` moves ("allocated" for the
    releases before 0.34.0)."""
    return _TRANSFER_EXTENT.get(version, "allocated")


class VllmUnavailable(RuntimeError):
    """vLLM cannot be imported here (not provisioned)."""


@dataclass(frozen=True)
class VllmFailure(Exception):
    """Something inside vLLM failed: ``where`` is vLLM's file:line, ``what`` the error."""

    where: str
    what: str
    kind: str = "vllm_failure"

    def __str__(self) -> str:
        return f"vLLM failed at {self.where}: {self.what}"


def _vllm_root() -> str | None:
    """The directory holding the imported vllm package's parent (frames under it are vLLM's)."""
    mod = sys.modules.get("vllm")
    path = getattr(mod, "__file__", None)
    return os.path.dirname(os.path.dirname(os.path.abspath(path))) if path else None


def vllm_failure(exc: BaseException) -> VllmFailure:
    """Name the innermost frame of vLLM's own code in ``exc``'s traceback (file:line relative
    to vLLM's installation, e.g. ``vllm/distributed/.../base_worker.py:3791``)."""
    root = _vllm_root()
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if root is not None and os.path.abspath(f.filename).startswith(
                  os.path.join(root, "vllm") + os.sep)]
    where = "?"
    if frames:
        rel = os.path.relpath(os.path.abspath(frames[-1].filename), root)
        where = f"{rel.replace(os.sep, '/')}:{frames[-1].lineno}"
    # the first lines (a pydantic error's first line only counts the errors; the next ones say
    # which field and why), joined onto one line
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = " / ".join(lines[:4])[:400]
    if isinstance(exc, AssertionError):
        line = (frames[-1].line or "").strip() if frames else ""
        what = line if line.startswith("assert") else "AssertionError"
        if text:
            what += f" ({text})"
        return VllmFailure(where=where, what=what)
    return VllmFailure(where=where, what=f"{type(exc).__name__}: {text}")


def load_vllm() -> str:
    """Import vLLM's connector package; returns the vLLM version. Raises VllmUnavailable with
    the provisioning command when vLLM is not importable."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # state pages in hkvsim are DS (channel-first conv), the layout vLLM's connector requires
    os.environ.setdefault(_CONV_LAYOUT, "DS")
    # vLLM's own logging setup writes INFO lines to stdout (0.26), which would corrupt --json:
    # leave its loggers to Python's defaults (warnings and errors on stderr)
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    try:
        import importlib

        vllm = importlib.import_module("vllm")
        importlib.import_module(f"{_NIXL}.pull_worker")
    except ImportError as exc:
        raise VllmUnavailable(f"implementation 'vllm' needs vLLM, which is not importable here "
                              f"({exc}); run it with: {PROVISION_HINT}") from None
    return str(vllm.__version__)


def vllm_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("vllm")
    except Exception:
        return None


def releases_between(first: str, last: str = SUPPORTED_VERSIONS[-1]) -> frozenset[str]:
    """The driven releases from ``first`` to ``last``, both included (ValueError for a release
    not driven)."""
    return frozenset(SUPPORTED_VERSIONS[SUPPORTED_VERSIONS.index(first):
                                        SUPPORTED_VERSIONS.index(last) + 1])


def _not_driven(version: str) -> str:
    return (f"vLLM {version} is not driven by this harness yet (runnable: "
            f"{', '.join(SUPPORTED_VERSIONS)})")


def unsupported(model: ModelSpec, mode: str, version: str) -> str | None:
    """Why this harness cannot run ``model`` in ``mode`` on ``version`` yet, or None."""
    if version not in SUPPORTED_VERSIONS:
        return _not_driven(version)
    if mode not in ("pull", "push"):
        return f"mode {mode!r} is not driven with implementation 'vllm' (allowed: pull, push)"
    if model.state is not None and model.state.kind not in _STATE_KINDS:
        return (f"state kind {model.state.kind!r} of model {model.name!r} is not driven yet with "
                f"implementation 'vllm' (allowed: {', '.join(sorted(_STATE_KINDS))}, e.g. "
                f"tiny-kimi-linear, tiny-qwen3-next)")
    return None


# hkvsim state kinds this harness hands vLLM as a MambaSpec, and the mamba type it names: KDA is
# GDN with Q = K = V columns and square (d, d) recurrent heads, so vLLM's GDN conv split (Q|K|V,
# dim(Q) == dim(K)) and its (heads, dv, dk) temporal state describe hkvsim's KDA page exactly
_STATE_KINDS = {"gdn": "GDN_ATTN", "kda": "GDN_ATTN"}


# ---- the simulated clock and in-process handshakes ------------------------------------------
class _Clock(types.ModuleType):
    """A stand-in for the ``time`` module inside vLLM's connector: ``perf_counter`` (and
    ``time``/``monotonic``) read the simulated clock; everything else is the real module."""

    def __init__(self, now: Callable[[], float]) -> None:
        super().__init__("time")
        import time as real

        self._real, self._now = real, now

    def perf_counter(self) -> float:
        return float(self._now())

    monotonic = time = perf_counter

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _NoThread:
    """Stands in for vLLM's push writer thread, which the harness never starts."""

    def is_alive(self) -> bool:
        return False

    def join(self, *args: Any, **kw: Any) -> None:
        return None


class _SyncExecutor:
    """Runs a submitted handshake at once, so its callbacks fire in a fixed order."""

    def submit(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args, **kw))
        except BaseException as exc:  # recorded on the future, as a thread pool would
            fut.set_exception(exc)
        return fut

    def shutdown(self, *args: Any, **kw: Any) -> None:
        return None


class _HandshakeSocket:
    """The REQ socket vLLM's ``_nixl_handshake`` opens, answered in process (the role of vLLM's
    zmq listener) from the handshake payloads hkvsim's coordinator delivered for the engine at
    that address (:meth:`VllmHarness.deliver_handshake`): the bytes vLLM's listener on that
    rank would send. The same on both backends: on the simulated fabric the peer is in this
    process, with ``--backend nixl`` in another one; either way its payload came through the
    coordinator (msgpack, never pickle). The clock sample is this rank's own (the ranks of a
    run share one time origin)."""

    def __init__(self, harness: "VllmHarness", path: str) -> None:
        self.harness, self.path, self._reply = harness, path, None

    def setsockopt(self, *args: Any) -> None:
        return None

    def send(self, msg: bytes) -> None:
        import msgspec

        _tag, _pp_rank, tp_rank = msgspec.msgpack.decode(msg)
        payload = self.harness.peer_payload(self.path, int(tp_rank))
        self._reply = [payload, msgspec.msgpack.encode(self.harness.now())]

    def recv_multipart(self) -> list[bytes]:
        reply, self._reply = self._reply, None
        assert reply is not None
        return reply


# ---- one vLLM engine rank -------------------------------------------------------------------
_HF_DIR: dict[str, str] = {}


def _hf_config_dir(model: ModelSpec) -> str:
    """A directory holding a Hugging Face config.json vLLM's ModelConfig accepts for ``model``
    (cache-relevant fields from the spec; the rest small and fixed)."""
    attn = model.attention
    if not isinstance(attn, MLAAttentionSpec):
        cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
               "hidden_size": model.hidden_size, "num_hidden_layers": model.num_layers,
               "num_attention_heads": 2 * attn.num_kv_heads, "num_key_value_heads":
               attn.num_kv_heads, "head_dim": attn.head_dim, "intermediate_size": 512,
               "vocab_size": 1024, "max_position_embeddings": 1 << 16,
               "torch_dtype": _model_dtype(attn)}
        return _write_config(cfg)
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
           "hidden_size": model.hidden_size, "num_hidden_layers": model.num_layers,
           "num_attention_heads": 8, "num_key_value_heads": 8, "kv_lora_rank": attn.kv_lora_rank,
           "qk_rope_head_dim": attn.rope_dim, "qk_nope_head_dim": 32, "v_head_dim": 32,
           "q_lora_rank": None, "intermediate_size": 512, "moe_intermediate_size": 64,
           "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
           "first_k_dense_replace": model.num_layers, "vocab_size": 1024,
           "max_position_embeddings": 1 << 16, "torch_dtype": _model_dtype(attn), "n_group": 1,
           "topk_group": 1}
    return _write_config(cfg)


def _write_config(cfg: dict[str, Any]) -> str:
    """The directory of a config.json holding ``cfg``. Its path is a function of the content
    (vLLM's compatibility hash includes the model path, so the rank processes of a
    ``--backend nixl`` run must name the same model the same way), under a directory of this
    user's (created 0700; refused if it is someone else's or a link)."""
    import hashlib
    import stat

    text = json.dumps(cfg, sort_keys=True)
    if text not in _HF_DIR:
        base = os.path.join(tempfile.gettempdir(), f"hkvsim-vllm-models-{os.getuid()}")
        os.makedirs(base, mode=0o700, exist_ok=True)
        st = os.lstat(base)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise RuntimeError(f"{base}: not a directory of this user's that only it can write")
        d = os.path.join(base, hashlib.sha256(text.encode()).hexdigest()[:16])
        os.makedirs(d, mode=0o700, exist_ok=True)
        path = os.path.join(d, "config.json")
        if not os.path.isfile(path):  # written once; concurrent writers write the same bytes
            fd, tmp = tempfile.mkstemp(dir=d, prefix=".config-")
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        _HF_DIR[text] = d
    return _HF_DIR[text]


@functools.cache
def _params(cls: Any) -> frozenset[str]:
    """The parameter names a vLLM class takes (its fields changed between releases); read
    once per class (start_load asks on every request)."""
    import inspect

    return frozenset(inspect.signature(cls).parameters)


def _mamba_cache_is_tuple() -> bool:
    """vLLM 0.26 hands the connector each state layer's cache as a (conv, ssm) pair of views;
    later releases (0.27 on) one view. Detected from the connector's own unpacking."""
    import importlib
    import inspect

    utils = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.utils")
    for cls in vars(utils).values():
        method = getattr(cls, "get_transfer_cache_regions", None) if isinstance(cls, type) else None
        if method is not None and "conv, ssm = cache" in inspect.getsource(method):
            return True
    return False


def _torch_dtype(name: str) -> Any:
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
            "fp8": torch.uint8, "fp8_e4m3": torch.uint8, "fp8_ds_mla": torch.uint8}[name]


def _model_dtype(attn: Any) -> str:
    """The dtype of vLLM's ModelConfig: the cache's when it is a 16-bit float (vLLM's
    ``cache_dtype = "auto"`` then follows it), else (fp8 caches) bfloat16."""
    cache = attn.stored_dtype
    return cache if cache in ("bfloat16", "float16", "float32") else "bfloat16"


def _cache_dtype(attn: Any) -> str:
    """vLLM's ``cache_dtype``: "auto" (the model's dtype), "fp8" or "fp8_ds_mla"."""
    cache = attn.stored_dtype
    return cache if cache in ("fp8", "fp8_ds_mla") else "auto"


class VllmRank:
    """One rank of one engine: vLLM's pull worker over this rank's transport memory."""

    def __init__(self, harness: "VllmHarness", engine_id: str, layout: EngineLayout, rank: int,
                 transport: Any, memory: Memory, role: str) -> None:
        self.harness, self.engine_id, self.layout, self.rank = harness, engine_id, layout, rank
        self.transport, self.memory, self.role = transport, memory, role
        self.agent = TransportNixlAgent(transport, [memory])
        self.expected: set[str] = set()  # requests this prefill rank's vLLM worker tracks
        self.worker = harness.build_worker(self)

    def handshake_payload(self) -> bytes:
        """What vLLM's handshake listener answers for this rank (its ``NixlHandshakePayload``,
        msgpack-encoded as vLLM sends it): published through hkvsim's coordinator."""
        import msgspec

        payload = self.worker.xfer_handshake_metadata
        if payload is None:
            raise VllmFailure(where="register_kv_caches",
                              what="vLLM set no handshake metadata after registering the caches")
        return bytes(msgspec.msgpack.encode(payload))

    def layer_name(self, layer: int) -> str:
        return f"model.layers.{layer}.self_attn.attn"

    def kv_caches(self) -> dict[str, Any]:
        """Per-layer tensors viewing this rank's memory exactly where hkvsim's layout puts them."""
        import torch

        layout = self.layout
        attn = layout.model.attention
        mla = isinstance(attn, MLAAttentionSpec)
        dtype = _torch_dtype(attn.stored_dtype)
        caches = {}
        state_layers = set(layout.model.state_layers)
        for region in layout.regions:
            raw = self.memory.array[region.tensor_offset:region.tensor_offset
                                    + region.tensor_bytes]
            for layer in (lay for lay in region.layers if lay in state_layers):
                caches[self.layer_name(layer)] = self.state_view(torch.from_numpy(raw))
            t = torch.from_numpy(raw).view(dtype)
            if mla:  # (blocks, tokens, latent + rope)
                shape = (layout.num_kernel_blocks, layout.kernel_block_size,
                         attn.bytes_per_token(1) // t.element_size())
            else:  # hkvsim HND = vLLM HND / LBHNC, NHD = NHD / LBNHC: K|V packed per token
                heads, tokens = attn.heads_per_rank(layout.tp), layout.kernel_block_size
                heads_first = layout.kv_cache_layout == "HND"
                shape = ((layout.num_kernel_blocks, heads, tokens, 2 * attn.head_dim) if heads_first
                         else (layout.num_kernel_blocks, tokens, heads, 2 * attn.head_dim))
            for layer in region.layers:
                if layer not in state_layers:
                    view = t.view(*shape)
                    caches[self.layer_name(layer)] = (view if mla else self._logical_kv(view))
        # handed over in the layout's registration order (releases that walk the dict register
        # in this order; later ones sort the names themselves)
        order = [self.layer_name(layer) for layer in layout.registration_order]
        return {name: caches[name] for name in order if name in caches}

    def _logical_kv(self, physical: Any) -> Any:
        """The GQA cache tensor as vLLM's model runner hands it over: the bytes in the layout's
        physical order, the dims in the order the release expects ((blocks, tokens, heads, K|V)
        whatever the layout up to 0.31.0, (blocks, heads, tokens, K|V) from 0.32.0:
        ``_TOKENS_FIRST_DIMS``). vLLM's receive-side post-processing (block-size ratio) permutes
        through these dims."""
        heads_first = self.layout.kv_cache_layout == "HND"
        if self.harness.version in _TOKENS_FIRST_DIMS:
            return physical.permute(0, 2, 1, 3) if heads_first else physical
        return physical if heads_first else physical.permute(0, 2, 1, 3)

    def state_view(self, raw: Any) -> Any:
        """A state layer's conv view over a shared tensor, as vLLM's model runner makes it: DS
        conv state (blocks, conv columns, rows) at the start of each logical page (the
        recurrent state follows it in the page; vLLM's connector reads the MambaSpec for it)."""
        import torch

        layout = self.layout
        state = layout.model.state
        assert state is not None
        t = raw.view(_torch_dtype(state.conv_dtype))
        cols = sum(state.conv_columns_per_rank(layout.tp))
        el = t.element_size()
        conv = torch.as_strided(t, (layout.num_logical_blocks, cols, state.conv_rows),
                                (layout.unified_page_bytes // el, state.conv_rows, 1))
        if not _mamba_cache_is_tuple():
            return conv
        # 0.26: a state layer's cache is the (conv, ssm) pair of views
        s = raw[state.conv_bytes(layout.tp):].view(_torch_dtype(state.recurrent_dtype))
        heads = state.recurrent_heads // layout.tp
        shape = (layout.num_logical_blocks, heads, *state.recurrent_head_shape)
        el = s.element_size()
        strides = [layout.unified_page_bytes // el]
        inner = [1]
        for dim in reversed((heads, *state.recurrent_head_shape)[1:]):
            inner.insert(0, inner[0] * dim)
        ssm = torch.as_strided(s, shape, tuple(strides + inner))
        return (conv, ssm)


class VllmHarness:
    """The vLLM ranks of one process (every rank of the run on the simulated fabric, one rank
    per process with ``--backend nixl``); ``now`` reads the run's clock. Peers are known only
    by the handshake payloads the coordinator delivers (:meth:`deliver_handshake`)."""

    def __init__(self, now: Callable[[], float]) -> None:
        self.version = load_vllm()
        if self.version not in SUPPORTED_VERSIONS:
            raise VllmUnavailable(f"vLLM {self.version} is importable, but "
                                  f"{_not_driven(self.version)}")
        # how the release names cache layouts and orders a GQA cache's dims (read from vLLM)
        self.legacy_layouts = legacy_layout_names()
        self.now = now
        self.mode = "pull"  # or "push": which of vLLM's workers every rank runs
        # per role: whether that engine runs with its prefix cache on (its vLLM CacheConfig)
        self.prefix_caching: dict[str, bool] = {}
        self.source: str | None = None  # the scenario file, for error lines
        self.engines: dict[str, dict[int, VllmRank]] = {}  # the ranks built in this process
        self.peers: dict[str, dict[int, bytes]] = {}  # handshake payloads, per engine and rank
        self._building: VllmRank | None = None
        self._patch()

    # ---- patches: where vLLM meets hkvsim --------------------------------------------------
    def _patch(self) -> None:
        """Point vLLM's connector modules at this harness (patched once per process; the
        patches consult the active harness, so a later harness replaces an earlier one)."""
        global _ACTIVE
        if _ACTIVE is not None and _ACTIVE is not self:
            # a harness driven directly (not through a run) is released when the next one
            # starts, so its workers end here and not inside the next run's collections
            _ACTIVE.release()
        _ACTIVE = self
        if _PATCHED:
            return
        _install_patches()

    def deliver_handshake(self, engine_id: str, payloads: dict[int, bytes]) -> None:
        """The handshake payloads of every rank of ``engine_id``, as the coordinator delivered
        them: vLLM's handshake with that engine is answered from these."""
        self.peers[engine_id] = {int(r): bytes(p) for r, p in payloads.items()}

    def remote_tp(self, engine_id: str) -> int:
        """The TP size of a peer engine (its number of delivered payloads)."""
        if engine_id not in self.peers:
            raise VllmFailure(where="harness", what=f"no handshake payloads delivered for engine "
                                                    f"{engine_id!r} (connect first)")
        return len(self.peers[engine_id])

    def peer_payload(self, path: str, tp_rank: int) -> bytes:
        host = path.split("://", 1)[-1].rsplit(":", 1)[0]
        payloads = self.peers.get(host)
        if payloads is None or tp_rank not in payloads:
            raise ConnectionError(f"no handshake payload delivered for {host} rank {tp_rank}")
        return payloads[tp_rank]

    # ---- building engines ------------------------------------------------------------------
    def vllm_config(self, rank: VllmRank) -> Any:
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            ParallelConfig,
            SchedulerConfig,
            VllmConfig,
        )

        layout = rank.layout
        attn = layout.model.attention
        model = ModelConfig(model=_hf_config_dir(layout.model), dtype=_model_dtype(attn),
                            seed=0, skip_tokenizer_init=True, max_model_len=1 << 14)
        cache = CacheConfig(block_size=layout.logical_block_size, enable_prefix_caching=False,
                            cache_dtype=_cache_dtype(attn))
        # per layer: (blocks, heads, tokens, K|V) for HND, (blocks, tokens, heads, K|V) for NHD
        cache.kv_cache_layout = vllm_layout_name(layout, self.legacy_layouts)
        kv = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both",
                              kv_buffer_device="cuda",
                              kv_connector_extra_config={"enforce_handshake_compat": True})
        conv_layout = os.environ.get(_CONV_LAYOUT)
        with _cpu_platform_without_triton_check():
            config = VllmConfig(model_config=model, cache_config=cache, kv_transfer_config=kv,
                                parallel_config=ParallelConfig(tensor_parallel_size=layout.tp),
                                scheduler_config=SchedulerConfig(max_model_len=1 << 14,
                                                                 is_encoder_decoder=False,
                                                                 max_num_batched_tokens=1 << 14),
                                device_config=DeviceConfig("cpu"))
        if conv_layout is not None:
            # vLLM 0.28.0 to 0.30.0's CPU platform sets SD conv state on an AVX-512 BF16 CPU
            # for its own kernels, over the DS layout that the GPU engine this stands for uses
            # (vLLM's NIXL connector asserts it; hkvsim's state pages are DS): put it back
            os.environ[_CONV_LAYOUT] = conv_layout
        # vLLM's CPU platform rewrites the block size for its own attention backend; the engine
        # this stands for runs the GPU backend the layout names
        config.cache_config.block_size = layout.logical_block_size
        # the engine's prefix cache as the scenario sets it (set after the config is built,
        # which may turn it off for the CPU platform or the stand-in model): vLLM's handshake
        # rule for hybrid models with different ppl (hkvsim's V4) reads it
        config.cache_config.enable_prefix_caching = self.prefix_caching.get(rank.role, False)
        if layout.is_hybrid:
            # a hybrid model runs with vLLM's hybrid KV-cache manager (the config derived here
            # from a stand-in HF model without state layers may have turned it off)
            config.scheduler_config.disable_hybrid_kv_cache_manager = False
        return config

    def kv_cache_config(self, rank: VllmRank) -> Any:
        from vllm.v1.kv_cache_interface import (
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
            MLAAttentionSpec as VllmMLASpec,
        )

        from vllm.v1.kv_cache_interface import FullAttentionSpec

        layout = rank.layout
        attn = layout.model.attention
        dtype = _torch_dtype(attn.stored_dtype)
        if isinstance(attn, MLAAttentionSpec):
            spec = VllmMLASpec(block_size=layout.logical_block_size, num_kv_heads=1,
                               head_size=attn.kv_lora_rank + attn.rope_dim, dtype=dtype,
                               cache_dtype_str=attn.cache_dtype or "auto")
        else:
            spec = FullAttentionSpec(block_size=layout.logical_block_size,
                                     num_kv_heads=attn.heads_per_rank(layout.tp),
                                     head_size=attn.head_dim, dtype=dtype)
        groups = []
        for g in layout.groups:
            names = [rank.layer_name(layer) for layer in g.layers]
            groups.append(KVCacheGroupSpec(names, spec if g.kind == "attention"
                                           else self.mamba_spec(layout)))
        fields = _params(KVCacheTensor)
        tensors = []
        for r in layout.regions:
            names_r = [rank.layer_name(lay) for lay in r.layers]
            if "layers" in fields:  # >= 0.27
                tensors.append(KVCacheTensor(size=r.tensor_bytes, layers=names_r,
                                             layer_stride=r.tensor_bytes,
                                             block_stride=layout.unified_page_bytes))
            else:  # 0.26: shared_by
                tensors.append(KVCacheTensor(size=r.tensor_bytes, shared_by=names_r))
        return KVCacheConfig(num_blocks=layout.num_logical_blocks, kv_cache_tensors=tensors,
                             kv_cache_groups=groups)

    def mamba_spec(self, layout: EngineLayout) -> Any:
        """vLLM's MambaSpec for the model's state layers on this rank: shapes (DS conv (columns,
        rows), recurrent (heads, *head shape)), padded to the unified page."""
        from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
        from vllm.v1.kv_cache_interface import MambaSpec

        state = layout.model.state
        assert state is not None
        shapes = ((sum(state.conv_columns_per_rank(layout.tp)), state.conv_rows),
                  (state.recurrent_heads // layout.tp, *state.recurrent_head_shape))
        extra: dict[str, Any] = {}
        fields = _params(MambaSpec)
        if "mamba_type" in fields:
            extra["mamba_type"] = getattr(MambaAttentionBackendEnum, _STATE_KINDS[state.kind])
        return MambaSpec(block_size=layout.logical_block_size, shapes=shapes,
                         dtypes=(_torch_dtype(state.conv_dtype),
                                 _torch_dtype(state.recurrent_dtype)),
                         page_size_padded=layout.unified_page_bytes, **extra)

    def build_worker(self, rank: VllmRank) -> Any:
        import importlib

        from vllm.config import set_current_vllm_config

        if self.mode == "push":
            cls = importlib.import_module(f"{_NIXL}.push_worker").NixlPushConnectorWorker
        else:
            cls = importlib.import_module(f"{_NIXL}.pull_worker").NixlPullConnectorWorker
        self._building = rank
        try:
            _override_layout(vllm_layout_name(rank.layout, self.legacy_layouts))
            config = self.vllm_config(rank)
            with set_current_vllm_config(config):
                worker = cls(config, rank.engine_id, self.kv_cache_config(rank))
            worker._handshake_initiation_executor.shutdown(wait=False)
            worker._handshake_initiation_executor = _SyncExecutor()
            if self.mode == "push":  # no writer thread: the harness posts the WRITEs itself
                worker._push_writer_thread = _NoThread()
            worker.register_kv_caches(rank.kv_caches())
            # the caches are host memory: 0.26 builds its post-processing indices on the
            # platform's device type (cuda here), which CPU-only torch cannot
            worker.device_type = "cpu"
        except Exception as exc:
            raise vllm_failure(exc) from exc
        finally:
            self._building = None
        return worker

    def add_rank(self, engine_id: str, layout: EngineLayout, rank: int, transport: Any,
                 memory: Memory, role: str) -> VllmRank:
        """Build rank ``rank`` of ``engine_id`` in this process."""
        ranks = self.engines.setdefault(engine_id, {})
        if rank in ranks or not 0 <= rank < layout.tp:
            raise ValueError(f"{engine_id}: rank {rank} already built or not in TP {layout.tp}")
        vrank = VllmRank(self, engine_id, layout, rank, transport, memory, role)
        ranks[rank] = vrank
        return vrank

    # ---- pulls ----------------------------------------------------------------------------
    def start_load(self, rank: VllmRank, request_id: str, prefill_request_id: str,
                   prefill: str, local: tuple[list[int], ...], remote: tuple[list[int], ...],
                   prefill_tokens: int | None = None) -> VllmFailure | None:
        """vLLM's ``start_load_kv`` on one decode rank for one request (block ids per group).
        ``prefill_tokens``: the tokens prefill computed, which vLLM's proxy forwards from
        prefill's ``kv_transfer_params`` as ``remote_num_tokens`` (0.34 pairs blocks of
        different sizes by the last token and declines the read without it)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
            NixlConnectorMetadata,
            RemoteMeta,
            ReqMeta,
        )

        try:
            prefill_tp = self.remote_tp(prefill)
        except VllmFailure as failure:
            return failure
        meta = NixlConnectorMetadata()
        extra = {"awaiting_kvs": True} if "awaiting_kvs" in _params(ReqMeta) else {}  # >= 0.27
        remote_extra = ({"num_tokens": prefill_tokens}
                        if prefill_tokens is not None and "num_tokens" in _params(RemoteMeta)
                        else {})  # >= 0.33
        meta.reqs_to_recv[request_id] = ReqMeta(
            local_block_ids=local, local_physical_block_ids=local,
            tp_size=prefill_tp, **extra,
            remote=RemoteMeta(block_ids=remote, host=prefill, port=5600, engine_id=prefill,
                              request_id=prefill_request_id, **remote_extra))
        meta.reqs_in_batch.add(request_id)
        try:
            rank.worker.start_load_kv(meta)
        except Exception as exc:
            return vllm_failure(exc)
        return None

    def expect_send(self, rank: VllmRank, request_id: str) -> None:
        """Tell a prefill rank's vLLM worker that ``request_id``'s blocks wait to be read (what
        vLLM's scheduler does when prefill finishes), once, before vLLM reads the request's
        first notification. The lease stays the coordinator's: vLLM's is set far out."""
        if request_id in rank.expected:
            return
        rank.expected.add(request_id)
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
            NixlConnectorMetadata,
        )

        meta = NixlConnectorMetadata()
        meta.reqs_in_batch.add(request_id)
        meta.reqs_to_send[request_id] = self.now() + 1e9
        if hasattr(meta, "scheduler_clock"):
            meta.scheduler_clock = self.now()
        try:
            rank.worker.start_load_kv(meta)
        except Exception as exc:
            log.warning("vLLM refused to track %s on %s.%d: %s", request_id, rank.engine_id,
                        rank.rank, vllm_failure(exc))

    def start_push(self, rank: VllmRank, prefill_request_id: str, decode: str,
                   decode_request_id: str, local: tuple[list[int], ...],
                   remote: tuple[list[int], ...]) -> VllmFailure | None:
        """Push: vLLM's prefill worker WRITEs ``prefill_request_id``'s blocks into decode's
        registered blocks (what its writer thread does once a decode registration matches the
        finished request: ``_do_start_push_kv``). The registration protocol between the
        engines stays hkvsim's coordinator's."""
        self.expect_send(rank, prefill_request_id)
        try:
            decode_tp = self.remote_tp(decode)
        except VllmFailure as failure:
            return failure
        registration = {"request_id": decode_request_id, "decode_engine_id": decode,
                        "decode_host": decode, "decode_port": 5600,
                        "decode_tp_size": decode_tp,
                        "local_block_ids": remote}
        try:
            rank.worker._do_start_push_kv(prefill_request_id, local, registration)
        except Exception as exc:
            return vllm_failure(exc)
        return None

    def shutdown_rank(self, rank: VllmRank) -> None:
        """vLLM's shutdown of one rank's worker, once: a failure is logged (what the worker
        leaves behind is the run's after-shutdown leak). vLLM's ``__del__`` shuts the worker down
        again, and a shutdown that failed here (releasing a handle still in flight) fails there
        too, at whatever moment a collection finds the worker, inside unrelated work; after this
        call the worker's own ``shutdown`` does nothing, so its finalizer has nothing left to do."""
        worker = rank.worker
        if getattr(worker, "shutdown", None) is _shut_down:
            return
        try:
            worker.shutdown()
        except Exception as exc:
            log.warning("vLLM's shutdown of %s.%d failed: %s", rank.engine_id, rank.rank,
                        vllm_failure(exc))
        finally:
            worker.shutdown = _shut_down  # an instance attribute: what __del__ calls

    def release(self) -> None:
        """Shut down every worker this harness built that is not shut down yet (each once,
        :meth:`shutdown_rank`), drop them, and hold the clock at its current reading (the
        run's clock would keep the run alive)."""
        for ranks in self.engines.values():
            for r in ranks.values():
                self.shutdown_rank(r)
        ended = float(self.now())
        self.now = lambda: ended
        self.engines.clear()
        self._building = None


def _shut_down() -> None:
    """A vLLM worker's ``shutdown`` once the harness has shut it down (``shutdown_rank``)."""
    return None


_ACTIVE: "VllmHarness | None" = None
_PATCHED: list[bool] = []


def release_workers() -> None:
    """A run is over: the active harness releases its vLLM workers (each shut down once,
    ``VllmHarness.release``) and their garbage is collected now, inside the run that made them,
    and not at whatever moment a later collection finds them: vLLM's ``__del__`` used to shut a
    worker down a second time, releasing handles still in flight, and CPython 3.11 failed an
    unrelated ``ast.parse`` with "AST constructor recursion depth mismatch" when that finalizer
    raised in the middle of it (seen at pytest's session end under vLLM 0.26.0)."""
    if _ACTIVE is not None:
        _ACTIVE.release()
    gc.collect()


def _active() -> "VllmHarness":
    assert _ACTIVE is not None
    return _ACTIVE


def _building() -> VllmRank:
    rank = _active()._building
    assert rank is not None, "vLLM constructed a NIXL agent outside the harness"
    return rank


def _backend(model: ModelSpec) -> Any:
    """vLLM's attention backend class for the model's backend (its kernel block sizes and name
    feed the compatibility hash and the block-size logic)."""
    if isinstance(model.attention, MLAAttentionSpec):
        from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend

        return FlashMLABackend
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    return FlashAttentionBackend


def _install_patches() -> None:
    import importlib

    bw = importlib.import_module(f"{_NIXL}.base_worker")
    clock = _Clock(lambda: _active().now())
    for name in _CLOCK_MODULES:
        with contextlib.suppress(ImportError):
            mod = importlib.import_module(f"{_NIXL}.{name}")
            if getattr(mod, "time", None) is not None:
                mod.time = clock

    @contextlib.contextmanager
    def zmq_ctx(_socket_type: Any, path: str) -> Iterator[_HandshakeSocket]:
        yield _HandshakeSocket(_active(), path)

    bw.NixlWrapper = lambda _name, _config=None: _building().agent
    bw.nixl_agent_config = None
    bw.check_nixl_version = lambda *_a, **_k: None
    bw.zmq_ctx = zmq_ctx
    bw.get_tensor_model_parallel_rank = lambda: _building().rank
    bw.get_tensor_model_parallel_world_size = lambda: _building().layout.tp
    bw.get_current_attn_backends = lambda *_a, **_k: [_backend(_building().layout.model)]
    bw.get_current_attn_backends_and_specs = (
        lambda _c, _k, fallback: (fallback, [None] * len(fallback)))
    bw.current_platform = _Platform(bw.current_platform)
    # the caches are host memory: host-to-"device" index copies need no pinned buffer (0.27's
    # receive post-processing pins one, which CPU-only torch cannot)
    with contextlib.suppress(ImportError):
        torch_utils = importlib.import_module("vllm.utils.torch_utils")
        if hasattr(torch_utils, "PIN_MEMORY"):
            torch_utils.PIN_MEMORY = False
    # the kernel block is the one hkvsim's layout names (vLLM would pick the largest size its
    # backend supports that divides the logical block: for flash-attn hybrids the whole logical
    # block, where hkvsim keeps the requested one; docs/vllm.md)
    if hasattr(bw, "select_common_block_size"):
        bw.select_common_block_size = lambda *_a, **_k: _building().layout.kernel_block_size
    _PATCHED.append(True)


@contextlib.contextmanager
def _cpu_platform_without_triton_check() -> Iterator[None]:
    """vLLM 0.34 refuses to configure an engine on an x86 CPU without Triton (its CPU model
    runner needs triton-cpu). The engine built here stands for a GPU engine and runs no model,
    so the check does not apply: while the config is built, vLLM reads Triton as present. The
    flag is restored afterwards, and Triton itself is never imported: the package that would
    import it (``vllm.triton_utils``) is imported here first, with the flag as it really is."""
    import importlib

    try:
        importing = importlib.import_module("vllm.triton_utils.importing")
        package = importlib.import_module("vllm.triton_utils")
    except ImportError:  # releases without the check
        yield
        return
    saved = (importing.HAS_TRITON, package.HAS_TRITON)
    importing.HAS_TRITON = package.HAS_TRITON = True
    try:
        yield
    finally:
        importing.HAS_TRITON, package.HAS_TRITON = saved


def legacy_layout_names() -> bool:
    """Whether the installed vLLM names cache layouts ``NHD`` / ``HND`` and reads them from a
    process-wide override (0.26.0 to 0.28.0: ``_KV_CACHE_LAYOUT_OVERRIDE`` in
    ``vllm.v1.attention.backends.utils``) rather than ``LBNHC`` / ``LBHNC`` from the cache config
    (0.29.0 on). Read from vLLM itself rather than from a table of releases."""
    import importlib

    utils = importlib.import_module("vllm.v1.attention.backends.utils")
    return hasattr(utils, "_KV_CACHE_LAYOUT_OVERRIDE")


def vllm_layout_name(layout: EngineLayout, legacy: bool) -> str:
    """The name vLLM gives the caches built for ``layout``: hkvsim's HND block (heads, tokens,
    K|V) is vLLM's HND (``legacy``: :func:`legacy_layout_names`) or LBHNC; hkvsim's NHD block
    (tokens, heads, K|V) is NHD / LBNHC. MLA caches are named NHD / LBNHC (vLLM ignores it)."""
    heads_first = (not layout.model.attention.is_mla and layout.kv_cache_layout == "HND")
    if legacy:
        return "HND" if heads_first else "NHD"
    return "LBHNC" if heads_first else "LBNHC"


def _override_layout(name: str) -> None:
    """Releases with legacy layout names (0.26.0 to 0.28.0): the worker reads the layout from
    ``get_kv_cache_layout()`` (a process-wide override), not from the cache config: set it for
    the rank being built."""
    import importlib

    with contextlib.suppress(ImportError):
        utils = importlib.import_module("vllm.v1.attention.backends.utils")
        if hasattr(utils, "_KV_CACHE_LAYOUT_OVERRIDE") and name in ("HND", "NHD"):
            utils._KV_CACHE_LAYOUT_OVERRIDE = name
            clear = getattr(utils.get_kv_cache_layout, "cache_clear", None)
            if clear is not None:  # it is memoized: a value read before now must not stick
                clear()


class _Platform:
    """vLLM's current platform as the connector worker must see it here: a CUDA-like device
    type (vLLM's CPU platform pins the process to one core per NUMA node in the worker), not
    ROCm, device selection a no-op, and NIXL memory type DRAM (the caches are host memory)."""

    device_type = "cuda"
    device_name = "cuda"

    def __init__(self, real: Any) -> None:
        self._real = real

    def is_rocm(self) -> bool:
        return False

    def is_cuda(self) -> bool:
        return True

    def set_device(self, *args: Any) -> None:
        return None

    def get_nixl_memory_type(self) -> str:
        return "DRAM"

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def decode_agent_metadata(blob: bytes) -> dict[str, Any]:  # pragma: no cover - debugging aid
    return msgpack.unpackb(blob, raw=False)


def check_layout(layout: EngineLayout) -> None:
    if layout.physical_blocks_per_logical != 1:
        raise GeometryError("implementation 'vllm' needs the kernel block to equal the logical "
                            "block today (block_size = the backend's kernel block)")
