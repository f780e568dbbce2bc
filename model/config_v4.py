"""DeepSeek-V4 checkpoints: ``V4Config`` from ``config.json``, the tensor layout it implies, and a checked reader.

``config.json`` is read as transformers' ``DeepseekV4Config`` reads it: ``layer_types`` (or the legacy per-layer
``compress_ratios`` 0 / 4 / 128, or the default schedule: two heavily compressed layers, then compressed sparse and
heavily compressed alternating), ``compress_rates``, ``mlp_layer_types`` (or ``num_hash_layers``, default 3
``hash_moe`` layers first), ``partial_rotary_factor`` (or ``qk_rope_head_dim``), and ``rope_parameters`` either
nested by rope type (``main``, ``compress``; each rotates the channels its own ``partial_rotary_factor`` gives, one
width for both, see ``_v4_rope_width``; a YaRN ``compress`` rope without ``attention_factor`` scales cos/sin by
YaRN's own factor) or flat (its YaRN keys then apply to the ``compress`` rope, whose base is ``compress_rope_theta``;
YaRN there never scales cos/sin: ``attention_factor`` 1).

The weights are found under the names DeepSeek writes and transformers saves (``model.layers.{i}.attn.wq_a.weight``,
``...ffn.experts.{e}.w1.weight``, ``head.weight``, ``model.hc_head.hc_fn``...); a leading ``model.`` is optional
(DeepSeek's own files have none, and call the embedding ``embed.weight`` and the head's mHC ``hc_head_fn``).
``V4Checkpoint.open`` reads every header and checks the whole checkpoint against the layout before a weight is read:
a missing, unexpected or mis-shaped tensor is a ``CheckpointError`` naming the file and the tensor. The
multi-token-prediction layers (``mtp.{k}.*``, ``mtp_layout``; all or none of them; ``num_nextn_predict_layers`` of
them, one where config.json leaves it out, as in transformers) are read for speculative decoding only.

Quantised checkpoints (``quantization_config``: ``quant_method: fp8``, ``fmt: e4m3``, ``weight_block_size: [128,
128]``, ``scale_fmt`` ``ue8m0`` or none, ``expert_dtype`` ``fp4`` or ``fp8``), as transformers' fine-grained FP8
integration writes them: a linear weight may be e4m3 with ``weight_scale_inv [ceil(N/128), ceil(K/128)]``; with
``expert_dtype: fp4`` the routed experts' weights are int8 ``[N, K/2]``, two e2m1 values a byte (the low nibble
first), with one scale per 32 values of a row, ``weight_scale_inv [N, K/32]``. Scales are fp32 or ``F8_E8M0``.
FP8 linears stay FP8 (``read_fp8``, a ``deepinfer.QTensor`` with fp32 ``(128, 128)`` block scales in the checkpoint's
``scale_fmt``) and run through ``ops.gemm`` / ``ops.grouped_gemm``, which quantise the activations per ``(1, 128)``
block as DeepSeek's FP8 GEMMs do; those are the linears transformers' FP8 integration converts: every ``LINEAR`` of
the layout but the ``HIGH_PRECISION`` ones, which the layout keeps float. An FP8 weight whose scales the FP8 op
cannot take (K not a multiple of 128; ``scale_fmt: ue8m0`` with a scale that is not a power of two) is dequantised
once, at load, to the model's dtype (``read``), as is one the model cannot assemble in FP8 (``deepseek_v4``:
``wo_a`` blocks that straddle its groups, gate and up projections whose rows are not whole blocks). FP4 routed
experts stay packed (``read_fp4``, a ``deepinfer.FP4Tensor``) where the backend has a grouped GEMM for them, else
they are dequantised; their activations go in unquantised (DeepSeek quantises them to FP8 first: not done yet).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from deepinfer.qtensor import FP4_GROUP, UE8M0_DTYPE, FP4Tensor, QTensor, fp4_from_fp32_scales

from .checkpoint import FLOAT_KINDS, TensorInfo, read_tensors
from .config import MAX_POSITIONS, MAX_ROUTED_EXPERTS, _finite, _special_tokens, _yarn_factor
from .errors import CheckpointError

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
V4_KV_FORMATS = ("bf16", "fp8_ds_mla")  # the compressed entries' and indexer keys' records (``V4CacheLayout``)
MLP_TYPES = ("hash_moe", "moe")
INT_KINDS = ("I32", "I64")


@dataclass(frozen=True)
class V4Config:
    """The fields of a DeepSeek-V4 ``config.json`` the model uses (transformers' names and defaults)."""

    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    q_lora_rank: int = 1024
    qk_rope_head_dim: int = 64
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    compress_rope_scaling: dict[str, Any] | None = None
    layer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    mtp_layer_types: tuple[str, ...] = ()  # the attention type of each multi-token-prediction layer
    compress_rates: dict[str, int] = field(default_factory=lambda: {CSA: 4, HCA: 128})
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    num_nextn_predict_layers: int = 0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    model_type: str = "deepseek_v4"
    quantization: dict[str, str] | None = None  # {"scale_fmt": ..., "expert_dtype": "fp8" | "fp4"} when quantised
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # The engine allocates the cache pages and hands them to the model, which lays them out itself
    # (``V4CacheLayout``): the engine asks ``cache_layout`` for the page size and the pages each sequence holds.
    owns_cache = True
    sparse_attention = False  # no DeepSeek-V3.2 paged indexer-key cache either

    def cache_layout(
        self, block_size: int, elem_bytes: int = 2, kv_format: str = "bf16", mtp_layers: int = 0, drafts: int = 0
    ) -> V4CacheLayout:
        """The paged cache's layout for pages of ``block_size`` tokens in a dtype of ``elem_bytes`` bytes, with
        ``kv_format`` records for the compressed entries and indexer keys; with the caches of the first
        ``mtp_layers`` multi-token-prediction layers after the model's, and room for ``drafts`` rejected draft
        tokens a step (``V4CacheLayout``)."""
        return V4CacheLayout.build(self, block_size, elem_bytes, kv_format, mtp_layers, drafts)

    def cache_bytes_per_token(self, elem_bytes: int = 2) -> float:
        """Bytes the caches grow by per token of context, ideally (with no slot of a page left unused): every
        compressed layer's entry (``head_dim``) and, for compressed sparse attention, its indexer key
        (``index_head_dim``), once per ``m`` tokens. ``V4CacheLayout.bytes_per_token`` gives what the pages of a
        given size hold; the window's keys and the unfinished windows are a fixed cost per sequence
        (``cache_bytes_per_sequence``)."""
        total = 0.0
        for i, kind in enumerate(self.layer_types):
            if kind != SLIDING:
                total += (self.head_dim + (self.index_head_dim if kind == CSA else 0)) / self.compress_rate(i)
        return total * elem_bytes

    def cache_bytes_per_sequence(self, elem_bytes: int = 2) -> int:
        """Fixed bytes per sequence (before rounding to whole pages): every layer's window ring of
        ``sliding_window - 1`` keys and each compressor's ring of its last projections (without speculative decoding:
        ``V4CacheLayout`` has the rings' sizes)."""
        return V4CacheLayout.build(self, 1, elem_bytes).state_elems * elem_bytes

    def cache_page_bytes(self, kv_format: str, block_size: int, elem_bytes: int = 2, mtp_layers: int = 0) -> int:
        """The engine's budget for one page of ``block_size`` tokens (``V4CacheLayout.page_bytes``)."""
        return self.cache_layout(block_size, elem_bytes, kv_format, mtp_layers).page_bytes

    def attention_type(self, layer: int) -> str:
        """The attention type of ``layer``: the model's layers, then its multi-token-prediction layers."""
        n = self.num_hidden_layers
        return self.layer_types[layer] if layer < n else self.mtp_layer_types[layer - n]

    def mlp_type(self, layer: int) -> str:
        """``hash_moe`` or ``moe``; a multi-token-prediction layer routes by score (``moe``)."""
        return self.mlp_layer_types[layer] if layer < self.num_hidden_layers else "moe"

    def compress_rate(self, layer: int) -> int:
        """``m`` of a compressed layer (0 for a sliding-window layer)."""
        kind = self.attention_type(layer)
        return 0 if kind == SLIDING else self.compress_rates[kind]

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> V4Config:
        """Parses a DeepSeek-V4 ``config.json`` dict; raises ``CheckpointError`` naming ``source`` and the field."""

        def fail(what: str) -> CheckpointError:
            return CheckpointError(f"{source}: {what}")

        if not isinstance(raw, dict):
            raise fail(f"expected a JSON object, got {type(raw).__name__}")

        def get(name: str, kind: type, default: Any = None, *, required: bool = False):
            if raw.get(name) is None:
                if required:
                    raise fail(f"field {name!r} is missing")
                return default
            value = raw[name]
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if (kind is int and (isinstance(value, bool) or not isinstance(value, int))) or not isinstance(value, kind):
                raise fail(f"field {name!r} must be {kind.__name__}, got {value!r}")
            return value

        if raw.get("model_type") != "deepseek_v4":
            raise fail(f"model_type {raw.get('model_type')!r} is not deepseek_v4")
        archs = raw.get("architectures") or []
        if not isinstance(archs, list):
            raise fail(f"field 'architectures' must be a list of class names, got {archs!r}")
        if archs and "DeepseekV4ForCausalLM" not in archs:
            raise fail(f"architectures {archs} do not include DeepseekV4ForCausalLM")
        if get("hidden_act", str, "silu") != "silu":
            raise fail(f"hidden_act {raw['hidden_act']!r} is not supported (silu)")
        if get("num_key_value_heads", int, 1) != 1:
            raise fail(f"num_key_value_heads must be 1 (shared key=value attention), got {raw['num_key_value_heads']}")
        for flag in ("attention_bias", "mlp_bias"):
            if raw.get(flag):
                raise fail(f"{flag}=true is not supported by DeepSeek-V4")
        quant = _v4_quantization(raw.get("quantization_config"), raw.get("expert_dtype"), fail)
        scoring = get("scoring_func", str, "sqrtsoftplus")
        if scoring not in ("sqrtsoftplus", "sigmoid", "softmax"):
            raise fail(f"scoring_func {scoring!r} is not supported (sqrtsoftplus, sigmoid or softmax)")

        n = get("num_hidden_layers", int, required=True)
        if not 1 <= n <= 4096:
            raise fail(f"field 'num_hidden_layers' must lie in [1, 4096], got {n}")
        rates = dict(raw.get("compress_rates") or {CSA: 4, HCA: 128})
        for key, legacy in ((CSA, "compress_rate_csa"), (HCA, "compress_rate_hca")):
            if raw.get(legacy) is not None:
                rates[key] = raw[legacy]
        for key in (CSA, HCA):
            v = rates.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise fail(f"compress_rates[{key!r}] must be an int >= 1, got {v!r}")
        types = raw.get("layer_types")
        if types is None and raw.get("compress_ratios") is not None:
            ratios = raw["compress_ratios"]
            if not isinstance(ratios, list) or any(r not in RATIO_TO_TYPE for r in ratios):
                raise fail(f"compress_ratios must list 0, 4 or 128 per layer, got {ratios!r}")
            types = [RATIO_TO_TYPE[r] for r in ratios]
        if types is None:
            types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        mlp = raw.get("mlp_layer_types")
        if mlp is None:
            hashed = get("num_hash_layers", int, 3)
            mlp = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
        for name, got, allowed in (("layer_types", types, LAYER_TYPES), ("mlp_layer_types", mlp, MLP_TYPES)):
            if not isinstance(got, list) or len(got) < n or any(t not in allowed for t in got):
                raise fail(f"{name} must list one of {list(allowed)} for each of the {n} layers, got {got!r}")
        nextn = get("num_nextn_predict_layers", int, 1)  # transformers' default (its checkpoints hold none)
        mtp_types = (list(types[n : n + nextn]) + [SLIDING] * nextn)[:nextn]  # legacy compress_ratios list them

        head_dim = get("head_dim", int, 512)
        # As transformers: partial_rotary_factor where given; else the legacy qk_rope_head_dim; else 64 of 512.
        factor = get("partial_rotary_factor", float)
        if factor is not None:
            _finite(fail, "field 'partial_rotary_factor'", factor, positive=True)
            rope_dim = int(head_dim * factor)
        else:
            rope_dim = get("qk_rope_head_dim", int, int(head_dim * 64 / 512))
        rope_dim = _v4_rope_width(raw, head_dim, rope_dim, fail)
        theta, c_theta, c_scaling = _v4_rope(raw, fail)
        eos = raw.get("eos_token_id", 1)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in eos_ids):
            raise fail(f"field 'eos_token_id' must be an int >= 0, a list of them or null, got {eos!r}")
        cfg = cls(
            vocab_size=get("vocab_size", int, required=True),
            hidden_size=get("hidden_size", int, required=True),
            moe_intermediate_size=get("moe_intermediate_size", int, required=True),
            num_hidden_layers=n,
            num_attention_heads=get("num_attention_heads", int, required=True),
            head_dim=head_dim,
            q_lora_rank=get("q_lora_rank", int, 1024),
            qk_rope_head_dim=rope_dim,
            num_experts_per_tok=get("num_experts_per_tok", int, 6),
            n_routed_experts=get("n_routed_experts", int, required=True),
            n_shared_experts=get("n_shared_experts", int, 1),
            scoring_func=scoring,
            routed_scaling_factor=get("routed_scaling_factor", float, 1.5),
            max_position_embeddings=get("max_position_embeddings", int, 1048576),
            rope_theta=theta,
            compress_rope_theta=c_theta,
            compress_rope_scaling=c_scaling,
            layer_types=tuple(types[:n]),
            mlp_layer_types=tuple(mlp[:n]),
            mtp_layer_types=tuple(mtp_types),
            compress_rates={CSA: rates[CSA], HCA: rates[HCA]},
            hc_mult=get("hc_mult", int, 4),
            hc_sinkhorn_iters=get("hc_sinkhorn_iters", int, 20),
            hc_eps=get("hc_eps", float, 1e-6),
            swiglu_limit=get("swiglu_limit", float, 10.0),
            sliding_window=get("sliding_window", int, 128),
            o_groups=get("o_groups", int, 8),
            o_lora_rank=get("o_lora_rank", int, 1024),
            index_n_heads=get("index_n_heads", int, 64),
            index_head_dim=get("index_head_dim", int, 128),
            index_topk=get("index_topk", int, 512),
            num_nextn_predict_layers=nextn,
            rms_norm_eps=get("rms_norm_eps", float, 1e-6),
            tie_word_embeddings=bool(get("tie_word_embeddings", bool, False)),
            bos_token_id=get("bos_token_id", int, None),
            eos_token_ids=eos_ids,
            quantization=quant,
            extra=raw,
        )
        cfg._check(fail)
        return cfg

    def _check(self, fail) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "moe_intermediate_size",
            "num_attention_heads",
            "head_dim",
            "q_lora_rank",
            "qk_rope_head_dim",
            "num_experts_per_tok",
            "n_routed_experts",
            "max_position_embeddings",
            "hc_mult",
            "hc_sinkhorn_iters",
            "sliding_window",
            "o_groups",
            "o_lora_rank",
            "index_n_heads",
            "index_head_dim",
            "index_topk",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise fail(f"field {name!r} must be positive, got {getattr(self, name)}")
        _special_tokens(fail, self.vocab_size, self.eos_token_ids, self.bos_token_id)
        for name in ("rms_norm_eps", "routed_scaling_factor", "swiglu_limit"):
            _finite(fail, f"field {name!r}", getattr(self, name), positive=True)
        _finite(fail, "field 'hc_eps'", self.hc_eps)
        if self.hc_eps < 0:
            raise fail(f"field 'hc_eps' must be >= 0, got {self.hc_eps}")
        if not 0 <= self.num_nextn_predict_layers <= 16:
            raise fail(f"field 'num_nextn_predict_layers' must lie in [0, 16], got {self.num_nextn_predict_layers}")
        if self.max_position_embeddings > MAX_POSITIONS:
            raise fail(f"field 'max_position_embeddings' must be at most {MAX_POSITIONS}")
        if self.n_routed_experts > MAX_ROUTED_EXPERTS:
            raise fail(f"field 'n_routed_experts' must be at most {MAX_ROUTED_EXPERTS}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise fail(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts ({self.n_routed_experts})"
            )
        if self.n_shared_experts != 1:
            raise fail(f"n_shared_experts must be 1 (DeepSeek-V4's shared expert), got {self.n_shared_experts}")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > min(self.head_dim, self.index_head_dim):
            raise fail(
                f"the rope part ({self.qk_rope_head_dim}) must be even and fit head_dim ({self.head_dim}) and "
                f"index_head_dim ({self.index_head_dim})"
            )
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise fail(f"o_groups ({self.o_groups}) must divide num_attention_heads * head_dim")


