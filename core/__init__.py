"""deepinfer: a hardware abstraction layer for DeepSeek-style MoE models.

The ops (``deepinfer.ops``) are contracts with pure-PyTorch references; backends found through the ``deepinfer``
entry-point group implement them. Choose a backend with ``deepinfer.use(name)`` or ``DEEPINFER_ACCELERATOR``.
Importing deepinfer loads no plugin and touches no device.
"""

from . import ops
from .dispatch import batch_invariant, batch_invariant_enabled, prepare_weight
from .errors import BackendError, DeepInferError, FallbackWarning, InputError, NotSupportedError, PluginError
from .hookspecs import hookimpl
from .kv_cache import allocate_kv_cache
from .qtensor import FP4Tensor, QTensor
from .records import BackendSpec, Decline, OpImpl, TransientDecline
from .selection import available_backends, current_backend, use
from .validation import value_checks

__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "BackendSpec",
    "Decline",
    "DeepInferError",
    "FP4Tensor",
    "FallbackWarning",
    "InputError",
    "NotSupportedError",
    "OpImpl",
    "PluginError",
    "QTensor",
    "TransientDecline",
    "allocate_kv_cache",
    "available_backends",
    "batch_invariant",
    "batch_invariant_enabled",
    "current_backend",
    "hookimpl",
    "ops",
    "prepare_weight",
    "use",
    "value_checks",
]
