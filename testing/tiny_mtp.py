"""A multi-token-prediction (MTP) layer for the tiny hybrid checkpoints (Qwen3.5, Qwen3.5-MoE, Qwen3-Next).

`add_mtp_layer(model_dir)` gives a checkpoint built by `testing.tiny_models.build_tiny_checkpoint`
what the released Qwen3.5 / Qwen3-Next checkpoints carry: `mtp_num_hidden_layers: 1` in its (text)
config and random `mtp.*` weights in a shard of their own, listed in the shard index. The names are
the released ones: `mtp.fc.weight` [h, 2h], `mtp.pre_fc_norm_embedding.weight`,
`mtp.pre_fc_norm_hidden.weight`, `mtp.norm.weight` and, under `mtp.layers.0.`, the state dict of
transformers' own decoder layer of the family with full attention and the MLP of decoder layer 0.
`MTPReference` computes, with those same transformers modules, what the layer drafts.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

MTP_SHARD = "model-mtp.safetensors"
_DECODER_LAYERS = {  # model_type -> (transformers module, decoder layer class)
    "qwen3_next": ("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextDecoderLayer"),
    "qwen3_5": ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5DecoderLayer"),
    "qwen3_5_moe": ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeDecoderLayer"),
}


def hf_mtp_decoder_layer(config: Any) -> torch.nn.Module:
    """transformers' decoder layer of the checkpoint's family, with full attention and the MLP of layer 0."""
    import importlib

    module, name = _DECODER_LAYERS[config.model_type]
    text = copy.deepcopy(config.get_text_config())
    text.layer_types = ["full_attention"] + list(text.layer_types[1:])
    text._attn_implementation = "sdpa"
    return getattr(importlib.import_module(module), name)(text, 0)


def add_mtp_layer(model_dir: Path, seed: int = 0) -> Path:
    """Random `mtp.*` weights and `mtp_num_hidden_layers: 1` added to the checkpoint in `model_dir`."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    text = config.get_text_config()
    hidden = text.hidden_size
    gen = torch.Generator().manual_seed(seed)
    layer = hf_mtp_decoder_layer(config)
    weights = {f"mtp.layers.0.{name}": _random_like(t, name, gen) for name, t in layer.state_dict().items()}
    weights["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) / (2 * hidden) ** 0.5
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        weights[f"mtp.{norm}.weight"] = torch.randn(hidden, generator=gen) * 0.1  # zero-centred norms
    save_file({k: v.contiguous() for k, v in weights.items()}, str(model_dir / MTP_SHARD))
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update({name: MTP_SHARD for name in weights})
    index_path.write_text(json.dumps(index, indent=2))
    raw = json.loads((model_dir / "config.json").read_text())
    (raw["text_config"] if "text_config" in raw else raw)["mtp_num_hidden_layers"] = 1
    (model_dir / "config.json").write_text(json.dumps(raw, indent=2))
    return model_dir


def _random_like(tensor: torch.Tensor, name: str, gen: torch.Generator) -> torch.Tensor:
    """Weights scaled by their fan-in; norm weights (zero-centred) small around 0."""
    if tensor.dim() == 1:
        return torch.randn(tensor.shape, generator=gen) * 0.1
    return torch.randn(tensor.shape, generator=gen) / tensor.shape[-1] ** 0.5


class MTPReference:
    """What the MTP layer drafts after a context, computed with transformers' modules (float32, CPU):
    the whole context through the model, then the layer over every position and once more per draft."""

    def __init__(self, model_dir: Path):
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        config = AutoConfig.from_pretrained(str(model_dir))
        vl = hasattr(config, "vision_config")
        loader = AutoModelForImageTextToText if vl else AutoModelForCausalLM
        self.model = loader.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.text_model = self.model.model.language_model if vl else self.model.model
        self.layer = hf_mtp_decoder_layer(config).eval()
        weights = load_file(str(model_dir / MTP_SHARD))
        self.layer.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in weights.items()
                                    if k.startswith("mtp.layers.0.")})
        self.fc = weights["mtp.fc.weight"]
        self.norms = {n: weights[f"mtp.{n}.weight"] for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
        self.eps = config.get_text_config().rms_norm_eps

    def _norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.norms[name])

    @torch.inference_mode()
    def drafts(self, context: list[int], k: int) -> list[int]:
        """The k greedy drafts after `context` (text tokens): draft 1 from the layer at the context's
        second-to-last position; each next one from the layer one position on, on the draft before."""
        ids = torch.tensor([context])
        hidden = self.text_model(input_ids=ids).last_hidden_state[0]  # [T, h], after the final norm
        embed = self.text_model.embed_tokens
        inputs = embed(ids[0, 1:])  # the token after each position q = 0 .. T-2
        states = hidden[:-1]
        out_drafts: list[int] = []
        for _ in range(k):
            x = torch.cat([self._norm("pre_fc_norm_embedding", inputs), self._norm("pre_fc_norm_hidden", states)], -1)
            x = x @ self.fc.T
            n = x.shape[0]
            positions = torch.arange(n)[None]
            cos_sin = self.text_model.rotary_emb(x[None], positions)
            h = self.layer(x[None], position_embeddings=cos_sin, attention_mask=None, position_ids=positions)
            h = h[0] if isinstance(h, tuple) else h
            out = self._norm("norm", h[0])  # [n, h]
            draft = int(self.model.lm_head(out[-1]).argmax())
            out_drafts.append(draft)
            inputs = torch.cat([inputs, embed(torch.tensor([draft]))])
            states = torch.cat([states, out[-1:]])
        return out_drafts
