"""Engine and model configuration.

`EngineConfig` is the one dataclass of user-facing knobs (vLLM-style names). `ModelConfig` wraps
the checkpoint's HF config and answers the questions the engine asks of it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch

from vlmrun.configs.quantization import QUANTIZATION_METHODS, QuantizationConfig, resolve_quantization
from vlmrun.configs.speculative import SpeculativeConfig
from vlmrun.generation_config import read_sampling_defaults
from vlmrun.processors.pixel_backends import IMAGE_BACKENDS
from vlmrun.processors.processor_kwargs import check_processor_kwargs

LINEAR_BACKENDS = ("auto", "torch", "onednn")
LORA_KERNELS = ("torch", "triton")  # the update of a batch of mixed LoRA adapters (`EngineConfig.lora_kernel`)
# The KV pool's float8 storage formats (`EngineConfig.kv_cache_dtype`; vLLM's names)
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


@dataclass
class EngineConfig:
    model: Optional[str] = None  # checkpoint dir or hub id; None = the bundled default model
    revision: Optional[str] = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    attention_backend: str = "auto"  # full-attention kernels: auto | torch | cpu | flashinfer (layers/attention/factory.py)
    gdn_backend: str = "auto"  # hybrid models' Gated DeltaNet (GDN) kernels: auto | torch | fla
    # Dense linears' GEMMs: "onednn" packs the weights once for oneDNN (CPU; layers/packed_linear.py),
    # "torch" runs F.linear on the weights as loaded (the reference); "auto": onednn where this CPU runs
    # it and a measurement says it wins (layers/cpu_kernels.py), else torch.
    linear_backend: str = "auto"
    # The weights' quantization (vLLM's names): None = the checkpoint's own (its quantization_config);
    # "fp8" | "awq" | "gptq" must agree with it, and "fp8" on a float checkpoint quantizes at load
    # (online FP8). vlmrun/quantization/.
    quantization: Optional[str] = None
    # FP8 layers' GEMM: "dequantize" (the weight dequantized to the activation dtype, then F.linear: every
    # device) or "cuda" (dynamic 1x128 activation quantization + a group-wise FP8 GEMM; opt-in until a GPU
    # run checks it against "dequantize"). vlmrun/quantization/fp8.py.
    fp8_kernel: str = "dequantize"
    # On the CPU: glibc's malloc keeps freed blocks for reuse instead of unmapping them, so a step does
    # not fault its activations in again (executor/cpu_malloc.py; process-wide). False leaves malloc as is.
    keep_freed_memory: bool = True
    # On the CPU: torch's thread count for the engine's steps. None: chosen from the cores the process may
    # use (affinity, cgroup quota) and the model's size, unless VLMRUN_NUM_THREADS or OMP_NUM_THREADS
    # says (vlmrun/threads.py); N: exactly N.
    num_threads: Optional[int] = None
    # False: decode steps run padded to a batch-size bucket (executor/bucketed_steps.py), replayed from
    # a CUDA graph per bucket where CUDA can capture them (unpadded where it cannot: `plan_bucketed_steps`; on
    # the CPU padded, eagerly); True: every step runs
    # unpadded. None: False on CUDA, True on the CPU (no graph to replay there: padding rows can only
    # add work; bench/bench_decode_padding.py). `enforces_eager(device)` resolves it.
    enforce_eager: Optional[bool] = None
    # Speculative decoding with CUDA graphs: also capture verify steps (rows of 1 + k tokens) per bucket.
    # Off by default until a GPU run checks it (docs/gpu_checks.md); verify steps run padded, eagerly.
    verify_cuda_graphs: bool = False
    # Async scheduling (vLLM's name): the engine plans and launches step N+1 while step N runs; step N's
    # sampled ids stay on the device and reach the host one step later (executor/overlap.py). Tokens
    # equal the synchronous engine's (with speculative decoding too: a request waits for its launched
    # verify step). None: on with CUDA, off on the CPU and with speculative decoding;
    # `overlaps_steps(device)` resolves it.
    async_scheduling: Optional[bool] = None
    # Speculative decoding (vLLM's name and keys): {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_min": a, "prompt_lookup_max": b}, {"method": "mtp", "num_speculative_tokens": k}
    # (a checkpoint's MTP layer) or a SpeculativeConfig; None: off. Greedy tokens equal plain decode's,
    # sampled ones keep its distribution (docs/spec_decode.md).
    speculative_config: Union[None, dict, SpeculativeConfig] = None
    image_backend: str = "auto"  # auto (torchvision if it imports, else pil) | torchvision | pil: whose resize (processors/pixel_backends.py)
    # Where images are normalised (and, with torchvision, resized): "cpu", the engine's CUDA device
    # ("cuda": decoded on the host and uploaded as uint8), or "auto": the GPU where it is faster and gives
    # the CPU path's pixels, measured once at start (processors/device_plan.py)
    preprocess_device: str = "auto"
    max_model_len: Optional[int] = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    page_size: int = 16
    gpu_memory_utilization: float = 0.9  # share of GPU memory the engine may use (CUDA)
    kv_cache_memory_bytes: Optional[int] = None  # explicit cache budget (KV + GDN state); default on CPU: 2 GiB
    gdn_state_dtype: str = "float32"  # hybrid models: dtype of the GDN recurrent state (float32 | bfloat16 | float16)
    # The KV pool's storage (vLLM's --kv-cache-dtype): "auto" the model's dtype; "fp8" / "fp8_e4m3" float8
    # e4m3 with per-layer scales from the checkpoint (else 1.0), "fp8_e5m2" float8 e5m2 (scale 1.0): half the
    # bytes of a 16-bit cache per token. docs/kv_cache_dtype.md.
    kv_cache_dtype: str = "auto"
    # Who runs first (vLLM's --scheduling-policy): "fcfs" by arrival; "priority" by a request's `priority`,
    # lower first, ties by arrival, preempting lower-priority requests for memory (engine/queue_policy.py).
    scheduling_policy: str = "fcfs"
    encoder_cache_tokens: int = 32768  # vision embeddings kept by image hash
    enable_prefix_caching: bool = True  # reuse the KV of full prompt pages across requests (docs/prefix_cache.md)
    # Hybrid models: GDN state snapshots for prefix hits. None = as many as max_num_seqs that fit in the
    # budget the KV pool cannot use anyway (often none on a tight budget); an int takes them from the budget.
    gdn_prefix_snapshots: Optional[int] = None
    prefix_snapshot_interval: int = 512  # hybrid models: snapshot every this many prompt tokens (and at the last full page)
    # vLLM's engine-wide mm_processor_kwargs ({"min_pixels", "max_pixels", "fps"}): sizes every image / video
    # that sets none itself and gets none from its request (processors/processor_kwargs.py).
    mm_processor_kwargs: Optional[dict[str, Any]] = None
    max_images_per_request: int = 32  # 0: no images (vLLM's limit_mm_per_prompt {"image": N}, `mm_limit_fields`)
    max_videos_per_request: int = 32  # 0: no videos ({"video": N})
    max_image_pixels: Optional[int] = None  # decompression-bomb cap; None = processors' default
    # Video limits per request (None = the processors' defaults, `processors.ProcessorLimits`)
    max_video_frames: Optional[int] = None  # frames sampled from one video
    max_video_frames_decoded: Optional[int] = None  # frames in one video file
    max_video_tokens: Optional[int] = None  # LLM tokens of all videos of a request
    # vLLM's `seed`: the engine's sampling generator starts from it, so unseeded sampled requests
    # repeat from a fresh start (a request's own `seed` still decides its own tokens).
    seed: int = 0
    # A chat template used instead of the checkpoint's: a file path or the template itself (vLLM's
    # --chat-template; processors.processor_files.load_chat_template). None: the checkpoint's.
    chat_template: Optional[str] = None
    # Sampling defaults for what a request leaves unset (vLLM's --generation-config): "auto" the
    # checkpoint's generation_config.json, "vllm" SamplingParams' own, or a folder holding one
    # (vlmrun/generation_config.py; read into ModelConfig.sampling_defaults).
    generation_config: str = "auto"
    # Tensor parallelism: one worker process per rank, each holding 1/N of the attention heads, MLP
    # units and experts (vlmrun/executor/distributed.py); "mp" spawns them here, "ray" places them
    # with a Ray placement group.
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"  # mp | ray
    # The vision tower under tensor parallelism: its weights on every rank; "weights": every rank
    # encodes every image, "data": each rank encodes a share of the step's images, gathered after.
    mm_encoder_tp_mode: str = "weights"
    enable_expert_parallel: bool = False  # MoE under tensor parallelism: whole experts per rank (else each sliced)
    # LoRA adapters (vLLM's names; docs/lora.md): requests name a PEFT adapter (`LoRARequest`); up to
    # `max_loras` adapters run in one step (slots, LRU), each of rank <= `max_lora_rank`; `max_cpu_loras`
    # read adapters kept on the host (None: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None
    # A batch of mixed adapters' update: "torch" (masked matmuls, every device) or "triton" (rows grouped by
    # slot, two Triton kernels; CUDA only, opt-in until a GPU run checks it). vlmrun/lora/triton_ops.py.
    lora_kernel: str = "torch"
    # Stop strings cost work on every generated token: what one request may ask for
    # (`vlmrun.sampling_params.StopLimits`; the server answers 400 past them).
    max_stop_strings: int = 32
    max_stop_string_length: int = 512  # characters
    max_stop_token_ids: int = 64
    # vLLM's runner: "generate" (text) or "pooling" (embeddings: LLM.embed / encode, /v1/embeddings;
    # vlmrun/pooling/); pooler_config (vLLM's --pooler-config) overrides the checkpoint's pooling:
    # {"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": bool}.
    runner: str = "generate"
    pooler_config: Optional[dict[str, Any]] = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.num_threads is not None and (isinstance(self.num_threads, bool) or not isinstance(self.num_threads, int)
                                             or self.num_threads < 1):
            raise ValueError(f"num_threads must be None or an integer >= 1, got {self.num_threads!r}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.gdn_prefix_snapshots is not None and self.gdn_prefix_snapshots < 0:
            raise ValueError(f"gdn_prefix_snapshots must be >= 0, got {self.gdn_prefix_snapshots}")
        if self.prefix_snapshot_interval < 1:
            raise ValueError(f"prefix_snapshot_interval must be >= 1, got {self.prefix_snapshot_interval}")
        if self.image_backend not in IMAGE_BACKENDS:
            raise ValueError(f"image_backend must be one of {', '.join(IMAGE_BACKENDS)}, got {self.image_backend!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be None or one of {', '.join(QUANTIZATION_METHODS)}, "
                             f"got {self.quantization!r}")
        if self.fp8_kernel not in ("dequantize", "cuda"):
            raise ValueError(f"fp8_kernel must be dequantize or cuda, got {self.fp8_kernel!r}")
        if self.linear_backend not in LINEAR_BACKENDS:
            raise ValueError(f"linear_backend must be auto, torch or onednn, got {self.linear_backend!r}")
        if self.preprocess_device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"preprocess_device must be auto, cpu or cuda, got {self.preprocess_device!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be mp or ray, got {self.distributed_executor_backend!r}")
        if self.mm_encoder_tp_mode not in ("weights", "data"):
            raise ValueError(f"mm_encoder_tp_mode must be weights or data, got {self.mm_encoder_tp_mode!r}")
        for name in ("max_images_per_request", "max_videos_per_request"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        self.speculative_config = SpeculativeConfig.of(self.speculative_config)
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {self.max_loras} and {self.max_lora_rank}")
        if self.lora_kernel not in LORA_KERNELS:
            raise ValueError(f"lora_kernel must be one of {', '.join(LORA_KERNELS)}, got {self.lora_kernel!r}")
        if self.mm_processor_kwargs is not None:
            check_processor_kwargs(self.mm_processor_kwargs)  # InputError (a ValueError) naming the option
        if self.runner not in ("generate", "pooling"):
            raise ValueError(f"runner must be generate or pooling, got {self.runner!r}")
        if self.gdn_state_dtype not in _DTYPES:
            raise ValueError(f"gdn_state_dtype must be float32, bfloat16 or float16, got {self.gdn_state_dtype!r}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be auto, {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")

    @property
    def lora_slots(self) -> Optional[int]:
        """How many adapters one step may run (`max_loras`); None without LoRA."""
        return self.max_loras if self.enable_lora else None

    @property
    def disable_by_batch_size(self) -> Optional[int]:
        """speculative_config's `disable_by_batch_size`; None without speculation or a limit."""
        return None if self.speculative_config is None else self.speculative_config.disable_by_batch_size

    @property
    def gdn_state_torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.gdn_state_dtype]

    def kv_cache_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV pool's storage dtype: the model's ("auto") or a float8 one."""
        return KV_CACHE_DTYPES.get(self.kv_cache_dtype, model_dtype)

    def enforces_eager(self, device: torch.device) -> bool:
        """`enforce_eager`, or what None means on `device`."""
        return self.enforce_eager if self.enforce_eager is not None else device.type != "cuda"

    def overlaps_steps(self, device: torch.device) -> bool:
        """`async_scheduling`, or what None means on `device`: on with CUDA (the stream orders the steps;
        equal to the synchronous engine on an H100, 2026-11-28), off on the CPU (no gain on 2 cores:
        the step's Python holds the GIL on both threads, BENCHMARKS.md) and with speculative decoding
        (token-equal, tests/test_async_spec_decode.py, but a speculating request waits for each verify
        step, and on the CPU it cost 25-55 % of the throughput at batch 16 and in captioning,
        BENCHMARKS.md; unmeasured on CUDA)."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return device.type == "cuda" and self.speculative_config is None

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} was asked for but CUDA is not available")
        return device


