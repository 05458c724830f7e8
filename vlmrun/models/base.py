"""The interface every model implements, in code: `Model`.

A model is built from its HF config (`transformers.AutoConfig`) and gives the engine:
- `forward(input_ids [T], positions [3, T], fb) -> hidden [T, hidden]`: full-attention layers call
  `Attention` and GDN layers `GDNAttention` (`vlmrun.layers.attention`); the backend behind
  `fb` does the rest. Image rows come spliced from `fb.mm_mask` / `fb.mm_embeds`.
- `compute_logits(hidden [n, hidden]) -> [n, vocab]` float32, through `lm_head`.
- `load_weights(weights) -> set[str]`: HF-named tensors into parameters through the one loader
  (`vlmrun.models.weights.load_checkpoint`), by the model's `checkpoint_name` (and
  `transform_weight` where a layout needs rearranging).
- `cache_shape() -> CacheShape`: what the KV pool and the GDN state pool hold for it.
- `supports_images` and `encode_images(pixel_values, grid_thw) -> VisionEmbeddings` for VL models;
  `mm_extras` names the model-owned tensors beside the embeddings (`VisionEmbeddings.extras`, e.g.
  Qwen3-VL's DeepStack features) that reach its forward as `fb.mm_extras`.
- `prompt_positions(hf_config) -> PromptPositions` (a classmethod): how a prompt's tokens are placed
  and the decode delta (`vlmrun.multimodal.prompt_positions`): 1-D by default, M-RoPE for the VL families.

One hook for the families' text stacks: `make_mlp(text_config, layer) -> nn.Module`, the MLP of a
decoder layer (the dense SwiGLU here; a family with sparse MoE layers overrides it).

The LM head is tied to the input embeddings when the config's top-level `tie_word_embeddings`
says so: the rule transformers 5 applies.

Tensor parallelism: a model is built with `tp` (`vlmrun.parallel.TensorParallel`, one rank of
`tp.size`; `SINGLE` by default) and passes it to the layers it shards; `cache_shape()` is then
this rank's share of the caches.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Iterable, Optional

import torch
from torch import nn

from vlmrun.config import CacheShape
from vlmrun.forward_batch import ForwardBatch
from vlmrun.layers.linear import ParallelLMHead, VocabParallelEmbedding
from vlmrun.layers.mlp import SwiGLUMLP
from vlmrun.models.blocks.vision_common import GridTHW, VisionEmbeddings
from vlmrun.models.weights import load_checkpoint
from vlmrun.multimodal.prompt_positions import LinearPositions, PromptPositions
from vlmrun.parallel import SINGLE, TensorParallel


class Model(nn.Module, ABC):
    supports_images: ClassVar[bool] = False
    mm_extras: ClassVar[tuple[str, ...]] = ()  # names of the extras `encode_images` returns beside the embeddings
    lm_head: ParallelLMHead

    def __init__(self, config: Any, tp: TensorParallel = SINGLE):
        super().__init__()
        self.config = config
        self.tp = tp

    @classmethod
    def prompt_positions(cls, hf_config: Any) -> PromptPositions:
        """How this family places a prompt's tokens (and the decode delta): 1-D positions here."""
        return LinearPositions()

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """input_ids [T], positions [3, T] -> hidden states [T, hidden]."""

    @abstractmethod
    def checkpoint_name(self, hf_name: str) -> Optional[str]:
        """Our parameter name for a checkpoint tensor, or None to skip it."""

    def transform_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Rearrange a checkpoint tensor before it is copied into parameter `name` (as is by default)."""
        return tensor

    def lora_output_rows(self, layer: str, rows: torch.Tensor) -> torch.Tensor:
        """A LoRA B [out, rank] of linear layer `layer` with its output rows in the order the layer keeps
        them (as `transform_weight` orders the base weight's rows; as is by default)."""
        return rows

    @property
    def ties_word_embeddings(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))

    def make_lm_head(self, embed: VocabParallelEmbedding) -> ParallelLMHead:
        """The LM head over `embed`'s vocabulary, sharing its weight when the config ties them."""
        head = ParallelLMHead(embed.num_embeddings, embed.embedding_dim, self.tp)
        if self.ties_word_embeddings:
            head.weight = embed.weight
        return head

    def make_mlp(self, text_config: Any, layer: int) -> nn.Module:
        """The MLP of text decoder layer `layer`: the dense SwiGLU (families with MoE layers override this)."""
        return SwiGLUMLP(text_config.hidden_size, text_config.intermediate_size,
                         getattr(text_config, "hidden_act", "silu"), tp=self.tp)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # [n, vocab]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        tied = self.ties_word_embeddings

        def rename(hf_name: str) -> Optional[str]:
            name = self.checkpoint_name(hf_name)
            return None if tied and name == "lm_head.weight" else name  # it is the embedding

        return load_checkpoint(self, weights, rename, transform=self.transform_weight)

    def cache_shape(self) -> CacheShape:
        return CacheShape.from_hf_config(self.config).for_tensor_parallel(self.tp.size)

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: GridTHW) -> VisionEmbeddings:
        """pixel_values [num_patches, C * T * P * P] -> embeddings, rows image by image (VL models)."""
        raise NotImplementedError(f"{type(self).__name__} takes no images")


def vl_checkpoint_name(name: str) -> Optional[str]:
    """The VL families' names: transformers 5 (`model.language_model.*`, `model.visual.*`) or hub
    (`model.*`, `visual.*`) -> `language_model.*` / `visual.*`; `lm_head.*` as is; others skipped."""
    for prefix, ours in (("model.language_model.", "language_model."), ("model.visual.", "visual."),
                         ("visual.", "visual."), ("model.", "language_model."), ("lm_head.", "lm_head.")):
        if name.startswith(prefix):
            return ours + name[len(prefix):]
    return None
