"""vLLM's request fields that change how a request is scheduled and cached, not what it samples.

`priority` (an int, default 0): its place under the engine's "priority" scheduling policy (lower first);
a non-zero one on an engine started with "fcfs" is the engine's 400 naming the field, as in vLLM.
`cache_salt` (a non-empty string): its prompts' prefix-cache entries are hit only by prompts of the same
salt (`ProcessedPrompt.cache_salt`), so one tenant's prompts cannot be timed against another's cache.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from vlmrun.processors import ProcessedPrompt
from vlmrun.processors.limits import quote
from vlmrun.server.body_fields import opt_int
from vlmrun.server.errors import bad_request

MAX_CACHE_SALT_CHARS = 1024


@dataclass(frozen=True)
class SchedulingFields:
    priority: int = 0
    cache_salt: Optional[str] = None

    @classmethod
    def of(cls, body: dict[str, Any]) -> "SchedulingFields":
        """The body's fields, checked (400 naming the field)."""
        priority = opt_int(body, "priority", 0)
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > MAX_CACHE_SALT_CHARS):
            raise bad_request(f"'cache_salt' must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
                              f"characters if given, got {quote(salt, 40)}", param="cache_salt")
        return cls(priority, salt)

    def salted(self, prompt: ProcessedPrompt) -> ProcessedPrompt:
        """`prompt` with this request's cache salt (as it is without one)."""
        return prompt if self.cache_salt is None else dataclasses.replace(prompt, cache_salt=self.cache_salt)
