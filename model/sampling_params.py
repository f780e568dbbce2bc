"""``SamplingParams``: how one request is decoded (the names and defaults vLLM users know)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from .errors import RequestError
from .structured_output import StructuredOutputsParams

MASK63 = (1 << 63) - 1
# Temperatures below this decode greedily, as in vLLM: fp32 logits divided by 1e-38 or less overflow, and at 1e-5 a
# token whose logit is 1e-3 below the highest is already e^-100 times less likely (only near-ties could differ).
SAMPLING_EPS = 1e-5
MAX_N = 128  # completions of one prompt
CHILD_SALT = 0x5DEECE66D  # sets the completions' seed mixes apart from the tokens'


@dataclass
class SamplingParams:
    """How to decode one request.

    max_tokens: tokens to generate at most; a sequence also stops at the context length (``LLM.max_model_len``,
    prompt included), with finish reason ``length`` either way. temperature: 0 is greedy (the first index of the
    highest logit), and so is any temperature below ``SAMPLING_EPS`` (1e-5; it is set to 0); otherwise logits are
    divided by it. top_p in (0, 1] (1: off) and top_k (0 or -1: off; so is any k of the vocabulary size or more,
    which keeps every token) filter the distribution as ``deepinfer.ops.sample`` documents. seed: any int (only its
    value modulo 2**64 counts); the random draw of a request's ``i``-th token depends only on this seed and ``i``,
    never on what else is batched with it (None: a fresh random seed). With
    batch-invariant ops (``DEEPINFER_BATCH_INVARIANT=1`` on a backend that declares them) the logits do not depend
    on the batch either, so a request's tokens and log-probabilities are bitwise the same alone and in any batch. In
    the default mode the logits' rounding depends on the batch (kernels pick their tiling by the number of rows), so
    where a draw falls close to the boundary between two tokens, or two logits tie for greedy, a request can take
    another token in another batch and continue differently from there, as in vLLM.
    stop_token_ids: generation ends after any of these; the model's ``eos_token_id`` ends it too unless
    ``ignore_eos``. stop: strings that end generation when they appear in the generated text (of several, the one
    the text completes first, however many tokens a step adds), which then ends before the string
    (``finish_reason`` ``stop``, ``stop_reason`` the string), or after it with ``include_stop_str_in_output``; a
    single string is a list of one. logprobs: None for none; ``k >= 0`` returns the log-probability of each
    generated token (and the ``k`` most likely tokens with theirs when ``k > 0``).
    prompt_logprobs: the same for the prompt tokens (the first prompt token has none). Log-probabilities come from
    the model's raw logits (log_softmax before temperature, filtering or a structured-output mask), as vLLM computes
    them by default.
    structured_outputs: hold the generated text to a JSON schema, regex, grammar or choice
    (``StructuredOutputsParams``, ``structured_output.py``); an invalid one is a ``RequestError`` when the request
    is submitted.
    n: completions of the prompt to return (``LLM`` and the server run one sequence each, sharing the prompt's
    cache pages through prefix caching; ``children`` gives their parameters). The first uses ``seed``, completion
    ``i`` a seed mixed from ``seed`` and ``i`` (``sample_seed``): with a seed, each of the ``n`` is the one a request
    with that seed gives.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    stop: list[str] | str | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    n: int = 1

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> SamplingParams:
        """``SamplingParams(**fields)``, with a ``RequestError`` naming any key that is not a field."""
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(str(k) for k in fields if k not in known)
        if unknown:
            raise RequestError(f"SamplingParams: unknown field(s) {unknown}; the fields are {', '.join(known)}")
        return cls(**fields)

    def __post_init__(self) -> None:
        def bad(what: str) -> RequestError:  # ``what`` starts with the field's name
            return RequestError(f"SamplingParams: {what}", field=what.split()[0])

        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise bad(f"n must be an int in [1, {MAX_N}], got {self.n!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < float("inf"):
            raise bad(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature < SAMPLING_EPS:
            self.temperature = 0.0
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad(f"top_p must lie in (0, 1], got {self.top_p!r}")
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad(f"top_k must be an int >= 0 (0 or -1: off), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad(f"seed must be an int or None, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is True:
                setattr(self, name, 0)
            elif value is False:
                setattr(self, name, None)
            elif value is not None and (not isinstance(value, int) or value < 0):
                raise bad(f"{name} must be None or an int >= 0, got {value!r}")
        stop = [] if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(stop, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop
        ):
            raise bad(f"stop_token_ids must be a list of ints >= 0, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(stop)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and (
            not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop)
        ):
            raise bad(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        self.stop = list(self.stop or [])
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad(f"structured_outputs must be StructuredOutputsParams or None, got {self.structured_outputs!r}")

    def children(self) -> list[SamplingParams]:
        """The parameters of each of the ``n`` completions (``n`` 1 each, seeds by ``sample_seed``)."""
        return [
            dataclasses.replace(self, n=1, seed=None if self.seed is None else sample_seed(self.seed, i))
            for i in range(self.n)
        ]


def sample_seed(seed: int, i: int) -> int:
    """The seed of completion ``i`` of a request seeded ``seed``: the seed itself for the first, a SplitMix64 mix
    of it and ``i`` (apart from the tokens' mixes) for the others."""
    return seed if i == 0 else step_seed(seed ^ CHILD_SALT, i)


def step_seed(seed: int, step: int) -> int:
    """The seed ``deepinfer.ops.sample`` gets for a request's ``step``-th token: a SplitMix64 mix of the request
    seed and the step, so each token draws fresh randomness that depends on nothing else."""
    z = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & MASK63


def _signed(c: int) -> int:
    return c - (1 << 64) if c >> 63 else c


def seed_int64(seed: int) -> int:
    """``seed`` modulo 2**64 as a signed 64-bit int: ``step_seed`` gives it the same seeds as ``seed`` (it only
    counts the seed modulo 2**64), and it fits the int64 tensors of ``step_seeds``."""
    return _signed(seed & ((1 << 64) - 1))


def step_seeds(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """``step_seed`` of each pair, on the tensors' device (int64, wrapping as unsigned 64-bit arithmetic does): for
    a step whose sampled positions are known only there (speculative decoding ahead of the host)."""

    def shr(z: torch.Tensor, k: int) -> torch.Tensor:  # a logical shift: int64's >> copies the sign bit
        return (z >> k) & ((1 << (64 - k)) - 1)

    z = seeds * _signed(0x9E3779B97F4A7C15) + (steps + 1) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ shr(z, 30)) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ shr(z, 27)) * _signed(0x94D049BB133111EB)
    return (z ^ shr(z, 31)) & MASK63
