"""What a preprocessing worker process runs for `LLM.generate` and `LLM.chat`: picklable prepare objects.

A worker thread runs `LLM`'s own closures over the engine's processor; a worker process cannot be sent a
closure (nor the engine), so the same work is written here as dataclasses holding the `Processor` (it
pickles as its checkpoint folder and options, `Processor.__reduce__`) and the call's options. They
import the processor and the prompt forms only, not the engine: a worker process starts in the time
it takes to import torch and load the tokenizer. `tests/test_feed_processes.py` checks that they give
the prompts the threads give (`Engine.process`, `LLM._processing`), bit for bit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from vlmrun.engine.prompt_forms import RawPrompt, UserTurnPrompt, parse_prompt, with_processor_kwargs
from vlmrun.processors import ProcessedPrompt
from vlmrun.processors.processor import Processor


@dataclass
class GeneratePrepare:
    """`LLM.generate`'s processing of one prompt: `Engine.process`, or with a call's `mm_processor_kwargs`
    under the prompt's own (as `LLM._processing`)."""

    processor: Processor
    mm_processor_kwargs: Optional[dict[str, Any]] = None

    def __call__(self, prompt: Any) -> ProcessedPrompt:
        kwargs = self.mm_processor_kwargs
        parsed = parse_prompt(prompt)
        if kwargs is not None:
            parsed = with_processor_kwargs(parsed, kwargs)
        if isinstance(parsed, ProcessedPrompt):
            return parsed
        if isinstance(parsed, RawPrompt):
            text_or_ids = parsed.token_ids if parsed.token_ids is not None else parsed.text
            processed = self.processor.process_raw(text_or_ids, parsed.images, videos=parsed.videos,
                                                   mm_processor_kwargs=parsed.mm_processor_kwargs)
            return dataclasses.replace(processed, cache_salt=parsed.cache_salt)
        if isinstance(parsed, UserTurnPrompt):
            return self.processor.process_prompt(parsed.text, parsed.images, videos=parsed.videos,
                                                 mm_processor_kwargs=kwargs)
        return self.processor.process_chat(parsed, mm_processor_kwargs=kwargs)


@dataclass
class ChatPrepare:
    """`LLM.chat`'s processing of one conversation (its options as `LLM.chat_stream` passes them)."""

    processor: Processor
    add_generation_prompt: bool = True
    options: dict[str, Any] = field(default_factory=dict)  # tools, chat_template(_kwargs), continue_final_message, ...

    def __call__(self, conversation: Any) -> ProcessedPrompt:
        return self.processor.process_chat(conversation, self.add_generation_prompt, **self.options)
