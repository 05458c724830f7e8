"""AWQ / GPTQ 4-bit checkpoints (vlmrun/quantization/int4.py), float32 on the CPU.

- The packing against a slow reference written from the formats' description (one nibble at a time).
- Every architecture, on the wide test checkpoints (testing/wide_models.py: 256 wide,
  one 320-wide MLP whose down projection is not whole groups and stays float): vlmrun on the AWQ and
  on the GPTQ checkpoint (testing/int4_checkpoints.py) equals HF transformers on the dequantized float
  twin — prompt ids and greedy tokens equal, top-5 logprobs within 1e-4 at every step; Qwen2.5-VL AWQ
  with an image too; GPTQ's symmetric variant once. TP=2 equals TP=1 (tests/test_tensor_parallel.py's
  tolerance) on the MoE + GDN architecture, text and an image.
  Qwen3-Next's in_proj_qkvz, grouped per key head in its checkpoint, is regrouped packed.
- Each unsupported variant is a ValueError at load naming it: desc_act, bits 8, AWQ gemv, group size
  -1, a g_idx that is not i // group, a layer that is not whole groups, a TP shard narrower than a group.
"""

from __future__ import annotations

import gc
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from testing.hf_reference import HFReference
from testing.int4_checkpoints import write_int4_checkpoint
from testing.tiny_models import ARCHS
from testing.wide_models import build_wide_checkpoint
from tests.test_engine_parity import assert_matches, make_image, user
from tests.test_tensor_parallel import assert_same_outputs, engine_options
from vlmrun import LLM, SamplingParams
from vlmrun.configs.quantization import QuantizationConfig
from vlmrun.layers.linear import LinearBase, RowParallelLinear
from vlmrun.layers.moe import FusedExperts
from vlmrun.parallel import TensorParallel
from vlmrun.quantization.int4 import Int4Linear, pack_int4, unpack_int4

MAX_NEW = 4
TOPK = 5
VL_ARCHS = {"qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe", "qwen3_vl_moe"}
MOE_ARCHS = {"qwen3_5_moe", "qwen3_vl_moe", "qwen3_next"}
# AutoAWQ's GEMM packing: nibble k of an int32 holds output feature AWQ_ORDER[k] of its eight; GPTQ's in order.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
SEQUENTIAL_ORDER = tuple(range(8))


# ---------------------------------------------------------------------------- the packing, by a slow reference


