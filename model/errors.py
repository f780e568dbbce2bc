"""The errors the model package raises."""

from __future__ import annotations

from deepinfer import DeepInferError


class CheckpointError(DeepInferError, ValueError):
    """A checkpoint cannot be used: its config, its index or one of its files (missing, unexpected or mis-shaped
    tensors, truncated or corrupt files, pickle files, unsupported architecture or quantization). The message
    names the file and the tensor. Raised before any weight reaches the device and before any compute."""


class RequestError(DeepInferError, ValueError):
    """A request cannot be served: an empty prompt, a prompt longer than the model's context, text without a
    tokenizer, or invalid sampling parameters."""