def _v4_quantization(qc: Any, expert_dtype: Any, fail) -> dict[str, str] | None:
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise fail(f"quantization_config must be an object, got {qc!r}")
    if qc.get("quant_method") != "fp8":
        raise fail(f"unsupported quantization quant_method={qc.get('quant_method')!r} (supported: fp8)")
    if qc.get("fmt", "e4m3") != "e4m3" or qc.get("activation_scheme", "dynamic") != "dynamic":
        raise fail("FP8 checkpoints must use fmt e4m3 and activation_scheme dynamic")
    block = qc.get("weight_block_size")
    if not isinstance(block, (list, tuple)) or list(block) != [128, 128]:
        raise fail(f"unsupported weight_block_size={qc.get('weight_block_size')!r} (supported: [128, 128])")
    scale_fmt = qc.get("scale_fmt") or "fp32"
    if scale_fmt not in ("fp32", "ue8m0"):
        raise fail(f"unsupported scale_fmt={scale_fmt!r} (supported: ue8m0 or none)")
    experts = qc.get("expert_dtype", expert_dtype) or "fp8"
    if experts not in ("fp8", "fp4"):
        raise fail(f"unsupported expert_dtype={experts!r} (supported: fp8, fp4)")
    return {"scale_fmt": scale_fmt, "expert_dtype": experts}


