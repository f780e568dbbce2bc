"""TEST DOUBLE of ``torch_npu`` — not Huawei's library, and nothing here runs on an NPU.

Importable as ``torch_npu`` when ``tests/ascend/double`` is on ``sys.path``. It implements in plain torch on the
CPU exactly the torch_npu functions the ``ascend`` backend calls, following their documented semantics (op-plugin
docs, ``docs/en/custom_APIs/torch_npu``; the Ascend 950 quantisation modes from the aclnn docs) and rejecting what
those docs reject: layouts, dtypes, block-size rules, alignment, transposition. It exists so that CI checks the
backend's wiring, layouts and scale conversions on every change; it says nothing about speed, kernel rounding or
whether the real kernels behave as documented.

``TEST_DOUBLE`` is the marker the backend looks for: with it, the backend accepts CPU tensors and its probe says
"torch_npu test double (emulated, not hardware)". ``CALLS`` logs each call for wiring tests. The emulated chip is
``DEEPINFER_TORCH_NPU_DOUBLE_SOC`` (default ``Ascend950PR``); set it to ``Ascend910B3`` to emulate an A2.

The MC2 expert all-to-all (``npu_moe_distribute_dispatch_v2`` / ``combine_v2``) exchanges data between real
processes over a Gloo process group instead of HCCL; ``_distribute`` says how a communicator name maps to that group.
"""

from __future__ import annotations

from . import npu
from ._attention import npu_fused_infer_attention_score_v2, npu_kv_quant_sparse_flash_attention
from ._common import CALLS, DocumentedRejection, NotEmulated, soc
from ._distribute import npu_moe_distribute_combine_v2, npu_moe_distribute_dispatch_v2
from ._gemm import (
    float8_e8m0fnu,
    get_npu_format,
    hifloat8,
    npu_dynamic_block_quant,
    npu_dynamic_mx_quant,
    npu_format_cast,
    npu_grouped_matmul,
    npu_quant_matmul,
)
from ._misc import npu_add_rms_norm, npu_rms_norm, npu_rotary_mul, npu_scatter_nd_update_, npu_swiglu
from ._moe import npu_moe_finalize_routing, npu_moe_gating_top_k, npu_moe_init_routing_v2
from ._sparse import npu_lightning_indexer, npu_sparse_flash_attention

TEST_DOUBLE = True
__version__ = "test-double"


def emulated_soc() -> str:
    """The chip this double pretends to be."""
    return soc()


__all__ = [
    "CALLS",
    "TEST_DOUBLE",
    "DocumentedRejection",
    "NotEmulated",
    "emulated_soc",
    "float8_e8m0fnu",
    "get_npu_format",
    "hifloat8",
    "npu",
    "npu_add_rms_norm",
    "npu_dynamic_block_quant",
    "npu_dynamic_mx_quant",
    "npu_format_cast",
    "npu_fused_infer_attention_score_v2",
    "npu_grouped_matmul",
    "npu_kv_quant_sparse_flash_attention",
    "npu_lightning_indexer",
    "npu_moe_distribute_combine_v2",
    "npu_moe_distribute_dispatch_v2",
    "npu_moe_finalize_routing",
    "npu_moe_gating_top_k",
    "npu_moe_init_routing_v2",
    "npu_quant_matmul",
    "npu_rms_norm",
    "npu_rotary_mul",
    "npu_scatter_nd_update_",
    "npu_sparse_flash_attention",
    "npu_swiglu",
]