MM_LIMIT_FIELDS = {"image": "max_images_per_request", "video": "max_videos_per_request"}


def mm_limit_fields(limit_mm_per_prompt: Any) -> dict[str, int]:
    """vLLM's `limit_mm_per_prompt` ({"image": 2, "video": 1}: items of each modality one prompt may
    carry) as the EngineConfig fields it sets. ValueError naming the key for another modality or a
    count that is not a non-negative integer."""
    if not isinstance(limit_mm_per_prompt, dict):
        raise ValueError(f"limit_mm_per_prompt must be an object such as {{\"image\": 2, \"video\": 1}}, "
                         f"got {limit_mm_per_prompt!r}")
    fields = {}
    for modality, count in limit_mm_per_prompt.items():
        if modality not in MM_LIMIT_FIELDS:
            raise ValueError(f"limit_mm_per_prompt: unknown modality {modality!r} (this engine takes "
                             f"{', '.join(MM_LIMIT_FIELDS)})")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"limit_mm_per_prompt[{modality!r}] must be a non-negative integer, got {count!r}")
        fields[MM_LIMIT_FIELDS[modality]] = count
    return fields


@dataclass
class ModelConfig:
    path: Path
    hf_config: Any  # transformers.PretrainedConfig
    dtype: torch.dtype
    max_model_len: int
    eos_token_ids: list[int] = field(default_factory=list)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)  # SamplingParams field -> default
    quantization: Optional[QuantizationConfig] = None  # the weights' format (vlmrun/quantization/)

    @classmethod
    def from_path(cls, path: Path, engine: EngineConfig, device: torch.device) -> "ModelConfig":
        from transformers import AutoConfig

        try:
            hf_config = AutoConfig.from_pretrained(path)
        except (ValueError, KeyError) as e:
            raise ValueError(f"cannot read the model config in {path}: {e}") from e
        if not getattr(hf_config, "architectures", None):
            raise ValueError(f"{path}/config.json names no 'architectures'")
        dtype = resolve_dtype(engine.dtype, hf_config, device)
        text = text_config(hf_config)
        limit = getattr(text, "max_position_embeddings", None) or 32768
        max_len = engine.max_model_len or limit
        if max_len > limit:
            raise ValueError(f"max_model_len={max_len} exceeds the model's max_position_embeddings={limit}")
        return cls(path=path, hf_config=hf_config, dtype=dtype, max_model_len=max_len,
                   eos_token_ids=read_eos_token_ids(path, hf_config),
                   sampling_defaults=read_sampling_defaults(engine.generation_config, path),
                   quantization=resolve_quantization(hf_config, engine.quantization))

    @property
    def architecture(self) -> str:
        return self.hf_config.architectures[0]

    @property
    def text_config(self) -> Any:
        return text_config(self.hf_config)


