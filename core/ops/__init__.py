"""The ops every backend implements. One file per op family; each op's docstring is its contract.

| family | ops |
|---|---|
| ``attention`` | ``mla_decode``, ``attention_varlen``, ``write_kv_cache`` |
| ``sparse_attention`` | ``write_index_cache``, ``indexer_topk``, ``sparse_mla`` |
| ``gemm`` | ``quantize_fp8``, ``gemm``, ``grouped_gemm`` |
| ``moe`` | ``moe_route``, ``moe_route_hash``, ``ep_dispatch``, ``ep_combine`` |
| ``norm`` | ``rms_norm``, ``layer_norm`` |
| ``rope`` | ``rope`` (tables: ``rope_cos_sin_cache``, ``mla_softmax_scale``) |
| ``activation`` | ``silu_and_mul`` |
| ``sampling`` | ``sample``, ``apply_token_bitmask`` |
| ``hyper_connection`` | ``hc_pre``, ``hc_post``, ``hc_head`` |
| ``compressed_attention`` | ``compress_kv``, ``indexer_topk_entries``, ``sparse_attention_sinks`` |

The reference implementation of each lives in the same-named file of ``deepinfer.reference``; a backend's in the
same-named file of its package.
"""

from .activation import silu_and_mul
from .attention import attention_varlen, mla_decode, write_kv_cache
from .compressed_attention import compress_kv, indexer_topk_entries, sparse_attention_sinks
from .gemm import gemm, grouped_gemm, quantize_fp8
from .hyper_connection import hc_head, hc_post, hc_pre
from .moe import DispatchHandle, ExpertLayout, ExpertPlacement, ep_combine, ep_dispatch, moe_route, moe_route_hash
from .norm import layer_norm, rms_norm
from .rope import mla_softmax_scale, rope, rope_cos_sin_cache
from .sampling import apply_token_bitmask, sample
from .sparse_attention import indexer_topk, sparse_mla, write_index_cache

OP_NAMES = (
    "mla_decode",
    "attention_varlen",
    "write_kv_cache",
    "write_index_cache",
    "indexer_topk",
    "sparse_mla",
    "quantize_fp8",
    "gemm",
    "grouped_gemm",
    "moe_route",
    "moe_route_hash",
    "ep_dispatch",
    "ep_combine",
    "rms_norm",
    "layer_norm",
    "rope",
    "silu_and_mul",
    "sample",
    "apply_token_bitmask",
    "hc_pre",
    "hc_post",
    "hc_head",
    "compress_kv",
    "indexer_topk_entries",
    "sparse_attention_sinks",
)

__all__ = [
    "OP_NAMES",
    "DispatchHandle",
    "ExpertLayout",
    "ExpertPlacement",
    "apply_token_bitmask",
    "attention_varlen",
    "compress_kv",
    "ep_combine",
    "ep_dispatch",
    "gemm",
    "grouped_gemm",
    "hc_head",
    "hc_post",
    "hc_pre",
    "indexer_topk",
    "indexer_topk_entries",
    "layer_norm",
    "mla_decode",
    "mla_softmax_scale",
    "moe_route",
    "moe_route_hash",
    "quantize_fp8",
    "rms_norm",
    "rope",
    "rope_cos_sin_cache",
    "sample",
    "silu_and_mul",
    "sparse_attention_sinks",
    "sparse_mla",
    "write_index_cache",
    "write_kv_cache",
]
