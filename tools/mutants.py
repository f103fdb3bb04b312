"""The mutation check the course keeps for itself: do the graded tests catch real learner bugs?

Each mutant is a realistic mistake a learner could make inside one exercise region of the
reference, with the idea it breaks. One at a time, it is planted into a copy of solutions/ and
that stage's graded tests run against the copy (stopping at the first failure: the message a
learner would read first). A mutant is

    killed      a test failed, and its message matches the mutant's `named` pattern: the
                failure names the broken idea
    unnamed     a test failed, but its message does not name the idea (it points at a symptom)
    SURVIVED    every test passed: a learner with this bug gets full marks
    TIMEOUT     the tests ran past TIMEOUT_S (a test stuck in a loop fails first, at pytest's own
                timeout, with a "stuck:" message naming the line it was running)

It prints one line per mutant, the kill rate per stage and every mutant not killed. A full run
takes about 40 minutes on a 2-core machine, so CI only checks that every mutant still applies
to the current solutions and that every exercise region has one (tests/course/test_mutants.py).

    python tools/mutants.py [--stages 5-7] [--only NAME ...]    # `make mutants` runs them all
    python tools/mutants.py --list                              # the catalogue, no tests run
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from pytest_runs import REPO, child_env, parse_stages

BEGIN, END = "# BEGIN EXERCISE:", "# END EXERCISE"
TIMEOUT_S = 900  # one mutant's test run; a healthy stage suite takes well under half of it


@dataclass(frozen=True)
class Mutant:
    name: str  # short and unique, e.g. "s05-admit-no-future"
    file: str  # under solutions/, e.g. "s05_continuous_batching/scheduler.py"
    idea: str  # the idea the bug breaks, in a learner's words
    edits: tuple[tuple[str, str], ...]  # (old, new): each old occurs once, inside an exercise region
    named: str  # a regex the first failure's message must match (case-insensitive): it names the idea

    @property
    def stage(self) -> int:
        return int(self.file[1:3])


def edit(old: str, new: str) -> tuple[tuple[str, str], ...]:
    return ((old, new),)


MUTANTS: list[Mutant] = [
    # --- stage 1: naive generation -------------------------------------------------------------
    Mutant(
        "s01-last-token-only",
        "s01_naive_generate/generate.py",
        "every step recomputes the WHOLE sequence (there is no cache yet): feeding only the newest token loses the "
        "context",
        edit(
            "ForwardBatch.build([list(token_ids)], prefix_lens=[0]",
            "ForwardBatch.build([list(token_ids)[-1:]], prefix_lens=[0]",
        ),
        r"logits for the next token differ",
    ),
    Mutant(
        "s01-eos-dropped",
        "s01_naive_generate/generate.py",
        "the EOS token ends the output and is kept in it, as transformers keeps it",
        edit(
            """        next_id = int(torch.argmax(next_token_logits(model, tokens)))
        tokens.append(next_id)""",
            """        next_id = int(torch.argmax(next_token_logits(model, tokens)))
        if next_id in eos_token_ids:
            break
        tokens.append(next_id)""",
        ),
        r"EOS",
    ),
    Mutant(
        "s01-one-token-short",
        "s01_naive_generate/generate.py",
        "without an EOS, generation runs to exactly max_new_tokens",
        edit("for _ in range(max_new_tokens):", "for _ in range(max_new_tokens - 1):"),
        r"stops too early|max_new_tokens",
    ),
    Mutant(
        "s01-new-token-not-fed-back",
        "s01_naive_generate/generate.py",
        "each step feeds the sequence INCLUDING the token just chosen",
        edit(
            "        tokens.append(next_id)\n        new_tokens.append(next_id)", "        new_tokens.append(next_id)"
        ),
        r"step \d+: your engine produced token",
    ),
    Mutant(
        "s01-argmin",
        "s01_naive_generate/generate.py",
        "greedy decoding picks the MOST likely token (argmax over the vocabulary)",
        edit(
            "next_id = int(torch.argmax(next_token_logits(model, tokens)))",
            "next_id = int(torch.argmin(next_token_logits(model, tokens)))",
        ),
        r"step 0: your engine produced token",
    ),
    Mutant(
        "s01-only-the-first-eos",
        "s01_naive_generate/generate.py",
        "any of the model's EOS ids ends the output, not only the first",
        edit("        if next_id in eos_token_ids:\n", "        if next_id in list(eos_token_ids)[:1]:\n"),
        r"any of them ends",
    ),
    Mutant(
        "s01-returns-the-prompt-too",
        "s01_naive_generate/generate.py",
        "naive_generate returns only the new tokens, not the prompt followed by them",
        edit("            break\n    return new_tokens\n", "            break\n    return tokens\n"),
        r"returns only the\s+new tokens",
    ),
    # --- stage 2: requests and sampling --------------------------------------------------------
    Mutant(
        "s02-seed-no-upper-bound",
        "s02_request_and_sampling/sampling_params.py",
        "a seed must fit torch's unsigned 64-bit generator: refuse seeds above 2**64 - 1 when the params are built",
        edit("if not 0 <= self.seed <= MAX_SEED:", "if not 0 <= self.seed:"),
        r"seed=18446744073709551616\) was accepted",
    ),
    Mutant(
        "s02-top-p-drops-the-head",
        "s02_request_and_sampling/sampler.py",
        "top-p keeps a token when the tokens MORE likely than it hold less than top_p: the most likely token always "
        "stays",
        edit(
            "keep_sorted = (mass_before < top_p) | (top_p >= 1)",
            "keep_sorted = (sorted_probs.cumsum(dim=-1) < top_p) | (top_p >= 1)",
        ),
        r"top.?p",
    ),
    Mutant(
        "s02-min-p-absolute",
        "s02_request_and_sampling/sampler.py",
        "min-p is relative: a token needs min_p times the probability of the row's MOST likely token",
        edit(
            "return probs >= min_p.to(probs.device, probs.dtype)[:, None] * p_max",
            "return probs >= min_p.to(probs.device, probs.dtype)[:, None]",
        ),
        r"min.?p",
    ),
    Mutant(
        "s02-top-k-one-extra",
        "s02_request_and_sampling/sampler.py",
        "top-k keeps exactly k tokens",
        edit("keep_sorted = rank < k[:, None]", "keep_sorted = rank <= k[:, None]"),
        r"top.?k",
    ),
    Mutant(
        "s02-temperature-ignored",
        "s02_request_and_sampling/sampler.py",
        "temperature divides the logits before the softmax",
        edit(
            "probs = torch.softmax(logits.float() / temperature[:, None], dim=-1)",
            "probs = torch.softmax(logits.float(), dim=-1)",
        ),
        r"temperature",
    ),
    Mutant(
        "s02-global-rng",
        "s02_request_and_sampling/sampler.py",
        "each request draws from its OWN generator, so its tokens depend on its seed alone",
        edit("torch.rand(1, generator=req.generator)", "torch.rand(1)"),
        r"seed",
    ),
    Mutant(
        "s02-stop-string-window-too-short",
        "s02_request_and_sampling/req.py",
        "a stop string may START in text produced before this step: search from (longest stop - 1) characters back",
        edit("start = max(0, len(text) - new_len - (max(map(len, stops)) - 1))", "start = max(0, len(text) - new_len)"),
        r"stop",
    ),
    Mutant(
        "s02-length-before-stop-token",
        "s02_request_and_sampling/req.py",
        "a stop token / EOS is checked before max_new_tokens: a stop token at the limit finishes with 'stop'",
        edit(
            """        params = self.sampling_params
        last = self.output_ids[-1]
        if last""",
            """        params = self.sampling_params
        last = self.output_ids[-1]
        if len(self.output_ids) >= params.max_new_tokens:
            self.finished_reason = FinishReason("length")
            return
        if last""",
        ),
        r"stop",
    ),
    Mutant(
        "s02-ignore-eos-ignored",
        "s02_request_and_sampling/req.py",
        "ignore_eos=True keeps generating past the model's EOS token",
        edit(
            "if last in params.stop_token_ids or (not params.ignore_eos and last in self.eos_token_ids):",
            "if last in params.stop_token_ids or last in self.eos_token_ids:",
        ),
        r"ignore_eos",
    ),
    Mutant(
        "s02-last-stop-wins",
        "s02_request_and_sampling/req.py",
        "when several stop strings complete, the one that STARTS first ends the text",
        edit("    pos, stop = min(hits, key=lambda hit: hit[0])", "    pos, stop = max(hits, key=lambda hit: hit[0])"),
        r"stop",
    ),
    Mutant(
        "s02-top-p-zero-allowed",
        "s02_request_and_sampling/sampling_params.py",
        "top_p must be in (0, 1]: 0 would keep no token at all",
        edit("        if not 0 < self.top_p <= 1:", "        if not 0 <= self.top_p <= 1:"),
        r"top_p",
    ),
    Mutant(
        "s02-masks-before-temperature",
        "s02_request_and_sampling/sampler.py",
        "temperature comes first: top-k, top-p and min-p filter the TEMPERED distribution",
        (
            (
                "    probs = torch.softmax(logits.float() / temperature[:, None], dim=-1)\n",
                "    probs = torch.softmax(logits.float(), dim=-1)\n",
            ),
            (
                "    probs = probs * keep\n",
                "    probs = torch.softmax(logits.float() / temperature[:, None], dim=-1) * keep\n",
            ),
        ),
        r"temperature",
    ),
    Mutant(
        "s02-reseed-every-step",
        "s02_request_and_sampling/sampler.py",
        "a request's generator is seeded once and then advances: each step draws a NEW number from it",
        edit(
            "torch.rand(1, generator=req.generator)",
            "torch.rand(1, generator=torch.Generator().manual_seed(req.generator.initial_seed()))",
        ),
        r"seed|draw|random",
    ),
    Mutant(
        "s02-empty-stop-allowed",
        "s02_request_and_sampling/sampling_params.py",
        "a stop string is never empty: an empty one would match before any text at all",
        edit('            if not isinstance(s, str) or s == "":', "            if not isinstance(s, str):"),
        r"stop",
    ),
    Mutant(
        "s02-ignore-eos-ignores-stop-tokens",
        "s02_request_and_sampling/req.py",
        "ignore_eos ignores the model's EOS only: the caller's own stop_token_ids still stop the request",
        edit(
            "if last in params.stop_token_ids or (not params.ignore_eos and last in self.eos_token_ids):",
            "if not params.ignore_eos and (last in params.stop_token_ids or last in self.eos_token_ids):",
        ),
        r"stop_token|ignore_eos",
    ),
    Mutant(
        "s02-top-k-zero-allowed",
        "s02_request_and_sampling/sampling_params.py",
        "top_k is -1 (off) or at least 1: 0 would keep no token",
        edit("        if self.top_k != -1 and self.top_k < 1:", "        if self.top_k < -1:"),
        r"top_k",
    ),
    Mutant(
        "s02-logprobs-no-upper-bound",
        "s02_request_and_sampling/sampling_params.py",
        "logprobs asks for at most 20 alternatives per token: refuse more when the params are built",
        edit("if not 0 <= value <= MAX_LOGPROBS:", "if not 0 <= value:"),
        r"logprobs=21\) was accepted",
    ),
    Mutant(
        "s02-prompt-logprobs-unchecked",
        "s02_request_and_sampling/sampling_params.py",
        "prompt_logprobs is checked like logprobs: None, or 0..20 alternatives per prompt token",
        edit('for name in ("logprobs", "prompt_logprobs"):', 'for name in ("logprobs",):'),
        r"prompt_logprobs=.* was accepted",
    ),
    Mutant(
        "s02-logprobs-are-probabilities",
        "s02_request_and_sampling/logprobs.py",
        "a log-probability is the log_softmax of the logits (<= 0), not the softmax",
        edit(
            "chosen = x.gather(1, ids[:, None])[:, 0] - norm",
            "chosen = torch.softmax(x, dim=-1).gather(1, ids[:, None])[:, 0]",
        ),
        r"log_softmax",
    ),
    Mutant(
        "s02-logprobs-the-batchs-k",
        "s02_request_and_sampling/logprobs.py",
        "each row gets the number of alternatives IT asked for (the batch's largest k is only what topk computes)",
        edit(
            "tuple(zip(map(int, top[:k_i]), top[k : k + k_i]))",
            "tuple(zip(map(int, top[:k]), top[k:]))",
        ),
        r"logprobs=0|likeliest",
    ),
    Mutant(
        "s02-frequency-penalty-no-range",
        "s02_request_and_sampling/sampling_params.py",
        "frequency_penalty and presence_penalty lie in [-2, 2] (OpenAI's range): refuse others when the params "
        "are built",
        edit(
            'self.frequency_penalty = _in_range("frequency_penalty", self.frequency_penalty, PENALTY_RANGE)',
            'self.frequency_penalty = _real("frequency_penalty", self.frequency_penalty)',
        ),
        r"frequency_penalty=2.5\) was accepted",
    ),
    Mutant(
        "s02-repetition-divides-negative-logits",
        "s02_request_and_sampling/penalties.py",
        "the repetition penalty DIVIDES a positive logit and MULTIPLIES a negative one: dividing a negative logit "
        "by r > 1 makes a repeat more likely",
        edit("x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)", "x = torch.where(seen, x / r, x)"),
        r"NEGATIVE one multiplied",
    ),
    Mutant(
        "s02-presence-counts-every-occurrence",
        "s02_request_and_sampling/penalties.py",
        "the presence penalty is subtracted ONCE per token present in the output, however often it appears",
        edit("x = x - frequency * counts - presence * in_output", "x = x - frequency * counts - presence * counts"),
        r"once per token present",
    ),
    Mutant(
        "s02-penalties-in-place",
        "s02_request_and_sampling/penalties.py",
        "penalties work on a copy: the logits given stay the model's own (the log-probabilities are read from them)",
        edit("out = logits.to(torch.float32, copy=True)", "out = logits.float()"),
        r"leave the logits it was given",
    ),
    Mutant(
        "s02-min-new-tokens-one-late",
        "s02_request_and_sampling/penalties.py",
        "min_new_tokens bans the ending tokens while FEWER than min_new_tokens are out: the request may end with "
        "its (min_new_tokens + 1)-th token",
        edit("s.drawn < p.min_new_tokens:", "s.drawn <= p.min_new_tokens:"),
        r"min_new_tokens",
    ),
    Mutant(
        "s02-min-new-tokens-counts-output-ids",
        "s02_request_and_sampling/penalties.py",
        "min_new_tokens counts the tokens the sampler drew (PenaltyState.drawn): output_ids lags behind under overlap",
        edit(
            "        if s.stop_ids is not None and s.drawn < p.min_new_tokens:",
            "        if s.stop_ids is not None and len(reqs[rows[k]].output_ids) < p.min_new_tokens:",
        ),
        r"PenaltyState.drawn",
    ),
    Mutant(
        "s02-repetition-penalty-as-integer",
        "s02_request_and_sampling/penalties.py",
        "a float setting reaches the device as a float: a repetition penalty of 1.6 made an integer is 1",
        edit(
            "r = host_to_device([p.repetition_penalty for p in params], device, torch.float32)",
            "r = host_to_device([p.repetition_penalty for p in params], device, torch.int64)",
        ),
        r"stays a float",
    ),
    Mutant(
        "s02-bias-before-the-penalties",
        "s02_request_and_sampling/penalties.py",
        "logit_bias is added AFTER the penalties (the repetition penalty scales the model's own logits, not the bias)",
        (
            ("    x = out[rows]\n", "    x = out[rows]\n    x = x + _stack([s.bias for s in states], like=x[0])\n"),
            ("        x = x + _stack([s.bias for s in states], like=x[0])\n", "        pass\n"),
        ),
        r"added after the penalty",
    ),
    Mutant(
        "s02-top-k-keeps-the-ties",
        "s02_request_and_sampling/sampler.py",
        "top-k keeps exactly k tokens, ties broken by the sort (top_k=1 is greedy)",
        edit(
            "    keep_sorted = rank < k[:, None]  # the first k places of each sorted row\n"
            "    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)\n",
            "    kth = probs.gather(-1, order).gather(-1, (k - 1)[:, None])\n    return probs >= kth\n",
        ),
        r"exactly \d+ of the tied",
    ),
    Mutant(
        "s02-top-k-of-row-0-for-all",
        "s02_request_and_sampling/sampler.py",
        "each row is filtered by its own request's top_k",
        edit(
            "keep &= top_k_mask(probs, host_to_device([p.top_k for p in params], device, torch.int64))",
            "keep &= top_k_mask(probs, host_to_device([params[0].top_k] * len(params), device, torch.int64))",
        ),
        r"own kept tokens",
    ),
    Mutant(
        "s02-min-p-only-if-row-0-asks",
        "s02_request_and_sampling/sampler.py",
        "a filter is applied whenever any row uses it, not only when the first row does",
        edit("    if any(p.min_p > 0 for p in params):\n", "    if params[0].min_p > 0:\n"),
        r"own kept tokens",
    ),
    Mutant(
        "s02-logprobs-in-half-precision",
        "s02_request_and_sampling/logprobs.py",
        "log-probabilities are taken in float32, whatever the model's dtype",
        edit(
            "    x = logits[rows].float() if len(rows) < len(top_ks) else logits.float()",
            "    x = logits[rows] if len(rows) < len(top_ks) else logits",
        ),
        r"float32",
    ),
    Mutant(
        "s02-top-p-of-1-not-off",
        "s02_request_and_sampling/sampler.py",
        "top_p = 1 keeps the whole row, even where float32's running sum passes 1",
        edit("    keep_sorted = (mass_before < top_p) | (top_p >= 1)\n", "    keep_sorted = mass_before < top_p\n"),
        r"top_p=1 \(off\)",
    ),
    Mutant(
        "s02-ignore-eos-any-value",
        "s02_request_and_sampling/sampling_params.py",
        "ignore_eos is True or False: a string or a number is refused",
        edit(
            "        if not isinstance(self.ignore_eos, bool):\n"
            '            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")\n',
            "",
        ),
        r"ignore_eos",
    ),
    Mutant(
        "s02-stop-strings-before-tokens",
        "s02_request_and_sampling/req.py",
        "a stop token / EOS is checked before the stop strings",
        (
            (
                """        if last in params.stop_token_ids or (not params.ignore_eos and last in self.eos_token_ids):
            self.finished_reason = FinishReason("stop", matched=last)
            return

