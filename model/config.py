"""``ModelConfig``: the DeepSeek-V3 family's ``config.json``, read and checked.

Accepted: ``model_type`` ``deepseek_v3`` (``DeepseekV3ForCausalLM``) and ``deepseek_v32`` (``DeepseekV32ForCausalLM``:
DeepSeek-V3 with DeepSeek Sparse Attention, ``index_n_heads`` / ``index_head_dim`` / ``index_topk``; its MLP layer
types may be listed in ``mlp_layer_types``), including V2-Lite-style ``q_lora_rank: null`` (V3 only),
dense first layers (``first_k_dense_replace``), group-limited routing (``n_group`` / ``topk_group``), YaRN rope
(``rope_scaling`` of the hub, or transformers' ``rope_parameters``), FP8 block-scaled weights
(``quantization_config`` with ``quant_method: fp8`` and ``weight_block_size: [128, 128]``). Anything else is a
``CheckpointError`` naming ``config.json`` and the field, raised before any weight is read.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CheckpointError

ARCHITECTURES = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v32": "DeepseekV32ForCausalLM"}
MODEL_TYPES = tuple(ARCHITECTURES)
FP8_BLOCK = (128, 128)
# Bounds on sizes that no tensor of the checkpoint bounds (the others are checked against the files' headers before
# anything of their size is built): generous for this family (DeepSeek-V3: 163840 positions, 256 experts, one MTP
# layer), and small enough that what is built from them (the rope table, the MTP layers' expected layout when the
# files hold none of their tensors) stays within memory.
MAX_POSITIONS = 1 << 22
MAX_ROUTED_EXPERTS = 1 << 12
MAX_MTP_LAYERS = 16


@dataclass(frozen=True)
class Fp8Config:
    """Block-scaled FP8 weights: e4m3 data, fp32 ``weight_scale_inv`` per ``block``; ``scale_format`` ``fp32`` or
    ``ue8m0`` (``scale_fmt`` of DeepSeek-V3.1 checkpoints)."""

    block: tuple[int, int] = FP8_BLOCK
    scale_format: str = "fp32"


@dataclass(frozen=True)
class ModelConfig:
    """The fields of ``config.json`` the model uses (Hugging Face names), with DeepSeek-V3's defaults."""

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int = 8
    topk_group: int = 4
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    max_position_embeddings: int = 163840
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    fp8: Fp8Config | None = None
    model_type: str = "deepseek_v3"
    index_n_heads: int = 0  # DeepSeek Sparse Attention (deepseek_v32); 0: dense MLA
    index_head_dim: int = 0
    index_topk: int = 0
    mlp_layer_types: tuple[str, ...] | None = None  # "dense" / "sparse" per layer, where config.json lists them
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_width(self) -> int:
        """Values per token in the latent cache: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def sparse_attention(self) -> bool:
        """Whether attention is DeepSeek Sparse Attention (an indexer per layer picks the tokens attended)."""
        return self.index_topk > 0

    def is_moe_layer(self, layer: int) -> bool:
        if self.mlp_layer_types is not None and layer < len(self.mlp_layer_types):
            return self.mlp_layer_types[layer] == "sparse" and self.n_routed_experts > 0
        return layer >= self.first_k_dense_replace and self.n_routed_experts > 0

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        file = Path(path) / "config.json"
        if not file.is_file():
            if file.exists():  # a FIFO would block the read
                raise CheckpointError(f"{file}: not a regular file")
            raise CheckpointError(f"{file}: not found (a Hugging Face layout directory has a config.json)")
        try:
            raw = json.loads(file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{file}: not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise CheckpointError(f"{file}: expected a JSON object, got {type(raw).__name__}")
        return cls.from_dict(raw, source=str(file))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Parses a ``config.json`` dict; raises ``CheckpointError`` naming ``source`` and the field."""

        def fail(what: str) -> CheckpointError:
            return CheckpointError(f"{source}: {what}")

        archs = raw.get("architectures") or []
        if not isinstance(archs, list):
            raise fail(f"field 'architectures' must be a list of class names, got {archs!r}")
        model_type = raw.get("model_type")
        if model_type not in MODEL_TYPES or (archs and ARCHITECTURES[model_type] not in archs):
            supported = ", ".join(f"model_type {t!r} with {a}" for t, a in ARCHITECTURES.items())
            raise fail(
                f"unsupported architecture (model_type={model_type!r}, architectures={archs}); supported: {supported}"
            )

        def get(name: str, kind: type, default: Any = None, *, required: bool = False, allow_none: bool = False):
            if name not in raw or (raw[name] is None and not allow_none):
                if required:
                    raise fail(f"field {name!r} is missing")
                return default
            value = raw[name]
            if value is None:
                return None
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value) if abs(value) < 1 << 1000 else math.inf  # float() of a huge int raises
            if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
                raise fail(f"field {name!r} must be an integer, got {value!r}")
            if not isinstance(value, kind):
                raise fail(f"field {name!r} must be {kind.__name__}, got {value!r}")
            return value

        def moe(name: str, kind: type, null: Any):
            """A routing field: transformers' default where config.json leaves it out (DeepSeek-V3's, ``d``), ``null``
            where it is null (DeepSeek-V2's reading: no groups, no shared or routed experts, no dense layers)."""
            if name not in raw:
                return getattr(d, name)
            value = get(name, kind, allow_none=True)
            return null if value is None else value

        d = cls()
        heads = get("num_attention_heads", int, required=True)
        kv_heads = get("num_key_value_heads", int, heads)
        if kv_heads != heads:
            raise fail(f"num_key_value_heads ({kv_heads}) must equal num_attention_heads ({heads}) for MLA")
        hidden_act = get("hidden_act", str, "silu")
        if hidden_act != "silu":
            raise fail(f"hidden_act {hidden_act!r} is not supported (silu)")
        scoring = get("scoring_func", str, "sigmoid")
        if scoring not in ("sigmoid", "softmax"):
            raise fail(f"scoring_func {scoring!r} is not supported (sigmoid or softmax)")
        if model_type == "deepseek_v32":  # transformers' DeepseekV32 routes by sigmoid only, whatever the field says
            scoring = "sigmoid"
        moe_freq = get("moe_layer_freq", int, 1)
        if moe_freq != 1:
            raise fail(f"moe_layer_freq {moe_freq} is not supported (1)")
        eos = raw.get("eos_token_id", 1)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in eos_ids):
            raise fail(f"field 'eos_token_id' must be an int >= 0, a list of them or null, got {eos!r}")

        rope_theta, rope_scaling = _rope(raw, fail)
        sparse = model_type == "deepseek_v32"
        layer_types = raw.get("mlp_layer_types")
        if layer_types is not None and (
            not isinstance(layer_types, list) or any(t not in ("dense", "sparse") for t in layer_types)
        ):
            raise fail(f"mlp_layer_types must be a list of 'dense' / 'sparse', got {layer_types!r}")
        max_positions = get("max_position_embeddings", int, d.max_position_embeddings if sparse else 4096)
        # no sequence is longer than max_position_embeddings, so a larger index_topk keeps every token, as it does in
        # transformers (which takes min(index_topk, keys)); capped, it sizes no buffer beyond that
        index_topk = get("index_topk", int, 2048) if sparse else 0
        if max_positions > 0:  # else refused below
            index_topk = min(index_topk, max_positions)
        cfg = cls(
            vocab_size=get("vocab_size", int, required=True),
            hidden_size=get("hidden_size", int, required=True),
            intermediate_size=get("intermediate_size", int, required=True),
            moe_intermediate_size=get("moe_intermediate_size", int, d.moe_intermediate_size),
            num_hidden_layers=get("num_hidden_layers", int, required=True),
            num_attention_heads=heads,
            n_shared_experts=moe("n_shared_experts", int, 0),
            n_routed_experts=moe("n_routed_experts", int, 0),
            routed_scaling_factor=moe("routed_scaling_factor", float, 1.0),
            kv_lora_rank=get("kv_lora_rank", int, required=True),
            q_lora_rank=get("q_lora_rank", int, d.q_lora_rank, allow_none=True),
            qk_rope_head_dim=get("qk_rope_head_dim", int, required=True),
            v_head_dim=get("v_head_dim", int, required=True),
            qk_nope_head_dim=get("qk_nope_head_dim", int, required=True),
            n_group=moe("n_group", int, 1) or 1,
            topk_group=moe("topk_group", int, 1) or 1,
            num_experts_per_tok=moe("num_experts_per_tok", int, 1),
            first_k_dense_replace=moe("first_k_dense_replace", int, 0),
            norm_topk_prob=bool(moe("norm_topk_prob", bool, False)),
            scoring_func=scoring,
            max_position_embeddings=max_positions,
            rms_norm_eps=get("rms_norm_eps", float, 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rope_interleave=bool(get("rope_interleave", bool, True)),
            attention_bias=bool(get("attention_bias", bool, False)),
            tie_word_embeddings=bool(get("tie_word_embeddings", bool, False)),
            num_nextn_predict_layers=get("num_nextn_predict_layers", int, 0) or 0,
            bos_token_id=get("bos_token_id", int, None),
            eos_token_ids=eos_ids,
            fp8=_quantization(raw.get("quantization_config"), fail),
            model_type=model_type,
            index_n_heads=get("index_n_heads", int, 64) if sparse else 0,
            index_head_dim=get("index_head_dim", int, 128) if sparse else 0,
            index_topk=index_topk,
            mlp_layer_types=tuple(layer_types) if layer_types is not None else None,
            extra=raw,
        )
        cfg._check(fail)
        return cfg

    def _check(self, fail) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "qk_nope_head_dim",
            "v_head_dim",
            "max_position_embeddings",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise fail(f"field {name!r} must be positive, got {getattr(self, name)}")
        _special_tokens(fail, self.vocab_size, self.eos_token_ids, self.bos_token_id)
        for name in ("rms_norm_eps", "routed_scaling_factor"):  # a bad one fails the first forward, or gives NaN
            _finite(fail, f"field {name!r}", getattr(self, name), positive=True)
        limits = (
            ("max_position_embeddings", MAX_POSITIONS),
            ("n_routed_experts", MAX_ROUTED_EXPERTS),
            ("num_nextn_predict_layers", MAX_MTP_LAYERS),
        )
        for name, limit in limits:
            if not 0 <= getattr(self, name) <= limit:
                raise fail(f"field {name!r} must lie in [0, {limit}], got {getattr(self, name)}")
        for name in ("n_shared_experts", "first_k_dense_replace"):
            if getattr(self, name) < 0:
                raise fail(f"field {name!r} must be >= 0, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise fail(f"field 'q_lora_rank' must be positive or null, got {self.q_lora_rank}")
        if self.mlp_layer_types is not None and len(self.mlp_layer_types) != self.num_hidden_layers:
            n = len(self.mlp_layer_types)
            raise fail(f"mlp_layer_types lists {n} layers, num_hidden_layers is {self.num_hidden_layers}")
        if self.sparse_attention:
            for name in ("index_n_heads", "index_head_dim", "index_topk"):
                if getattr(self, name) <= 0:
                    raise fail(f"field {name!r} must be positive, got {getattr(self, name)}")
            if self.q_lora_rank is None:
                raise fail("deepseek_v32 needs q_lora_rank (its indexer reads the query's low-rank projection)")
            if self.index_topk > self.max_position_embeddings:
                raise fail(
                    f"field 'index_topk' must be at most max_position_embeddings ({self.max_position_embeddings}), "
                    f"got {self.index_topk}"
                )
            if not self.qk_rope_head_dim <= self.index_head_dim:
                raise fail(f"index_head_dim ({self.index_head_dim}) must hold the rope part ({self.qk_rope_head_dim})")
            if not self.rope_interleave:  # transformers' DeepseekV32 has no such field and rotates interleaved pairs
                raise fail(
                    "field 'rope_interleave' must be true for deepseek_v32 (its attention rotates interleaved pairs), "
                    "got false"
                )
        if self.qk_rope_head_dim % 2:
            raise fail(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if any(self.is_moe_layer(i) for i in range(self.num_hidden_layers)):  # by mlp_layer_types where listed
            e, g = self.n_routed_experts, self.n_group
            if e % g:
                raise fail(f"field 'n_group' must divide n_routed_experts ({e}), got {g}")
            if not 1 <= self.topk_group <= g:
                raise fail(f"field 'topk_group' must lie in [1, n_group = {g}], got {self.topk_group}")
            if not 1 <= self.num_experts_per_tok <= self.topk_group * (e // g):
                raise fail(
                    f"field 'num_experts_per_tok' must lie in [1, topk_group * experts per group = "
                    f"{self.topk_group * (e // g)}], got {self.num_experts_per_tok}"
                )
            if self.moe_intermediate_size <= 0:
                raise fail(f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}")


def _rope(raw: dict[str, Any], fail) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, yarn parameters or None)`` from either the hub's ``rope_scaling`` or ``rope_parameters``, read
    as transformers reads them: ``rope_scaling``, where given, stands for ``rope_parameters``; a ``rope_theta`` in it
    wins over the top-level one; a top-level ``original_max_position_embeddings`` wins over the one in it."""
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
    if scaling is not None and not isinstance(scaling, dict):
        raise fail(f"rope_scaling / rope_parameters must be an object or null, got {scaling!r}")
    scaling = scaling or {}
    theta = scaling.get("rope_theta", raw.get("rope_theta"))
    theta = 10000.0 if theta is None else theta
    _finite(fail, "rope_theta", theta, positive=True)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return float(theta), None
    if kind != "yarn":
        raise fail(f"rope scaling type {kind!r} is not supported (default or yarn)")
    yarn = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type")}
    yarn["rope_type"] = "yarn"
    if raw.get("original_max_position_embeddings") is not None:
        yarn["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
    original = yarn.get("original_max_position_embeddings") or raw.get("max_position_embeddings")
    yarn["original_max_position_embeddings"] = original
    _yarn_factor(fail, yarn, raw, original)
    for name in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        if yarn.get(name) is not None:
            _finite(fail, f"yarn rope scaling field {name!r}", yarn[name])
    if yarn.get("attention_factor") is not None:
        _finite(fail, "yarn rope scaling field 'attention_factor'", yarn["attention_factor"], positive=True)
    if yarn.get("truncate") is False:
        raise fail("yarn with truncate=false is not supported")
    return float(theta), yarn


def _yarn_factor(fail, yarn: dict, raw: dict, original: Any) -> None:
    """Refuses an ``original`` (``original_max_position_embeddings``) that is not an int > 0; sets YaRN's ``factor``
    where the config leaves it out (as transformers: the ratio of ``max_position_embeddings`` to ``original``);
    refuses one that is not a finite number > 0."""
    if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
        raise fail(f"yarn rope scaling needs original_max_position_embeddings (an int > 0), got {original!r}")
    if yarn.get("factor") is None:
        longest = raw.get("max_position_embeddings")
        longest = original if longest is None else longest
        if isinstance(longest, bool) or not isinstance(longest, int) or longest <= 0:
            what = "yarn rope scaling without 'factor' needs max_position_embeddings"
            raise fail(f"{what} (an int > 0), got {longest!r}")
        yarn["factor"] = longest / original
    _finite(fail, "yarn rope scaling field 'factor'", yarn["factor"], positive=True)


def _special_tokens(fail, vocab: int, eos_ids: list[int], bos_id: int | None) -> None:
    """Refuses an ``eos_token_id`` at or past ``vocab`` (never sampled: requests would run to ``max_tokens``) and a
    ``bos_token_id`` outside the vocabulary (never embedded)."""
    bad_eos = [e for e in eos_ids if e >= vocab]
    if bad_eos:
        raise fail(f"field 'eos_token_id' must hold token ids below vocab_size ({vocab}), got {bad_eos}")
    if bos_id is not None and not 0 <= bos_id < vocab:
        raise fail(f"field 'bos_token_id' must be null or a token id in [0, {vocab}), got {bos_id}")


def _finite(fail, what: str, value: Any, *, positive: bool = False) -> None:
    """Refuses ``value`` unless it is a finite number (and > 0 with ``positive``); ``what`` names the field."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and isinstance(value, int):
        ok = abs(value) < 1 << 1000  # math.isfinite of a huge int raises
    if not ok or not math.isfinite(value) or (positive and value <= 0):
        raise fail(f"{what} must be a finite number{' > 0' if positive else ''}, got {value!r}")


def _quantization(qc: Any, fail) -> Fp8Config | None:
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise fail(f"quantization_config must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method != "fp8":
        raise fail(f"unsupported quantization quant_method={method!r} (supported: fp8 block-scaled)")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise fail(f"unsupported FP8 format fmt={fmt!r} (supported: e4m3)")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise fail(f"unsupported activation_scheme={scheme!r} (supported: dynamic)")
    block = qc.get("weight_block_size")
    if not isinstance(block, (list, tuple)) or list(block) != list(FP8_BLOCK):
        raise fail(f"unsupported weight_block_size={block!r} (supported: [128, 128])")
    scale_fmt = qc.get("scale_fmt") or "fp32"
    if scale_fmt not in ("fp32", "ue8m0"):
        raise fail(f"unsupported scale_fmt={scale_fmt!r} (supported: ue8m0 or none)")
    return Fp8Config(FP8_BLOCK, scale_fmt)
