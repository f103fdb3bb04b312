"""Stage 8: CUDA graphs for decode - decode passes captured once per (batch size, key length)
bucket and replayed, batches padded to their bucket with dummy requests that write only a reserved
dummy KV slot, static input/output buffers, an attention decode path that reads only static
tensors, and the eager fallback for prefills, mixed batches and decodes larger or longer than the
largest bucket (on a CPU the same path runs eagerly)."""
