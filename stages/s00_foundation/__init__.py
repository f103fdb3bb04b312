"""Stage 0: the provided foundation every stage stands on (never an exercise).

- ``config``: a Hugging Face ``config.json`` read into one small dataclass.
- ``model``: a Llama-family decoder (Llama / SmolLM2, Llama 3, Qwen2, Qwen3) in plain PyTorch.
- ``forward_batch``: the explicit batch object passed into the model (no global context).
- ``attention``: the attention backend seam the model calls; later stages plug in KV caches.
- ``loader`` / ``tokenizer`` / ``paths`` / ``device``: loading weights, text <-> ids, where the
  default model lives, which device and dtype to run on.
"""
