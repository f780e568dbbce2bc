"""The errors the model package raises."""

from __future__ import annotations

from deepinfer import DeepInferError


class CheckpointError(DeepInferError, ValueError):
    """A checkpoint cannot be used: its config, its index or one of its files (missing, unexpected or mis-shaped
    tensors, truncated or corrupt files, pickle files, unsupported architecture or quantization). The message
    names the file and the tensor. Raised before any weight reaches the device and before any compute."""


class RequestError(DeepInferError, ValueError):
    """A request cannot be served: an empty prompt, a prompt longer than the model's context, text without a
    tokenizer, or invalid sampling parameters. ``field``: the parameter at fault, where one is (a server names it
    as the error's ``param``)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class StructuredOutputError(RequestError):
    """A request's structured-output constraint is malformed or does not compile (a JSON schema, regex, grammar or
    choice list the grammar engine refuses)."""


class ParallelError(DeepInferError, ValueError):
    """Expert parallelism cannot be set up as asked: ``ep`` (``--ep``) is not the size of the process group or of
    the torchrun launch, no process group is initialised, or the model's routed experts cannot be split evenly over
    the ranks. ``arg``, ``expected`` and ``actual`` say which argument, what it needed and what it got. Raised before
    any weight is loaded and before any collective, on every rank alike."""

    def __init__(self, arg: str, expected: str, actual: str):
        self.arg, self.expected, self.actual = arg, expected, actual
        super().__init__(f"argument '{arg}': expected {expected}, got {actual}")


class RankDivergenceError(DeepInferError, RuntimeError):
    """The ranks of an expert-parallel group stopped running the same thing: their engine settings, a step's
    scheduled batch or the tokens they sampled differ. Every rank compares the same gathered fingerprints, so every
    rank raises it at the same step, before the next model forward (never a hang or a silently wrong output)."""
