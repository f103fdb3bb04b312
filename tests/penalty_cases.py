"""One mixed batch of penalised requests for every engine from stage 3 on: the penalties (and
min_new_tokens) count the tokens the sampler drew, so any engine that samples some other way,
drops a step's token, or counts a token the request did not keep, gives other tokens than stage
3's cached engine."""

from __future__ import annotations

from reference import assert_same_tokens, engine_model, engine_tokenizer
from s02_request_and_sampling.sampling_params import SamplingParams

PENALTY_FIELDS = ("repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias", "min_new_tokens")


def penalised_params(scale: int = 1) -> list[SamplingParams]:
    """Greedy and seeded requests with each penalty, and one without (``scale`` stretches the lengths)."""
    return [
        SamplingParams(temperature=0, max_new_tokens=20 * scale, ignore_eos=True, frequency_penalty=1.0),
        SamplingParams(temperature=0.9, max_new_tokens=14 * scale, ignore_eos=True, seed=4, repetition_penalty=1.4),
        SamplingParams(temperature=0, max_new_tokens=9 * scale, ignore_eos=True),
        SamplingParams(
            temperature=0.8,
            max_new_tokens=16 * scale,
            ignore_eos=True,
            seed=9,
            presence_penalty=-1.5,
            logit_bias={65: 3.0, 32: -100.0},
        ),
        SamplingParams(temperature=0, max_new_tokens=11 * scale, ignore_eos=True, presence_penalty=2.0, logprobs=1),
        # a stop token forced by +100 but banned until 5 * scale tokens are out: it ends at exactly the next one
        SamplingParams(
            temperature=0,
            max_new_tokens=12 * scale,
            min_new_tokens=5 * scale,
            stop_token_ids=[65],
            logit_bias={65: 100.0},
        ),
    ]


def assert_penalties_like_stage3(path, prompts, params, outputs, what: str) -> None:
    """``outputs`` (GenerateOutputs of ``prompts`` under ``params``) carry the same tokens as stage 3's engine."""
    from s03_kv_cache.engine import generate as stage3_generate

    model, tokenizer = engine_model(str(path)), engine_tokenizer(str(path))
    expected = stage3_generate(model, tokenizer, prompts, params)
    for params_i, want in zip(params, expected):
        if params_i.min_new_tokens:
            assert len(want.output_ids) > params_i.min_new_tokens, (
                f"stage 3: min_new_tokens={params_i.min_new_tokens} gave only {len(want.output_ids)} tokens"
            )
    for i, (got, want) in enumerate(zip(outputs, expected)):
        shown = {k: v for k, v in vars(params[i]).items() if k in PENALTY_FIELDS and v not in (0, 1, {})}
        assert_same_tokens(got.output_ids, want.output_ids, f"{what}: request {i} ({shown}), vs stage 3", tokenizer)
