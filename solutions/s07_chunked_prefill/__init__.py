"""Stage 7: chunked prefill - a per-step prefill token budget; a prompt longer than it is
computed a chunk per step, in the same forward pass as the running requests' decodes, so one
long prompt no longer freezes everyone else's token stream."""
