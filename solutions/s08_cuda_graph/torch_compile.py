"""``torch.compile`` of the decoder layers: the model's own math through Inductor, attention eager.

Between two attention calls a layer runs a chain of small operators: RMSNorm (square, mean,
rsqrt, multiply), the q/k/v projections, q/k norms, RoPE (slices, negation, concatenation,
multiplications), the output projection, a residual add, another RMSNorm, the MLP (two
projections, SiLU, a product, a third projection) and a second residual. Eagerly each operator
is a call from Python that reads its input from memory and writes a new tensor. Inductor, the
compiler behind ``torch.compile``, turns the chain into generated code (vectorised C++ on a CPU,
Triton on a GPU) that fuses the element-wise steps into the loops around them; the matrix
products still go to the same BLAS / cuBLAS calls.

What is compiled: each layer's MLP and RMSNorms, the modules between the attention calls that
are pure tensor math. The attention layer stays eager: its backend's Python reads the batch's
lists and builds index arrays, which a compiler would specialise on (a recompilation for every
new batch). Shapes are dynamic (one compilation serves every token count), and the 30 layers
share the compiled code: their weights are its inputs.

Measured on this course's 2-core CPU (SmolLM2-135M, float32, 1 thread, CPU time of a bare pass
without attention): no gain, a little worse: 16 decode tokens 145-165 ms eager, 175-192 compiled;
64 tokens 297-395 vs 359-399; a 512-token prefill 1498-1553 vs 1595-1702; and ~24 s of
compilation before the first passes (with an empty Inductor cache). A CPU pass of this model is
the matrix products (MKL either way); the fused element-wise steps are a few percent of it. Writing
the decode attention out for Inductor to fuse its gather (so the keys are read straight from the
pool) won in isolation and lost inside the engine (36 ms per layer against 14 for gather + SDPA,
64 requests of 256 tokens). So it is off by default; on a GPU, where fusion saves memory traffic
and launches, it is the experiment to run next (SGLang compiles small decode batches there).

The price is start-up: the first pass compiles (tens of seconds on a CPU), and so does the first
pass of a new kind of shape. ``Engine(enable_torch_compile=True)`` turns it on; off by default, so
that the code a learner steps through is the plain model.
"""

from __future__ import annotations

from s00_foundation.model import CausalLM


def compile_model(model: CausalLM) -> None:
    """Compile every decoder layer's MLP and RMSNorms of ``model`` in place (the model changes for
    every engine that shares it)."""
    for layer in model.model.layers:
        for module in (layer.input_layernorm, layer.mlp, layer.post_attention_layernorm):
            module.compile(dynamic=True)
