"""The DeepSeek-V3 model (and DeepSeek-V3.2) on deepinfer ops, and the assembly of its weights from a checked
checkpoint.

Forward: token embedding -> ``num_hidden_layers`` x (RMSNorm -> MLA (DeepSeek-V3.2: sparse MLA with its indexer,
``dsa.py``) -> RMSNorm -> dense MLP or MoE, residual adds fused into ``rms_norm``) -> final RMSNorm;
``compute_logits`` applies ``lm_head`` (fp32 logits) to the rows asked for. Numerics follow Hugging Face
transformers' ``DeepseekV3ForCausalLM`` and ``DeepseekV32ForCausalLM``.

Weights are read once from the memory-mapped files, assembled into the layout the ops take (gate and up
projections stacked, routed experts stacked per layer in placement order, ``W_UK`` / ``W_UV`` split out of
``kv_b_proj`` for absorbed decode, dequantised once for FP8 checkpoints as DeepSeek's own code does), and handed to
the backend's ``prepare_weight`` once under its checkpoint name (stacked weights take transformers' names:
``mlp.gate_up_proj.weight``, ``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``; the absorbed ones
``self_attn.w_uk`` and ``self_attn.w_uv``). The embedding table is only indexed, never an op argument, so it is
not prepared.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer import QTensor, ops, prepare_weight

from .checkpoint import FP32, Checkpoint
from .config import ModelConfig
from .dsa import SparseMLAttention
from .forward_batch import ForwardBatch
from .mla import MLAttention
from .moe import DenseMLP, ExpertParallel, MoE
from .mtp import MTPLayer

ATTN_LINEARS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def _concat_rows(parts: list, dtype: torch.dtype) -> torch.Tensor | QTensor:
    """Weights concatenated along dim 0: FP8 QTensors whose row counts are whole 128-blocks stay FP8; any other
    mix is dequantised to ``dtype``."""
    if _stacks_as_fp8(parts):
        data, scale = torch.cat([p.data for p in parts]), torch.cat([p.scale for p in parts])
        return QTensor(data, scale, parts[0].block, parts[0].scale_format)
    return torch.cat([p.dequantize(dtype) if isinstance(p, QTensor) else p for p in parts])


def _stacks_as_fp8(parts: list) -> bool:
    """Whether ``parts`` are all FP8, every one but the last in whole row blocks (their scales then stack too)."""
    return all(isinstance(p, QTensor) for p in parts) and all(p.shape[0] % p.block[0] == 0 for p in parts[:-1])


def _stack_keeps_format(parts: list) -> bool:
    """Whether ``_concat_rows`` stacks ``parts`` without dequantising any (all float, or all FP8 in whole blocks)."""
    return _stacks_as_fp8(parts) or not any(isinstance(p, QTensor) for p in parts)


class WeightLoader:
    """Reads checkpoint tensors one at a time onto the device, assembles them, and prepares each once."""

    def __init__(
        self,
        ckpt: Checkpoint,
        dtype: torch.dtype,
        device: torch.device,
        on_progress: Callable[[int], None] | None = None,
    ):
        self.ckpt, self.dtype, self.device, self.on_progress = ckpt, dtype, torch.device(device), on_progress

    def raw(self, name: str) -> torch.Tensor | QTensor:
        kind = (self.ckpt.layout.get(name) or self.ckpt.mtp_layout[name]).kind
        t = self.ckpt.read(name, torch.float32 if kind == FP32 else self.dtype, self.device)
        if self.on_progress is not None:
            self.on_progress(self.ckpt.nbytes(name))
        return t

    def fused(self, names: list[str]) -> torch.Tensor | QTensor:
        parts = [self.raw(n) for n in names]
        if len(parts) == 1:
            return parts[0]
        return _concat_rows(parts, self.dtype)

    def experts(self, prefix: str, ep: ExpertParallel) -> tuple:
        """``(gate_up [E_local, 2I, H], down [E_local, H, I])`` filled expert by expert on the device."""
        w13 = w2 = None
        for i, e in enumerate(ep.local):
            p = f"{prefix}experts.{e}."
            gate_up, down = self.fused([p + "gate_proj.weight", p + "up_proj.weight"]), self.raw(p + "down_proj.weight")
            if w13 is None:
                w13, w2 = _empty_stack(gate_up, len(ep.local)), _empty_stack(down, len(ep.local))
            _put(w13, i, gate_up, self.dtype)
            _put(w2, i, down, self.dtype)
        return w13, w2


def _empty_stack(like, n: int):
    if isinstance(like, QTensor):
        data = torch.empty(n, *like.data.shape, dtype=like.data.dtype, device=like.data.device)
        scale = torch.empty(n, *like.scale.shape, dtype=torch.float32, device=like.scale.device)
        return QTensor(data, scale, like.block, like.scale_format)
    return torch.empty(n, *like.shape, dtype=like.dtype, device=like.device)


def _put(stack, i: int, w, dtype: torch.dtype) -> None:
    if isinstance(stack, QTensor):
        if not isinstance(w, QTensor):
            raise ValueError("experts of one layer mix FP8 and float weights")  # Checkpoint.open refuses such files
        stack.data[i].view(torch.uint8).copy_(w.data.view(torch.uint8))
        stack.scale[i].copy_(w.scale)
    else:
        stack[i].copy_(w.dequantize(dtype) if isinstance(w, QTensor) else w)


class DeepseekV3:
    """The model. ``forward`` returns the final normed hidden states of the batch's tokens; ``compute_logits``
    the fp32 logits of the rows asked for; ``mtp`` holds the multi-token-prediction layers when loaded
    (``mtp.py``)."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict,
        *,
        dtype: torch.dtype,
        device: torch.device,
        ep: ExpertParallel,
        max_position: int,
    ):
        self.cfg, self.dtype, self.device, self.ep = cfg, dtype, device, ep
        self.embed = weights["model.embed_tokens.weight"]
        self.lm_head = weights["lm_head.weight"]
        self.norm = weights["model.norm.weight"]
        cos_sin = ops.rope_cos_sin_cache(cfg.qk_rope_head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        self.cos_sin_cache = cos_sin.to(device)
        scale, eps = ops.mla_softmax_scale(cfg.qk_head_dim, cfg.rope_scaling), cfg.rms_norm_eps
        self.layers = [self._block(weights, i, scale) for i in range(cfg.num_hidden_layers)]
        mtp_layers = range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
        self.mtp = [
            MTPLayer(
                _below(weights, f"model.layers.{i}."), self._block(weights, i, scale), self.embed, self.lm_head, eps
            )
            for i in mtp_layers
            if f"model.layers.{i}.eh_proj.weight" in weights
        ]

    def moe_layers(self) -> list[MoE]:
        """The MoE of every decoder layer that has one, in order (not the multi-token-prediction layers')."""
        return [ffn for *_, ffn in self.layers if isinstance(ffn, MoE)]

    def _block(self, weights: dict, i: int, softmax_scale: float) -> tuple:
        """Decoder layer ``i``: ``(input norm, attention, post-attention norm, dense MLP or MoE)``."""
        cfg, p = self.cfg, f"model.layers.{i}."
        attention = SparseMLAttention if cfg.sparse_attention else MLAttention
        attn = attention(cfg, _below(weights, p + "self_attn."), self.cos_sin_cache, softmax_scale)
        mlp = _below(weights, p + "mlp.")
        ffn = MoE(cfg, mlp, self.ep) if cfg.is_moe_layer(i) else DenseMLP(mlp)
        return weights[p + "input_layernorm.weight"], attn, weights[p + "post_attention_layernorm.weight"], ffn

    @classmethod
    def load(
        cls,
        ckpt: Checkpoint,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        ep: ExpertParallel | None = None,
        max_position: int | None = None,
        on_progress: Callable[[int], None] | None = None,
        mtp: bool = False,
    ) -> DeepseekV3:
        """Builds the model from a checked checkpoint: every weight read once, assembled, prepared once. ``mtp``:
        also its multi-token-prediction layers (``self.mtp``, empty when the checkpoint has none)."""
        cfg = ckpt.config
        device = torch.device(device)
        ep = ep or ExpertParallel.single(cfg.n_routed_experts)
        weights = load_weights(ckpt, WeightLoader(ckpt, dtype, device, on_progress), ep, mtp)
        return cls(
            cfg,
            weights,
            dtype=dtype,
            device=device,
            ep=ep,
            max_position=max_position or cfg.max_position_embeddings,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        batch: ForwardBatch,
        kv_caches: list[torch.Tensor],
        index_caches: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``input_ids [T]`` -> final normed hidden states ``[T, hidden]``; writes each token's latent into
        ``kv_caches[layer]`` (and, for sparse attention, its indexer key into ``index_caches[layer]``) at
        ``batch.slot_mapping``."""
        eps = self.cfg.rms_norm_eps
        index_caches = index_caches or [None] * len(self.layers)
        x, residual = self.embed[input_ids], None
        for (in_norm, attn, post_norm, ffn), cache, index_cache in zip(self.layers, kv_caches, index_caches):
            y, residual = ops.rms_norm(x, in_norm, eps, residual)
            y, residual = ops.rms_norm(attn.forward(y, batch, cache, index_cache), post_norm, eps, residual)
            x = ffn.forward(y, batch)
        return ops.rms_norm(x, self.norm, eps, residual)[0]

    def use_index_format(self, index_format: str) -> None:
        """Tells the sparse attention layers the format of their indexer-key caches (an FP8 cache makes the
        indexers rotate queries and keys first: ``dsa.py``)."""
        for _, attn, _, _ in [*self.layers, *(m.block for m in self.mtp)]:
            if isinstance(attn, SparseMLAttention) and index_format == "fp8_ds_index":
                attn.indexer.use_rotation(self.dtype, self.device)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]`` of ``hidden [N, hidden]``."""
        return ops.gemm(hidden, self.lm_head, out_dtype=torch.float32)


def _below(weights: dict, prefix: str) -> dict:
    return {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}


def load_weights(ckpt: Checkpoint, loader: WeightLoader, ep: ExpertParallel, mtp: bool = False) -> dict:
    """Every op weight of the model by name, read, assembled and passed through ``prepare_weight`` once; with
    ``mtp``, also those of the checkpoint's multi-token-prediction layers."""
    cfg = ckpt.config
    out: dict = {}

    def put(name: str, w) -> None:
        out[name] = prepare_weight(name, w)

    embed = loader.raw("model.embed_tokens.weight")
    out["model.embed_tokens.weight"] = embed  # indexed directly, never an op argument
    put("lm_head.weight", embed if cfg.tie_word_embeddings else loader.raw("lm_head.weight"))
    put("model.norm.weight", loader.raw("model.norm.weight"))
    for layer in range(cfg.num_hidden_layers):
        _load_layer(ckpt, loader, ep, layer, ckpt.layout, put)
    if mtp and ckpt.mtp_keys:
        for layer in range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers):
            p = f"model.layers.{layer}."
            for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"):
                put(p + name, loader.raw(p + name))
            _load_layer(ckpt, loader, ep, layer, ckpt.mtp_layout, put)
    return out


def _load_layer(ckpt: Checkpoint, loader: WeightLoader, ep: ExpertParallel, layer: int, layout: dict, put) -> None:
    """The decoder block of ``layer``: its norms, attention (with DeepSeek-V3.2's indexer) and MLP or MoE."""
    cfg, p = ckpt.config, f"model.layers.{layer}."
    for norm in ("input_layernorm", "post_attention_layernorm"):
        put(f"{p}{norm}.weight", loader.raw(f"{p}{norm}.weight"))
    a = p + "self_attn."
    for name in layout:
        if name.startswith(a) and (name.endswith(".bias") or "layernorm" in name) and ".indexer." not in name:
            put(name, loader.raw(name))
    for name in layout:
        if name.startswith(a + "indexer."):
            put(name, loader.raw(name))
    # the two low-rank projections of the hidden state, stacked into one product (MLAttention._down) where neither
    # has a bias and stacking keeps their format; None: stacked, not put apart
    down = [f"{a}q_a_proj.weight", f"{a}kv_a_proj_with_mqa.weight"]
    read = {}
    if down[0] in layout and not any(n.removesuffix("weight") + "bias" in layout for n in down):
        read = {n: loader.raw(n) for n in down}
        if _stack_keeps_format(list(read.values())):
            put(f"{a}qkv_a_proj.weight", _concat_rows(list(read.values()), loader.dtype))
            read = dict.fromkeys(down)
    for lin in ATTN_LINEARS:
        name = f"{a}{lin}.weight"
        if name not in layout:
            continue
        w = read[name] if name in read else loader.raw(name)
        if w is None:
            continue
        if lin == "kv_b_proj":
            w_uk, w_uv = _absorbed(cfg, w, loader.dtype)
            put(f"{a}w_uk", w_uk)
            put(f"{a}w_uv", w_uv)
        put(name, w)
    m = p + "mlp."
    if not cfg.is_moe_layer(layer):
        put(m + "gate_up_proj.weight", loader.fused([m + "gate_proj.weight", m + "up_proj.weight"]))
        put(m + "down_proj.weight", loader.raw(m + "down_proj.weight"))
        return
    put(m + "gate.weight", loader.raw(m + "gate.weight"))
    if m + "gate.e_score_correction_bias" in layout:
        put(m + "gate.e_score_correction_bias", loader.raw(m + "gate.e_score_correction_bias"))
    w13, w2 = loader.experts(m, ep)
    put(m + "experts.gate_up_proj", w13)
    put(m + "experts.down_proj", w2)
    if cfg.n_shared_experts:
        s = m + "shared_experts."
        put(s + "gate_up_proj.weight", loader.fused([s + "gate_proj.weight", s + "up_proj.weight"]))
        put(s + "down_proj.weight", loader.raw(s + "down_proj.weight"))


def _absorbed(cfg: ModelConfig, kv_b, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``W_UK [H, r, nope]`` and ``W_UV [H, v, r]`` from ``kv_b_proj [H * (nope + v), r]`` (dequantised)."""
    w = kv_b.dequantize(dtype) if isinstance(kv_b, QTensor) else kv_b
    w = w.view(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
    return w[:, : cfg.qk_nope_head_dim].transpose(1, 2).contiguous(), w[:, cfg.qk_nope_head_dim :].contiguous()
