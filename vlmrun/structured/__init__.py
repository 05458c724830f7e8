"""Structured outputs: decoding constrained by a JSON schema, a regex, a choice or an EBNF grammar.

- `StructuredOutputsParams` (`params.py`): what a request asks for, vLLM's names; checked for
  shape when built, compiled when the engine accepts the request.
- `GrammarCompiler` (`compiler.py`): specs -> xgrammar compiled grammars, cached by their text
  (thread-safe), for one tokenizer and logits width; a bad spec raises `StructuredOutputError`.
- `GrammarState` (`compiler.py`): one request's matcher: fills its row of the token bitmask the
  sampler applies, accepts each sampled token, says when the grammar has terminated.
- `ReasoningGate` (`reasoning.py`): in front of a request's matcher when its constraint holds only
  after `<think>…</think>` (`after_reasoning`) or its reasoning has a budget: no mask and no
  matcher advance while the model thinks.
- `GrammarLimits` (`limits.py`): how large a client's constraint may be before anything compiles it.

xgrammar is imported only when the first grammar is compiled.
"""

from vlmrun.structured.limits import GrammarLimits
from vlmrun.structured.params import StructuredOutputError, StructuredOutputsParams

__all__ = ["GrammarLimits", "StructuredOutputError", "StructuredOutputsParams"]
