"""PEFT LoRA adapters for the tiny checkpoints, made by `peft` itself, and HF + PEFT as their reference.

`build_peft_adapter(model_dir, out_dir, ...)` wraps the checkpoint's HF model with `peft.get_peft_model`
(`target_modules` a list or a regex string, `target_parameters` for the MoE experts' fused tensors),
gives every A and B random values from a seeded generator (B non-zero: PEFT's default B is zero, which
would test nothing) and saves the adapter as PEFT saves it. `peft_reference(model_dir, adapter_dir)` is
`HFReference` with the adapter applied by `PeftModel.from_pretrained`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import torch

from testing.hf_reference import HFReference

# Every text linear of the Qwen families (attention, MLP and shared expert, GDN projections).
TEXT_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj",
                "shared_expert_gate"]
# The text model only (a regex keeps the vision tower's gate/up/down and qkv out).
TEXT_ONLY_REGEX = r".*language_model.*\.(q_proj|v_proj|down_proj|in_proj_qkv|out_proj)|model\.layers\..*\.(q_proj|v_proj|down_proj|in_proj_qkvz|out_proj)"
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# The vision tower and merger of both towers (Qwen2.5-VL: attn.qkv / proj, mlp.gate|up|down_proj, merger.mlp.0/2;
# Qwen3-VL: attn.qkv / proj, mlp.linear_fc1/2, merger.linear_fc1/2).
VISION_REGEX = r".*visual\.(blocks|merger|deepstack_merger_list)\..*\.?(qkv|proj|linear_fc1|linear_fc2|gate_proj|up_proj|down_proj|mlp\.0|mlp\.2)"


def _hf_model(model_dir: Path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(model_dir)
    cls = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    return cls.from_pretrained(model_dir, dtype=torch.float32)


def build_peft_adapter(model_dir: Path, out_dir: Path, *, target_modules: Union[list[str], str],
                       target_parameters: Optional[list[str]] = None, r: int = 4, lora_alpha: float = 8,
                       use_rslora: bool = False, seed: int = 0, b_gain: float = 0.5) -> Path:
    """A PEFT adapter of `model_dir` saved in `out_dir`: A ~ N(0, 1/in), B ~ N(0, b_gain^2 / r), seeded."""
    from peft import LoraConfig, get_peft_model

    model = _hf_model(Path(model_dir))
    if isinstance(target_modules, list):  # only the names this model has (PEFT refuses a list that matches none)
        names = {n.rpartition(".")[2] for n, _ in model.named_modules()}
        target_modules = [t for t in target_modules if t in names]
    config = LoraConfig(r=r, lora_alpha=lora_alpha, use_rslora=use_rslora, target_modules=target_modules,
                        target_parameters=target_parameters or None, lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_A." in name:
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[1] ** 0.5)
            elif ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=gen) * b_gain / param.shape[1] ** 0.5)
    out_dir = Path(out_dir)
    peft_model.save_pretrained(str(out_dir))
    return out_dir


def peft_reference(model_dir: Path, adapter_dir: Path) -> HFReference:
    """HF's model of `model_dir` with the adapter applied by PEFT (float32, CPU, eager attention)."""
    from peft import PeftModel

    ref = HFReference(model_dir)
    ref.model = PeftModel.from_pretrained(ref.model, str(adapter_dir)).eval()
    return ref