def _v4_rope_width(raw: dict[str, Any], head_dim: int, rope_dim: int, fail) -> int:
    """The channels rope rotates: ``rope_dim`` (the config's) unless ``rope_parameters`` is nested by rope type. As
    transformers reads a nested one, each rope rotates ``head_dim`` times its own ``partial_rotary_factor``, else the
    config's ``partial_rotary_factor`` (not the legacy ``qk_rope_head_dim``), else all ``head_dim`` channels; the
    two must agree."""
    rp = raw.get("rope_scaling") or raw.get("rope_parameters")
    if not (isinstance(rp, dict) and isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict)):
        return rope_dim
    widths = []
    for kind in ("main", "compress"):
        factor = rp[kind].get("partial_rotary_factor", raw.get("partial_rotary_factor"))
        if factor is None:
            factor = 1.0
        _finite(fail, f"rope_parameters[{kind!r}] field 'partial_rotary_factor'", factor, positive=True)
        widths.append(int(head_dim * factor))
    if widths[0] != widths[1]:
        raise fail(
            f"rope_parameters rotate {widths[0]} channels on sliding-window layers and {widths[1]} on compressed ones "
            "(one width for both is supported)"
        )
    return widths[0]


def _v4_rope(raw: dict[str, Any], fail) -> tuple[float, float, dict[str, Any] | None]:
    """``(main theta, compress theta, compress YaRN parameters or None)``. As in transformers, the hub's
    ``rope_scaling``, where given, stands for ``rope_parameters``."""
    rp = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(rp, dict):
        raise fail(f"rope_scaling / rope_parameters must be an object, got {rp!r}")
    nested = isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict)
    if nested:
        main, compress = rp["main"], dict(rp["compress"])
    else:
        main = {"rope_type": "default", "rope_theta": raw.get("rope_theta", 10000.0)}
        compress = {k: v for k, v in rp.items() if k not in ("main", "compress")}
        compress["rope_theta"] = raw.get("compress_rope_theta", 160000.0)
    if main.get("rope_type", main.get("type", "default")) != "default":
        raise fail(f"the main rope must be of type default, got {main.get('rope_type')!r}")
    top = raw.get("rope_theta")  # a nested dict without a base takes the top-level one, as in transformers
    top = 10000.0 if top is None else top
    theta, c_theta = main.get("rope_theta", top), compress.get("rope_theta", top)
    _finite(fail, "rope_theta", theta, positive=True)
    _finite(fail, "compress_rope_theta", c_theta, positive=True)
    kind = compress.get("rope_type", compress.get("type", "default"))
    if kind in (None, "default"):
        return float(theta), float(c_theta), None
    if kind != "yarn":
        raise fail(f"the compress rope type {kind!r} is not supported (default or yarn)")
    yarn = {k: v for k, v in compress.items() if k not in ("rope_theta", "type", "partial_rotary_factor")}
    yarn["rope_type"] = "yarn"
    if not nested:  # as transformers: the flat form never scales cos / sin; a nested one says what it means
        yarn["attention_factor"] = yarn.get("attention_factor") or 1.0
    # transformers' default where the config leaves it out: the model's own length
    original = yarn.get("original_max_position_embeddings") or raw.get("max_position_embeddings", 1048576)
    yarn["original_max_position_embeddings"] = original
    _yarn_factor(fail, yarn, raw, original)
    for name in ("beta_fast", "beta_slow"):
        if yarn.get(name) is not None:
            _finite(fail, f"yarn rope scaling field {name!r}", yarn[name])
    if yarn.get("truncate") is False:
        raise fail("yarn with truncate=false is not supported")
    return float(theta), float(c_theta), yarn


