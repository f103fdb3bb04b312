"""Stage 3: the KV cache - prefill the prompt once, then decode one token per step against
each request's stored keys and values instead of recomputing the whole sequence."""
