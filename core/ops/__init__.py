"""The ops every backend implements. One file per op family; each op's docstring is its contract.

| family | ops |
|---|---|
| ``attention`` | ``mla_decode``, ``attention_varlen``, ``write_kv_cache`` |
| ``gemm`` | ``quantize_fp8``, ``gemm``, ``grouped_gemm`` |
| ``moe`` | ``moe_route``, ``ep_dispatch``, ``ep_combine`` |
| ``norm`` | ``rms_norm`` |
| ``rope`` | ``rope`` (tables: ``rope_cos_sin_cache``, ``mla_softmax_scale``) |
| ``activation`` | ``silu_and_mul`` |
| ``sampling`` | ``sample`` |

The reference implementation of each lives in the same-named file of ``deepinfer.reference``; a backend's in the
same-named file of its package.
"""

from .activation import silu_and_mul
from .attention import attention_varlen, mla_decode, write_kv_cache
from .gemm import gemm, grouped_gemm, quantize_fp8
from .moe import DispatchHandle, ExpertLayout, ExpertPlacement, ep_combine, ep_dispatch, moe_route
from .norm import rms_norm
from .rope import mla_softmax_scale, rope, rope_cos_sin_cache
from .sampling import sample

OP_NAMES = (
    "mla_decode",
    "attention_varlen",
    "write_kv_cache",
    "quantize_fp8",
    "gemm",
    "grouped_gemm",
    "moe_route",
    "ep_dispatch",
    "ep_combine",
    "rms_norm",
    "rope",
    "silu_and_mul",
    "sample",
)

__all__ = [
    "OP_NAMES",
    "DispatchHandle",
    "ExpertLayout",
    "ExpertPlacement",
    "attention_varlen",
    "ep_combine",
    "ep_dispatch",
    "gemm",
    "grouped_gemm",
    "mla_decode",
    "mla_softmax_scale",
    "moe_route",
    "quantize_fp8",
    "rms_norm",
    "rope",
    "rope_cos_sin_cache",
    "sample",
    "silu_and_mul",
    "write_kv_cache",
]
