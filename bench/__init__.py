"""Benchmark scripts, run from the repository root as `python -m bench.NAME` (results: BENCHMARKS.md).

`common` and `gemm_ceiling` are what the scripts share; a script imports those, `vlmrun` and
`testing`, never another script (tests/test_imports.py checks).
"""
