"""Quantized checkpoints: which format a checkpoint's weights are in, and the linear methods that run them.

- `vlmrun/configs/quantization.py` (on the bottom floor, beside `vlmrun.config`, which holds it):
  `QuantizationConfig` from the checkpoint's `quantization_config` and the user's `quantization`
  (vLLM's names: "fp8", "awq", "gptq"; None = from the checkpoint); any method or variant not
  supported is an error at load, naming it.
- `assign.py`: gives each linear layer of a built model its `LinearMethod`
  (`vlmrun.layers.linear_method`), by the checkpoint's names of its modules and the config's
  unquantized-module list.
- `fp8.py`: FP8 block-wise weights (Qwen's `-FP8` checkpoints, and online FP8 of a float checkpoint);
  `fp8_blocks.py` their block arithmetic in plain torch.
- `int4.py`: AWQ / GPTQ 4-bit weights.
"""
