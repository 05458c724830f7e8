"""Builds a `ModelRunner` around a loaded model and its caches: the one place kernels are chosen.

`build_model_runner` packs the dense linears' weights for oneDNN where this CPU runs it and it wins
(`EngineConfig.linear_backend`, `layers/cpu_kernels.py`) and has glibc's malloc keep freed memory there
(`keep_freed_memory`), picks the attention backends (`EngineConfig.attention_backend` /
`gdn_backend`, "auto" by device), switches the vision tower to the fused varlen kernel on the
FlashInfer path, builds the vision stage, and sets up decode padding and CUDA graphs (`enforce_eager`,
`plan_bucketed_steps`).
The engine (one device) and each tensor-parallel rank build their runner with it, and only with it.
`build_local_executor` is the rest of the engine's executor on one device around a loaded model: its
MTP drafter (the speculative method "mtp"), the caches and the runner (behind `OverlappedExecutor` for
async scheduling).
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Optional, Union

import torch
from torch import nn

from vlmrun.cache.encoder_cache import EncoderCache
from vlmrun.cache.kv_scales import decoder_layer_index, read_kv_scales
from vlmrun.cache.plan import Caches, build_caches
from vlmrun.config import EngineConfig, ModelConfig
from vlmrun.executor.cpu_malloc import keep_freed_memory
from vlmrun.executor.model_runner import ModelRunner
from vlmrun.executor.overlap import OverlappedExecutor
from vlmrun.executor.bucketed_steps import BucketedStepRunner, graph_capturable, plan_bucketed_steps
from vlmrun.layers.attention import Attention, AttentionBackend, create_attention_backend
from vlmrun.layers.attention.base import check_backend_serves
from vlmrun.layers.attention.factory import BackendSetup, backend_names
from vlmrun.layers.attention.flashinfer_backend import FlashInferAttnBackend
from vlmrun.layers.attention.hybrid_backend import HybridAttnBackend
from vlmrun.layers.cpu_kernels import cpu_features, pack_threshold
from vlmrun.layers.packed_linear import pack_linear_weights
from vlmrun.lora.manager import LoRAManager
from vlmrun.models.blocks.vision_common import use_fused_vision_attention
from vlmrun.multimodal.vision_stage import VisionStage
from vlmrun.parallel import SINGLE, TensorParallel
from vlmrun.executor.mtp_drafter import MTPDrafter, build_mtp_drafter, with_mtp_layer
from vlmrun.threads import apply_cpu_threads

logger = logging.getLogger(__name__)


def build_local_executor(model: nn.Module, config: EngineConfig, model_config: ModelConfig,
                         device: torch.device) -> Union[ModelRunner, OverlappedExecutor]:
    """For the loaded `model` on `device`: its MTP drafter (weights loaded before the caches are
    planned), its caches (with the MTP layer's KV) and its runner."""
    drafter = build_mtp_drafter(model, config, model_config, config.max_num_seqs, device)
    shape = model.cache_shape() if drafter is None else with_mtp_layer(model.cache_shape())
    caches = build_caches(shape, config, dtype=model_config.dtype, max_model_len=model_config.max_model_len,
                          device=device)
    load_kv_scales(caches, model, model_config.path)
    runner = build_model_runner(model, caches, config, device, model_config.dtype, drafter=drafter)
    return OverlappedExecutor(runner) if config.async_scheduling else runner


def load_kv_scales(caches: Caches, model: nn.Module, path) -> None:
    """An e4m3 float8 KV pool takes the checkpoint's per-layer k/v scales (`cache/kv_scales.py`)."""
    pool = caches.kv_pool
    if pool.dtype is not torch.float8_e4m3fn:
        return
    kv_layer_of = {decoder_layer_index(name): m.layer_id for name, m in model.named_modules()
                   if isinstance(m, Attention) and decoder_layer_index(name) is not None}
    pool.set_scales(*read_kv_scales(path, kv_layer_of, pool.num_layers))


def build_model_runner(model: nn.Module, caches: Caches, config: EngineConfig, device: torch.device,
                       dtype: torch.dtype, tp: Optional[TensorParallel] = None,
                       drafter: Optional[MTPDrafter] = None) -> ModelRunner:
    """The runner of one device: the engine's own (`tp` None) or one tensor-parallel rank's. Its vision
    stage has an encoder cache of its own; under TP with `mm_encoder_tp_mode="data"` each rank encodes
    a share of the step's images and the ranks gather the embeddings."""
    split_over = tp if tp is not None and config.mm_encoder_tp_mode == "data" else None
    if device.type == "cpu":
        logger.info("CPU: %s", cpu_features().describe())
        apply_cpu_threads(config.num_threads, model, ranks=tp.size if tp is not None else 1)
    threshold = pack_threshold(config.linear_backend, device, next(model.parameters()).dtype)
    if threshold is not None:
        pack_linear_weights(model, threshold)
        if drafter is not None:  # the MTP layer's linears by the same rule
            pack_linear_weights(drafter.mtp, threshold)
    if device.type == "cpu" and config.keep_freed_memory:
        keep_freed_memory()
    backend = make_attention_backend(model, caches, config, device)
    fuse_vision_attention(model, backend, caches)
    lora = (LoRAManager(model, config.max_loras, config.max_lora_rank, device, dtype, config.max_cpu_loras,
                        kernel=config.lora_kernel) if config.enable_lora else None)
    vision = (VisionStage(model, EncoderCache(config.encoder_cache_tokens), device, dtype, split_over, lora)
              if model.supports_images else None)
    return ModelRunner(model, caches, backend, vision, device, lora=lora,
                       bucketed_steps=make_bucketed_steps(model, backend, caches, config, device), tp=tp or SINGLE,
                       async_scheduling=config.async_scheduling,
                       seed=config.seed, drafter=drafter)


def make_attention_backend(model: nn.Module, caches: Caches, config: EngineConfig,
                           device: torch.device) -> AttentionBackend:
    """The step's backend, planned with the query heads and scale of the model's own attention layers
    (and, for a model with GDN layers, one with a GDN backend for them)."""
    layer = next(m for m in model.modules() if isinstance(m, Attention))
    setup = BackendSetup(caches, num_q_heads=layer.num_heads, scaling=layer.scaling, device=device)
    backend = create_attention_backend(setup, config.attention_backend, config.gdn_backend)
    check_backend_serves(model, backend)
    if config.speculative_config is not None and backend.gdn is not None and not backend.gdn.verifies_drafts:
        raise ValueError(f"speculative decoding on a hybrid model needs a GDN backend that keeps the state after "
                         f"each draft position; {type(backend.gdn).__name__} does not (use gdn_backend='torch')")
    logger.info("attention backend: %s", backend_names(backend))
    return backend


def fuse_vision_attention(model: nn.Module, backend: AttentionBackend, caches: Caches) -> None:
    """On the FlashInfer path in half precision, the vision tower's attention runs as one
    flash-attention varlen call instead of one SDPA call per image size (where this torch has the
    kernel: `torch.nn.attention.varlen`, torch >= 2.10)."""
    full = backend.full if isinstance(backend, HybridAttnBackend) else backend
    if isinstance(full, FlashInferAttnBackend) and caches.kv_pool.compute_dtype in (torch.float16, torch.bfloat16):
        if importlib.util.find_spec("torch.nn.attention.varlen") is None:
            logger.info("vision attention: per-size SDPA (torch %s has no torch.nn.attention.varlen; 2.10 does)",
                        torch.__version__)
            return
        layers = use_fused_vision_attention(model)
        if layers:
            logger.info("vision attention: fused varlen kernel in %d layers", layers)


def make_bucketed_steps(model: nn.Module, backend: AttentionBackend, caches: Caches, config: EngineConfig,
                        device: torch.device) -> Optional[BucketedStepRunner]:
    """Decode padded to buckets where it is captured in CUDA graphs (`plan_bucketed_steps`: on CUDA, padding without
    a graph is pure extra work), or on the CPU when asked (`enforce_eager=False`, run eagerly)."""
    spec = config.speculative_config
    width = 1 if spec is None or not config.verify_cuda_graphs else 1 + spec.num_speculative_tokens
    plan = plan_bucketed_steps(device.type, config.enforces_eager(device), backend.supports_cuda_graph,
                               graph_capturable(model, caches.plan.max_num_seqs * width),
                               config.tensor_parallel_size, config.enable_lora)
    logger.info("decode: %s", plan.why)
    if not plan.padded:
        return None
    return BucketedStepRunner(model, backend, caches, device, use_cuda_graphs=plan.graphs,
                              num_speculative_tokens=0 if spec is None else spec.num_speculative_tokens,
                              verify_cuda_graphs=config.verify_cuda_graphs)
