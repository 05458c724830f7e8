"""The features' settings that `EngineConfig` (`vlmrun/config.py`) holds, on its floor (the bottom one).

Each module is a leaf (it imports nothing of vlmrun), so the configuration can check a feature's
settings without importing the feature, which sits on a higher floor:
- `quantization.py`: `QuantizationConfig`, the quantization a checkpoint declares or the user asks for
  (the linear methods that run it are `vlmrun/quantization/`);
- `speculative.py`: `SpeculativeConfig`, speculative decoding's settings (the proposers and the verify
  step are `vlmrun/spec_decode/`).
"""
