"""What a caller may ask of one generation: how to sample, and when to stop.

``SamplingParams`` is checked once, when it is built, so that an impossible request
(``top_p=0``, ``temperature=-1``, an empty stop string) fails immediately with a message
that says what was wrong and what is allowed, instead of surfacing ten steps later as a
NaN inside the sampler or a request that never ends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral, Real

# A temperature this small is argmax in all but name (logits 0.01 apart end up 1e5 apart), and
# far smaller ones overflow float32 (1e-7 is where SGLang draws the same line).
GREEDY_TEMPERATURE = 1e-7
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes an unsigned 64-bit seed
MAX_LOGPROBS = 20  # the most alternatives per token a caller may ask for (OpenAI's top_logprobs allows 20)
# Below 0.01 a repeated token's logit is multiplied past anything the model produces (and at
# float32's smallest numbers, to infinity); above 2 a token seen once is as good as banned.
REPETITION_PENALTY_RANGE = (0.01, 2.0)
PENALTY_RANGE = (-2.0, 2.0)  # frequency_penalty and presence_penalty (OpenAI's range)
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's: -100 bans a token, +100 all but forces it


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy (always the most likely token)
    top_k: int = -1  # keep the k most likely tokens; -1 = off
    top_p: float = 1.0  # keep the smallest set of most likely tokens holding >= top_p of the mass
    min_p: float = 0.0  # keep tokens at least min_p times as likely as the most likely one
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)  # a str is accepted and wrapped in a list
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # keep going past the model's end-of-sequence token
    seed: int | None = None  # None: the request draws a fresh seed (and records it)
    # None: no log-probabilities; k: each output token's log-probability and the k most likely
    # tokens' at its position (0 = the token's own only); see logprobs.py
    logprobs: int | None = None
    # The same for every prompt token after the first (how likely the model found the prompt
    # itself: how a text is scored); see prompt_logprobs.py
    prompt_logprobs: int | None = None
    # How the request's own history reshapes its logits before the draw (penalties.py):
    repetition_penalty: float = 1.0  # a token in the prompt or output: logit / r if > 0, else * r; 1 = off
    frequency_penalty: float = 0.0  # minus f for every time the token is already in the output
    presence_penalty: float = 0.0  # minus p once the token is in the output at all
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    min_new_tokens: int = 0  # the tokens that would end the request (EOS, stop_token_ids) banned until this many

    def __post_init__(self) -> None:
        # Normalise the convenient spellings first, so validation sees one shape.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.logit_bias is None:
            self.logit_bias = {}
        self._validate()

    def _validate(self) -> None:
        # BEGIN EXERCISE: check every field; a ValueError says what is wrong and what is allowed
        # [#samplingparams-what-the-caller-asked-for]
        self.temperature = _real("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        self.top_k = _integer("top_k", self.top_k)
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        self.top_p = _real("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.min_p = _real("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        self.max_new_tokens = _integer("max_new_tokens", self.max_new_tokens)
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        for s in self.stop:
            if not isinstance(s, str) or s == "":
                raise ValueError(f"stop must hold non-empty strings, got {s!r} in {self.stop!r}")
        for i, t in enumerate(self.stop_token_ids):
            self.stop_token_ids[i] = _integer("stop_token_ids entries", t)
            if t < 0:
                raise ValueError(f"stop_token_ids must be token ids >= 0, got {t}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.seed is not None:
            self.seed = _integer("seed", self.seed)
            if not 0 <= self.seed <= MAX_SEED:
                raise ValueError(f"seed must be None or an integer in [0, 2**64 - 1], got {self.seed}")
        for name in ("logprobs", "prompt_logprobs"):  # None (off), or how many alternatives per token
            value = getattr(self, name)
            if value is not None:
                value = _integer(name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise ValueError(f"{name} must be None (off) or an integer in [0, {MAX_LOGPROBS}], got {value}")
                setattr(self, name, value)
        self.repetition_penalty = _in_range("repetition_penalty", self.repetition_penalty, REPETITION_PENALTY_RANGE)
        self.frequency_penalty = _in_range("frequency_penalty", self.frequency_penalty, PENALTY_RANGE)
        self.presence_penalty = _in_range("presence_penalty", self.presence_penalty, PENALTY_RANGE)
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a dict {{token id: bias}}, got {self.logit_bias!r:.60}")
        bias = {}
        for token, value in self.logit_bias.items():
            token = _integer("logit_bias keys", token)
            if token < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {token}")
            bias[token] = _in_range(f"logit_bias[{token}]", value, LOGIT_BIAS_RANGE)
        self.logit_bias = bias
        self.min_new_tokens = _integer("min_new_tokens", self.min_new_tokens)
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens] ([0, {self.max_new_tokens}]), got {self.min_new_tokens}"
            )
        # END EXERCISE

    @property
    def is_greedy(self) -> bool:
        """True when only the most likely token can ever be picked: no randomness at all."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """True when the request's history, a bias or a minimum length changes its logits (penalties.py
        has work to do)."""
        return (
            self.repetition_penalty != 1
            or self.frequency_penalty != 0
            or self.presence_penalty != 0
            or bool(self.logit_bias)
            or self.min_new_tokens > 0
        )


def _real(name: str, value) -> float:
    # bool is an int in Python; temperature=True is a bug in the caller, not 1.0.
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return value


def _in_range(name: str, value, bounds: tuple[float, float]) -> float:
    value = _real(name, value)
    low, high = bounds
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low:g}, {high:g}], got {value}")
    return value


def _integer(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)