@dataclass(frozen=True)
class CacheShape:
    """What the caches hold for a model: KV per token (full-attention layers), GDN state per request.

    Derived once, from the HF config (`from_hf_config`); a model gives its own through
    `Model.cache_shape()`. A model is hybrid when `num_gdn_layers > 0`.
    """
    num_attention_layers: int  # full-attention layers: the only ones with KV
    num_kv_heads: int
    head_dim: int
    num_gdn_layers: int = 0  # GDN layers
    gdn_conv_dim: int = 0  # 2 * Hk * Dk + Hv * Dv
    gdn_conv_kernel: int = 0
    gdn_num_v_heads: int = 0
    gdn_head_v_dim: int = 0
    gdn_head_k_dim: int = 0

    @property
    def is_hybrid(self) -> bool:
        return self.num_gdn_layers > 0

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> "CacheShape":
        """From a Qwen3.5 / Qwen3-Next style config (`layer_types`, `linear_*`) or a plain decoder config."""
        text = text_config(hf_config)
        layer_types = list(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers)
        layer_types = layer_types[: text.num_hidden_layers]
        num_gdn = sum(t == "linear_attention" for t in layer_types)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        shape = dict(num_attention_layers=len(layer_types) - num_gdn,
                     num_kv_heads=text.num_key_value_heads or text.num_attention_heads, head_dim=head_dim,
                     num_gdn_layers=num_gdn)
        if num_gdn:
            hk, hv = text.linear_num_key_heads, text.linear_num_value_heads
            dk, dv = text.linear_key_head_dim, text.linear_value_head_dim
            shape.update(gdn_conv_dim=2 * hk * dk + hv * dv, gdn_conv_kernel=text.linear_conv_kernel_dim,
                         gdn_num_v_heads=hv, gdn_head_v_dim=dv, gdn_head_k_dim=dk)
        return cls(**shape)

    def for_tensor_parallel(self, size: int) -> "CacheShape":
        """One rank's share when `size` ranks split the heads: KV heads (at least one, replicated when
        fewer than ranks), GDN value heads and conv channels (q | k | v each split)."""
        if size == 1:
            return self
        return dataclasses.replace(self, num_kv_heads=max(self.num_kv_heads // size, 1),
                                   gdn_conv_dim=self.gdn_conv_dim // size,
                                   gdn_num_v_heads=self.gdn_num_v_heads // size)


def text_config(hf_config: Any) -> Any:
    return getattr(hf_config, "text_config", None) or hf_config


def resolve_dtype(name: str, hf_config: Any, device: torch.device) -> torch.dtype:
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"unknown dtype {name!r}; choose auto, float32, bfloat16 or float16")
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # the CPU reference path runs in float32
    stored = getattr(text_config(hf_config), "dtype", None) or getattr(hf_config, "dtype", None)
    if isinstance(stored, str):
        stored = _DTYPES.get(stored)
    return stored if stored in (torch.bfloat16, torch.float16) else torch.bfloat16


def read_eos_token_ids(path: Path, hf_config: Any) -> list[int]:
    """EOS ids from generation_config.json, falling back to the model config."""
    ids: Any = None
    gen = Path(path) / "generation_config.json"
    if gen.exists():
        ids = json.loads(gen.read_text()).get("eos_token_id")
    if ids is None:
        ids = getattr(text_config(hf_config), "eos_token_id", None) or getattr(hf_config, "eos_token_id", None)
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, list) else [ids])]
