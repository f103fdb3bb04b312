"""Notebook 11's picture and stage 11's milestone on the reference (not graded): ``mask_walk``
tells, for each token of a constrained greedy output, how many tokens the grammar allowed and
whether it overrode the model's own choice."""

from __future__ import annotations

from reference import engine_model, engine_tokenizer
from s11_structured_output.engine import Engine
from s11_structured_output.sampling_params import StructuredSamplingParams
from s11_structured_output.validity import CASES, mask_walk


def test_mask_walk_marks_exactly_the_tokens_the_grammar_overrode(default_model_dir):
    path = str(default_model_dir)
    engine = Engine(engine_model(path), engine_tokenizer(path), disable_overlap=True)
    prompt, schema = CASES["rating"]
    walk = mask_walk(engine, schema, prompt, max_new_tokens=32)
    params = StructuredSamplingParams(temperature=0, max_new_tokens=32, json_schema=schema)
    [out] = engine.generate([[{"role": "user", "content": prompt}]], params)
    assert "".join(step.token for step in walk) == engine.tokenizer.decode(out.output_ids, skip_special_tokens=False)
    vocab = engine.model.config.vocab_size
    for i, step in enumerate(walk):
        assert 1 <= step.allowed < vocab, f"step {i}: {step}"
        # Greedy under a mask takes the model's own choice whenever the mask allows it.
        assert step.steered == (step.token != step.model_choice), f"step {i}: {step}"
    # The instruct model opens with a code fence or prose; the grammar allows only the object.
    assert walk[0].token == '{"' and walk[0].allowed == 1 and walk[0].steered, walk[0]