def slow_pack(values: list[list[int]], dim: int, order: tuple[int, ...]) -> torch.Tensor:
    """2-D 4-bit values -> int32, 8 per element along `dim`: nibble k of element j holds feature 8j + order[k]."""
    rows, cols = len(values), len(values[0])
    shape = (rows // 8, cols) if dim == 0 else (rows, cols // 8)
    out = torch.zeros(shape, dtype=torch.int32)
    for r in range(shape[0]):
        for c in range(shape[1]):
            word = 0
            for k in range(8):
                feature = (8 * r + order[k], c) if dim == 0 else (r, 8 * c + order[k])
                word |= values[feature[0]][feature[1]] << (4 * k)
            out[r, c] = word - 2**32 if word >= 2**31 else word
    return out


@pytest.mark.parametrize("order", [AWQ_ORDER, SEQUENTIAL_ORDER], ids=["awq_order", "sequential"])
@pytest.mark.parametrize("dim", [0, 1])
def test_pack_and_unpack_match_the_slow_reference(order, dim):
    gen = torch.Generator().manual_seed(dim)
    values = torch.randint(0, 16, (16, 24), generator=gen)
    packed = slow_pack(values.tolist(), dim, order)
    assert torch.equal(unpack_int4(packed, dim, order), values.to(torch.int32))
    assert torch.equal(pack_int4(values, dim, order), packed)


def _slow_awq(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """AWQ's tensors of W [out, in] = (q - z) * s: qweight [in, out/8], qzeros [groups, out/8], both AWQ-ordered."""
    return {"qweight": slow_pack(q.T.tolist(), 1, AWQ_ORDER), "qzeros": slow_pack(zeros.tolist(), 1, AWQ_ORDER),
            "scales": scales}


def _slow_gptq(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """GPTQ v1's: qweight [in/8, out] in order, qzeros [groups, out/8] storing z - 1 (no g_idx: it is not read)."""
    return {"qweight": slow_pack(q.T.tolist(), 0, SEQUENTIAL_ORDER),
            "qzeros": slow_pack((zeros - 1).tolist(), 1, SEQUENTIAL_ORDER), "scales": scales}


GROUP = 8  # input features per group in the small examples below


def small_int4(method: str, gen: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A 16 x 32 weight in `method`'s format, packed by the slow reference, and W = (q - z) * s [out, in]."""
    out, width = 16, 32
    q = torch.randint(0, 16, (out, width), generator=gen)
    zeros = torch.randint(1, 16, (width // GROUP, out), generator=gen)
    scales = (torch.rand(width // GROUP, out, generator=gen) + 0.5).half()
    weight = (q - zeros.T.repeat_interleave(GROUP, 1)).float() * scales.T.float().repeat_interleave(GROUP, 1)
    return (_slow_awq if method == "awq" else _slow_gptq)(q, zeros, scales), weight


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_dequantize_and_apply_read_the_format(method):
    """W[o, i] = (q - z[i // group, o]) * s[i // group, o]; apply = x @ W.T + bias."""
    gen = torch.Generator().manual_seed(1)
    tensors, expected = small_int4(method, gen)
    int4 = Int4Linear(QuantizationConfig(method, group_size=GROUP))
    assert torch.equal(int4.dequantize(tensors, torch.float32), expected)
    layer = SimpleNamespace(method_params=lambda: tensors)
    x, bias = torch.randn(3, expected.shape[1], generator=gen), torch.randn(expected.shape[0], generator=gen)
    torch.testing.assert_close(int4.apply(layer, x, bias), x @ expected.T + bias, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_regroup_output_reorders_the_packed_output_features(method):
    """What Qwen3-Next's loader does to its grouped GDN rows: the dequantized weight's rows, reordered."""
    gen = torch.Generator().manual_seed(2)
    tensors, expected = small_int4(method, gen)
    int4 = Int4Linear(QuantizationConfig(method, group_size=GROUP))
    order = torch.randperm(expected.shape[0], generator=gen)
    regrouped = {name: int4.regroup_output(name, t, lambda rows: rows[order]) for name, t in tensors.items()}
    assert torch.equal(int4.dequantize(regrouped, torch.float32), expected[order])


def test_widths_and_shards_that_are_not_whole_packs_or_groups_are_refused():
    int4 = Int4Linear(QuantizationConfig("awq", group_size=128))
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down_proj: .*320, not a multiple of 128"):
        RowParallelLinear(320, 256).use_method(int4, "layers.0.mlp.down_proj")
    with pytest.raises(ValueError, match=r"layers\.0\.x: .*output features 8 to an int32; .* 260"):
        RowParallelLinear(256, 260).use_method(int4, "layers.0.x")
    gptq = Int4Linear(QuantizationConfig("gptq", group_size=128))
    with pytest.raises(ValueError, match=r"o_proj: tensor_parallel_size=2 gives this rank input columns "
                                         r"\[192, 384\) of 384.*gptq's .* 128 to an element"):
        RowParallelLinear(384, 256, TensorParallel(1, 2)).use_method(gptq, "o_proj", 2)
    experts = FusedExperts(4, 256, 384, tp=TensorParallel(0, 2))
    with pytest.raises(ValueError, match=r"mlp\.experts: tensor_parallel_size=2 gives this rank expert units"):
        experts.use_method(gptq, "mlp.experts", 2)


# ---------------------------------------------------------------------------- checkpoints, once per module


class Checkpoints:
    """Wide float checkpoints and their int4 copies, built once each."""

    def __init__(self, root: Path):
        self.root = root
        self.made: dict[tuple, Path] = {}

    def float_dir(self, arch: str) -> Path:
        if (arch,) not in self.made:
            self.made[(arch,)] = build_wide_checkpoint(arch, self.root / f"{arch}_float")
        return self.made[(arch,)]

    def int4(self, arch: str, method: str, sym: bool = False, **options) -> tuple[Path, Path]:
        """(the `method` checkpoint, its dequantized float twin)."""
        key = (arch, method, sym, tuple(sorted(options.items())))
        if key not in self.made:
            name = f"{arch}_{method}{'_sym' if sym else ''}{'_' + '_'.join(options) if options else ''}"
            twin = self.root / f"{name}_reference"
            write_int4_checkpoint(self.float_dir(arch), self.root / name, twin, method, sym=sym, **options)
            self.made[key] = self.root / name
            self.made[key + ("reference",)] = twin
        return self.made[key], self.made[key + ("reference",)]

    def edited(self, arch: str, method: str, name: str, quantization: dict) -> Path:
        """A copy of the `method` checkpoint whose quantization_config fields are changed to `quantization`."""
        source, _ = self.int4(arch, method)
        out = self.root / f"{arch}_{method}_{name}"
        shutil.copytree(source, out)
        config = json.loads((out / "config.json").read_text())
        config["quantization_config"].update(quantization)
        (out / "config.json").write_text(json.dumps(config))
        return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("int4"))


def cases_for(arch: str, method: str) -> dict[str, list[dict]]:
    cases = {"text": [{"role": "system", "content": "You are brief."}, user("Tell me about the sea.")]}
    if arch == "qwen2_5_vl" and method == "awq":  # Qwen2.5-VL-*-AWQ, as Qwen publishes it
        cases["image"] = [user(make_image(120, 90, 1), "Describe the image.")]
    return cases


def int4_layers(llm: LLM, method: str) -> set[str]:
    model = llm.engine.executor.model
    return {name for name, m in model.named_modules()
            if isinstance(m, (LinearBase, FusedExperts)) and m.method.name == method}


PARITY = [(arch, method, False) for arch in ARCHS for method in ("awq", "gptq")] + [("qwen3", "gptq", True)]


@pytest.mark.parametrize("arch,method,sym", PARITY,
                         ids=[f"{a}-{m}{'-sym' if s else ''}" for a, m, s in PARITY])
def test_int4_checkpoint_matches_hf_on_the_dequantized_twin(arch, method, sym, checkpoints):
    quantized, twin = checkpoints.int4(arch, method, sym)
    hf = HFReference(twin)
    cases = cases_for(arch, method)
    expected = {case: hf.generate(msgs, MAX_NEW) for case, msgs in cases.items()}
    del hf
    gc.collect()
    llm = LLM(str(quantized), dtype="float32", device="cpu", max_num_seqs=2)
    layers = int4_layers(llm, method)
    assert any(name.endswith("self_attn.qkv_proj") for name in layers)
    if arch == "qwen3_next":  # its checkpoint groups in_proj_qkvz rows per key head: regrouped packed
        assert any(name.endswith("linear_attn.in_proj_qkvz") for name in layers)
    assert any(name.endswith("o_proj") for name in layers)
    if arch in MOE_ARCHS:
        assert any(name.endswith("mlp.experts") for name in layers)
    odd = "mlp.shared_expert.down_proj" if arch == "qwen3_5_moe" else "mlp.down_proj"  # 320 inputs: 2.5 groups
    assert not any(name.endswith(odd) for name in layers)
    assert not any(name.startswith("visual") for name in layers)
    outs = llm.chat(list(cases.values()), SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=TOPK),
                    use_tqdm=False)
    for (case, exp), out in zip(expected.items(), outs):
        assert_matches(out, exp, f"{arch}/{method}/{case}")


def test_tp2_matches_tp1_on_awq_experts_and_gdn(checkpoints):
    """Each rank cuts its shard of the packed tensors: q | k | v and gate | up parts by packed output columns,
    o_proj / out_proj / down projections by whole groups of inputs, every expert by its units."""
    quantized, _ = checkpoints.int4("qwen3_5_moe", "awq")
    prompts = [{"prompt": "Tell me a story about the sea.", "images": []},
               {"prompt": "Describe the picture.", "images": [make_image(120, 90, 1)]}]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, logprobs=2, ignore_eos=True)
    reference = LLM(str(quantized), **engine_options(quantized, 1)).generate(prompts, params, use_tqdm=False)
    parallel = LLM(str(quantized), **engine_options(quantized, 2))
    try:
        outs = parallel.generate(prompts, params, use_tqdm=False)
    finally:
        parallel.engine.shutdown()
    assert_same_outputs(outs, reference)


# ---------------------------------------------------------------------------- refusals, each naming what it refuses


@pytest.mark.parametrize("method,fields,message", [
    ("gptq", {"desc_act": True}, r"gptq checkpoint with desc_act=True is not supported"),
    ("gptq", {"bits": 8}, r"gptq checkpoint with bits=8 is not supported"),
    ("awq", {"version": "gemv"}, r"awq checkpoint with version='gemv' is not supported"),
    ("awq", {"group_size": -1}, r"awq checkpoint with group_size=-1 is not supported"),
])
def test_unsupported_variants_are_refused_at_load(method, fields, message, checkpoints):
    edited = checkpoints.edited("qwen3", method, "_".join(fields), fields)
    with pytest.raises(ValueError, match=message):
        LLM(str(edited), dtype="float32", device="cpu")


def test_gptq_g_idx_out_of_group_order_is_refused(checkpoints):
    source, _ = checkpoints.int4("qwen3", "gptq")
    edited = checkpoints.root / "qwen3_gptq_act_order"
    shutil.copytree(source, edited)
    tensors = load_file(str(edited / "model.safetensors"))
    name = "model.layers.1.mlp.gate_proj.g_idx"
    tensors[name] = tensors[name].roll(1)  # what activation order leaves: groups not in input order
    save_file(tensors, str(edited / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"g_idx is not input feature // group_size \(128\).*desc_act"):
        LLM(str(edited), dtype="float32", device="cpu")


def test_a_layer_of_partial_groups_is_refused_naming_it(checkpoints):
    quantized, _ = checkpoints.int4("qwen3", "awq", partial_groups=True)
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down_proj: awq int4 with group_size=128 needs whole "
                                         r"groups of input features; this layer has 320"):
        LLM(str(quantized), dtype="float32", device="cpu")