""",
                "",
            ),
            (
                """                self.finished_reason = FinishReason("stop", matched=stop_str)
                return

""",
                """                self.finished_reason = FinishReason("stop", matched=stop_str)
                return
        if last in params.stop_token_ids or (not params.ignore_eos and last in self.eos_token_ids):
            self.finished_reason = FinishReason("stop", matched=last)
            return

""",
            ),
        ),
        r"stop tokens are checked before stop strings",
    ),
    # --- stage 3: the KV cache ----------------------------------------------------------------
    Mutant(
        "s03-attend-new-tokens-only",
        "s03_kv_cache/backend.py",
        "a step's queries attend over the WHOLE cache (the stored prefix plus the new tokens)",
        edit(
            "outputs.append(causal_attention(q[start:end], cache.k[layer_id, :seq_len], cache.v[layer_id, :seq_len]))",
            "outputs.append(causal_attention(q[start:end], k[start:end], v[start:end]))",
        ),
        r"step \d+: your engine produced token|logits",
    ),
    Mutant(
        "s03-grow-loses-the-prefix",
        "s03_kv_cache/kv_cache.py",
        "growing the cache keeps every stored position (copy [0, seq_len) into the bigger buffer)",
        edit("            new[:, : self.seq_len] = old[:, : self.seq_len]\n", ""),
        r"grow|reserve|capacity",
    ),
    Mutant(
        "s03-decode-the-last-token",
        "s03_kv_cache/generate.py",
        "the last generated token is never fed back: nothing would ever read its K/V",
        edit("if next_id in eos_token_ids or step == max_new_tokens - 1:", "if next_id in eos_token_ids:"),
        r"positions|last token",
    ),
    Mutant(
        "s03-cached-before-the-pass",
        "s03_kv_cache/generate.py",
        "new positions count as cached only once the pass has written them (seq_len after the model ran)",
        edit(
            """    logits = model(batch)
    # Only now""",
            """    for cache, seq_len in zip(caches, batch.seq_lens):
        cache.seq_len = seq_len
    logits = model(batch)
    # Only now""",
        ),
        r"cached",
    ),
    Mutant(
        "s03-cached-len-not-advanced",
        "s03_kv_cache/engine.py",
        "after the pass the tokens just computed are cached (cached_len = device_len): the next step sends only what "
        "is new",
        edit(
            """    for req in reqs:
        req.cached_len = req.device_len
    append_sampled""",
            """    append_sampled""",
        ),
        r"cached",
    ),
    Mutant(
        "s03-positions-from-zero",
        "s03_kv_cache/generate.py",
        "new tokens sit at positions after the cached ones: a decode token's position is the cache's seq_len, not 0",
        edit("new_token_ids, [cache.seq_len for cache in caches],", "new_token_ids, [0 for cache in caches],"),
        r"position|prefix",
    ),
    Mutant(
        "s03-no-eos-stop",
        "s03_kv_cache/generate.py",
        "generation stops at an EOS id (and keeps it), like stage 1",
        edit("if next_id in eos_token_ids or step == max_new_tokens - 1:", "if step == max_new_tokens - 1:"),
        r"EOS|goes on with",
    ),
    Mutant(
        "s03-reserve-the-new-tokens-only",
        "s03_kv_cache/generate.py",
        "a cache must hold its stored prefix AND the new tokens: reserve seq_len + the new count",
        edit("        cache.reserve(cache.seq_len + len(ids))", "        cache.reserve(len(ids))"),
        r"reserve|capacity|grow",
    ),
    Mutant(
        "s03-grow-doubles-once",
        "s03_kv_cache/kv_cache.py",
        "reserve grows the cache until `length` fits: doubling once may not be enough",
        edit(
            "        while capacity < length:\n            capacity *= 2",
            "        if capacity < length:\n            capacity *= 2",
        ),
        r"capacity|reserve|fit",
    ),
    Mutant(
        "s03-grown-cache-loses-its-dtype",
        "s03_kv_cache/kv_cache.py",
        "the grown cache keeps the old one's dtype and device (a bfloat16 model on a GPU)",
        edit(
            "            new = old.new_zeros((old.shape[0], capacity, *old.shape[2:]))\n",
            "            new = torch.zeros((old.shape[0], capacity, *old.shape[2:]))\n",
        ),
        r"new_zeros",
    ),
    Mutant(
        "s03-step-resends-the-cached-tokens",
        "s03_kv_cache/engine.py",
        "a step sends only what the cache lacks: fill_ids[cached_len:device_len]",
        edit(
            "    logits = extend(model, caches, [req.fill_ids[req.cached_len : req.device_len] for req in reqs])",
            "    logits = extend(model, caches, [req.fill_ids[: req.device_len] for req in reqs])",
        ),
        r"cached|prefix_lens|seq_len",
    ),
    Mutant(
        "s03-decode-recomputes-the-sequence",
        "s03_kv_cache/generate.py",
        "a decode step runs only the newest token against the cache, never the whole sequence again",
        (
            (
                "    logits = extend(model, [cache], [list(input_ids)])[0]\n    for step",
                "    logits = extend(model, [cache], [list(input_ids)])[0]\n    seen = list(input_ids)\n    for step",
            ),
            (
                "        logits = extend(model, [cache], [[next_id]])[0]\n",
                "        seen.append(next_id)\n        cache.seq_len = 0\n"
                "        logits = extend(model, [cache], [seen])[0]\n",
            ),
        ),
        r"naive cost",
    ),
    Mutant(
        "s03-step-recomputes-the-sequence",
        "s03_kv_cache/engine.py",
        "each request sends only what its cache lacks, fill_ids[cached_len:device_len]",
        (
            (
                "    logits = extend(model, caches, [req.fill_ids[req.cached_len : req.device_len] for req in reqs])",
                "    for cache in caches:\n        cache.seq_len = 0\n"
                "    logits = extend(model, caches, [req.fill_ids[: req.device_len] for req in reqs])",
            ),
        ),
        r"naive cost",
    ),
    # --- stage 4: the paged KV pool -----------------------------------------------------------
    Mutant(
        "s04-offset-from-the-chunk-start",
        "s04_paged_kv_pool/allocator.py",
        "position j of a request sits at offset j % page_size of its page (its last page is filled first)",
        edit(
            "out_cache_loc += [pages[j // p - first_page] * p + j % p for j in range(prefix, seq)]",
            "out_cache_loc += [pages[j // p - first_page] * p + (j - prefix) % p for j in range(prefix, seq)]",
        ),
        r"offset",
    ),
    Mutant(
        "s04-double-free-accepted",
        "s04_paged_kv_pool/allocator.py",
        "freeing a page that is not allocated (a double free) is refused",
        edit("        if not_allocated:\n            raise", "        if False:\n            raise"),
        r"double free",
    ),
    Mutant(
        "s04-free-changes-before-refusing",
        "s04_paged_kv_pool/allocator.py",
        "a refused free changes nothing: check every page before freeing any",
        edit(
            """        not_allocated = [page for page in pages if not self.page_allocated[page]]
        if not_allocated:
            raise ValueError(
                f"cannot free page(s) {not_allocated[:8]} (slots {[q * p for q in not_allocated[:8]]}...): "
                "they are not allocated - a double free, or slots this allocator never handed out"
            )
        self.page_allocated[pages] = False
        self.free_pages.extend(pages)""",
            """        for page in pages:
            if not self.page_allocated[page]:
                raise ValueError(f"cannot free page {page}: it is not allocated (a double free?)")
            self.page_allocated[page] = False
            self.free_pages.append(page)""",
        ),
        r"must leave the allocator as it was",
    ),
    Mutant(
        "s04-release-keeps-the-slots",
        "s04_paged_kv_pool/engine.py",
        "a finished request gives back its slots, not only its table row",
        edit(
            "        self.runner.allocator.free(self.runner.req_to_token_pool.req_to_token[row, : req.cached_len])\n",
            "",
        ),
        r"leak|release",
    ),
    Mutant(
        "s04-release-keeps-the-row",
        "s04_paged_kv_pool/engine.py",
        "a finished request gives back its table row, not only its slots",
        edit(
            "        self.runner.req_to_token_pool.free(row)\n        req.req_pool_idx = None",
            "        req.req_pool_idx = None",
        ),
        r"table row",
    ),
    Mutant(
        "s04-table-not-written",
        "s04_paged_kv_pool/engine.py",
        "the request's new slots go into its req_to_token row BEFORE the pass: attention reads K/V through the table",
        edit("        table[row, prefix_len:seq_len] = out_cache_loc[start : start + seq_len - prefix_len]\n", ""),
        r"table|req_to_token",
    ),
    Mutant(
        "s04-not-marked-cached",
        "s04_paged_kv_pool/engine.py",
        "after the pass the computed tokens are cached (cached_len = device_len)",
        edit(
            """        for req in self.running:
            req.cached_len = req.device_len
        append_sampled""",
            """        append_sampled""",
        ),
        r"cached|extend_lens",
    ),
    Mutant(
        "s04-marked-cached-after-append",
        "s04_paged_kv_pool/engine.py",
        "cached_len counts the positions whose K/V the pass stored, before the sampled token grows device_len",
        edit(
            """        for req in self.running:
            req.cached_len = req.device_len
        append_sampled(self.running, logits)""",
            """        append_sampled(self.running, logits)
        for req in self.running:
            req.cached_len = req.device_len""",
        ),
        r"cached_len\) before its K/V were stored",
    ),
    Mutant(
        "s04-gather-before-write",
        "s04_paged_kv_pool/paged_backend.py",
        "each layer writes the new tokens' K/V into the pool BEFORE it gathers: the gathered keys include the new "
        "tokens' own",
        (
            ("        pool.set_kv_buffer(layer_id, batch.out_cache_loc, k, v)\n        keys = ", "        keys = "),
            (
                "        outputs, q_start, kv_start = [], 0, 0\n",
                "        pool.set_kv_buffer(layer_id, batch.out_cache_loc, k, v)\n"
                "        outputs, q_start, kv_start = [], 0, 0\n",
            ),
        ),
        r"logits differ from transformers|step \d+: your engine produced",
    ),
    Mutant(
        "s04-kv-indptr-of-new-tokens",
        "s04_paged_kv_pool/paged_backend.py",
        "kv_indptr runs over each request's WHOLE sequence (seq_lens), qo_indptr over its new tokens (extend_lens)",
        edit(
            "kv_indptr = torch.tensor([0, *batch.seq_lens]",
            "kv_indptr = torch.tensor([0, *batch.extend_lens]",
        ),
        r"kv_indptr",
    ),
    Mutant(
        "s04-table-row-from-zero",
        "s04_paged_kv_pool/engine.py",
        "a request's new slots go into its table row at their positions [prefix_len, seq_len)",
        edit(
            "        table[row, prefix_len:seq_len] = out_cache_loc[start : start + seq_len - prefix_len]",
            "        table[row, : seq_len - prefix_len] = out_cache_loc[start : start + seq_len - prefix_len]",
        ),
        r"table|req_to_token",
    ),
    Mutant(
        "s04-kv-indices-whole-row",
        "s04_paged_kv_pool/paged_backend.py",
        "a request's kv_indices are its table row up to its seq_len only: the rest of the row holds no K/V of it",
        edit(
            "kv_indices = torch.cat([table[row, :seq_len] for row, seq_len in zip(rows, batch.seq_lens)])",
            "kv_indices = torch.cat([table[row] for row, seq_len in zip(rows, batch.seq_lens)])",
        ),
        r"kv_indices|seq_len",
    ),
    Mutant(
        "s04-kv-indices-in-row-order",
        "s04_paged_kv_pool/paged_backend.py",
        "kv_indices follow the batch's order: request i's slots come from ITS row, wherever that row is",
        edit(
            "kv_indices = torch.cat([table[row, :seq_len] for row, seq_len in zip(rows, batch.seq_lens)])",
            "kv_indices = torch.cat([table[row, :seq_len] for row, seq_len in zip(sorted(rows), batch.seq_lens)])",
        ),
        r"its own table row",
    ),
    Mutant(
        "s04-release-keeps-the-row-name",
        "s04_paged_kv_pool/engine.py",
        "a released request no longer names the table row it gave back (req_pool_idx = None)",
        edit(
            "        self.runner.req_to_token_pool.free(row)\n        req.req_pool_idx = None\n",
            "        self.runner.req_to_token_pool.free(row)\n",
        ),
        r"req_pool_idx",
    ),
    # --- stage 5: continuous batching ---------------------------------------------------------
    Mutant(
        "s05-admit-no-future",
        "s05_continuous_batching/scheduler.py",
        "admission keeps room for an admitted request's own future tokens (need = prefill + future_slots)",
        edit("need = prefill_slots + self.future_slots(req)", "need = prefill_slots"),
        r"future",
    ),
    Mutant(
        "s05-overtake-the-head",
        "s05_continuous_batching/scheduler.py",
        "first come, first served: the first request that does not fit stops admission, nobody overtakes it",
        (
            (
                """        while self.waiting and len(self.reqs_holding_memory()) + len(admitted) < self.max_running_requests:
            req = self.waiting[0]""",  # noqa: E501 (the reference's line)
                """        for req in list(self.waiting):
            if len(self.reqs_holding_memory()) + len(admitted) >= self.max_running_requests:
                break""",
            ),
            (
                """            if need > room and not (first_alone and prefill_slots <= room):
                break
            self.waiting.popleft()""",
                """            if need > room and not (first_alone and prefill_slots <= room):
                continue
            self.waiting.remove(req)""",
            ),
        ),
        r"overtook",
    ),
    Mutant(
        "s05-retract-the-oldest",
        "s05_continuous_batching/scheduler.py",
        "the most recently admitted request is retracted first",
        edit("req = self.running.pop()", "req = self.running.pop(0)"),
        r"most recently admitted",
    ),
    Mutant(
        "s05-retracted-to-the-back",
        "s05_continuous_batching/scheduler.py",
        "a retracted request waits at the FRONT of the queue (it keeps its place)",
        edit(
            "self.waiting.appendleft(req)\n            retracted.append(req)",
            "self.waiting.append(req)\n            retracted.append(req)",
        ),
        r"front of the waiting",
    ),
    Mutant(
        "s05-no-prefill-budget",
        "s05_continuous_batching/scheduler.py",
        "a step admits prompts only up to max_prefill_tokens (a single longer one runs alone)",
        edit("            if admitted and extend_len > budget:\n                break\n", ""),
        r"max_prefill_tokens",
    ),
    Mutant(
        "s05-release-keeps-the-row",
        "s05_continuous_batching/scheduler.py",
        "a leaving request gives its table row back",
        edit(
            "        self.runner.req_to_token_pool.free(row)\n        req.req_pool_idx, req.prefix_match, "
            "req.cached_len = None, None, 0",
            "        req.req_pool_idx, req.prefix_match, req.cached_len = None, None, 0",
        ),
        r"table row|request rows",
    ),
    Mutant(
        "s05-own-prefix-counted-as-room",
        "s05_continuous_batching/scheduler.py",
        "a request's own matched prefix is not room it could evict for itself (count the room while it is locked)",
        edit(
            """            self.prefix_cache.lock(match)
            room = self.available_slots() - reserved
            self.prefix_cache.unlock(match)""",
            """            room = self.available_slots() - reserved""",
        ),
        r"own cached prefix",
    ),
    Mutant(
        "s05-finished-not-released",
        "s05_continuous_batching/scheduler.py",
        "a finished request is retired at once: its slots and row are freed in the step it finishes",
        edit(
            """        for req in finished:
            self.release_req(req, "finished")
        self.running""",
            """        self.running""",
        ),
        r"finished",
    ),
    Mutant(
        "s05-release-keeps-the-match",
        "s05_continuous_batching/scheduler.py",
        "a released request forgets its row, its match and its cached length: a retracted one starts from nothing",
        edit(
            "        req.req_pool_idx, req.prefix_match, req.cached_len = None, None, 0\n",
            "        req.req_pool_idx = None\n",
        ),
        r"retract|cached_len|prefix_match|release",
    ),
    Mutant(
        "s05-no-running-cap",
        "s05_continuous_batching/scheduler.py",
        "admission stops at max_running_requests requests running at once",
        edit(
            "        while self.waiting and len(self.reqs_holding_memory()) + len(admitted) < self.max_running_requests:",  # noqa: E501
            "        while self.waiting:",
        ),
        r"max_running_requests",
    ),
    Mutant(
        "s05-match-the-whole-prompt",
        "s05_continuous_batching/scheduler.py",
        "a prompt's last token is always computed (its logits give the next token): match all but the last token",
        edit(
            "            match = self.prefix_cache.match_prefix(req.fill_ids[: req.max_prefix_len])",
            "            match = self.prefix_cache.match_prefix(req.fill_ids)",
        ),
        r"last token",
    ),
    Mutant(
        "s05-match-past-the-scored-prompt",
        "s05_continuous_batching/scheduler.py",
        "a request scoring its prompt (prompt_logprobs) needs logits where a cached prefix has none: match only "
        "fill_ids[: req.max_prefix_len]",
        edit(
            "            match = self.prefix_cache.match_prefix(req.fill_ids[: req.max_prefix_len])",
            "            match = self.prefix_cache.match_prefix(req.fill_ids[:-1])",
        ),
        r"max_prefix_len",
    ),
    Mutant(
        "s05-reserved-not-accumulated",
        "s05_continuous_batching/scheduler.py",
        "each admitted request's need is kept back from the room the next one in line may take",
        edit("            reserved += need\n", ""),
        r"future|reserve|room|retract",
    ),
    Mutant(
        "s05-budget-not-spent",
        "s05_continuous_batching/scheduler.py",
        "each admitted prompt spends its tokens from the step's prefill budget",
        edit("            budget -= extend_len\n", ""),
        r"budget|max_prefill_tokens",
    ),
    Mutant(
        "s05-retracted-newest-first-in-line",
        "s05_continuous_batching/scheduler.py",
        "requests retracted in one step wait at the front of the queue oldest first (they keep their order)",
        (
            ("            self.waiting.appendleft(req)\n", ""),
            (
                "            retracted.append(req)\n        return retracted\n",
                "            retracted.append(req)\n        self.waiting.extendleft(reversed(retracted))\n"
                "        return retracted\n",
            ),
        ),
        r"oldest first",
    ),
    Mutant(
        "s05-admission-returns-the-scheduled",
        "s05_continuous_batching/scheduler.py",
        "admission returns only the requests it started, not those already in the pass (stage 7's next chunk)",
        edit("        return admitted[len(scheduled) :]\n", "        return admitted\n"),
        r"returns only those",
    ),
    Mutant(
        "s05-first-alone-needs-its-future",
        "s05_continuous_batching/scheduler.py",
        "with nothing running, the first in line is admitted whenever its prefill fits, whatever its future needs",
        edit(
            "            if need > room and not (first_alone and prefill_slots <= room):\n",
            "            if need > room:\n",
        ),
        r"whatever its later tokens",
    ),
    Mutant(
        "s05-every-leaver-inserted",
        "s05_continuous_batching/scheduler.py",
        "a leaving request's K/V are offered for keeping only when its reason is in keep_kv_of",
        edit("        insert = why in self.keep_kv_of\n", "        insert = True\n"),
        r"keep_kv_of",
    ),
    Mutant(
        "s05-whole-fill-ids-handed-back",
        "s05_continuous_batching/scheduler.py",
        "a leaving request hands back one token id per slot: the tokens it has K/V for, fill_ids[:cached_len]",
        edit(
            "self.prefix_cache.cache_finished_req(req.fill_ids[: req.cached_len], slots, req.prefix_match, insert)",
            "self.prefix_cache.cache_finished_req(req.fill_ids, slots, req.prefix_match, insert)",
        ),
        r"token ids for .* slots",
    ),
    Mutant(
        "s05-budget-off-by-one",
        "s05_continuous_batching/scheduler.py",
        "a prompt that exactly fills what is left of the prefill budget is admitted",
        edit(
            "            if admitted and extend_len > budget:\n", "            if admitted and extend_len >= budget:\n"
        ),
        r"fill the budget exactly",
    ),
    Mutant(
        "s05-room-off-by-one",
        "s05_continuous_batching/scheduler.py",
        "a request whose need is exactly the room left is admitted",
        edit(
            "            if need > room and not (first_alone and prefill_slots <= room):\n",
            "            if need >= room and not (first_alone and prefill_slots <= room):\n",
        ),
        r"need <= room",
    ),
    Mutant(
        "s05-device-len-not-set",
        "s05_continuous_batching/scheduler.py",
        "admission sets device_len to the end of the pass it gives a new request (stage 7 cuts it short)",
        edit(
            "            req.device_len = end  # this pass computes fill_ids[cached_len:end] "
            "(all of them, before stage 7)\n",
            "",
        ),
        r"sets req.device_len",
    ),
    Mutant(
        "s05-prefill-not-from-prefill-len",
        "s05_continuous_batching/scheduler.py",
        "a new request's first pass is what prefill_len gives it (stage 7 cuts long prompts), not its whole prompt",
        edit(
            "            extend_len = self.prefill_len(req, match.cached_len, budget)\n",
            "            extend_len = len(req.fill_ids) - match.cached_len\n",
        ),
        r"prefill_len gives it",
    ),
    Mutant(
        "s05-room-not-less-reserved",
        "s05_continuous_batching/scheduler.py",
        "the room is what the pool has less what admission keeps back for the requests before (reserved)",
        edit(
            "            room = self.available_slots() - reserved\n",
            "            room = self.available_slots()\n",
        ),
        r"minus what admission keeps back \(reserved",
    ),
    Mutant(
        "s05-cached-len-not-advanced",
        "s05_continuous_batching/scheduler.py",
        "after its pass a request's K/V are stored up to device_len: cached_len moves there",
        edit("        for req in reqs:\n            req.cached_len = req.device_len\n", ""),
        r"sets req.cached_len = req.device_len",
    ),
    Mutant(
        "s05-room-counts-free-slots-only",
        "s05_continuous_batching/scheduler.py",
        "admission's room is available_slots(): the free slots plus those the prefix cache can evict",
        edit(
            "            room = self.available_slots() - reserved\n",
            "            room = self.runner.allocator.available_size() - reserved\n",
        ),
        r"available_slots\(\) \(free slots plus prefix_cache.evictable_size\(\)\)",
    ),
    Mutant(
        "s05-retract-while-free-slots-short",
        "s05_continuous_batching/scheduler.py",
        "retraction stops once the pass fits the room, the prefix cache's evictable slots included",
        edit(
            "while len(self.running) > 1 and self.next_pass_slots(self.running) > self.available_slots():",
            "while len(self.running) > 1 and self.next_pass_slots(self.running) > self.runner.allocator.available_size():",  # noqa: E501
        ),
        r"slots the prefix cache can evict are room too",
    ),
    Mutant(
        "s05-retract-off-by-one",
        "s05_continuous_batching/scheduler.py",
        "retraction stops once the pass fits: a pass that needs exactly the room left fits",
        edit(
            "while len(self.running) > 1 and self.next_pass_slots(self.running) > self.available_slots():",
            "while len(self.running) > 1 and self.next_pass_slots(self.running) >= self.available_slots():",
        ),
        r"needs exactly the room left fits",
    ),
    # --- stage 6: the radix cache -------------------------------------------------------------
    Mutant(
        "s06-evict-a-parent-with-children",
        "s06_radix_cache/radix_cache.py",
        "only leaves are evicted: a parent joins the heap when its LAST child is gone",
        edit(
            "if parent is not self.root and not parent.children and parent.lock_ref == 0:",
            "if parent is not self.root and parent.lock_ref == 0:",
        ),
        r"evict",
    ),
    Mutant(
        "s06-evict-heap-of-all-nodes",
        "s06_radix_cache/radix_cache.py",
        "eviction starts from the unlocked LEAVES (a node with children still holds its children's prefix)",
        edit(
            "heap = [node for node in self._all_nodes() if not node.children and node.lock_ref == 0]",
            "heap = [node for node in self._all_nodes() if node.lock_ref == 0]",
        ),
        r"evict",
    ),
    Mutant(
        "s06-evict-most-recent",
        "s06_radix_cache/radix_cache.py",
        "the least recently used leaf is evicted first",
        edit("            leaf = heapq.heappop(heap)", "            leaf = heap.pop()"),
        r"least recently used",
    ),
    Mutant(
        "s06-match-no-split",
        "s06_radix_cache/radix_cache.py",
        "a match that ends inside an edge splits it, so the matched node ends exactly where the match does",
        edit(
            """            if n < len(child.key):
                node = self._split_node(child, n)
                values.append(node.value)
                break""",
            """            if n < len(child.key):
                node = child
                values.append(child.value[:n])
                break""",
        ),
        r"split",
    ),
    Mutant(
        "s06-split-takes-the-whole-edge",
        "s06_radix_cache/radix_cache.py",
        "a match that ends inside an edge takes only the part it matched: the split node's slots",
        edit(
            """                node = self._split_node(child, n)
                values.append(node.value)""",
            """                node = self._split_node(child, n)
                values.append(child.value)""",
        ),
        r"a match is never longer than its key",
    ),
    Mutant(
        "s06-lock-only-the-node",
        "s06_radix_cache/radix_cache.py",
        "a lock covers the whole path: the node and every node above it",
        edit(
            "            node.lock_ref += delta\n            node = node.parent",
            "            node.lock_ref += delta\n            break",
        ),
        r"locked more often than its parent|lock",
    ),
    Mutant(
        "s06-unlock-below-zero",
        "s06_radix_cache/radix_cache.py",
        "an unlock without a matching lock is refused (a negative count would let eviction free slots in use)",
        edit(
            "            if node.lock_ref + delta < 0:\n                raise",
            "            if False:\n                raise",
        ),
        r"unlock",
    ),
    Mutant(
        "s06-duplicates-kept",
        "s06_radix_cache/radix_cache.py",
        "when the tree already holds a prefix, the leaving request's own copies of it are freed",
        edit(
            "            self.allocator.free(slots[match.cached_len : present])\n            "
            "self.allocator.free(slots[aligned:])",
            "            self.allocator.free(slots[aligned:])",
        ),
        r"duplicate",
    ),
    Mutant(
        "s06-insert-no-split",
        "s06_radix_cache/radix_cache.py",
        "an insert that leaves an edge midway splits it there, so the new tokens hang where the match ends",
        edit(
            """            if n < len(child.key):
                child = self._split_node(child, n)
            present += n""",
            """            present += n""",
        ),
        r"split",
    ),
    Mutant(
        "s06-insert-returns-nothing-present",
        "s06_radix_cache/radix_cache.py",
        "insert returns how many leading tokens the tree already held, so the caller frees its copies of them",
        edit("            present += n\n", ""),
        r"already|duplicate|insert",
    ),
    Mutant(
        "s06-insert-leaf-not-evictable",
        "s06_radix_cache/radix_cache.py",
        "a new leaf is evictable (nobody locks it yet): evictable_size counts its tokens",
        edit("            self.evictable_size_ += len(key)\n", ""),
        r"evictable",
    ),
    Mutant(
        "s06-partial-page-kept",
        "s06_radix_cache/radix_cache.py",
        "a leaving request's last, partly filled page is freed: the tree holds whole pages only",
        edit("            self.allocator.free(slots[aligned:])\n        else:", "        else:"),
        r"page|leak|free",
    ),
    Mutant(
        "s06-never-unlocked",
        "s06_radix_cache/radix_cache.py",
        "a leaving request unlocks its match, so the prefix it used becomes evictable again",
        edit("        self.unlock(match)\n        # END EXERCISE", "        # END EXERCISE"),
        r"unlock|lock|evictable|protected",
    ),
    Mutant(
        "s06-match-not-touched",
        "s06_radix_cache/radix_cache.py",
        "a match counts as a use: every node on its path gets a new access time, so eviction spares it",
        edit(
            """            child = node.children[self._child_key(key)]
            self._touch(child)
            n = self._match_len(child.key, key)
            if n < len(child.key):
                node = self._split_node(child, n)""",
            """            child = node.children[self._child_key(key)]
            n = self._match_len(child.key, key)
            if n < len(child.key):
                node = self._split_node(child, n)""",
        ),
        r"least recently|LRU|access|recent",
    ),
    Mutant(
        "s06-evict-locked-leaf",
        "s06_radix_cache/radix_cache.py",
        "a locked leaf is never evicted: a running request reads its slots",
        edit(
            "        heap = [node for node in self._all_nodes() if not node.children and node.lock_ref == 0]",
            "        heap = [node for node in self._all_nodes() if not node.children]",
        ),
        r"lock",
    ),
    Mutant(
        "s06-evict-locked-parent",
        "s06_radix_cache/radix_cache.py",
        "a parent left without children is evicted only when nobody locks it",
        edit(
            "            if parent is not self.root and not parent.children and parent.lock_ref == 0:",
            "            if parent is not self.root and not parent.children:",
        ),
        r"lock",
    ),
    Mutant(
        "s06-leaf-never-used",
        "s06_radix_cache/radix_cache.py",
        "a new leaf counts as used when insert makes it (its access time from the clock), so it is not evicted first",
        edit(
            "            leaf = TreeNode(next(self._node_ids), key, slots.clone(), node, next(self._clock))",
            "            leaf = TreeNode(next(self._node_ids), key, slots.clone(), node, 0)",
        ),
        r"used|evict",
    ),
    Mutant(
        "s06-match-splits-inside-a-page",
        "s06_radix_cache/radix_cache.py",
        "a match compares whole pages, so an edge is split only between pages",
        edit(
            """            self._touch(child)
            n = self._match_len(child.key, key)
            if n < len(child.key):
                node = self._split_node(child, n)""",
            """            self._touch(child)
            n = next((i for i, (a, b) in enumerate(zip(child.key, key)) if a != b), min(len(child.key), len(key)))
            if n < len(child.key):
                node = self._split_node(child, n)""",
        ),
        r"page",
    ),
    Mutant(
        "s06-evict-heap-not-heapified",
        "s06_radix_cache/radix_cache.py",
        "the least recently used leaf is evicted first: the leaves form a heap (heapify) before the first pop",
        edit("        heapq.heapify(heap)\n", ""),
        r"least recently used leaf first",
    ),
    Mutant(
        "s06-evict-one-leaf-too-many",
        "s06_radix_cache/radix_cache.py",
        "eviction stops as soon as it has freed num_tokens slots",
        edit("        while evicted < num_tokens and heap:\n", "        while evicted <= num_tokens and heap:\n"),
        r"evicted < num_tokens",
    ),
    Mutant(
        "s06-insert-path-not-touched",
        "s06_radix_cache/radix_cache.py",
        "insert touches every node it walks through: what a request just finished with is the most recently used",
        edit(
            "            self._touch(child)\n            n = self._match_len(child.key, key)\n"
            "            if n < len(child.key):\n                child = self._split_node(child, n)",
            "            n = self._match_len(child.key, key)\n            if n < len(child.key):\n"
            "                child = self._split_node(child, n)",
        ),
        r"insert touches every node",
    ),
    # --- stage 7: chunked prefill -------------------------------------------------------------
    Mutant(
        "s07-no-chunking",
        "s07_chunked_prefill/scheduler.py",
        "a prompt longer than what is left of the step's budget is cut there",
        edit("        return min(rest, budget)", "        return rest"),
        r"budget|chunk",
    ),
    Mutant(
        "s07-unlock-before-lock",
        "s07_chunked_prefill/prefix_cache.py",
        "lock the new match BEFORE unlocking the old one: in between, nothing on the request's path may become "
        "evictable",
        edit(
            "        self.lock(new_match)\n        self.unlock(match)",
            "        self.unlock(match)\n        self.lock(new_match)",
        ),
        r"lock the new match before",
    ),
    Mutant(
        "s07-empty-chunk-when-budget-spent",
        "s07_chunked_prefill/scheduler.py",
        "a request the step's spent budget would cut to nothing runs whole (it is the step's only prefill)",
        edit(
            "        if self.chunked_prefill_size is None or budget < 1:",
            "        if self.chunked_prefill_size is None:",
        ),
        r"pass of 0 tokens",
    ),
    Mutant(
        "s07-chunked-req-not-cleared",
        "s07_chunked_prefill/scheduler.py",
        "a request leaves chunked_req when its next chunk is scheduled",
        edit(
            "                return []\n            self.chunked_req = None\n",
            "                return []\n",
        ),
        r"chunked_req still names request",
    ),
    Mutant(
        "s07-stale-match-returned",
        "s07_chunked_prefill/prefix_cache.py",
        "cache_unfinished_req returns the NEW match (the tree's copy of the prefix), not the one it was given",
        edit("        return new_match\n        # END EXERCISE", "        return match\n        # END EXERCISE"),
        r"returned a match of \d+ tokens",
    ),
    Mutant(
        "s07-duplicates-kept",
        "s07_chunked_prefill/prefix_cache.py",
        "a chunk's own copies of tokens the tree already held are freed",
        edit("        self.allocator.free(slots[match.cached_len : present])\n        new_match", "        new_match"),
        r"duplicate",
    ),
    Mutant(
        "s07-sample-mid-prefill",
        "s07_chunked_prefill/scheduler.py",
        "a request whose prefill is unfinished is never sampled (its logits mean nothing yet)",
        edit(
            "sampled = super().process_batch_result(others, logits[rest] if pending else logits)",
            "sampled = super().process_batch_result(batch, logits)",
        ),
        r"sampled with only",
    ),
    Mutant(
        "s07-chunk-stays-running",
        "s07_chunked_prefill/scheduler.py",
        "the half-prefilled request leaves the running list (it has no token to decode) and is kept as chunked_req",
        edit("            self.running.remove(req)\n", ""),
        r"half.prefilled|mid.prefill|prefill is unfinished|prefill is still unfinished",
    ),
    Mutant(
        "s07-chunk-not-charged",
        "s07_chunked_prefill/scheduler.py",
        "the half-prefilled request's next chunk is paid from the step's budget, like any prompt tokens",
        edit("            budget -= chunk\n", ""),
        r"budget",
    ),
    Mutant(
        "s07-chunks-when-off",
        "s07_chunked_prefill/scheduler.py",
        "chunked_prefill_size=None turns chunking off: every prompt is computed whole (stage 6's behaviour)",
        edit("if self.chunked_prefill_size is None or budget < 1:", "if budget < 1:"),
        r"chunked_prefill_size=None",
    ),
    Mutant(
        "s07-no-in-batch-check",
        "s07_chunked_prefill/scheduler.py",
        "waiting requests are admitted through admit_waiting, which holds back one that would compute again a "
        "prefix a request ahead of it computes in the same pass",
        edit(
            "return continuing + self.admit_waiting(scheduled=[*scheduled, *continuing], budget=budget)",
            "return continuing + super().admit_new_requests(scheduled=[*scheduled, *continuing], budget=budget)",
        ),
        r"held_back|wait a step|hold C back",
    ),
    Mutant(
        "s07-prompt-not-shared",
        "s07_chunked_prefill/scheduler.py",
        "a request's prompt goes into the tree right after its prefill (share_prompts), not only when it leaves",
        edit("        self.share_prompts(others.prefill_reqs)\n", ""),
        r"share_prompts|into the tree",
    ),
    Mutant(
        "s07-pending-row-sampled-for-another",
        "s07_chunked_prefill/scheduler.py",
        "the logits rows handed on are those of the requests sampled: a half-prefilled request's row is dropped",
        edit(
            "        sampled = super().process_batch_result(others, logits[rest] if pending else logits)",
            "        sampled = super().process_batch_result(others, logits)",
        ),
        r"row|logits",
    ),
    Mutant(
        "s07-chunk-match-not-locked",
        "s07_chunked_prefill/prefix_cache.py",
        "the tree's copy of a half-prefilled request's chunks is locked for it: a running request's prefix stays",
        edit("        self.lock(new_match)\n", ""),
        r"lock",
    ),
    Mutant(
        "s07-chunk-ignores-room",
        "s07_chunked_prefill/scheduler.py",
        "a half-prefilled request's next chunk fits the pool's room after what the running requests keep back",
        edit(
            "            chunk = self.next_chunk_len(req, budget)",
            "            chunk = self.prefill_len(req, req.cached_len, budget)",
        ),
        r"next_chunk_len|room",
    ),
    Mutant(
        "s07-chunk-rounded-to-pages",
        "s07_chunked_prefill/scheduler.py",
        "a chunk is cut to the budget in tokens, never rounded up to whole pages",
        edit(
            "        return min(rest, budget)",
            "        return min(rest, -(-budget // self.page_size) * self.page_size)",
        ),
        r"budget",
    ),
    Mutant(
        "s07-continuing-not-scheduled",
        "s07_chunked_prefill/scheduler.py",
        "the continuing chunk counts as admitted first: waiting requests are admitted after it, within the rows left",
        edit(
            "admit_waiting(scheduled=[*scheduled, *continuing], budget=budget)",
            "admit_waiting(scheduled=scheduled, budget=budget)",
        ),
        r"table row|scheduled",
    ),
    Mutant(
        "s07-continuing-not-returned",
        "s07_chunked_prefill/scheduler.py",
        "admit_new_requests returns the half-prefilled request's chunk with the newly admitted requests",
        edit("        return continuing + self.admit_waiting(", "        return self.admit_waiting("),
        r"admit_new_requests|half-prefilled",
    ),
    Mutant(
        "s07-pending-not-marked-cached",
        "s07_chunked_prefill/scheduler.py",
        "a chunk just computed is cached (cached_len = device_len) before it goes into the tree",
        edit(
            """            req = batch.reqs[i]
            req.cached_len = req.device_len
""",
            """            req = batch.reqs[i]
""",
        ),
        r"cached_len|cached",
    ),
    # --- stage 8: CUDA graphs (regions that exist now, picked away from the capture protocol) -----
    Mutant(
        "s08-no-max-bs-bucket",
        "s08_cuda_graph/cuda_graph_runner.py",
        "max_bs itself is the largest batch-size bucket",
        edit("    return buckets + [max_bs]\n    # END EXERCISE", "    return buckets\n    # END EXERCISE"),
        r"max_bs|bucket",
    ),
    Mutant(
        "s08-bucket-too-big",
        "s08_cuda_graph/cuda_graph_runner.py",
        "a batch runs in the SMALLEST bucket that holds it",
        edit(
            "bs = self.capture_bs[bisect.bisect_left(self.capture_bs, num_reqs)]",
            "bs = self.capture_bs[min(bisect.bisect_right(self.capture_bs, num_reqs), len(self.capture_bs) - 1)]",
        ),
        r"bucket|smallest",
    ),
    Mutant(
        "s08-kv-bucket-too-big",
        "s08_cuda_graph/cuda_graph_runner.py",
        "a batch runs in the SMALLEST key-length bucket that holds its longest sequence",
        edit(
            "kv_len = self.capture_kv_lens[bisect.bisect_left(self.capture_kv_lens, max_seq_len)]",
            "kv_len = self.capture_kv_lens[min(bisect.bisect_right(self.capture_kv_lens, max_seq_len), "
            "len(self.capture_kv_lens) - 1)]",
        ),
        r"bucket|kv_len|smallest",
    ),
    Mutant(
        "s08-full-batch-runs-eager",
        "s08_cuda_graph/cuda_graph_runner.py",
        "a decode of exactly max_bs requests still fits the largest graph",
        edit("forward_batch.num_reqs <= self.max_bs", "forward_batch.num_reqs < self.max_bs"),
        r"max_bs|graph|eager",
    ),
    Mutant(
        "s08-no-max-kv-len-bucket",
        "s08_cuda_graph/cuda_graph_runner.py",
        "the table width itself is the largest key-length bucket, so every sequence the table holds has a graph",
        edit("    return buckets + [max_kv_len]\n    # END EXERCISE", "    return buckets\n    # END EXERCISE"),
        r"kv_len_buckets",
    ),
    Mutant(
        "s08-padding-not-refilled",
        "s08_cuda_graph/cuda_graph_runner.py",
        "rows past the real batch are padded with dummy requests on every replay",
        edit("        self.fill_padding(n, bs)\n        self.attn_backend", "        self.attn_backend"),
        r"pad|dummy",
    ),
    Mutant(
        "s08-key-mask-one-more",
        "s08_cuda_graph/decode_attention.py",
        "a decode row sees the keys j < seq_len: its last key is its own new token, nothing after it",
        edit(
            "self.key_positions[None, :kv_len] < meta.seq_lens[:, None]",
            "self.key_positions[None, :kv_len] <= meta.seq_lens[:, None]",
        ),
        r"mask|key",
    ),
    Mutant(
        "s08-metadata-rebound",
        "s08_cuda_graph/decode_attention.py",
        "the decode metadata are filled IN PLACE: a captured graph reads the buffers it was recorded with",
        edit(
            """        meta.kv_indices.copy_(table[req_pool_indices, :kv_len])
        meta.key_mask.copy_(self.key_positions[None, :kv_len] < meta.seq_lens[:, None])""",
            """        meta.kv_indices = table[req_pool_indices, :kv_len]
        meta.key_mask = self.key_positions[None, :kv_len] < meta.seq_lens[:, None]""",
        ),
        r"in place|copy_|replaced|address",
    ),
    Mutant(
        "s08-decode-unmasked",
        "s08_cuda_graph/decode_attention.py",
        "a decode row attends only to its own keys: the key mask hides the padding of shorter rows",
        edit(
            "F.scaled_dot_product_attention(grouped, keys, values, attn_mask=key_mask[:, None, None, :])",
            "F.scaled_dot_product_attention(grouped, keys, values)",
        ),
        r"mask|attend_decode",
    ),
    Mutant(
        "s08-no-eager-fallback",
        "s08_cuda_graph/model_runner.py",
        "a batch no graph can run (a prefill, or more requests than the largest bucket) runs eagerly",
        edit(
            "if self.cuda_graph_runner is not None and self.cuda_graph_runner.can_run(batch):",
            "if self.cuda_graph_runner is not None:",
        ),
        r"eager|can_run|bucket",
    ),
    Mutant(
        "s08-one-warmup",
        "s08_cuda_graph/cuda_graph_runner.py",
        "NUM_WARMUP_RUNS eager runs on a side stream precede a capture: no lazy setup happens while recording",
        edit("                for _ in range(NUM_WARMUP_RUNS):", "                for _ in range(1):"),
        r"run the model \d+ times|warm-up",
    ),
    Mutant(
        "s08-gqa-repeat-not-interleave",
        "s08_cuda_graph/decode_attention.py",
        "with grouped-query attention, query head h reads KV head h // (query heads per KV head), not h % num_kv_heads",
        edit(
            """        grouped = q.reshape(n, kv_heads, q.shape[1] // kv_heads, head_dim)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=key_mask[:, None, None, :])
        return out.reshape(n, -1, head_dim)""",
            """        grouped = q.reshape(n, q.shape[1] // kv_heads, kv_heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=key_mask[:, None, None, :])
        return out.transpose(1, 2).reshape(n, -1, head_dim)""",
        ),
        r"GQA|grouped|KV head|repeat",
    ),
    Mutant(
        "s08-side-waits-after-warmup",
        "s08_cuda_graph/cuda_graph_runner.py",
        "the side stream waits for the default stream BEFORE the warm-ups: the static buffers were filled there",
        edit(
            """            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(NUM_WARMUP_RUNS):
                    self.model(batch, return_all_logits=True)
""",
            """            with torch.cuda.stream(stream):
                for _ in range(NUM_WARMUP_RUNS):
                    self.model(batch, return_all_logits=True)
            stream.wait_stream(torch.cuda.current_stream(self.device))
""",
        ),
        r"BEFORE its first warm-up",
    ),
    Mutant(
        "s08-default-waits-before-warmup",
        "s08_cuda_graph/cuda_graph_runner.py",
        "the default stream waits for the side stream AFTER the warm-ups: a wait orders only the work already queued",
        edit(
            """            with torch.cuda.stream(stream):
                for _ in range(NUM_WARMUP_RUNS):
                    self.model(batch, return_all_logits=True)
            torch.cuda.current_stream(self.device).wait_stream(stream)
""",
            """            torch.cuda.current_stream(self.device).wait_stream(stream)
            with torch.cuda.stream(stream):
                for _ in range(NUM_WARMUP_RUNS):
                    self.model(batch, return_all_logits=True)
""",
        ),
        r"AFTER the\s+last warm-up",
    ),
    Mutant(
        "s08-kv-check-one-request",
        "s08_cuda_graph/cuda_graph_runner.py",
        "a graph holds a batch only if its LONGEST sequence fits the largest key bucket, wherever it stands",
        edit(
            "and max(forward_batch.seq_lens) <= self.max_kv_len",
            "and forward_batch.seq_lens[-1] <= self.max_kv_len",
        ),
        r"longest",
    ),
    Mutant(
        "s08-pool-per-graph",
        "s08_cuda_graph/cuda_graph_runner.py",
        "every graph is captured into the ONE pool the runner made at start (self.graph_pool), so they share memory",
        edit(
            "with torch.cuda.graph(graph, pool=self.graph_pool):",
            "with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle()):",
        ),
        r"shared graph_pool",
    ),
    Mutant(
        "s08-output-buffer-copy",
        "s08_cuda_graph/cuda_graph_runner.py",
        "a graph writes the very tensor its capture returned: output_buffers keeps that tensor, not a copy of it",
        edit("self.output_buffers[bs, kv_len] = logits", "self.output_buffers[bs, kv_len] = logits.clone()"),
        r"output_buffers",
    ),
    Mutant(
        "s08-out-cache-loc-not-copied",
        "s08_cuda_graph/cuda_graph_runner.py",
        "every input the graph reads is copied into its static buffer, the new tokens' KV slots too",
        edit("        self.out_cache_loc[:n].copy_(forward_batch.out_cache_loc)\n", ""),
        r"static out_cache_loc",
    ),
    Mutant(
        "s08-seq-lens-are-positions",
        "s08_cuda_graph/cuda_graph_runner.py",
        "a decode row's length counts its new token: seq_len = position + 1",
        edit("seq_lens[:n].copy_(forward_batch.positions + 1)", "seq_lens[:n].copy_(forward_batch.positions)"),
        r"static seq_lens",
    ),
    Mutant(
        "s08-refill-before-padding",
        "s08_cuda_graph/cuda_graph_runner.py",
        "the bucket's metadata are refilled from the static buffers AFTER the batch is copied in and padded",
        edit(
            "        self.fill_padding(n, bs)\n"
            "        self.attn_backend.init_forward_metadata_replay_cuda_graph(bs, kv_len, self.req_pool_indices[:bs])",
            "        self.attn_backend.init_forward_metadata_replay_cuda_graph(bs, kv_len, self.req_pool_indices[:bs])"
            "\n        self.fill_padding(n, bs)",
        ),
        r"after the batch is copied in and padded",
    ),
    Mutant(
        "s08-refill-another-bucket",
        "s08_cuda_graph/cuda_graph_runner.py",
        "a replay reads the metadata views of ITS bucket (bs, kv_len): a refill of another bucket's goes unseen",
        edit(
            "replay_cuda_graph(bs, kv_len, self.req_pool_indices[:bs])\n        return bucket",
            "replay_cuda_graph(bs, self.max_kv_len, self.req_pool_indices[:bs])\n        return bucket",
        ),
        r"the bucket's own views",
    ),
    Mutant(
        "s08-refill-real-rows-only",
        "s08_cuda_graph/cuda_graph_runner.py",
        "the bucket's metadata cover all of its bs rows, the padding rows included",
        edit(
            "replay_cuda_graph(bs, kv_len, self.req_pool_indices[:bs])\n        return bucket",
            "replay_cuda_graph(bs, kv_len, forward_batch.req_pool_indices)\n        return bucket",
        ),
        r"padding included",
    ),
    Mutant(
        "s08-metadata-first-table-rows",
        "s08_cuda_graph/decode_attention.py",
        "a row's keys are the slots of ITS request's table row, req_to_token[req_pool_indices[i]], not of table row i",
        edit(
            "meta.kv_indices.copy_(table[req_pool_indices, :kv_len])",
            "meta.kv_indices.copy_(table[: len(req_pool_indices), :kv_len])",
        ),
        r"req_to_token\[req_pool_indices",
    ),
    # --- stage 9: serving ----------------------------------------------------------------------
    Mutant(
        "s09-no-hold-back",
        "s09_zmq_serving/detokenizer_manager.py",
        "text that may be the start of a stop string is held back until it is known not to be one",
        edit("    longest = 0\n    for stop in stops:", "    return 0\n    longest = 0\n    for stop in stops:"),
        r"hold|stop",
    ),
    Mutant(
        "s09-hold-back-first-stop-only",
        "s09_zmq_serving/detokenizer_manager.py",
        "ANY stop string's beginning is held back, not only the first one's",
        edit(
            "    for stop in stops:\n        for k in range(min(len(stop) - 1, len(text)), longest, -1):",
            "    for stop in stops[:1]:\n        for k in range(min(len(stop) - 1, len(text)), longest, -1):",
        ),
        r"hold|stop",
    ),
    Mutant(
        "s09-no-finish-chunk",
        "s09_zmq_serving/api_server.py",
        "the stream's last content chunk carries the finish reason",
        edit(
            """        if out.finish_reason is not None:
            yield sse(make_chunk("", out.finish_reason, None))
""",
            "",
        ),
        r"finish",
    ),
    Mutant(
        "s09-no-done",
        "s09_zmq_serving/api_server.py",
        "an SSE stream ends with 'data: [DONE]'",
        edit('    yield sse("[DONE]")\n    # END EXERCISE', "    # END EXERCISE"),
        r"DONE",
    ),
    Mutant(
        "s09-max-completion-tokens-ignored",
        "s09_zmq_serving/protocol.py",
        "max_completion_tokens (the newer name) limits the answer like max_tokens",
        edit("        max_tokens = other\n", ""),
        r"max_completion_tokens|max_tokens",
    ),
    Mutant(
        "s09-logprobs-not-passed",
        "s09_zmq_serving/protocol.py",
        "the request's logprobs (chat: logprobs + top_logprobs, completions: logprobs) become SamplingParams.logprobs",
        edit("            logprobs=logprobs,\n", ""),
        r"SamplingParams.logprobs",
    ),
    Mutant(
        "s09-logit-bias-not-passed",
        "s09_zmq_serving/protocol.py",
        "the request's penalties and logit_bias (its keys read as token ids) become SamplingParams' fields",
        edit('        "logit_bias": token_bias(request),\n', ""),
        r"logit_bias",
    ),
    Mutant(
        "s09-min-tokens-not-passed",
        "s09_zmq_serving/protocol.py",
        "min_tokens (the extension) becomes SamplingParams.min_new_tokens",
        edit('        "min_new_tokens": request.min_tokens,\n', ""),
        r"min_tokens|min_new_tokens",
    ),
    Mutant(
        "s09-error-names-no-param",
        "s09_zmq_serving/protocol.py",
        "an invalid sampling field is refused with an error whose `param` names that field",
        edit(
            "raise InvalidRequest(in_api_words(str(error)), param=API_NAMES.get(name, name)) from None",
            "raise InvalidRequest(in_api_words(str(error))) from None",
        ),
        r"param",
    ),
    Mutant(
        "s09-abort-detokenizer-not-told",
        "s09_zmq_serving/scheduler_process.py",
        "an aborted request's end goes to the detokenizer, which forgets its text and ends its stream",
        edit(
            "            self.send_to_detokenizer.send_pyobj(\n"
            "                BatchTokenIDOut(\n"
            "                    [rid],",
            "            (\n                (\n                    [rid],",
        ),
        r"abort|detokenizer",
    ),
    Mutant(
        "s09-stop-token-shown",
        "s09_zmq_serving/detokenizer_manager.py",
        "a matched stop token (or EOS) ends the text and is not part of it",
        edit(
            "            final = detok.flush(self.output_ids[:-1])", "            final = detok.flush(self.output_ids)"
        ),
        r"stop token|stop_token|EOS",
    ),
    Mutant(
        "s09-stop-string-kept",
        "s09_zmq_serving/detokenizer_manager.py",
        "the final text ends before a matched stop string",
        edit(
            """            if self.stop_pos is not None:
                final = detok.text[: self.stop_pos]
            else:
                final = detok.flush(self.output_ids)""",
            """            final = detok.flush(self.output_ids)""",
        ),
        r"stop",
    ),
    Mutant(
        "s09-loop-always-blocks",
        "s09_zmq_serving/scheduler_process.py",
        "the loop waits for messages only when it has no work; with requests running it only polls",
        edit("self.recv_requests(block=not self.engine.has_work)", "self.recv_requests(block=True)"),
        r"block|wait|poll|loop",
    ),
    Mutant(
        "s09-loop-never-blocks",
        "s09_zmq_serving/scheduler_process.py",
        "an idle loop sleeps in recv until a message comes, instead of spinning on a core",
        edit("self.recv_requests(block=not self.engine.has_work)", "self.recv_requests(block=False)"),
        r"block|idle|spin|CPU",
    ),
    Mutant(
        "s09-unservable-kills-the-loop",
        "s09_zmq_serving/scheduler_process.py",
        "a request that can never be served gets a 400 with the engine's reason; the loop goes on",
        edit(
            """        try:
            self.reqs[req.rid] = self.engine.add_request(req.input_ids, params, rid=req.rid)
        except ValueError as error:
            self.send_to_detokenizer.send_pyobj(ErrorOut.refused(req.rid, error))""",
            """        self.reqs[req.rid] = self.engine.add_request(req.input_ids, params, rid=req.rid)""",
        ),
        r"400|context|served",
    ),
    Mutant(
        "s09-refused-without-its-code",
        "s09_zmq_serving/scheduler_process.py",
        "a request too long for the engine is answered with OpenAI's code and the part to shorten (ErrorOut.refused)",
        edit(
            "            self.send_to_detokenizer.send_pyobj(ErrorOut.refused(req.rid, error))",
            "            self.send_to_detokenizer.send_pyobj(ErrorOut(req.rid, str(error), 400))",
        ),
        r"context_length_exceeded|refused|param",
    ),
    Mutant(
        "s09-abort-only-forgets",
        "s09_zmq_serving/scheduler_process.py",
        "an abort ends the request IN THE ENGINE (its KV is freed), not only in the scheduler's own table",
        edit(
            "        if self.engine.abort_request(rid):\n            req = self.reqs.pop(rid)",
            "        if rid in self.reqs:\n            req = self.reqs.pop(rid)",
        ),
        r"abort|untracked|no longer tracks",
    ),
    Mutant(
        "s09-no-usage-chunk",
        "s09_zmq_serving/api_server.py",
        "with stream_options.include_usage the stream's last chunk before [DONE] carries the token counts",
        edit("    if include_usage and last is not None:", "    if False:"),
        r"usage",
    ),
    Mutant(
        "s09-final-text-not-flushed",
        "s09_zmq_serving/detokenizer_manager.py",
        "when a request ends, the detokenizer flushes its pending tail: the final text is ALL of its ids' text",
        edit("                final = detok.flush(self.output_ids)\n", "                final = detok.text\n"),
        r"flush|tail|final text|pending|held",
    ),
    Mutant(
        "s09-stop-window-in-tokens",
        "s09_zmq_serving/detokenizer_manager.py",
        "the stop-string search window counts the characters a step added, and one token can add several",
        edit(
            "            hit = find_stop_str(detok.text, len(new_text), self.stops)\n",
            "            hit = find_stop_str(detok.text, len(new_ids), self.stops)\n",
        ),
        r"a stop string went out",
    ),
    Mutant(
        "s09-tail-before-eos-dropped",
        "s09_zmq_serving/detokenizer_manager.py",
        "a request that ends on EOS still sends all of its text before the EOS, the tail the detokenizer holds too",
        edit("            final = detok.flush(self.output_ids[:-1])\n", "            final = detok.text\n"),
        r"never came",
    ),
    Mutant(
        "s09-abort-of-a-finished-request",
        "s09_zmq_serving/scheduler_process.py",
        "an abort for a request that already finished (its client left just after the end) finds nothing to do",
        edit(
            """        if self.engine.abort_request(rid):
            req = self.reqs.pop(rid)""",
            """        self.engine.abort_request(rid)
        if True:
            req = self.reqs.pop(rid)""",
        ),
        r"finished|already|gone|abort",
    ),
    Mutant(
        "s09-tool-tag-not-held-back",
        "s09_zmq_serving/tool_calls.py",
        "text that may be the start of <tool_call> waits for the next piece, as a stop string's start does",
        edit(
            "            held = next((n for n in range(len(OPEN) - 1, 0, -1) if self.buffer.endswith(OPEN[:n])), 0)",
            "            held = 0",
        ),
        r"held back",
    ),
    Mutant(
        "s09-tool-block-that-is-no-call-dropped",
        "s09_zmq_serving/tool_calls.py",
        "a <tool_call> block that holds no call of the offered tools is the model's text, kept as written",
        edit(
            "                    content += self.content(OPEN + body + CLOSE)  # not a call of one of the tools",
            "                    pass  # not a call of one of the tools",
        ),
        r"no call of the offered tools|model's text",
    ),
    Mutant(
        "s09-tool-call-block-kept-as-content",
        "s09_zmq_serving/tool_calls.py",
        "a call's block, tags and JSON, is a call and not content",
        edit(
            "                else:\n                    done.append(call)\n                continue",
            "                else:\n                    done.append(call)\n"
            "                    content += OPEN + body + CLOSE\n                continue",
        ),
        r"not content",
    ),
    Mutant(
        "s09-filled-max-tokens-dropped",
        "s09_zmq_serving/scheduler_process.py",
        "a request without max_tokens runs to the end of the context: the engine gets the params with it filled in",
        edit(
            "            self.reqs[req.rid] = self.engine.add_request(req.input_ids, params, rid=req.rid)",
            "            self.reqs[req.rid] = self.engine.add_request(req.input_ids, req.sampling_params, rid=req.rid)",
        ),
        r"fill_max_new_tokens|end of the context|until its prompt",
    ),
    Mutant(
        "s09-seed-zero-dropped",
        "s09_zmq_serving/protocol.py",
        "0 is a value (seed=0, temperature=0), not a field left out",
        edit('        "seed": request.seed,\n', '        "seed": request.seed or None,\n'),
        r"is not None",
    ),
    Mutant(
        "s09-loop-swallows-errors",
        "s09_zmq_serving/scheduler_process.py",
        "what run_batch raises (a broken state) ends the scheduler process; the loop does not catch it",
        edit(
            "            if self.engine.has_work:\n                self.send_outputs(self.run_batch())\n",
            "            if self.engine.has_work:\n                try:\n"
            "                    self.send_outputs(self.run_batch())\n"
            '                except Exception:\n                    logger.exception("a step failed")\n',
        ),
        r"must not catch what run_batch raises",
    ),
    # --- stage 10: overlap scheduling --------------------------------------------------------------
    Mutant(
        "s10-resolve-not-in-place",
        "s10_overlap_scheduling/future_map.py",
        "the future ids are replaced IN the batch's input ids, which the forward then reads",
        edit(
            "input_ids.copy_(torch.where(future, looked_up, input_ids))",
            "input_ids = torch.where(future, looked_up, input_ids)",
        ),
        r"resolve|future",
    ),
    Mutant(
        "s10-resolve-wrong-slot",
        "s10_overlap_scheduling/future_map.py",
        "a future id -k names slot k of the buffer (negated, not used as it is)",
        edit(
            "looked_up = self.token_ids[(-input_ids).clamp(min=0)]",
            "looked_up = self.token_ids[input_ids.clamp(min=0)]",
        ),
        r"resolve|future",
    ),
    Mutant(
        "s10-always-wait",
        "s10_overlap_scheduling/scheduler.py",
        "step N is processed AFTER step N+1 is launched (waiting first is the plain loop: nothing overlaps)",
        edit(
            "        if self.last is not None and self.must_wait_for_last():\n"
            "            outputs += self.process_last()\n        launched",
            "        if self.last is not None:\n            outputs += self.process_last()\n        launched",
        ),
        r"launched before|order|scheduled before",
    ),
    Mutant(
        "s10-keep-future-of-ended",
        "s10_overlap_scheduling/scheduler.py",
        "a request that ended drops the future id of the step in flight from its output ids",
        edit(
            "                self.drop_future(req, future_id)\n                self.release_ended(req)",
            "                self.release_ended(req)",
        ),
        r"future id",
    ),
    Mutant(
        "s10-release-while-in-flight",
        "s10_overlap_scheduling/scheduler.py",
        "a request finished at step N but already in step N+1 is released only when step N+1 is processed",
        edit("                if id(req) in in_flight:", "                if False:"),
        r"in flight|release|row|double",
    ),
    Mutant(
        "s10-insert-extra-position",
        "s10_overlap_scheduling/scheduler.py",
        "a finished request drops the position the extra step stored: the tree gets what stage 8 inserts",
        edit("keep = req.cached_len if aborted else req.cached_len - 1", "keep = req.cached_len"),
        r"tree|insert|extra",
    ),
    Mutant(
        "s10-abort-drops-a-real-token",
        "s10_overlap_scheduling/scheduler.py",
        "an aborted request keeps the K/V of every token it computed; only a finished one drops the extra position",
        edit("keep = req.cached_len if aborted else req.cached_len - 1", "keep = req.cached_len - 1"),
        r"abort",
    ),
    Mutant(
        "s10-extra-page-not-freed",
        "s10_overlap_scheduling/scheduler.py",
        "the page that only the dropped position used is freed with it",
        edit("        if first_free < req.cached_len:\n", "        if False:\n"),
        r"leak|free|slot",
    ),
    Mutant(
        "s10-free-from-the-page-below",
        "s10_overlap_scheduling/scheduler.py",
        "only the pages after the kept positions are freed: the first page boundary AT OR AFTER keep (a ceiling)",
        edit(
            "first_free = pages_for(keep, self.page_size) * self.page_size",
            "first_free = keep // self.page_size * self.page_size",
        ),
        r"first page boundary at or after keep",
    ),
    Mutant(
        "s10-never-wait",
        "s10_overlap_scheduling/scheduler.py",
        "a half-prefilled request's next chunk (or a retraction) waits for the step in flight, which stores its start",
        edit(
            "        if self.last is not None and self.must_wait_for_last():\n            outputs +=",
            "        if False:\n            outputs +=",
        ),
        r"chunk|retract|wait",
    ),
    Mutant(
        "s10-wait-for-own-step",
        "s10_overlap_scheduling/scheduler.py",
        "a turn launches step N+1 and goes on: waiting for the step it just launched overlaps nothing",
        edit(
            "        launched = self.schedule_and_launch()\n        if self.last is not None:\n",
            "        launched = self.schedule_and_launch()\n        if launched is not None:\n"
            "            launched.result.result()\n        if self.last is not None:\n",
        ),
        r"did not return while the forward",
    ),
    Mutant(
        "s10-wait-before-launch",
        "s10_overlap_scheduling/scheduler.py",
        "step N+1 is launched while step N's forward still runs; the CPU waits for step N only after that",
        edit(
            "            outputs += self.process_last()\n        launched = self.schedule_and_launch()\n",
            "            outputs += self.process_last()\n        if self.last is not None:\n"
            "            self.last.result.result()\n        launched = self.schedule_and_launch()\n",
        ),
        r"did not launch step 2 while step 1",
    ),
    Mutant(
        "s10-idle-turn-skips-processing",
        "s10_overlap_scheduling/scheduler.py",
        "a turn that launches nothing still processes the step in flight (else the loop never ends)",
        edit(
            "        if self.last is not None:\n            outputs += self.process_last(next_batch=launched)",
            "        if self.last is not None and launched is not None:\n"
            "            outputs += self.process_last(next_batch=launched)",
        ),
        r"ended without processing the step that was in flight",
    ),
    Mutant(
        "s10-release-in-flight-by-hand",
        "s10_overlap_scheduling/scheduler.py",
        "a request in the step in flight keeps its table row until that step is processed (its forward reads it)",
        (
            (
                "            if req.finished:\n                self.drop_future(req, future_id)",
                "            if req.finished and req.req_pool_idx is None:\n"
                "                self.dropped_tokens += 1\n                continue\n"
                "            if req.finished:\n                self.drop_future(req, future_id)",
            ),
            (
                "                if id(req) in in_flight:\n                    self.ending.append(req)\n"
                '                else:\n                    self.release_req(req, "finished")',
                "                if id(req) in in_flight:\n"
                "                    row = self.runner.req_to_token_pool.req_to_token[req.req_pool_idx]\n"
                "                    first = pages_for(req.cached_len, self.page_size) * self.page_size\n"
                "                    if first < req.device_len:\n"
                "                        self.runner.allocator.free(row[first : req.device_len])\n"
                '                self.release_req(req, "finished")',
            ),
        ),
        r"in the step in flight but hold no table row",
    ),
    Mutant(
        "s10-resolve-unclamped",
        "s10_overlap_scheduling/future_map.py",
        "only negative ids are futures: a real token id must not be looked up in the buffer at all",
        edit(
            "        looked_up = self.token_ids[(-input_ids).clamp(min=0)]",
            "        looked_up = self.token_ids[-input_ids]",
        ),
        r"future|negative|resolve",
    ),
    Mutant(
        "s10-finished-stays-running",
        "s10_overlap_scheduling/scheduler.py",
        "a request that finishes when its step is processed leaves the running list at once",
        edit(
            "            if req.finished:\n                self.running.remove(req)\n"
            "                if id(req) in in_flight:",
            "            if req.finished:\n                if id(req) in in_flight:",
        ),
        r"still in the running list",
    ),
    Mutant(
        "s10-dropped-token-not-counted",
        "s10_overlap_scheduling/scheduler.py",
        "a token sampled for a request that had already ended is dropped, and counted (dropped_tokens)",
        edit("                self.dropped_tokens += 1\n", ""),
        r"dropped_tokens",
    ),
    Mutant(
        "s10-released-stays-ending",
        "s10_overlap_scheduling/scheduler.py",
        "a request released when the step in flight is processed leaves self.ending",
        edit("        if req in self.ending:\n            self.ending.remove(req)\n", ""),
        r"release_ended takes a request it releases out of self.ending",
    ),
    # --- stage 11: structured output ----------------------------------------------------------------
    Mutant(
        "s11-bitmask-bit-order",
        "s11_structured_output/vocab_mask.py",
        "bit j of word w is token 32*w + j (the lowest bit first)",
        edit("bits = torch.arange(32, dtype=torch.int32)", "bits = 31 - torch.arange(32, dtype=torch.int32)"),
        r"bit j of word",
    ),
    Mutant(
        "s11-padding-allowed",
        "s11_structured_output/vocab_mask.py",
        "the tokens of a padded vocabulary, past the mask's, are never allowed",
        edit("allowed.new_zeros(", "allowed.new_ones("),
        r"past the mask",
    ),
    Mutant(
        "s11-bitmask-row-of-the-batch",
        "s11_structured_output/vocab_mask.py",
        "the bitmask holds one row per CONSTRAINED request (row i of it is the i-th constrained row of the batch)",
        edit(
            "            reqs[row].grammar.fill_mask(bitmask, i)",
            "            reqs[row].grammar.fill_mask(bitmask, row)",
        ),
        r"bitmask|mask|row",
    ),
    Mutant(
        "s11-sample-unmasked",
        "s11_structured_output/vocab_mask.py",
        "the masked rows go back into the logits the sampler reads",
        edit("        logits[rows] = masked\n", ""),
        r"grammar|validate|match",
    ),
    Mutant(
        "s11-no-compile-cache",
        "s11_structured_output/grammar_backend.py",
        "each distinct grammar compiles once: the Future is cached by (kind, text)",
        edit("future = self.cache.get(key)", "future = None"),
        r"compiled|cache",
    ),
    Mutant(
        "s11-rollback-keeps-count",
        "s11_structured_output/grammar_backend.py",
        "after a rollback the grammar counts only the tokens it kept",
        edit("            self.num_tokens = num_tokens\n", ""),
        r"rollback",
    ),
    Mutant(
        "s11-retract-drops-grammar",
        "s11_structured_output/scheduler.py",
        "a retracted request keeps its grammar, rolled back to its kept tokens, for when it is readmitted",
        edit('if why == "retracted":', "if False:"),
        r"retract|rolled back",
    ),
    Mutant(
        "s11-two-grammars",
        "s11_structured_output/sampling_params.py",
        "a request follows one grammar: json_schema and regex together are refused",
        edit("        if self.json_schema is not None and self.regex is not None:", "        if False:"),
        r"json_schema|regex|one grammar",
    ),
    Mutant(
        "s11-grammar-with-ignore-eos",
        "s11_structured_output/sampling_params.py",
        "a constrained request ends with EOS, so ignore_eos cannot go with a grammar",
        edit("if self.grammar_key is not None and self.ignore_eos:", "if False:"),
        r"ignore_eos",
    ),
    Mutant(
        "s11-grammar-with-min-new-tokens",
        "s11_structured_output/sampling_params.py",
        "a complete grammar allows only EOS, so min_new_tokens (which bans EOS) cannot go with a grammar",
        edit("if self.grammar_key is not None and self.min_new_tokens:", "if False:"),
        r"min_new_tokens",
    ),
    Mutant(
        "s11-wait-for-the-compiler",
        "s11_structured_output/scheduler.py",
        "a grammar still compiling holds back only its own request: the others are scheduled meanwhile",
        edit(
            "            if not future.done() and not timed_out:\n"
            "                continue  # still compiling: the others go on without it\n",
            "",
        ),
        r"compil|wait|others",
    ),
    Mutant(
        "s11-no-grammar-timeout",
        "s11_structured_output/scheduler.py",
        "a grammar that takes longer than grammar_timeout to compile ends its request with an error",
        edit(
            "timed_out = not future.done() and now - req.time_stats.arrival > self.grammar_timeout",
            "timed_out = False",
        ),
        r"timeout|took longer|longer than",
    ),
    Mutant(
        "s11-timed-out-future-asked",
        "s11_structured_output/scheduler.py",
        "a compilation that timed out is still running: asking its future for an error waits for it (a stalled loop)",
        edit(
            "            if timed_out or future.exception() is not None:",
            "            if future.exception() is not None or timed_out:",
        ),
        r"waited for\s+a compilation still running",
    ),
    Mutant(
        "s11-shared-matcher",
        "s11_structured_output/scheduler.py",
        "each request gets its own matcher (a copy of the compiled one): two requests of one schema are at two places",
        edit(  # one Future per schema (the compile cache), so one Grammar per schema too: the mistake
            "            req.grammar = self.grammar_backend.new_grammar(future.result())",
            "            if not hasattr(future, 'grammar'):\n"
            "                future.grammar = self.grammar_backend.new_grammar(future.result())\n"
            "            req.grammar = future.grammar",
        ),
        r"share one grammar matcher|grammar has consumed",
    ),
    Mutant(
        "s11-ready-grammar-jumps-the-line",
        "s11_structured_output/scheduler.py",
        "a request joins the waiting queue when its grammar is ready: at its end, behind those already waiting",
        edit(
            "            self.waiting.append(req)\n        return outputs",
            "            self.waiting.appendleft(req)\n        return outputs",
        ),
        r"END\s+of the waiting queue",
    ),
    Mutant(
        "s11-schema-wrapper",
        "s11_structured_output/response_format.py",
        "the grammar is the schema INSIDE response_format's json_schema ({name, schema}), not the wrapper",
        edit('return {"json_schema": spec["schema"]}', 'return {"json_schema": spec}'),
        r"schema",
    ),
    Mutant(
        "s11-json-object-unconstrained",
        "s11_structured_output/response_format.py",
        "response_format json_object constrains the output to a JSON object",
        edit('        return {"json_schema": JSON_OBJECT_SCHEMA}\n', "        return {}\n"),
        r"json_object|JSON",
    ),
    Mutant(
        "s11-grammar-never-advanced",
        "s11_structured_output/scheduler.py",
        "every sampled token moves its request's grammar on, so the next mask allows what may follow it",
        edit("                req.grammar.accept_token(token_id)", "                pass"),
        r"grammar|accept",
    ),
    Mutant(
        "s11-compile-on-the-callers-thread",
        "s11_structured_output/grammar_backend.py",
        "a grammar compiles on the backend's pool, never on the scheduler's thread: get() returns at once",
        edit(
            "                future = self.cache[key] = self.executor.submit(self.compile, key)",
            """                future = self.cache[key] = Future()
                try:
                    future.set_result(self.compile(key))
                except Exception as error:
                    future.set_exception(error)""",
        ),
        r"background|thread|block|pool|at once",
    ),
    Mutant(
        "s11-rollback-by-the-kept-count",
        "s11_structured_output/grammar_backend.py",
        "a rollback undoes the tokens past the kept ones: num_tokens - kept of them, not the kept count",
        edit(
            "            if not self.matcher.rollback(self.num_tokens - num_tokens):",
            "            if not self.matcher.rollback(num_tokens):",
        ),
        r"roll",
    ),
    Mutant(
        "s11-ignore-eos-checked-for-regex-only",
        "s11_structured_output/sampling_params.py",
        "every grammar, a JSON schema as well as a regex, ends with EOS: ignore_eos cannot go with either",
        edit("if self.grammar_key is not None and self.ignore_eos:", "if self.regex is not None and self.ignore_eos:"),
        r"ignore_eos.*a schema too",
    ),
    Mutant(
        "s11-regex-of-any-type",
        "s11_structured_output/sampling_params.py",
        "a regex is a non-empty str: a number or a list is refused when the params are built",
        edit("(not isinstance(self.regex, str) or not self.regex)", "not self.regex"),
        r"regex.*str",
    ),
    Mutant(
        "s11-empty-schema-is-no-grammar",
        "s11_structured_output/sampling_params.py",
        "{} is a schema too (any JSON value): a grammar is given when its field is not None, not when it is truthy",
        edit(
            "        if self.json_schema is not None and self.regex is not None:",
            "        if self.json_schema and self.regex:",
        ),
        r"cannot both.*not truth",
    ),
    Mutant(
        "s11-failed-grammar-compiled-again",
        "s11_structured_output/grammar_backend.py",
        "a failed compilation stays cached: the same grammar fails the same way, so it is not compiled again",
        edit(
            "            if future is None:",
            "            if future is None or (future.done() and future.exception() is not None):",
        ),
        r"failed compilation stays cached",
    ),
    Mutant(
        "s11-finished-keeps-grammar",
        "s11_structured_output/scheduler.py",
        "a request that leaves for good, finished as well as aborted, drops its matcher; a retracted one keeps it",
        edit(
            "        else:\n            req.grammar = None",
            '        elif why == "aborted":\n            req.grammar = None',
        ),
        r"drops its matcher",
    ),
    Mutant(
        "s11-aborted-without-finished-time",
        "s11_structured_output/scheduler.py",
        "a request aborted for its grammar ends then: time_stats.finished is set, as for any request that ends",
        edit("                req.time_stats.finished = now\n", ""),
        r"time_stats\.finished",
    ),
    Mutant(
        "s11-ready-grammar-timed-out",
        "s11_structured_output/scheduler.py",
        "grammar_timeout bounds the compilation: a grammar that is ready admits its request however late the poll",
        edit(
            "timed_out = not future.done() and now - req.time_stats.arrival > self.grammar_timeout",
            "timed_out = now - req.time_stats.arrival > self.grammar_timeout",
        ),
        r"still compiling",
    ),
    Mutant(
        "s11-ready-grammar-stays-queued",
        "s11_structured_output/scheduler.py",
        "a request leaves grammar_queue when its grammar is ready (or fails): left there, every poll admits it again",
        edit(
            "            self.grammar_queue.remove((req, future))\n            if timed_out",
            "            if timed_out",
        ),
        r"leaves grammar_queue",
    ),
    Mutant(
        "s11-output-before-abort",
        "s11_structured_output/scheduler.py",
        "the aborted request's output carries its finish reason, so it is built after req.abort() sets it",
        (
            ("                outputs.append(TokenOutput(req.rid, [], req.finished_reason))\n", ""),
            (
                "                req.abort()\n                req.time_stats.finished = now\n",
                "                outputs.append(TokenOutput(req.rid, [], req.finished_reason))\n"
                "                req.abort()\n                req.time_stats.finished = now\n",
            ),
        ),
        r"finish reason abort",
    ),
    Mutant(
        "s11-regex-with-text-refused",
        "s11_structured_output/response_format.py",
        'response_format {"type": "text"} is no constraint: a regex goes with it',
        edit(
            'if regex is not None and response_format not in (None, {"type": "text"}):',
            "if regex is not None and response_format is not None:",
        ),
        r"text is no constraint",
    ),
    Mutant(
        "s11-mask-on-the-callers-logits",
        "s11_structured_output/vocab_mask.py",
        "the mask works on a float32 COPY of the logits: the log-probabilities are read from the caller's afterwards",
        edit("logits = logits.to(torch.float32, copy=True)", "logits = logits.float()"),
        r"COPY of the logits",
    ),
    # --- stage 12: tensor parallelism ------------------------------------------------------------
    Mutant(
        "s12-kv-head-modulo",
        "s12_tensor_parallel/layers.py",
        "a replicated KV head goes to the ranks whose query heads read it (rank // replicas)",
        edit("kv_head = tp.rank // replicas", "kv_head = tp.rank % num_kv_heads"),
        r"KV head|head_ranges|heads",
    ),
    Mutant(
        "s12-kv-heads-not-replicated",
        "s12_tensor_parallel/layers.py",
        "with fewer KV heads than ranks each KV head is replicated on tp_size / num_kv_heads ranks",
        edit("    if num_kv_heads >= tp.size:\n", "    if True:\n"),
        r"KV head|head_ranges|heads|replicat",
    ),
    Mutant(
        "s12-every-rank-the-first-heads",
        "s12_tensor_parallel/layers.py",
        "rank r computes query heads [r * q, (r + 1) * q): each head on exactly one rank",
        edit(
            "    return range(tp.rank * q, (tp.rank + 1) * q), range(kv_head, kv_head + 1)",
            "    return range(0, q), range(kv_head, kv_head + 1)",
        ),
        r"head_ranges|heads",
    ),
    Mutant(
        "s12-uneven-heads-accepted",
        "s12_tensor_parallel/layers.py",
        "query heads that do not divide by tp_size are refused (a rank would silently drop the rest)",
        edit("    if num_heads % tp.size:\n", "    if False:\n"),
        r"divide|heads",
    ),
    Mutant(
        "s12-embedding-no-all-reduce",
        "s12_tensor_parallel/layers.py",
        "each embedding rank holds only its ids' rows: the all-reduce fills the others",
        edit("        return self.tp.all_reduce(x)\n", "        return x\n"),
        r"embedding|all-reduce|vocab",
    ),
    Mutant(
        "s12-bias-before-all-reduce",
        "s12_tensor_parallel/layers.py",
        "a row-parallel layer's bias is added once, after the all-reduce",
        edit(
            "        y = self.tp.all_reduce(F.linear(x, self.weight))\n"
            "        return y if self.bias is None else y + self.bias",
            "        return self.tp.all_reduce(F.linear(x, self.weight, self.bias))",
        ),
        r"all-reduce|bias|row-parallel",
    ),
    Mutant(
        "s12-no-all-reduce",
        "s12_tensor_parallel/layers.py",
        "a row-parallel layer's partial products are summed over the ranks",
        edit("        y = self.tp.all_reduce(F.linear(x, self.weight))", "        y = F.linear(x, self.weight)"),
        r"all-reduce|row-parallel",
    ),
    Mutant(
        "s12-embedding-unmasked",
        "s12_tensor_parallel/layers.py",
        "an embedding rank writes zeros for the ids it does not own",
        edit(
            "        x = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)",
            "        x = F.embedding(local, self.weight)",
        ),
        r"embedding|all-reduce|vocab",
    ),
    Mutant(
        "s12-embedding-global-ids",
        "s12_tensor_parallel/layers.py",
        "a rank's embedding shard is indexed by ids minus the shard's first id",
        edit(
            "        local = torch.where(mine, ids - self.shard.start, 0)",
            "        local = torch.where(mine, ids, 0)",
        ),
        r"embedding|shard|vocab",
    ),
    Mutant(
        "s12-padding-kept",
        "s12_tensor_parallel/layers.py",
        "the gathered logits lose the padding rows past the vocabulary",
        edit(
            "        return None if logits is None else logits[:, : self.vocab_size]",
            "        return logits",
        ),
        r"gather|logits|vocab",
    ),
    Mutant(
        "s12-stale-table-rows",
        "s12_tensor_parallel/tp_worker.py",
        "a follower writes the table rows that travel with each batch before running it",
        edit(
            "            table[row, : len(slots)] = torch.tensor(slots, dtype=table.dtype, device=device)",
            "            pass",
        ),
        r"table row",
    ),
    Mutant(
        "s12-follower-writes-only-new-slots",
        "s12_tensor_parallel/tp_worker.py",
        "a follower writes each request's whole table row: its cached prefix sits in slots an earlier step chose",
        edit(
            "            table[row, : len(slots)] = torch.tensor(slots, dtype=table.dtype, device=device)",
            "            table[row, len(slots) - 1 : len(slots)] = "
            "torch.tensor(slots[-1:], dtype=table.dtype, device=device)",
        ),
        r"table row",
    ),
    Mutant(
        "s12-follower-drops-prompt-rows",
        "s12_tensor_parallel/tp_worker.py",
        "a follower's batch scores the same prompt rows as rank 0's: every rank joins their gather",
        edit("            extra_logit_rows=self.extra_logit_rows,\n", ""),
        r"extra_logit_rows",
    ),
    Mutant(
        "s12-replication-unchecked",
        "s12_tensor_parallel/layers.py",
        "KV heads fewer than ranks are replicated a whole number of times, or refused (2 KV heads on 3 ranks)",
        edit("    if tp.size % num_kv_heads:\n", "    if False:\n"),
        r"tp_size|replicat|divide",
    ),
    Mutant(
        "s12-kv-head-by-kv-count",
        "s12_tensor_parallel/layers.py",
        "a replicated KV head goes to rank // replicas (replicas = tp_size / num_kv_heads), not rank // num_kv_heads",
        edit("kv_head = tp.rank // replicas", "kv_head = tp.rank // num_kv_heads"),
        r"KV head|head_ranges",
    ),
    Mutant(
        "s12-embedding-stop-inclusive",
        "s12_tensor_parallel/layers.py",
        "a rank owns the ids [start, stop) of its shard: the id at stop belongs to the next rank alone",
        edit(
            "        mine = (ids >= self.shard.start) & (ids < self.shard.stop)",
            "        mine = (ids >= self.shard.start) & (ids <= self.shard.stop)",
        ),
        r"embedding|shard|own",
    ),
    Mutant(
        "s12-uneven-kv-heads-accepted",
        "s12_tensor_parallel/layers.py",
        "KV heads at least as many as ranks must divide by tp_size, or a rank would silently drop some",
        edit(
            """        if num_kv_heads % tp.size:
            raise ValueError(f"num_key_value_heads={num_kv_heads} does not divide by tp_size={tp.size}")
""",
            "",
        ),
        r"num_key_value_heads|divide",
    ),
    Mutant(
        "s12-lm-head-follower-skips-gather",
        "s12_tensor_parallel/layers.py",
        "a follower joins the logits' gather before it returns None: rank 0 waits there for every rank's slice",
        edit(
            "        logits = self.tp.gather_to_first(F.linear(x, self.weight).float())\n",
            "        if not self.tp.is_first:\n"
            "            return None\n"
            "        logits = self.tp.gather_to_first(F.linear(x, self.weight).float())\n",
        ),
        r"joins every collective",
    ),
    Mutant(
        "s12-embedding-skips-all-reduce",
        "s12_tensor_parallel/layers.py",
        "a rank that owns none of the batch's ids still joins the embedding's all-reduce (with zeros)",
        edit(
            "        x = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)\n",
            "        if not mine.any():\n"
            "            return torch.zeros(*ids.shape, self.weight.shape[1], dtype=self.weight.dtype)\n"
            "        x = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)\n",
        ),
        r"joins every collective",
    ),
    Mutant(
        "s12-logits-not-float32",
        "s12_tensor_parallel/layers.py",
        "rank 0 samples from float32 logits, as one device does, whatever the model's dtype",
        edit(
            "self.tp.gather_to_first(F.linear(x, self.weight).float())",
            "self.tp.gather_to_first(F.linear(x, self.weight))",
        ),
        r"float32",
    ),
    Mutant(
        "s12-embedding-float32-mask",
        "s12_tensor_parallel/layers.py",
        "the embedding's mask multiplies in the table's dtype: a float32 mask promotes a bfloat16 hidden state",
        edit(
            "        x = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)",
            "        x = F.embedding(local, self.weight) * mine.unsqueeze(-1).float()",
        ),
        r"dtype",
    ),
    Mutant(
        "s12-embedding-ids-in-place",
        "s12_tensor_parallel/layers.py",
        "the embedding builds its shard's local ids in a new tensor: the batch's input_ids are the caller's",
        edit(
            "        local = torch.where(mine, ids - self.shard.start, 0)",
            "        local = ids\n        local[~mine] = self.shard.start\n        local -= self.shard.start",
        ),
        r"in place",
    ),
    Mutant(
        "s12-refused-by-assert",
        "s12_tensor_parallel/layers.py",
        "heads that cannot split are refused with ValueError (the engine's refusal before any process starts)",
        edit(
            """    if num_heads % tp.size:
        raise ValueError(
            f"num_attention_heads={num_heads} does not divide by tp_size={tp.size}: each rank must hold whole heads"
        )
""",
            """    assert num_heads % tp.size == 0, (
        f"num_attention_heads={num_heads} does not divide by tp_size={tp.size}"
    )
""",
        ),
        r"raise ValueError",
    ),
    Mutant(
        "s12-follower-keeps-rows-written",
        "s12_tensor_parallel/tp_worker.py",
        "a follower writes each request's whole table row every step: a freed row is reused by another request",
        edit(
            """        for row, slots in zip(self.req_pool_indices, self.table_rows):
            table[row, : len(slots)] = torch.tensor(slots, dtype=table.dtype, device=device)""",
            """        written = runner.__dict__.setdefault("rows_written", {})  # row -> slots already written
        for row, slots in zip(self.req_pool_indices, self.table_rows):
            done = min(written.get(row, 0), len(slots))
            table[row, done : len(slots)] = torch.tensor(slots[done:], dtype=table.dtype, device=device)
            written[row] = len(slots)""",
        ),
        r"reused by another",
    ),
    Mutant(
        "s12-padding-cut-from-the-front",
        "s12_tensor_parallel/layers.py",
        "the padding rows are the last slice's last rows: the cut keeps the first vocab_size logits",
        edit(
            "        return None if logits is None else logits[:, : self.vocab_size]",
            "        return None if logits is None else logits[:, -self.vocab_size :]",
        ),
        r"start with rank 0's slice",
    ),
    Mutant(
        "s12-bias-before-and-after",
        "s12_tensor_parallel/layers.py",
        "a row-parallel layer adds its bias once, after the all-reduce (not also inside each rank's partial product)",
        edit(
            "        y = self.tp.all_reduce(F.linear(x, self.weight))",
            "        y = self.tp.all_reduce(F.linear(x, self.weight, self.bias))",
        ),
        r"bias once",
    ),
]


