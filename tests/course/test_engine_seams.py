"""The engines' seams on the reference (not graded): config objects, each stage's own class names,
and the named policy for a leaving request's K/V."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reference import engine_model, engine_tokenizer
from s00_foundation import linear as linear_module
from s00_foundation.loader import load_model
from s02_request_and_sampling.sampling_params import SamplingParams
from s05_continuous_batching.engine import ContinuousBatchingEngine, EngineConfig
from s05_continuous_batching.prefix_cache import NoPrefixCache
from s05_continuous_batching.scheduler import Scheduler
from s06_radix_cache.engine import RadixEngine, RadixEngineConfig
from s06_radix_cache.radix_cache import RadixCache
from s06_radix_cache.scheduler import RadixScheduler
from s08_cuda_graph.engine import CudaGraphEngine

REPO = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)


def test_every_stage_package_names_its_engine_and_keeps_the_alias_engine():
    import s05_continuous_batching.engine as s05
    import s06_radix_cache.engine as s06
    import s07_chunked_prefill.engine as s07
    import s08_cuda_graph.engine as s08
    import s10_overlap_scheduling.engine as s10
    import s11_structured_output.engine as s11
    import s12_tensor_parallel.engine as s12

    classes = [s05.Engine, s06.Engine, s07.Engine, s08.Engine, s10.Engine, s11.Engine, s12.Engine]
    names = ["ContinuousBatchingEngine", "RadixEngine", "ChunkedPrefillEngine", "CudaGraphEngine", "OverlapEngine"]
    names += ["StructuredOutputEngine", "TPEngine"]
    assert [c.__name__ for c in classes] == names
    assert all(issubclass(later, earlier) for earlier, later in zip(classes, classes[1:]))


def test_no_class_of_the_course_is_imported_under_another_name():
    renamed = []
    for path in sorted((REPO / "solutions").rglob("*.py")):
        for line in path.read_text(encoding="utf-8").splitlines():
            found = re.match(r"\s*from (?:s\d\d_\w+|\.)\S* import (\w+) as (\w+)", line)  # the course's own
            if found and found.group(1)[:1].isupper():
                renamed.append(f"{path.relative_to(REPO)}: {line.strip()}")
    assert not renamed, "\n".join(renamed)


def test_an_engine_takes_its_config_or_the_fields_as_keyword_arguments(tiny_models_root):
    path = str(tiny_models_root / "llama")
    model, tokenizer = engine_model(path), engine_tokenizer(path)
    by_object = RadixEngine(model, tokenizer, RadixEngineConfig(pool_size=96, enable_radix_cache=False))
    by_keywords = RadixEngine(model, tokenizer, pool_size=96, enable_radix_cache=False)
    assert by_object.config == by_keywords.config and by_object.tree_cache is None
    replaced = RadixEngine(model, tokenizer, RadixEngineConfig(pool_size=96), pool_size=128)
    assert replaced.config.pool_size == 128 and replaced.runner.allocator.size == 128
    with pytest.raises(TypeError, match="RadixEngine takes a RadixEngineConfig, got a EngineConfig"):
        RadixEngine(model, tokenizer, EngineConfig(pool_size=96))
    with pytest.raises(TypeError, match="chunked_prefill_size"):
        ContinuousBatchingEngine(model, tokenizer, chunked_prefill_size=8)  # a later stage's field


class RecordingCache:
    """Wraps a prefix cache; records the insert each leaving request's K/V were offered with."""

    def __init__(self, cache):
        self.cache, self.inserts = cache, []

    def cache_finished_req(self, token_ids, slots, match, insert):
        self.inserts.append(insert)
        self.cache.cache_finished_req(token_ids, slots, match, insert)

    def __getattr__(self, name):
        return getattr(self.cache, name)


@pytest.mark.parametrize(
    "scheduler_class, cache_class, expected",
    [
        (Scheduler, NoPrefixCache, {"aborted": False, "finished": True}),
        (RadixScheduler, RadixCache, {"aborted": True, "finished": True}),
    ],
)
def test_what_a_leaver_offers_the_prefix_cache_is_the_schedulers_named_policy(
    tiny_models_root, scheduler_class, cache_class, expected
):
    path = str(tiny_models_root / "llama")
    engine = ContinuousBatchingEngine(engine_model(path), engine_tokenizer(path), pool_size=128)
    cache = RecordingCache(cache_class(engine.runner.allocator))
    scheduler = scheduler_class(engine.runner, cache)
    with torch.inference_mode():
        for rid in ("a", "b"):
            scheduler.add_request(engine.make_req([5, 6, 7, 8], GREEDY, rid=rid))
        scheduler.step()
        assert scheduler.abort_request("a")
        while scheduler.has_work:
            scheduler.step()
    assert cache.inserts == [expected["aborted"], expected["finished"]]
    assert {"finished"} <= scheduler.keep_kv_of and ("aborted" in scheduler.keep_kv_of) == expected["aborted"]


