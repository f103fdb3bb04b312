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

Measured on this course's 2-core CPU (SmolLM2-135M, float32, 2 torch threads, the engine on
``make bench``'s workloads, back to back: ``tools/benchmark_offline.py --workload a,b --threads 2
--skip-transformers --skip-ceiling`` with and without ``--torch-compile``): no gain. Workload a
took 11.96 s compiled against 10.61 s eager, workload b 63.1 s against 63.6 s. A CPU pass of this
model is its matrix products (68% of workload a's time, in oneDNN either way; traced code gets
``F.linear``, see s00 linear.py); the fused element-wise steps are a few percent of it, and each
compiled module adds its own guards and calls. Writing the decode attention out for Inductor to
fuse its gather (so the keys are read straight from the pool) won in isolation and lost inside
the engine on an earlier machine (36 ms per layer against 14 for gather + SDPA, 64 requests of
256 tokens); decode_kernel.cpp reads the pool in place in a loop written for it instead. So it
is off by default; on a GPU, where fusion saves memory traffic and launches, it is the experiment
to run next (SGLang compiles small decode batches there).

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