@dataclass(frozen=True)
class V4CacheLayout:
    """Where a DeepSeek-V4 sequence's caches live in the engine's pages.

    Every page has ``page_bytes`` bytes. A sequence's block table starts with ``state_pages`` **state pages**, then
    one **token page** per ``block_size`` tokens of context (token ``t`` in the page ``state_pages + t //
    block_size``).

    - Token pages hold the compressed entries: entry ``w`` of a layer of rate ``m`` (the pooling of tokens ``[w m,
      (w + 1) m)``) lives in the token page of its first token, ``p = w m // block_size``, at slot ``w -
      ceil(p block_size / m)`` of that layer's region, which has ``entries_per_page = ceil(block_size / m)`` records
      of ``entry_bytes`` from byte ``entry_offset`` of the page; a compressed sparse layer's indexer key ``w`` has
      the same slot in a region of ``index_bytes`` records from ``index_offset``. With ``block_size`` a multiple of
      every rate no slot is unused. Records (``kv_format``): ``bf16``, the values in the model's dtype;
      ``fp8_ds_mla``, DeepSeek's FP8 record: an entry's first ``head_dim - rope_dim`` channels in e4m3 with one
      power-of-two scale per ``entry_group`` channels (``quantize_fp8`` with ``ue8m0`` scales), then the scales, one
      ue8m0 byte each, then the ``rope_dim`` rope channels in the model's dtype; an indexer key all in e4m3 with one
      scale per ``index_group`` channels, then the scales. The groups are 64 and 128 channels, or the whole part
      when it is not a multiple of those.
    - State pages hold one flat vector of ``state_elems`` elements in the model's dtype, ``page_bytes / elem_bytes``
      a page in order: per layer (``state_offset[layer]``, element offsets in the vector; the model's layers, then
      ``mtp_layers`` multi-token-prediction layers) ``window``, the keys of the last ``window_rows`` positions as a
      ring (the key of position ``q`` in row ``q % window_rows``), and for a compressed layer its compressor's
      projections ``buf_kv``, ``buf_gate`` of the last ``compressor_rows(layer)`` positions as a ring alike (of
      which it reads the unfinished window and, overlapping (CSA), the window before it); a CSA layer's indexer has
      the same two as ``ibuf_kv``, ``ibuf_gate`` at ``index_head_dim``.

    The rings hold ``drafts`` positions more than a step reads (``window_rows`` is ``sliding_window - 1 +
    drafts``; a compressor's ``m`` or ``2 m``, plus ``drafts``): a speculative step writes the caches of up to
    ``drafts`` draft tokens past what the sequence keeps if they are rejected, and those writes then overwrite no
    position a later step reads. Every value is a function of the sequence's tokens and its length: nothing is
    valid beyond what the length says, so a recomputed sequence starts from fresh pages, a rejected draft needs no
    undoing, and swapping pages out and in keeps the state.
    """

    block_size: int
    elem_bytes: int
    kv_format: str
    entry_width: int  # head_dim
    index_width: int  # index_head_dim
    rope_dim: int
    entry_group: int  # FP8 scale groups (0 in bf16)
    index_group: int
    entry_bytes: int
    index_bytes: int
    page_bytes: int
    state_pages: int
    state_elems: int
    entries_per_page: tuple[int, ...]
    entry_offset: tuple[int, ...]  # bytes; -1 for a sliding-window layer
    index_offset: tuple[int, ...]  # bytes; -1 unless compressed sparse
    state_offset: tuple[dict[str, int], ...]
    compress_rates: tuple[int, ...]  # m per layer, 0 for a sliding-window layer
    window_rows: int
    drafts: int

    @classmethod
    def build(
        cls,
        cfg: V4Config,
        block_size: int,
        elem_bytes: int,
        kv_format: str = "bf16",
        mtp_layers: int = 0,
        drafts: int = 0,
    ) -> V4CacheLayout:
        if block_size < 1 or elem_bytes < 1 or drafts < 0:
            raise ValueError(
                f"need block_size >= 1, elem_bytes >= 1 and drafts >= 0, got {block_size}, {elem_bytes}, {drafts}"
            )
        if not 0 <= mtp_layers <= cfg.num_nextn_predict_layers:
            raise ValueError(f"mtp_layers {mtp_layers} not in [0, {cfg.num_nextn_predict_layers}]")
        if kv_format not in V4_KV_FORMATS:
            raise CheckpointError(f"deepseek_v4 caches: kv_format one of {V4_KV_FORMATS}, got {kv_format!r}")
        d, di, rd = cfg.head_dim, cfg.index_head_dim, cfg.qk_rope_head_dim
        ring = max(cfg.sliding_window - 1, 0) + drafts
        nope = d - rd
        if kv_format == "fp8_ds_mla":
            eg = 64 if nope % 64 == 0 else nope
            ig = 128 if di % 128 == 0 else di
            entry_bytes = nope + nope // eg + rd * elem_bytes
            index_bytes = di + di // ig
        else:
            eg = ig = 0
            entry_bytes, index_bytes = d * elem_bytes, di * elem_bytes
        per_page, entry_off, index_off, state_off, rates = [], [], [], [], []
        page = state = 0
        for i in range(cfg.num_hidden_layers + mtp_layers):
            kind = cfg.attention_type(i)
            offsets = {"window": state}
            state += ring * d
            rates.append(cfg.compress_rate(i))
            if kind == SLIDING:
                per_page.append(0)
                entry_off.append(-1)
                index_off.append(-1)
                state_off.append(offsets)
                continue
            m = cfg.compress_rate(i)
            cap = -(-block_size // m)
            per_page.append(cap)
            entry_off.append(page)
            page += cap * entry_bytes
            overlap = kind == CSA
            rows = (2 if overlap else 1) * m + drafts
            for prefix, width in [("", d)] + ([("i", di)] if overlap else []):
                for name in ("buf_kv", "buf_gate"):
                    offsets[prefix + name] = state
                    state += rows * (2 if overlap else 1) * width
            if overlap:
                index_off.append(page)
                page += cap * index_bytes
            else:
                index_off.append(-1)
            state_off.append(offsets)
        page = max(page, d * elem_bytes)  # a model of window layers only still pages its state
        page += -page % 16  # pages of whole 16-byte units
        per_state_page = page // elem_bytes
        return cls(
            block_size=block_size,
            elem_bytes=elem_bytes,
            kv_format=kv_format,
            entry_width=d,
            index_width=di,
            rope_dim=rd,
            entry_group=eg,
            index_group=ig,
            entry_bytes=entry_bytes,
            index_bytes=index_bytes,
            page_bytes=page,
            state_pages=-(-state // per_state_page),
            state_elems=state,
            entries_per_page=tuple(per_page),
            entry_offset=tuple(entry_off),
            index_offset=tuple(index_off),
            state_offset=tuple(state_off),
            compress_rates=tuple(rates),
            window_rows=ring,
            drafts=drafts,
        )

    def entry_place(self, m: int, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where entries ``w`` (int64) of a layer of rate ``m`` lie: their token page (a block-table column), slot."""
        p = w * m // self.block_size
        return self.state_pages + p, w - (p * self.block_size + m - 1) // m

    def compressor_rows(self, layer: int) -> int:
        """Rows of ``layer``'s compressor rings: its rate ``m`` (``2 m`` overlapping), plus ``drafts``."""
        m = self.compress_rates[layer]
        return (2 if self.index_offset[layer] >= 0 else 1) * m + self.drafts

    @property
    def page_elems(self) -> int:
        """Elements of the model's dtype in a page (a state page's share of the state vector)."""
        return self.page_bytes // self.elem_bytes

    @property
    def bytes_per_token(self) -> float:
        """Bytes of token pages per token of context."""
        return self.page_bytes / self.block_size

    @property
    def bytes_per_sequence(self) -> int:
        """Bytes of state pages each sequence holds."""
        return self.state_pages * self.page_bytes

    def pages_for(self, num_tokens: int) -> int:
        """Pages (state and token pages) a sequence of ``num_tokens`` tokens holds."""
        return self.state_pages + -(-num_tokens // self.block_size)

    def describe(self) -> str:
        """One line: bytes per token of context and per sequence (what ``model/README.md`` reports)."""
        return (
            f"{self.kv_format} pages of {self.block_size} tokens, {self.page_bytes} bytes: {self.bytes_per_token:g} "
            f"bytes per token of context; {self.state_pages} state pages ({self.bytes_per_sequence} bytes, of which "
            f"{self.state_elems * self.elem_bytes} used) per sequence"
        )


def is_v4_checkpoint(path: str | Path) -> bool:
    """Whether ``path/config.json`` declares ``model_type: deepseek_v4`` (False when it cannot be read, or is not a
    regular file, which is never opened: a FIFO would block the read; the other loader then reports what is
    wrong)."""
    file = Path(path) / "config.json"
    if not file.is_file():
        return False
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(raw, dict) and raw.get("model_type") == "deepseek_v4"


# --- layout --------------------------------------------------------------------------------------------------------

FLOAT, INDEX, LINEAR, EXPERT = "float", "index", "linear", "expert"
SCALE_SUFFIX = "_scale_inv"
FP8_BLOCK = (128, 128)  # the only weight_block_size a V4 config may give
# Weights a quantised V4 checkpoint keeps in high precision, as transformers' DeepseekV4 and its FP8 integration
# (``FP8Linear`` replaces every ``nn.Linear`` outside ``modules_to_not_convert``) do: the attention compressor's and
# the indexer compressor's ``kv_proj`` / ``gate_proj`` and the indexer's ``weights_proj`` (``_keep_in_fp32_modules``:
# BF16 in DeepSeek-V4-Flash, with no ``scale_inv``), the router (a parameter, not a linear) and the head (the output
# embedding, which the quantizer never converts). Any other linear may be FP8 (the layout's ``LINEAR`` kind).
HIGH_PRECISION = ("compressor.wkv.", "compressor.wgate.", "indexer.weights_proj.", "ffn.gate.", "head.")


def expected_layout(cfg: V4Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor of the model (normalised names: no leading ``model.``), with its shape and kind (``float`` or
    ``index``: the hash-routing table)."""
    h, v, n = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    out: dict[str, tuple[tuple[int, ...], str]] = {
        "embed_tokens.weight": ((v, h), FLOAT),
        "norm.weight": ((h,), FLOAT),
        "hc_head.hc_fn": ((n, n * h), FLOAT),
        "hc_head.hc_base": ((n,), FLOAT),
        "hc_head.hc_scale": ((1,), FLOAT),
    }
    if not cfg.tie_word_embeddings:
        out["head.weight"] = ((v, h), FLOAT)
    for i in range(cfg.num_hidden_layers):
        out.update(_block_layout(cfg, i, f"layers.{i}."))
    return out


def mtp_layout(cfg: V4Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """The tensors of the multi-token-prediction layers, as DeepSeek writes them: under ``mtp.{k}.`` a decoder block
    (named as a layer's, built as layer ``num_hidden_layers + k``), ``enorm``, ``hnorm``, ``e_proj``, ``h_proj``,
    the head's ``norm`` and its mHC ``hc_head_fn``, ``hc_head_base``, ``hc_head_scale`` (``MTP_COPIES``, copies of
    the embedding and head, may be there too and are not read)."""
    h, n = cfg.hidden_size, cfg.hc_mult
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for k in range(cfg.num_nextn_predict_layers):
        p = f"mtp.{k}."
        out.update(_block_layout(cfg, cfg.num_hidden_layers + k, p))
        out.update({p + name: ((h,), FLOAT) for name in ("enorm.weight", "hnorm.weight", "norm.weight")})
        out.update({p + name: ((h, h), LINEAR) for name in ("e_proj.weight", "h_proj.weight")})
        out[p + "hc_head_fn"] = ((n, n * h), FLOAT)
        out[p + "hc_head_base"] = ((n,), FLOAT)
        out[p + "hc_head_scale"] = ((1,), FLOAT)
    return out


MTP_COPIES = ("emb.tok_emb.weight", "head.weight")


def _block_layout(cfg: V4Config, i: int, p: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """The tensors of decoder block ``i`` under ``p``."""
    h, v, n = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    d, nh, q, inter = cfg.head_dim, cfg.num_attention_heads, cfg.q_lora_rank, cfg.moe_intermediate_size
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    mixes = (2 + n) * n
    out[p + "attn_norm.weight"] = ((h,), FLOAT)
    out[p + "ffn_norm.weight"] = ((h,), FLOAT)
    for site in ("attn", "ffn"):
        out[f"{p}hc_{site}_fn"] = ((mixes, n * h), FLOAT)
        out[f"{p}hc_{site}_base"] = ((mixes,), FLOAT)
        out[f"{p}hc_{site}_scale"] = ((3,), FLOAT)
    a = p + "attn."
    g, r = cfg.o_groups, cfg.o_lora_rank
    out.update(
        {
            a + "attn_sink": ((nh,), FLOAT),
            a + "wq_a.weight": ((q, h), LINEAR),
            a + "q_norm.weight": ((q,), FLOAT),
            a + "wq_b.weight": ((nh * d, q), LINEAR),
            a + "wkv.weight": ((d, h), LINEAR),
            a + "norm.weight": ((d,), FLOAT),
            a + "wo_a.weight": ((g * r, nh * d // g), LINEAR),
            a + "wo_b.weight": ((h, g * r), LINEAR),
        }
    )
    kind = cfg.attention_type(i)
    if kind != SLIDING:
        m, coff = cfg.compress_rate(i), 2 if kind == CSA else 1
        out.update(_compressor(a + "compressor.", m, coff * d, d, h))
    if kind == CSA:
        di, ni = cfg.index_head_dim, cfg.index_n_heads
        out.update(_compressor(a + "indexer.compressor.", cfg.compress_rate(i), 2 * di, di, h))
        out[a + "indexer.wq_b.weight"] = ((ni * di, q), LINEAR)
        out[a + "indexer.weights_proj.weight"] = ((ni, h), FLOAT)
    f = p + "ffn."
    out[f + "gate.weight"] = ((cfg.n_routed_experts, h), FLOAT)
    if cfg.mlp_type(i) == "hash_moe":
        out[f + "gate.tid2eid"] = ((v, cfg.num_experts_per_tok), INDEX)
    else:
        out[f + "gate.bias"] = ((cfg.n_routed_experts,), FLOAT)
    for e in [*(f"experts.{j}." for j in range(cfg.n_routed_experts)), "shared_experts."]:
        kind = LINEAR if e == "shared_experts." else EXPERT
        out[f + e + "w1.weight"] = ((inter, h), kind)
        out[f + e + "w3.weight"] = ((inter, h), kind)
        out[f + e + "w2.weight"] = ((h, inter), kind)
    return out


def _compressor(p: str, m: int, width: int, dim: int, h: int) -> dict[str, tuple[tuple[int, ...], str]]:
    return {
        p + "ape": ((m, width), FLOAT),
        p + "wkv.weight": ((width, h), FLOAT),
        p + "wgate.weight": ((width, h), FLOAT),
        p + "norm.weight": ((dim,), FLOAT),
    }


ALIASES = {"embed.weight": "embed_tokens.weight", "hc_head_fn": "hc_head.hc_fn", "hc_head_base": "hc_head.hc_base"}
ALIASES["hc_head_scale"] = "hc_head.hc_scale"


def _check_quantised(cfg: V4Config, tensors: dict, name: str, info: TensorInfo, shape: tuple, kind: str) -> None:
    """An e4m3 weight with 128 x 128 block scales, or (routed experts of an ``expert_dtype: fp4`` checkpoint) an
    int8 weight of two e2m1 values a byte with one scale per 32 values of a row."""
    if cfg.quantization is None:
        raise CheckpointError(f"{info.file}: tensor {name!r} is {info.dtype}; config.json has no quantization_config")
    n, k = shape
    fp4 = info.dtype == "I8"
    if fp4 and (kind != EXPERT or cfg.quantization["expert_dtype"] != "fp4"):
        raise CheckpointError(f"{info.file}: tensor {name!r} is int8 (FP4); only routed experts with expert_dtype fp4")
    if not fp4 and any(p in name for p in HIGH_PRECISION):
        raise CheckpointError(f"{info.file}: tensor {name!r} is FP8; DeepSeek-V4 keeps it in high precision")
    want = (n, k // 2) if fp4 else shape
    if info.shape != want or (fp4 and k % FP4_GROUP):
        raise CheckpointError(f"{info.file}: tensor {name!r} has shape {list(info.shape)}, expected {list(want)}")
    scale = tensors.get(name + SCALE_SUFFIX)
    want_scale = (n, k // FP4_GROUP) if fp4 else (math.ceil(n / 128), math.ceil(k / 128))
    if scale is None:
        raise CheckpointError(f"{info.file}: quantised tensor {name!r} has no {name + SCALE_SUFFIX!r}")
    if scale.shape != want_scale or scale.dtype not in ("F32", "BF16", "F8_E8M0"):
        raise CheckpointError(
            f"{scale.file}: tensor {name + SCALE_SUFFIX!r} is {scale.dtype}{list(scale.shape)}, expected fp32 or "
            f"ue8m0 {list(want_scale)}"
        )


def dequantize(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of a quantised weight: e4m3 ``[N, K]`` times its 128 x 128 block scales, or int8 ``[N, K/2]`` of
    two e2m1 values a byte (the low nibble is the even element) times one scale per 32 values of a row."""
    if w.dtype == torch.int8:
        return FP4Tensor(w, scale).dequantize()  # (its scale may be fp32 here: the decoding is the same)
    s = scale.float()
    n, k = w.shape
    full = s.repeat_interleave(128, dim=0)[:n].repeat_interleave(128, dim=1)[:, :k]
    return w.float() * full


def _powers_of_two(s: torch.Tensor) -> bool:
    """Whether every value of the fp32 ``s`` is a positive normal power of two (a value ue8m0 holds exactly)."""
    bits = s.view(torch.int32)
    exponent = bits >> 23
    return bool(((bits & 0x807FFFFF) == 0).all() and ((exponent > 0) & (exponent < 255)).all())


def normalise(name: str) -> str:
    """A tensor's name in ``expected_layout``'s terms: no leading ``model.``, DeepSeek's top-level aliases mapped."""
    name = name.removeprefix("model.")
    return ALIASES.get(name, name)


def _check_scales(file: Path, name: str, scale: torch.Tensor) -> None:
    """Refuses a NaN or infinite scale (every value of its block would be NaN or infinite), naming the tensor."""
    s = scale.float()
    if not bool(torch.isfinite(s).all()):
        bad = s[~torch.isfinite(s)][0].item()
        raise CheckpointError(f"{file}: tensor {name!r} holds a scale of {bad}, expected finite scales")


@dataclass
class V4Checkpoint:
    """A checked DeepSeek-V4 checkpoint directory. ``names``: normalised name -> name in the files, the
    multi-token-prediction layers' included; ``mtp_keys``: the multi-token-prediction tensors it holds (all of
    ``mtp_layout`` or none; read only for speculative decoding)."""

    path: Path
    config: V4Config
    tensors: dict[str, TensorInfo]
    names: dict[str, str]
    mtp_keys: list[str] = field(default_factory=list)
    bytes_read: int = 0
    _handles: dict[Path, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, path: str | Path, config: V4Config | None = None) -> V4Checkpoint:
        path = Path(path)
        if config is None:
            file = path / "config.json"
            if file.exists() and not file.is_file():  # a FIFO would block the read
                raise CheckpointError(f"{file}: not a regular file")
            try:
                raw = json.loads(file.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{file}: cannot be read as JSON: {e}") from e
            config = V4Config.from_dict(raw, source=str(file))
        tensors = read_tensors(path)
        want, want_mtp = expected_layout(config), mtp_layout(config)
        names: dict[str, str] = {}
        mtp: list[str] = []
        scales = {n for n in tensors if n.endswith(SCALE_SUFFIX)}
        for name, info in sorted(tensors.items()):
            key = normalise(name)
            if key.startswith("mtp."):
                mtp.append(name)
                if key.split(".", 2)[-1] in MTP_COPIES:
                    continue
            if name in scales:
                weight = name[: -len(SCALE_SUFFIX)]
                if weight not in tensors or tensors[weight].dtype not in ("F8_E4M3", "I8"):
                    raise CheckpointError(f"{info.file}: unexpected tensor {name!r} (no quantised weight {weight!r})")
                continue
            if key in want_mtp:
                shape, kind = want_mtp[key]
            elif key not in want:
                raise CheckpointError(
                    f"{info.file}: unexpected tensor {name!r} (not part of the {config.num_hidden_layers}-layer "
                    f"deepseek_v4 layout with {config.num_nextn_predict_layers} multi-token-prediction layers that "
                    "config.json describes)"
                )
            else:
                shape, kind = want[key]
            if key in names:
                raise CheckpointError(f"{info.file}: tensor {name!r} duplicates {names[key]!r}")
            if info.dtype in ("F8_E4M3", "I8") and kind in (LINEAR, EXPERT):
                _check_quantised(config, tensors, name, info, shape, kind)
                names[key] = name
                continue
            if info.shape != shape:
                raise CheckpointError(
                    f"{info.file}: tensor {name!r} has shape {list(info.shape)}, config.json implies {list(shape)}"
                )
            kinds = INT_KINDS if kind == INDEX else FLOAT_KINDS
            if info.dtype not in kinds:
                raise CheckpointError(f"{info.file}: tensor {name!r} has dtype {info.dtype}; expected one of {kinds}")
            names[key] = name
        missing = [k for k in want if k not in names]
        if mtp:  # no multi-token-prediction tensor at all is fine: serving without speculation never needs them
            missing += [k for k in want_mtp if k not in names]
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise CheckpointError(f"{path}: missing tensor {missing[0]!r}{more}, which config.json implies")
        return cls(path, config, tensors, names, mtp)

    def read(self, key: str, dtype: torch.dtype | None, device: torch.device | str) -> torch.Tensor:
        """The tensor of normalised name ``key`` on ``device`` (in ``dtype``; None keeps the stored dtype); a quantised
        weight dequantised (``dequantize``)."""
        name = self.names[key]
        info = self.tensors[name]
        t = self._get(name)
        # the scales by their own file: a sharded checkpoint may hold them in another shard than the weight
        scale = self._get(name + SCALE_SUFFIX) if info.dtype in ("F8_E4M3", "I8") else None
        self.bytes_read += t.numel() * t.element_size()
        if key.endswith("gate.tid2eid"):  # the ops index the experts with these ids, unchecked in the engine's forward
            experts = self.config.n_routed_experts
            bad = t[(t < 0) | (t >= experts)]
            if bad.numel():
                raise CheckpointError(
                    f"{info.file}: tensor {name!r} holds expert id {int(bad[0])}, expected ids in [0, {experts}) "
                    f"(n_routed_experts = {experts})"
                )
        if scale is not None:
            _check_scales(self.tensors[name + SCALE_SUFFIX].file, name + SCALE_SUFFIX, scale)
            self.bytes_read += scale.numel() * scale.element_size()
            t = dequantize(t.to(device), scale.to(device))
        return t.to(device=device, dtype=dtype or t.dtype)

    def read_fp8(self, key: str, device: torch.device | str) -> QTensor | None:
        """The FP8 weight of normalised name ``key`` kept in FP8 on ``device``: a ``QTensor`` of its e4m3 data
        ``[N, K]`` and its block scales as fp32 ``[ceil(N/128), K/128]``, block ``(128, 128)``, in the checkpoint's
        ``scale_fmt`` (the format ``ops.gemm`` quantises the activations in). None where it is not an e4m3 weight,
        where K is not a multiple of 128 (the FP8 ops take whole K blocks only), or where ``scale_fmt`` is ue8m0 but a
        scale is not a power of two (``read`` then dequantises it)."""
        name = self.names[key]
        info = self.tensors[name]
        if info.dtype != "F8_E4M3" or info.shape[1] % FP8_BLOCK[1]:
            return None
        fmt = self.config.quantization["scale_fmt"] if self.config.quantization else "fp32"
        scale = self._get(name + SCALE_SUFFIX)
        _check_scales(self.tensors[name + SCALE_SUFFIX].file, name + SCALE_SUFFIX, scale)
        s = scale.float()  # exact from fp32, bf16 and ue8m0
        if fmt == "ue8m0" and not _powers_of_two(s):
            return None
        data = self._get(name)
        self.bytes_read += data.numel() * data.element_size() + scale.numel() * scale.element_size()
        return QTensor(data.to(device), s.to(device), FP8_BLOCK, fmt)

    def _get(self, name: str) -> torch.Tensor:
        """Tensor ``name`` (as the files name it) as stored."""
        info = self.tensors[name]
        handle = self._handle(info)
        try:
            return handle.get_tensor(name)
        except Exception as e:  # safetensors raises its own error type
            raise CheckpointError(f"{info.file}: tensor {name!r} cannot be read: {e}") from e

    def _handle(self, info: TensorInfo) -> Any:
        handle = self._handles.get(info.file)
        if handle is None:
            try:
                handle = self._handles[info.file] = safe_open(str(info.file), framework="pt")
            except Exception as e:  # safetensors raises its own error type
                raise CheckpointError(f"{info.file}: cannot be opened as safetensors: {e}") from e
        return handle

    def read_fp4(self, key: str, device: torch.device | str) -> FP4Tensor | None:
        """The FP4 weight of normalised name ``key`` kept packed on ``device``: None where it is not an int8 FP4
        weight, or where its scales are not powers of two (fp32 or bf16 scales that ue8m0 cannot hold; ``read``
        then dequantises it)."""
        name = self.names[key]
        info = self.tensors[name]
        if info.dtype != "I8":
            return None
        data, scale = self._get(name), self._get(name + SCALE_SUFFIX)  # each from its own shard
        _check_scales(self.tensors[name + SCALE_SUFFIX].file, name + SCALE_SUFFIX, scale)
        weight = FP4Tensor(data, scale) if scale.dtype == UE8M0_DTYPE else fp4_from_fp32_scales(data, scale)
        if weight is None:
            return None
        self.bytes_read += data.numel() + scale.numel() * scale.element_size()
        return FP4Tensor(weight.data.to(device), weight.scale.to(device))

    def close(self) -> None:
        self._handles.clear()

    def total_bytes(self) -> int:
        from .checkpoint import DTYPES

        return sum(math.prod(i.shape) * DTYPES[i.dtype][1] for n, i in self.tensors.items() if n not in self.mtp_keys)

    def mtp_bytes(self) -> int:
        """Bytes of the multi-token-prediction tensors ``load_weights`` reads (not the copies of the embedding and
        head)."""
        from .checkpoint import DTYPES

        read = set(self.names.values())
        return sum(
            math.prod(i.shape) * DTYPES[i.dtype][1]
            for n, i in self.tensors.items()
            if n in self.mtp_keys and (n in read or n.removesuffix(SCALE_SUFFIX) in read)
        )
