"""What tests, benchmarks and training share, kept in the checkout and never installed.

`tiny_models` builds tiny random checkpoints and a tiny tokenizer, `hf_reference` runs HF
transformers as the reference, `videos` writes small test videos. Modules here import `vlmrun`
and third-party libraries only, never `tests`, `bench` or `training` (tests/test_imports.py checks).
"""