# --- applying ------------------------------------------------------------------------------------


def exercise_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) character offsets of every exercise region's body in ``text``."""
    spans, start = [], None
    offset = 0
    for line in text.splitlines(keepends=True):
        stripped = line.strip()
        if stripped.startswith(BEGIN):
            start = offset + len(line)
        elif stripped == END and start is not None:
            spans.append((start, offset + len(line)))  # the END line itself may be part of an edit's context
            start = None
        offset += len(line)
    return spans


def mutate(mutant: Mutant, text: str) -> str:
    """``text`` with the mutant's edits made; ValueError if an edit's old text is missing, not
    unique, or not inside an exercise region."""
    for number, (old, new) in enumerate(mutant.edits, 1):
        where = f"{mutant.name}: edit {number} in solutions/{mutant.file}"
        count = text.count(old)
        if count != 1:
            raise ValueError(f"{where}: its old text occurs {count} times (it must occur once): {old[:80]!r}")
        at = text.index(old)
        if not any(start <= at and at + len(old) <= end for start, end in exercise_spans(text)):
            raise ValueError(f"{where}: its old text is not inside an exercise region: {old[:80]!r}")
        text = text.replace(old, new)
    return text


def check_all(solutions: Path) -> list[str]:
    """Every problem with the catalogue against ``solutions``: edits that no longer apply, a
    mutant that does not compile, duplicate names, a stage with fewer than five mutants, an
    exercise region no mutant edits (``unmutated_regions``)."""
    problems, names = [], set()
    for mutant in MUTANTS:
        if mutant.name in names:
            problems.append(f"{mutant.name}: the name is used twice")
        names.add(mutant.name)
        path = solutions / mutant.file
        if not path.is_file():
            problems.append(f"{mutant.name}: solutions/{mutant.file} does not exist")
            continue
        try:
            compile(mutate(mutant, path.read_text()), str(path), "exec")
        except (ValueError, SyntaxError) as error:
            problems.append(
                str(error) if isinstance(error, ValueError) else f"{mutant.name}: the mutant does not compile: {error}"
            )
    for stage in range(1, 13):
        count = sum(m.stage == stage for m in MUTANTS)
        if count < 5:
            problems.append(f"stage {stage}: {count} mutants, the course keeps at least 5 per stage")
    return problems + unmutated_regions(solutions)


