"""Speculative decoding: drafts proposed beside the model, verified in one forward of 1 + k positions.

`SpeculativeConfig` (vLLM's names) lives in `vlmrun/configs/speculative.py`, on the floor of
`vlmrun.config`, which holds it; here `ngram.py` is the prompt-lookup proposer,
`verify.py` what the model runner needs to verify a request's drafts (the sampling row of each
position, how many drafts the sampled tokens accept, a seeded generator wound to plain decode's
draws), `grammar.py` the grammar mask of each verified position of a structured-output request,
`metrics.py` the acceptance counters. The scheduler feeds the drafts and takes
back only the accepted positions; docs/spec_decode.md says what works and what does not.
"""
