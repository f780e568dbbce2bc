"""The exceptions and warnings deepinfer raises.

Every error a user can cause carries the argument it is about, what was expected and what was found.
"""

from __future__ import annotations


class DeepInferError(Exception):
    """Base class of every deepinfer error."""


class InputError(DeepInferError, ValueError):
    """An op argument is invalid: wrong dtype, shape, device, layout or value.

    Raised by the core before any backend runs, so every backend gives the same error for the same input.
    """

    def __init__(self, op: str, arg: str, expected: str, actual: str):
        self.op, self.arg, self.expected, self.actual = op, arg, expected, actual
        super().__init__(f"{op}: argument '{arg}': expected {expected}, got {actual}")


class BackendError(DeepInferError, RuntimeError):
    """A backend cannot be selected or used (not installed, not available, ambiguous)."""


class PluginError(BackendError):
    """A plugin broke the plugin contract (duplicate names, bad records, hook errors)."""


class NotSupportedError(BackendError):
    """The selected backend has no implementation for these arguments and ``DEEPINFER_STRICT=1`` forbids the
    fallback to the reference."""


class FallbackWarning(UserWarning):
    """An op ran on the reference because the selected backend does not support its arguments (shown once per
    op and backend)."""
