"""How a chat request's messages become its prompt, by vLLM's template fields, and what those fields
change in the answer.

The fields (vLLM's names and meaning): `add_generation_prompt` (default true: open the assistant's
reply); `continue_final_message` (leave the last message open for the model to continue; only with
`add_generation_prompt` false); `chat_template` (this request's template, given as its text, used
instead of the server's; as in vLLM only on a server started with --trust-request-chat-template, else
a 400 naming it); `chat_template_kwargs` (template variables; not the arguments of the template call,
which the server sets); `documents` (a list of {"title", "text"}-style objects for templates that
take them); `mm_processor_kwargs` (`min_pixels`, `max_pixels`, `fps` for every image / video that
does not set its own, over the server's --mm-processor-kwargs); `add_special_tokens` (default false:
the tokenizer's special tokens around the rendered prompt; Qwen's tokenizers add none, and a chat
on a tokenizer that would is a 400 naming it).

In the answer: the message's role is "assistant", or, with `add_generation_prompt` false, the last
message's role; chat `echo` puts the last message's text before the answer's when that message has
the answer's role (with `continue_final_message`: the assistant text being continued), as vLLM does.
The prompt itself is rendered by `chat_handler.render_chat`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from transformers import PreTrainedTokenizerBase

from vlmrun.processors import InputError
from vlmrun.processors.processor_kwargs import check_processor_kwargs
from vlmrun.server.body_fields import opt_bool
from vlmrun.server.errors import bad_request

# Arguments of the tokenizer's apply_chat_template call: not template variables, so not client-settable.
_TEMPLATE_CALL_ARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})
_JINJA_MARKS = ("{{", "{%")


@dataclass(frozen=True)
class ChatPromptOptions:
    """How the messages are rendered (see the module docstring)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)
    documents: Optional[list[dict[str, Any]]] = None
    add_special_tokens: bool = False

    def template_variables(self) -> dict[str, Any]:
        """What the template reads besides messages and tools: the kwargs, and the documents when given."""
        return {**self.chat_template_kwargs, **({"documents": self.documents} if self.documents else {})}


def chat_prompt_options(body: dict[str, Any]) -> ChatPromptOptions:
    """The body's template fields, checked (400 naming the field)."""
    add_generation_prompt = opt_bool(body, "add_generation_prompt", True)
    continue_final_message = opt_bool(body, "continue_final_message", False)
    if add_generation_prompt and continue_final_message:
        raise bad_request("'continue_final_message' and 'add_generation_prompt' cannot both be true: set "
                          "'add_generation_prompt' to false to continue the last message",
                          param="continue_final_message")
    template = body.get("chat_template")
    if template is not None and not (isinstance(template, str) and any(m in template for m in _JINJA_MARKS)
                                     and not os.path.exists(template)):
        raise bad_request("'chat_template' must be a Jinja chat template, given as its text", param="chat_template")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    reserved = sorted(set(kwargs) & _TEMPLATE_CALL_ARGS)
    if reserved:
        raise bad_request(f"'chat_template_kwargs' may not set {', '.join(reserved)}: the server sets those "
                          "(template variables only)", param="chat_template_kwargs")
    mm_kwargs = body.get("mm_processor_kwargs")
    try:
        mm_kwargs = check_processor_kwargs(mm_kwargs) if mm_kwargs is not None else {}
    except InputError as exc:
        raise bad_request(str(exc), param="mm_processor_kwargs") from None
    documents = body.get("documents")
    if documents is not None and not (isinstance(documents, list) and all(isinstance(d, dict) for d in documents)):
        raise bad_request("'documents' must be a list of objects (e.g. {'title': ..., 'text': ...})",
                          param="documents")
    return ChatPromptOptions(add_generation_prompt, continue_final_message, template, kwargs, mm_kwargs, documents,
                             opt_bool(body, "add_special_tokens", False))


def response_role(messages: list[Any], options: ChatPromptOptions, generation_role: str = "assistant") -> str:
    """The answer's role: `generation_role` (vLLM's --response-role), or the last message's when no generation
    prompt opens a reply (vLLM's)."""
    return generation_role if options.add_generation_prompt else messages[-1]["role"]


def echo_text(messages: list[Any], role: str) -> str:
    """What chat `echo` puts before the answer: the last message's text (its text parts joined by
    newlines) when it has the answer's `role`, else nothing."""
    last = messages[-1]
    if last.get("role") != role:
        return ""
    content = last.get("content") or ""
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content if isinstance(part, dict) and part.get("type") == "text"
                         and isinstance(part.get("text"), str))
    return content if isinstance(content, str) else ""


def special_tokens_around(tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after a text when it adds special tokens (a BOS, an EOS;
    none for Qwen's tokenizers): found by encoding one word with and without them."""
    plain = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start], full[start + len(plain):]
    return [], []
