"""LoRA adapters (PEFT's format) served over one base model, rows of different adapters in one batch.

- `request.py`: `LoRARequest(name, id, path)`, vLLM's class and field names.
- `peft_files.py`: an adapter folder (`adapter_config.json` + `adapter_model.safetensors`) read and
  checked: rank, alpha, rsLoRA, the per-module A / B tensors; what is not supported is refused by name.
- `mapping.py`: those tensors laid out for this model's layers on this rank (fused q | k | v and
  gate | up parts, tensor-parallel slices, the scaling folded into B).
- `layers.py`: the per-layer slot tensors and the batched update over rows of mixed adapters (torch ops).
- `triton_ops.py`: that update as Triton kernels, rows grouped by slot (opt-in `lora_kernel="triton"`, CUDA).
- `manager.py`: `LoRAManager`: adapters in a fixed number of slots with LRU eviction; each step
  binds the rows' slots to the layers.

docs/lora.md says what works and what does not.
"""
