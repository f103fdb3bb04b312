"""Which requests an engine can ever serve, and the error for one it never can.

A request that could not finish here whatever else runs - a prompt longer than the model's
context, a prompt plus max_new_tokens past the context, the KV pool or the request table - is
refused when it is added, saying what to shorten, instead of waiting in the queue forever.

This module imports no model code, so a server's other processes can name the error
(``RequestTooLong``) without loading the engine.
"""

from __future__ import annotations

from typing import Literal

from s02_request_and_sampling.req import Req
from s04_paged_kv_pool.allocator import pages_for


class RequestTooLong(ValueError):
    """A request that could never fit this engine. ``field`` is what its caller would shorten:
    "prompt" or "max_new_tokens" (a server answers it as OpenAI's ``context_length_exceeded``)."""

    def __init__(self, message: str, field: Literal["prompt", "max_new_tokens"]):
        super().__init__(message)
        self.field = field


def check_servable(req: Req, context: int, pool: int, table_width: int, page_size: int) -> None:
    """Raise RequestTooLong unless ``req`` fits the model's ``context``, a KV ``pool`` of that
    many slots (in pages of ``page_size``) and a request table ``table_width`` positions wide."""
    prompt, max_new = len(req.origin_input_ids), req.sampling_params.max_new_tokens
    longest = prompt + max_new - 1  # positions stored at the end (the last token is never fed back)
    if prompt > context:
        raise RequestTooLong(
            f"request {req.rid}: its prompt has {prompt} tokens, more than the model's context of {context} tokens",
            "prompt",
        )
    if longest > context:
        raise RequestTooLong(
            f"request {req.rid}: a prompt of {prompt} tokens plus max_new_tokens={max_new} needs {longest} "
            "positions, "
            f"more than the model's context of {context}; lower max_new_tokens to at most {context - prompt + 1}",
            "max_new_tokens",
        )
    needed = pages_for(longest, page_size) * page_size
    if needed > pool:
        what = (
            f"its prompt alone ({prompt} tokens)"
            if prompt > pool
            else f"a prompt of {prompt} tokens plus max_new_tokens={max_new}"
        )
        raise RequestTooLong(
            f"request {req.rid}: {what} needs up to {needed} KV slots, but the whole KV pool has {pool}; "
            "it could never finish. Make the pool bigger (pool_size) or lower max_new_tokens",
            "prompt" if prompt > pool else "max_new_tokens",
        )
    if longest > table_width:
        raise RequestTooLong(
            f"request {req.rid}: it needs {longest} positions, but the request table holds {table_width} per "
            "request "
            "(max_context_len); raise max_context_len or lower max_new_tokens",
            "prompt" if prompt > table_width else "max_new_tokens",
        )
