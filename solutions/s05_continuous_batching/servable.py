"""Which requests an engine can ever serve, and the error for one it never can.

A request that could not finish here whatever else runs - a prompt longer than the model's
context, a prompt plus max_new_tokens past the context, the KV pool or the request table - is
refused when it is added, saying what to shorten, instead of waiting in the queue forever.

Each of the three is a capacity in positions, and a request needs ``prompt + max_new_tokens - 1``
of them (its last token is sampled but never fed back, so never stored). The error keeps the
numbers, so a server can say the same thing in its API's words (``max_tokens``).

This module imports no model code, so a server's other processes can name the error
(``RequestTooLong``) without loading the engine.
"""

from __future__ import annotations

from typing import Hashable, Literal

from s02_request_and_sampling.req import Req


class RequestTooLong(ValueError):
    """A request that could never fit this engine: it needs ``needed`` positions and ``limit``
    (e.g. "the model's context") holds ``capacity``. ``field`` is what its caller would shorten:
    "prompt" or "max_new_tokens" (a server answers it as OpenAI's ``context_length_exceeded``)."""

    def __init__(self, rid: Hashable, prompt_tokens: int, max_new_tokens: int, limit: str, capacity: int):
        self.rid, self.limit, self.capacity = rid, limit, capacity
        self.prompt_tokens, self.max_new_tokens = prompt_tokens, max_new_tokens
        self.needed = prompt_tokens + max_new_tokens - 1
        # With a prompt that fits, a smaller max_new_tokens (at least 1) always would.
        self.field: Literal["prompt", "max_new_tokens"] = "prompt" if prompt_tokens > capacity else "max_new_tokens"
        super().__init__(f"request {rid}: {self.describe()}")

    def describe(self, max_new_name: str = "max_new_tokens") -> str:
        """What is too long and what to do, calling max_new_tokens ``max_new_name``."""
        if self.field == "prompt":
            return f"the prompt has {self.prompt_tokens} tokens, but {self.limit} holds {self.capacity}"
        return (
            f"a prompt of {self.prompt_tokens} tokens plus {max_new_name}={self.max_new_tokens} needs "
            f"{self.needed} positions (the last token is never stored), but {self.limit} holds {self.capacity}; "
            f"lower {max_new_name} to at most {self.capacity - self.prompt_tokens + 1}"
        )


def check_servable(req: Req, context: int, pool: int, table_width: int, page_size: int) -> None:
    """Raise RequestTooLong unless ``req`` fits the model's ``context``, a KV ``pool`` of that
    many slots (in pages of ``page_size``) and a request table ``table_width`` positions wide."""
    prompt, max_new = len(req.origin_input_ids), req.sampling_params.max_new_tokens
    limits = (
        ("the model's context", context),
        ("the whole KV pool (pool_size)", pool // page_size * page_size),  # a request holds whole pages
        ("the request table (max_context_len)", table_width),
    )
    for limit, capacity in limits:
        if prompt + max_new - 1 > capacity:
            raise RequestTooLong(req.rid, prompt, max_new, limit, capacity)