def test_stage_9s_servers_need_nothing_beyond_stage_9(tiny_models_root):
    """Stage 9's tests start their servers with --disable-overlap, which builds stage 8's engine and
    never imports stage 10: a learner who finished stage 9 but not stage 10 passes `make stage-9`.
    (Without the flag the server runs stage 10's engine, the newest; stage 10's tests check that.)"""
    from stage09.serving_helpers import DEFAULT_ARGS, GUARD_ARGS, SERVED_ENGINE, TINY_ARGS

    assert SERVED_ENGINE == ["--disable-overlap"]
    assert all(set(SERVED_ENGINE) <= set(args) for args in (TINY_ARGS, DEFAULT_ARGS, GUARD_ARGS))
    model = str(tiny_models_root / "llama")
    code = (
        "import sys\n"
        "from s09_zmq_serving.scheduler_process import build_engine\n"
        f"engine = build_engine({model!r}, dict(disable_overlap=True, pool_size=64))\n"
        "print(type(engine).__name__, sorted(m for m in sys.modules if m.startswith('s10_')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["CudaGraphEngine", "[]"], done.stdout


def test_the_served_engine_starts_without_torch_dynamo(tiny_models_root):
    """Importing torch._dynamo costs ~2 s of every process start (a server's scheduler, a notebook's
    kernel, each test process). Two things used to import it with nothing compiled: nn.Embedding's
    random init on the meta device (s00 model.py now hands it its weight) and llguidance.torch,
    which wraps a kernel in torch.compile as it is imported (stage 11 uses llguidance.numpy and its
    own bitmask). Some releases of transformers import it themselves with AutoTokenizer (5.17 does,
    through its auto classes' docstrings); there the engine cannot avoid it, and the test says so."""
    probe = "import sys; from transformers import AutoTokenizer; print('torch._dynamo' in sys.modules)"
    by_transformers = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    if by_transformers.stdout.split() == ["True"]:
        import transformers

        pytest.skip(f"transformers {transformers.__version__} imports torch._dynamo itself with AutoTokenizer")
    model = str(tiny_models_root / "llama")
    code = (
        "import sys\n"
        "from s09_zmq_serving.scheduler_process import build_engine\n"
        "from s11_structured_output.sampling_params import StructuredSamplingParams as P\n"
        f"engine = build_engine({model!r}, dict(pool_size=256))\n"
        "free = P(temperature=0, max_new_tokens=4, ignore_eos=True)\n"
        "constrained = P(temperature=0, max_new_tokens=8, regex='[ab]{8}')\n"
        "outputs = engine.generate([[1, 2, 3], [4, 5]], [free, constrained])\n"
        "print(type(engine).__name__, len(outputs), 'torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["StructuredOutputEngine", "2", "False"], done.stdout


@pytest.mark.parametrize("bad", [0, -5, "big", 2.5, True])
def test_a_bad_chunked_prefill_size_is_refused_with_what_is_allowed(tiny_models_root, bad):
    from s07_chunked_prefill.engine import ChunkedPrefillEngine

    path = str(tiny_models_root / "llama")
    with pytest.raises(ValueError, match=r"chunked_prefill_size must be a positive number of tokens.*auto"):
        ChunkedPrefillEngine(engine_model(path), engine_tokenizer(path), pool_size=256, chunked_prefill_size=bad)


@pytest.mark.skipif(not linear_module.PREPACKING, reason="no oneDNN x86 kernels here: no product is prepacked")
@pytest.mark.parametrize("family", ["llama", "qwen3"])  # tied and untied output projections
def test_stage8_prepacks_every_product_at_start_and_requests_make_no_copy(tiny_models_root, family):
    # The first request must not wait for the reordered weights (s00 linear.py, s08 model_runner.py):
    # every copy a pass reads exists once the engine is built, and the passes reuse exactly those.
    path = str(tiny_models_root / family)
    model = load_model(path)
    engine = CudaGraphEngine(model, engine_tokenizer(path), pool_size=256, max_running_requests=8)
    copies = [packed for module in model.modules() for packed, _ in getattr(module, "packed_products", list)()]
    assert len(copies) == 4 * model.config.num_hidden_layers + 1  # qkv, o, gate/up, down a layer; the logits
    made = [packed.packed for packed in copies]
    assert all(tensor is not None for tensor in made), "a product's copy was not made when the engine started"
    # as many prompts as a product needs rows to take the prepacked path, in the prefill and the decodes
    prompts = [[65 + i, 66, 67, 68, 69] for i in range(linear_module.MIN_PREPACKED_ROWS)]
    engine.generate(prompts, GREEDY)
    assert all(packed.packed is tensor for packed, tensor in zip(copies, made)), (
        "a request's pass made a prepacked copy again: prepack() lists other weights than forward() multiplies"
    )


@pytest.mark.parametrize("engine_class", [ContinuousBatchingEngine, CudaGraphEngine])
def test_a_dropped_engine_frees_its_kv_pool_without_the_cycle_collector(tiny_models_root, engine_class):
    """The attention backend keeps its pass's metadata, and a batch points at its backend: were
    the metadata to hold the batch (stage 4), or the backend a batch of a MIXED pass's extend rows
    (stage 8), a dropped engine's pool would wait for Python's cycle collector. A notebook that
    built four engines held four default CPU pools, 2 GiB each (9.5 GiB at its peak)."""
    import gc
    import weakref

    path = str(tiny_models_root / "llama")
    model, tokenizer = engine_model(path), engine_tokenizer(path)
    # A chunk budget smaller than the long prompt makes MIXED passes: decodes beside its chunks.
    options = {"chunked_prefill_size": 8} if engine_class is CudaGraphEngine else {}
    engine = engine_class(model, tokenizer, pool_size=256, **options)
    prompts = [[5, 6, 7], list(range(10, 40)), [8, 9]]
    engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))
    pool = weakref.ref(engine.runner.token_to_kv_pool)
    gc.disable()
    try:
        del engine
        assert pool() is None, "the engine's KV pool outlived it: something it owns forms a reference cycle"
    finally:
        gc.enable()
