"""Weights whose values are NaN or inf are refused when they load, naming the tensor (issue 45, item 2).

A quantized checkpoint (FP8, AWQ, GPTQ) with one NaN or inf scale, and a LoRA adapter with a NaN or
inf tensor or a non-finite `lora_alpha` (JSON's `Infinity` / `NaN`), would turn every output of the
layer to NaN; they are refused at load with an error naming the tensor or setting, and a refused
adapter fails its own request only.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from testing.fp8_checkpoints import write_fp8_checkpoint
from testing.int4_checkpoints import write_int4_checkpoint
from testing.wide_models import build_wide_checkpoint
from tests.test_engine_parity import assert_matches
from tests.test_lora import params
from tests.test_lora_errors import MSGS, first_key, good, variant  # noqa: F401 (good: a fixture)
from vlmrun import LLM, LoRARequest


@pytest.fixture(scope="module")
def wide_qwen3(tmp_path_factory) -> Path:
    return build_wide_checkpoint("qwen3", tmp_path_factory.mktemp("wide_qwen3"))


def poisoned(src: Path, dst: Path, tensor: str, value: float) -> Path:
    """A copy of checkpoint `src` whose tensor `tensor` has one value set to `value`."""
    shutil.copytree(src, dst)
    file = dst / "model.safetensors"
    tensors = load_file(str(file))
    tensors[tensor].view(-1)[0] = value
    save_file(tensors, str(file), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("method", ["fp8", "awq", "gptq"])
def test_a_non_finite_quantization_scale_is_refused_naming_it(method, value, wide_qwen3, tmp_path):
    quantized = tmp_path / method
    if method == "fp8":
        write_fp8_checkpoint(wide_qwen3, quantized)
        tensor = "model.layers.1.self_attn.k_proj.weight_scale_inv"
    else:
        write_int4_checkpoint(wide_qwen3, quantized, None, method)
        tensor = "model.layers.1.mlp.up_proj.scales"
    LLM(str(quantized), dtype="float32", device="cpu")  # the good checkpoint loads
    bad = poisoned(quantized, tmp_path / "bad", tensor, value)
    with pytest.raises(ValueError, match=rf"{tensor}: 1 of \d+ quantization scales are NaN or inf"):
        LLM(str(bad), dtype="float32", device="cpu")


def test_non_finite_adapters_are_refused_naming_the_tensor_or_setting(qwen3_dir, good, tmp_path):
    good_dir, expected = good

    def set_first(part: str, value: float):
        def edit(sd: dict) -> None:
            sd[first_key(sd, part)].view(-1)[3] = value
        return edit

    bad = {
        "nan_a": (variant(good_dir, tmp_path, "nan_a", tensors=set_first("lora_A", float("nan"))),
                  r"lora_A\.weight holds 1 NaN or inf value"),
        "inf_b": (variant(good_dir, tmp_path, "inf_b", tensors=set_first("lora_B", float("-inf"))),
                  r"lora_B\.weight holds 1 NaN or inf value"),
        "inf_alpha": (variant(good_dir, tmp_path, "inf_alpha", config=lambda c: c.update(lora_alpha=float("inf"))),
                      r"'lora_alpha' must be a finite positive number, got inf"),
        "nan_alpha": (variant(good_dir, tmp_path, "nan_alpha", config=lambda c: c.update(lora_alpha=float("nan"))),
                      r"'lora_alpha' must be a finite positive number, got nan"),
        "inf_pattern": (variant(good_dir, tmp_path, "inf_pattern",
                                config=lambda c: c.update(alpha_pattern={"q_proj": float("inf")})),
                        r"alpha_pattern\['q_proj'\] must be a finite positive number, got inf"),
        # finite, but alpha / r times B overflows float32 once scaled
        "overflow": (variant(good_dir, tmp_path, "overflow", config=lambda c: c.update(lora_alpha=1e300)),
                     r"scaled by lora_alpha / r, B of the layer is not finite in float32"),
    }
    assert "Infinity" in (bad["inf_alpha"][0] / "adapter_config.json").read_text()  # JSON as Python writes it
    llm = LLM(str(qwen3_dir), dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8)
    names = ["good", *bad]
    requests = [LoRARequest(n, i + 1, str(good_dir if n == "good" else bad[n][0])) for i, n in enumerate(names)]
    outs = llm.chat([MSGS] * len(names), params(), use_tqdm=False, lora_request=requests)
    for name, out in zip(names, outs):
        if name == "good":
            assert_matches(out, expected, name)
        else:
            assert out.error is not None and repr(name) in out.error and re.search(bad[name][1], out.error), \
                (name, out.error)