def unmutated_regions(solutions: Path) -> list[str]:
    """Every exercise region of ``solutions`` that no mutant edits: a learner's bug there would be
    graded by tests nobody has checked against a bug."""
    problems = []
    for path in sorted(solutions.rglob("*.py")):
        text = path.read_text()
        file = path.relative_to(solutions).as_posix()
        edited = [text.find(old) for mutant in MUTANTS if mutant.file == file for old, _ in mutant.edits]
        for start, end in exercise_spans(text):
            title = text[:start].splitlines()[-1].strip()[len(BEGIN) :].split(" [#")[0].strip()
            if not any(start <= at < end for at in edited):
                line = text.count("\n", 0, start)
                problems.append(f"solutions/{file}:{line}: no mutant edits the exercise region '{title}'")
    return problems


# --- running -------------------------------------------------------------------------------------


def first_failure(junit: Path) -> tuple[str, str] | None:
    """(test id, what it said) of the first failed or errored test in a JUnit report: the
    exception's message and pytest's "E" lines, without the test's source lines (a pattern
    found only in the test's code would not be something the learner was told)."""
    for case in ET.parse(junit).iter("testcase"):
        for tag in ("failure", "error"):
            found = case.find(tag)
            if found is not None:
                said = [line[1:].strip() for line in (found.text or "").splitlines() if line.startswith("E ")]
                return f"{case.get('classname')}::{case.get('name')}", "\n".join([found.get("message", ""), *said])
    return None


