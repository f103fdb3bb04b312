"""Stage 6: the radix cache - finished requests' K/V kept in a radix tree over token ids, so a
request starts its prefill at the end of its longest cached prefix (shared system prompts are
computed once); locked nodes stay, unlocked leaves are evicted LRU when the pool runs short."""
