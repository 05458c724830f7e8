"""FP8 block-wise weights (Qwen's `-FP8` format, vlmrun/quantization/fp8.py), float32 on the CPU.

Every architecture's wide tiny checkpoint (testing/wide_models.py: widths of 256 and more, one
320-wide MLP per model, so blocks are real and some partial) is written in Qwen's FP8 format
(testing/fp8_checkpoints.py) in a variant per architecture: Qwen's config and unquantized list with
the vision tower quantized, the vision tower listed unquantized, transformers' own config format with
another list, experts per expert or fused. vlmrun on the FP8 files must give transformers' greedy
tokens and top-5 logprobs within 1e-4: transformers reading the same files (it dequantizes on the CPU)
where it reads them right, else transformers on the float32 checkpoint the FP8 one stands for,
dequantized here in plain torch (transformers takes the block size from the scale grid, wrong for
partial blocks, and loads fused FP8 experts unscaled).

Beside that: the block arithmetic against transformers' (bit-equal), scale rows expanded for
slicing and compacted after loading, tensor parallelism (each rank's slice; TP=2 equals TP=1 on a
dense and a MoE model; a shard cutting a 128-column block is an error naming the layer and the TP
size), the refusals (unsupported variants, FP8 bytes without a quantization_config), online FP8 of
a float checkpoint, the resident bytes, and the opt-in CUDA kernel (its activation quantization on
the CPU; the GEMM only with CUDA).
"""

from __future__ import annotations

import gc
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from testing.fp8_checkpoints import (QWEN_UNQUANTIZED, dequantize_blocks as reference_dequantize, hf_can_read,
                                     quantize_blocks as reference_quantize, write_dequantized_copy,
                                     write_fp8_checkpoint)
from testing.hf_reference import HFReference
from testing.wide_models import build_wide_checkpoint
from tests.test_engine_parity import assert_matches, make_image, user
from tests.test_tensor_parallel import assert_same_outputs
from vlmrun import LLM, SamplingParams
from vlmrun.config import EngineConfig, ModelConfig
from vlmrun.configs.quantization import QuantizationConfig
from vlmrun.layers.linear import ColumnParallelLinear
from vlmrun.layers.moe import FusedExperts
from vlmrun.models.registry import load_model
from vlmrun.models.weights import weight_bytes
from vlmrun.parallel import Shard, TensorParallel
from vlmrun.quantization.fp8 import Fp8BlockLinear, Fp8OnlineLinear, fp8_gemm, make_fp8_method
from vlmrun.quantization.fp8_blocks import (FP8, compact_rows, dequantize_blocks, expand_rows, fp8_to_float32,
                                            quantize_activation, quantize_weight)

MAX_NEW = 4
TOPK = 5
CPU = torch.device("cpu")
# The 320-wide MLPs (and shared experts) listed unquantized: every FP8 width a multiple of 128.
ALIGNED = QWEN_UNQUANTIZED + ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "shared_expert.gate_proj",
                              "shared_expert.up_proj", "shared_expert.down_proj")
# arch -> (the writer's options, whether transformers reads the FP8 files themselves)
VARIANTS: dict[str, tuple[dict, bool]] = {
    "qwen3": ({}, False),  # Qwen's format, bf16 scales, the 320-wide MLP quantized (partial blocks)
    "qwen2_5_vl": (dict(unquantized=ALIGNED, quantize_vision=False), True),  # Qwen's format, vision listed
    "qwen3_vl": ({}, False),  # the vision tower quantized
    "qwen3_5": (dict(unquantized=ALIGNED, quantize_vision=False, style="hf", scale_dtype=torch.float32), True),
    "qwen3_5_moe": ({}, False),  # per-expert experts, the 320-wide shared expert quantized
    "qwen3_next": (dict(unquantized=ALIGNED, style="hf"), True),  # transformers' config, per-expert experts
    "qwen3_vl_moe": (dict(experts="fused", scale_dtype=torch.float32), False),  # fused FP8 experts
}
VL = {"qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe", "qwen3_vl_moe"}


