"""DeepSeekMoE on deepinfer ops: a dense SwiGLU MLP, and routed experts plus shared experts.

Routed path: router logits in fp32 (``gemm`` on fp32 operands) -> ``moe_route`` (group-limited, bias for selection
only) -> ``ep_dispatch`` (rows grouped by expert) -> ``grouped_gemm`` (gate and up fused) -> ``silu_and_mul`` ->
``grouped_gemm`` (down) -> ``ep_combine`` (weighted sum back to the tokens); the shared experts are a dense
SwiGLU MLP added on top.

Which experts this process holds is data (``ExpertParallel``: the core's ``ExpertPlacement``, a rank, a process
group): the layer keeps the weights of its local experts in placement order and passes placement and group to
``ep_dispatch``, so sharding the experts over ranks changes the data, not the layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from deepinfer import QTensor, ops
from deepinfer.ops.moe import ExpertPlacement

from .config import ModelConfig
from .forward_batch import ForwardBatch
from .mla import linear


@dataclass(frozen=True)
class ExpertParallel:
    """This process's place in expert parallelism: the core ``ExpertPlacement`` (which rank holds which experts),
    this process's ``rank`` and the ``torch.distributed`` ``group`` (None: one process holding every expert).
    The layer keeps the weights of ``local`` experts, in that order."""

    placement: ExpertPlacement
    rank: int = 0
    group: Any = None

    @classmethod
    def single(cls, num_experts: int) -> ExpertParallel:
        """One process holding every expert in id order."""
        return cls(ExpertPlacement.contiguous(num_experts, 1))

    @property
    def local(self) -> tuple[int, ...]:
        return self.placement.local_experts[self.rank]


def _swiglu(x: torch.Tensor, w13, w2) -> torch.Tensor:
    h = linear(x, w13)
    if isinstance(w2, QTensor):
        return ops.gemm(ops.silu_and_mul(h, quantize=True, scale_format=w2.scale_format), w2, out_dtype=x.dtype)
    return linear(ops.silu_and_mul(h), w2)


class DenseMLP:
    """SwiGLU MLP: ``gate_up_proj.weight`` (gate and up stacked, ``[2I, H]``) and ``down_proj.weight`` ``[H, I]``."""

    def __init__(self, weights: dict):
        self.w13, self.w2 = weights["gate_up_proj.weight"], weights["down_proj.weight"]

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return _swiglu(x, self.w13, self.w2)


class MoE:
    """Weights by name below ``mlp.``: routed experts ``experts.gate_up_proj [E_local, 2I, H]`` and
    ``experts.down_proj [E_local, H, I]``, the fp32 router ``gate.weight [E, H]`` and
    ``gate.e_score_correction_bias [E]`` (sigmoid scoring), and the shared experts (a ``DenseMLP`` under
    ``shared_experts.``, optional)."""

    def __init__(self, cfg: ModelConfig, weights: dict, ep: ExpertParallel):
        self.cfg, self.ep = cfg, ep
        self.gate, self.bias = weights["gate.weight"], weights.get("gate.e_score_correction_bias")
        self.w13, self.w2 = weights["experts.gate_up_proj"], weights["experts.down_proj"]
        shared = {k.removeprefix("shared_experts."): v for k, v in weights.items() if k.startswith("shared_experts.")}
        self.shared = DenseMLP(shared) if shared else None

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        cfg = self.cfg
        logits = ops.gemm(x.float(), self.gate, out_dtype=torch.float32)
        weights, ids = ops.moe_route(
            logits,
            self.bias,
            top_k=cfg.num_experts_per_tok,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            renormalize=cfg.norm_topk_prob,
            routed_scaling_factor=cfg.routed_scaling_factor,
            scoring=cfg.scoring_func,
        )
        recv, _, _, layout, handle = ops.ep_dispatch(
            x,
            ids,
            weights,
            num_experts=cfg.n_routed_experts,
            group=self.ep.group,
            mode=batch.moe_mode,
            placement=self.ep.placement,
        )
        groups = {"expert_offsets": layout.expert_offsets, "masked_m": layout.masked_m}
        h = ops.grouped_gemm(recv, self.w13, out_dtype=x.dtype, **groups)
        if isinstance(self.w2, QTensor):
            a = ops.silu_and_mul(h, quantize=True, scale_format=self.w2.scale_format)
        else:
            a = ops.silu_and_mul(h)
        out = ops.ep_combine(ops.grouped_gemm(a, self.w2, out_dtype=x.dtype, **groups), handle)
        if self.shared is not None:
            out = out + self.shared.forward(x, batch)
        return out