def run_mutant(mutant: Mutant, work: Path, solutions: Path) -> tuple[str, str, float]:
    """Plant ``mutant`` into a fresh copy of ``solutions`` and run its stage's graded tests.
    Returns (verdict, the first failure's headline or '', seconds)."""
    copy = work / "solutions"
    if copy.exists():
        shutil.rmtree(copy)
    shutil.copytree(solutions, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / mutant.file
    target.write_text(mutate(mutant, target.read_text()))
    junit = work / "junit.xml"
    junit.unlink(missing_ok=True)
    env = child_env(ENGINE_IMPL="solutions", ENGINE_SOLUTIONS_DIR=str(copy), ENGINE_REQUIRE_DEFAULT_MODEL="1")
    command = [
        sys.executable,
        "-m",
        "pytest",
        f"tests/stage{mutant.stage:02d}",
        "-x",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
    ]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return "TIMEOUT", f"the tests ran past {TIMEOUT_S} s", time.perf_counter() - start
    seconds = time.perf_counter() - start
    failure = first_failure(junit) if junit.is_file() else None
    if failure is None:
        if done.returncode == 0:
            return "SURVIVED", "", seconds
        return "unnamed", f"pytest exited {done.returncode} without a failed test: {done.stdout[-300:]}", seconds
    test, said = failure
    # The message alone: a test whose name happens to hold the pattern (a fault test "aborts_its_requests")
    # would otherwise count as naming an idea its message never states.
    verdict = "killed" if re.search(mutant.named, said, re.IGNORECASE | re.DOTALL) else "unnamed"
    return verdict, f"{test.rsplit('.', 1)[-1]}: {' '.join(said.split())[:400]}", seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=parse_stages, help="which stages, e.g. 5-7 (default: all)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutants")
    parser.add_argument("--list", action="store_true", help="print the catalogue and check it applies; run nothing")
    args = parser.parse_args(argv)
    solutions = REPO / "solutions"
    problems = check_all(solutions)
    if problems:
        print("the catalogue does not apply to solutions/:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    chosen = [
        m for m in MUTANTS if (args.stages is None or m.stage in args.stages) and (not args.only or m.name in args.only)
    ]
    if args.list:
        for mutant in chosen:
            print(f"{mutant.name:36s} stage {mutant.stage}  {mutant.idea}")
        print(f"{len(chosen)} mutants; every one applies to solutions/")
        return 0

    results: list[tuple[Mutant, str, str]] = []
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        # The copy of solutions/ finds the default model beside it, as solutions/ does: without it
        # every default-model test would be skipped, and a mutant only they catch would survive.
        (Path(tmp) / "models").symlink_to(REPO / "models", target_is_directory=True)
        for mutant in chosen:
            verdict, message, seconds = run_mutant(mutant, Path(tmp), solutions)
            results.append((mutant, verdict, message))
            print(
                f"{verdict:8s} {seconds:5.0f} s  {mutant.name}" + (f"\n{'':17s}{message[:300]}" if message else ""),
                flush=True,
            )

    print(f"\n{'stage':>5}  {'mutants':>7}  {'killed':>6}  {'unnamed':>7}  {'survived':>8}  kill rate (named / all)")
    for stage in sorted({m.stage for m, _, _ in results}):
        rows = [verdict for m, verdict, _ in results if m.stage == stage]
        killed, unnamed = rows.count("killed"), rows.count("unnamed")
        print(
            f"{stage:>5}  {len(rows):>7}  {killed:>6}  {unnamed:>7}  {len(rows) - killed - unnamed:>8}  "
            f"{killed}/{len(rows)} named, {killed + unnamed}/{len(rows)} caught"
        )
    missed = [(m, verdict, message) for m, verdict, message in results if verdict != "killed"]
    if missed:
        print(f"\n{len(missed)} mutant(s) not killed by a message naming the idea:")
        for mutant, verdict, message in missed:
            print(
                f"  - {mutant.name} ({verdict}): {mutant.idea}"
                + (f"\n      first failure: {message}" if message else "")
            )
        return 1
    print(f"\nall {len(results)} mutants killed, each by a message naming the broken idea")
    return 0


if __name__ == "__main__":
    sys.exit(main())