class Checkpoints:
    """Wide float checkpoints and their FP8 variants, built once per module."""

    def __init__(self, factory: pytest.TempPathFactory):
        self.factory = factory
        self.made: dict[tuple, Path] = {}

    def wide(self, arch: str) -> Path:
        if (arch,) not in self.made:
            self.made[(arch,)] = build_wide_checkpoint(arch, self.factory.mktemp(f"wide_{arch}"))
        return self.made[(arch,)]

    def fp8(self, arch: str, aligned: bool = False) -> Path:
        """`VARIANTS[arch]`, or with `aligned` Qwen's format with the 320-wide MLPs left unquantized."""
        if (arch, aligned) not in self.made:
            options = dict(unquantized=ALIGNED) if aligned else VARIANTS[arch][0]
            out = self.factory.mktemp(f"fp8_{arch}{'_aligned' if aligned else ''}")
            self.made[(arch, aligned)] = write_fp8_checkpoint(self.wide(arch), out, **options)
        return self.made[(arch, aligned)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return Checkpoints(tmp_path_factory)


def chat(arch: str) -> list[dict]:
    if arch in VL:
        return [user(make_image(90, 61, 1), "Describe the picture.")]
    return [{"role": "system", "content": "You are brief."}, user("Tell me about the sea.")]


def fp8_layers(llm: LLM) -> list[str]:
    return [name for name, m in llm.engine.executor.model.named_modules() if getattr(m, "method", None) is not None
            and m.method.quantized]


# ---------------------------------------------------------------------------- block arithmetic


@pytest.mark.parametrize("shape", [(256, 384), (320, 300), (3, 2, 256, 130)])
def test_dequantize_equals_transformers_arithmetic(shape):
    torch.manual_seed(0)
    q, scale = quantize_weight(torch.randn(shape))
    assert scale.shape[-2:] == (-(-shape[-2] // 128), -(-shape[-1] // 128))
    ours = dequantize_blocks(q, scale, torch.float32)
    rows, cols = shape[-2:]
    if rows % 128 == 0 and cols % 128 == 0:  # transformers' Fp8Dequantize arithmetic, written out
        grid = q.float().reshape(-1, rows // 128, 128, cols // 128, 128) * scale.reshape(-1, rows // 128, cols // 128)[:, :, None, :, None]
        assert torch.equal(ours, grid.reshape(shape))
    assert torch.equal(ours, reference_dequantize(q, scale))  # the test writer's own, partial blocks too
    assert torch.equal(dequantize_blocks(q, scale, torch.bfloat16), ours.to(torch.bfloat16))


def test_fp8_values_read_through_float16_equal_torchs_conversion():
    every = torch.arange(256, dtype=torch.uint8).view(FP8)  # each bit pattern, subnormals and -0 too
    ours, torchs = fp8_to_float32(every), every.float()
    real = ~torch.isnan(torchs)  # 0x7f / 0xff: NaN in e4m3fn, never in a checkpoint's weights
    assert torch.equal(ours[real], torchs[real]) and torch.equal(ours.signbit()[real], torchs.signbit()[real])


def test_quantize_equals_the_checkpoint_writer():
    torch.manual_seed(1)
    w = torch.randn(320, 300) * torch.linspace(0.01, 3, 300)
    w[:128, :128] = 0  # an all-zero block keeps scale 1
    q, scale = quantize_weight(w)
    ref_q, ref_scale = reference_quantize(w, torch.float32)
    assert q.dtype == FP8 and torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scale, ref_scale)
    assert scale[0, 0] == 1.0
    assert (dequantize_blocks(q, scale, torch.float32) - w).abs().max() <= w.abs().max() / 16  # 3 mantissa bits


def test_scale_rows_expand_for_slicing_and_compact_after_loading():
    method = Fp8BlockLinear()
    block = torch.rand(3, 2) + 0.5  # 320 rows x 200 columns
    expanded = method.checkpoint_tensor("weight_scale_inv", block.to(torch.bfloat16), 320)
    assert expanded.shape == (320, 2) and torch.equal(expanded[127], expanded[0]) and torch.equal(expanded[319], expanded[256])
    assert torch.equal(compact_rows(expand_rows(block, 320)), block)  # the full tensor: back to 128-row blocks
    assert compact_rows(expand_rows(block, 320)[64:192]).shape == (2, 2)  # a shard from row 64: 64-row groups
    assert compact_rows(expand_rows(block, 320)[128:192]).shape == (1, 2)
    with pytest.raises(ValueError, match=r"weight_scale_inv of shape \(\) is not 128x128 block scales"):
        method.checkpoint_tensor("weight_scale_inv", torch.tensor(0.5), 320)  # per-tensor


def test_layer_keeps_fp8_and_block_scales_and_multiplies_as_dequantized():
    torch.manual_seed(2)
    q, scale = quantize_weight(torch.randn(384, 320))
    x = torch.randn(5, 320)
    expected = x @ dequantize_blocks(q, scale, torch.float32).t()
    for method in (Fp8BlockLinear(), Fp8BlockLinear(tile_rows=None), Fp8BlockLinear(tile_rows=128)):
        layer = ColumnParallelLinear(320, [Shard(256, 0, 256), Shard(128, 0, 128)], part_names=("a", "b"))
        layer.use_method(method)
        for part, rows in ((0, slice(0, 256)), (1, slice(256, 384))):
            layer.load_weight("weight", q[rows], part, "w")
            layer.load_weight("weight_scale_inv", layer.checkpoint_tensor("weight_scale_inv",
                                                                          scale[rows.start // 128:rows.stop // 128], part), part, "s")
        method.after_loading(layer)
        assert layer.weight.dtype == FP8 and layer.weight_scale_inv.shape == (3, 3)
        assert torch.allclose(layer(x), expected, atol=1e-5, rtol=1e-5)


def test_activation_quantization_round_trips_within_fp8_error():
    torch.manual_seed(3)
    x = torch.randn(7, 300) * torch.logspace(-3, 2, 300)
    q, scale = quantize_activation(x)
    assert q.dtype == FP8 and scale.shape == (7, 3)
    back = q.float() * scale.repeat_interleave(128, dim=1)[:, :300]
    step = scale.repeat_interleave(128, dim=1)[:, :300] * 2.0**-9  # the subnormal spacing, scaled
    assert ((back - x).abs() <= x.abs() / 16 + step).all()  # e4m3: 3 mantissa bits, half an ulp
    assert (back - x).abs().max() > 0


def test_online_fp8_quantizes_a_loaded_layer_and_experts_as_the_checkpoint_writer():
    torch.manual_seed(4)
    online = Fp8OnlineLinear(Fp8BlockLinear())
    layer = ColumnParallelLinear(300, [Shard(320, 0, 320)])
    layer.use_method(online)
    w = torch.randn(320, 300)
    layer.load_weight("weight", w, None, "w")
    online.after_loading(layer)
    ref_q, ref_scale = reference_quantize(w, torch.float32)
    assert layer.method is online.target and torch.equal(layer.weight.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(layer.weight_scale_inv, ref_scale)
    experts = FusedExperts(2, hidden=256, intermediate=384)
    experts.use_method(online)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(2, 768, 256))
        experts.down_proj.copy_(torch.randn(2, 256, 384))
    gate_up = experts.gate_up_proj.clone()
    online.after_loading(experts)
    assert experts.method is online.target and experts.gate_up_proj.dtype == FP8
    assert experts.gate_up_proj_scale_inv.shape == (2, 6, 2) and experts.down_proj_scale_inv.shape == (2, 2, 3)
    assert torch.equal(experts.expert_weight("gate_up_proj", 1, torch.float32),
                       reference_dequantize(*reference_quantize(gate_up[1], torch.float32)))


def test_the_cuda_kernel_is_refused_off_cuda():
    with pytest.raises(ValueError, match=r"fp8_kernel='cuda' runs FP8 GEMMs on a CUDA device; this engine runs on cpu"):
        make_fp8_method(QuantizationConfig("fp8"), CPU, "cuda")
    assert type(make_fp8_method(QuantizationConfig("fp8"), CPU, "dequantize")) is Fp8BlockLinear


@pytest.mark.gpu
def test_cuda_kernel_matches_the_dequantized_reference():
    torch.manual_seed(5)
    q, scale = quantize_weight(torch.randn(512, 384, device="cuda"))
    for tokens in (1, 33, 64):  # cuBLAS takes token counts that are multiples of 4: fp8_gemm pads
        x = torch.randn(tokens, 384, device="cuda", dtype=torch.bfloat16)
        expected = (x.float() @ dequantize_blocks(q, scale, torch.float32).t())
        ours = fp8_gemm(x, q, scale, torch.bfloat16).float()
        assert ours.shape == expected.shape
        assert ((ours - expected).abs() / expected.abs().mean()).max() < 0.1  # activations in FP8 too
    finer = expand_rows(scale, 512)[64:448]  # a shard's per-row scales: the 1x128 weight recipe
    assert fp8_gemm(x, q[64:448], compact_rows(finer), torch.bfloat16).shape == (64, 384)


# ---------------------------------------------------------------------------- every architecture against HF


@pytest.mark.parametrize("arch", list(VARIANTS))
def test_fp8_checkpoint_equals_transformers(arch: str, checkpoints: Checkpoints,
                                            tmp_path_factory: pytest.TempPathFactory):
    fp8_dir = checkpoints.fp8(arch)
    _, hf_reads = VARIANTS[arch]
    assert hf_can_read(fp8_dir) == hf_reads
    reference_dir = fp8_dir if hf_reads else write_dequantized_copy(
        fp8_dir, tmp_path_factory.mktemp(f"dequantized_{arch}"), fuse_experts=arch == "qwen3_vl_moe")
    hf = HFReference(reference_dir)
    expected = hf.generate(chat(arch), MAX_NEW)
    del hf
    gc.collect()
    llm = LLM(str(fp8_dir), dtype="float32", device="cpu", max_num_seqs=2)
    out = llm.chat([chat(arch)], SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=TOPK), use_tqdm=False)[0]
    assert_matches(out, expected, arch)
    layers = fp8_layers(llm)
    assert any("experts" in n for n in layers) == (arch in ("qwen3_5_moe", "qwen3_next", "qwen3_vl_moe"))
    assert any("visual" in n for n in layers) == (arch in VL and VARIANTS[arch][0].get("quantize_vision", True))
    assert not any(n.endswith(("mlp.gate", "shared_expert_gate", "in_proj_ba", "in_proj_a", "in_proj_b")) for n in layers)


# ---------------------------------------------------------------------------- tensor parallelism


def model_config(path: Path, dtype: str = "float32", quantization: str | None = None) -> ModelConfig:
    return ModelConfig.from_path(path, EngineConfig(model=str(path), dtype=dtype, quantization=quantization), CPU)


def dequantized_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every FP8 layer's [out, in] weight (each expert's for the fused experts), dequantized."""
    weights = {}
    for name, module in model.named_modules():
        if isinstance(module, FusedExperts) and module.method.quantized:
            for projection in ("gate_up_proj", "down_proj"):
                for e in range(module.experts.length):
                    weights[f"{name}.{projection}.{e}"] = module.expert_weight(projection, e, torch.float32)
        elif getattr(module, "method", None) is not None and module.method.quantized:
            weights[name] = module.method.dequantize(module.method_params(), torch.float32)
    return weights


def test_each_rank_holds_its_slice_of_the_fp8_weights(checkpoints: Checkpoints):
    """qwen3_next (transformers' format): rank r's dequantized q|k|v|z rows (regrouped), o_proj / out_proj
    input columns and expert units are the TP=1 weights' slices, scales included."""
    config = model_config(checkpoints.fp8("qwen3_next"))
    whole = dequantized_weights(load_model(config, CPU))
    ranks = [dequantized_weights(load_model(config, CPU, TensorParallel(r, 2))) for r in range(2)]
    assert whole.keys() == ranks[0].keys() == ranks[1].keys()
    for name, w in whole.items():
        halves = [rank[name] for rank in ranks]
        if name.endswith(("o_proj", "out_proj", "down_proj", ".0", ".1", ".2", ".3")) and "gate_up" not in name:
            assert torch.equal(torch.cat(halves, dim=1), w), name  # input columns split
        else:
            rows = halves[0].shape[0]
            assert rows == w.shape[0] // 2, name
    # output rows split: each rank's rows are rows of the whole weight, in the model's own order
    qkvz = "model.layers.0.linear_attn.in_proj_qkvz"
    rows = {tuple(r.tolist()) for r in whole[qkvz]}
    assert all(tuple(r.tolist()) in rows for rank in ranks for r in rank[qkvz])


def test_a_shard_cutting_a_column_block_is_an_error_naming_layer_and_tp_size(checkpoints: Checkpoints):
    """qwen3 in Qwen's format quantizes its 320-wide MLP: two ranks would take 160 input columns of down_proj."""
    with pytest.raises(ValueError, match=r"mlp\.down_proj: tensor_parallel_size=2 gives this rank input columns "
                                         r"\[0, 160\) of 320, but fp8's weight_scale_inv stores them 128 to an element"):
        load_model(model_config(checkpoints.fp8("qwen3")), CPU, TensorParallel(0, 2))


def tp_options(tp: int) -> dict:
    return dict(device="cpu", dtype="float32", max_num_seqs=2, max_model_len=256, tensor_parallel_size=tp)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_next"])  # dense (attention in FP8), MoE (experts, GDN too)
def test_tp2_equals_tp1(arch: str, checkpoints: Checkpoints):
    fp8_dir = checkpoints.fp8(arch, aligned=arch == "qwen3")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=2, ignore_eos=True)
    prompts = [chat(arch)]
    reference = LLM(str(fp8_dir), **tp_options(1)).chat(prompts, params, use_tqdm=False)
    parallel = LLM(str(fp8_dir), **tp_options(2))
    try:
        assert_same_outputs(parallel.chat(prompts, params, use_tqdm=False), reference)
    finally:
        parallel.engine.shutdown()


# ---------------------------------------------------------------------------- refusals


def with_config(src: Path, dst: Path, edit) -> Path:
    """A copy of checkpoint `src` (weights linked) whose config.json `edit(config)` changed."""
    dst.mkdir()
    for file in src.iterdir():
        (dst / file.name).symlink_to(file) if file.suffix == ".safetensors" else shutil.copy(file, dst / file.name)
    config = json.loads((src / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("field, value", [("activation_scheme", "static"), ("weight_block_size", [64, 64]),
                                          ("fmt", "e5m2"), ("weight_block_size", None)])  # None: per-tensor
def test_unsupported_fp8_variants_fail_at_load_naming_the_field(field, value, checkpoints: Checkpoints, tmp_path):
    variant = with_config(checkpoints.fp8("qwen3"), tmp_path / "variant",
                          lambda c: c["quantization_config"].update({field: value}))
    with pytest.raises(ValueError, match=re.escape(f"fp8 checkpoint with {field}={value!r} is not supported")):
        LLM(str(variant), device="cpu", dtype="float32")


def test_fp8_weights_without_a_quantization_config_never_load(checkpoints: Checkpoints, tmp_path):
    bare = with_config(checkpoints.fp8("qwen3"), tmp_path / "bare", lambda c: c.pop("quantization_config"))
    with pytest.raises(ValueError, match=r"the checkpoint stores torch\.float8_e4m3fn, the model expects torch\.float32"):
        LLM(str(bare), device="cpu", dtype="float32")


# ---------------------------------------------------------------------------- online FP8, memory


def test_online_fp8_equals_the_converted_checkpoint_and_stays_near_the_float_model(checkpoints: Checkpoints,
                                                                                    tmp_path_factory):
    """qwen3_5_moe (experts, shared expert, GDN, vision), quantization="fp8" on the float checkpoint: the
    same tokens and logprobs as the FP8 checkpoint converted from it with online FP8's unquantized list
    (vision, routers, GDN gates), each fused part quantized on its own; and near the float model: its
    first-step top-5 logprobs within 1.0 (FP8's noise through these random weights measured 0.34-0.78
    on four architectures; a weight read without its scales moves them by 5 and more)."""
    wide = checkpoints.wide("qwen3_5_moe")
    converted = write_fp8_checkpoint(wide, tmp_path_factory.mktemp("converted"), quantize_vision=False,
                                     scale_dtype=torch.float32)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=TOPK)
    prompt = [chat("qwen3_5_moe")]
    online = LLM(str(wide), device="cpu", dtype="float32", max_num_seqs=2, quantization="fp8")
    ours = online.chat(prompt, params, use_tqdm=False)[0]
    assert any("experts" in n for n in fp8_layers(online)) and not any("visual" in n for n in fp8_layers(online))
    del online
    gc.collect()
    assert_same_outputs([ours], LLM(str(converted), device="cpu", dtype="float32", max_num_seqs=2).chat(
        prompt, params, use_tqdm=False))
    float_first = LLM(str(wide), device="cpu", dtype="float32", max_num_seqs=2).chat(prompt, params, use_tqdm=False)[0].logprobs[0]
    assert all(abs(ours.logprobs[0][t] - lp) < 1.0 for t, lp in float_first.items() if t in ours.logprobs[0])
    assert len(set(float_first) & set(ours.logprobs[0])) >= 3


def test_fp8_weights_take_half_the_bf16_bytes(checkpoints: Checkpoints):
    """qwen3_5_moe in bf16: the FP8 layers' resident bytes (weights and block scales) are about half
    those of the same layers in bf16, and the model's total is smaller by what they saved."""
    fp8 = load_model(model_config(checkpoints.fp8("qwen3_5_moe"), "bfloat16"), CPU)
    bf16 = load_model(model_config(checkpoints.wide("qwen3_5_moe"), "bfloat16"), CPU)
    quantized = [name for name, m in fp8.named_modules() if getattr(m, "method", None) is not None and m.method.quantized]
    assert any("experts" in n for n in quantized) and any("visual" in n for n in quantized)
    ours = sum(weight_bytes(fp8.get_submodule(n)) for n in quantized)
    theirs = sum(weight_bytes(bf16.get_submodule(n)) for n in quantized)
    assert 0.5 <= ours / theirs <= 0.51
    assert weight_bytes(bf16) - weight_bytes(fp8) == theirs - ours
