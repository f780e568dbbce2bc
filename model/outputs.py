"""What ``LLM.generate`` returns: one ``RequestOutput`` per prompt (vLLM's shape)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated completion.

    token_ids: the generated tokens (a stop token included). text: their decoding ("" without a tokenizer).
    logprobs: the log-probability of each generated token (when asked); top_logprobs: per token, the ``k`` most
    likely tokens and theirs (when ``k > 0`` was asked). finish_reason: ``stop`` (a stop or end-of-sequence token),
    ``length`` (``max_tokens`` or the model's context), ``abort`` (the request was cancelled) or ``error`` (its
    structured-output grammar refused the last token, which ends it); stop_reason: the stop token (or stop string),
    or with ``error`` a one-line message naming the grammar error.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    """The result of one prompt. outputs: its ``SamplingParams.n`` completions, by ``index``. prompt_logprobs: per
    prompt token, its log-probability given the tokens before it (``None`` for the first), when asked;
    prompt_top_logprobs likewise with the ``k`` most likely tokens. num_cached_tokens: prompt tokens found in the
    prefix cache (not prefilled), by the first completion. metrics: preemptions (and speculative decoding's drafted
    and accepted tokens), summed over the completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    finished: bool = True
    metrics: dict[str, float] = field(default_factory=dict)
    num_cached_tokens: int = 0
