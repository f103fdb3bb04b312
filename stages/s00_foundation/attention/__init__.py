"""The attention seam: the model computes q, k, v and hands them to a backend with the batch.

A backend decides where K/V are stored and which earlier tokens each query can see. Stage 1
uses ``NoCacheBackend`` (every pass sends whole sequences); later stages plug in backends that
keep K/V in a per-request cache, then in a shared paged pool.
"""

from .backend import AttentionBackend, causal_attention
from .no_cache import NoCacheBackend

__all__ = ["AttentionBackend", "NoCacheBackend", "causal_attention"]
