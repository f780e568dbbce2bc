"""Checkpoint tensors each of the right shape and a usable dtype, but whose values, or dtypes together, the model
cannot use: refused with a ``CheckpointError`` naming the tensor (or layer) and what was expected, before a request
is served.

DeepSeek-V4's hash-routed layers take each token's experts from ``gate.tid2eid [vocab, k]``: an id outside
``[0, n_routed_experts)`` names no expert, and an op indexing with it reads out of bounds (an error on the CPU,
other memory on a GPU where the engine's forward checks no values).

A NaN or infinite block scale of a quantised DeepSeek-V4 weight (fp32, or the ue8m0 byte 255) makes every value of
its block NaN or infinite, and every log-probability NaN; refused as DeepSeek-V3's are (``test_model_checkpoint``).

The routed experts of a layer are stacked into one tensor, so they must all be FP8 or all float: a
multi-token-prediction layer whose experts mix the two is refused when the checkpoint is opened, as a decoder
layer's are.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import test_model_v4 as v4
import torch
from model_helpers import fp8_copy, hf_checkpoint, one_thread  # noqa: F401 (autouse fixture)
from safetensors.torch import load_file, save_file

from deepinfer.model import LLM, Checkpoint, ModelConfig
from deepinfer.model.checkpoint import mtp_layer_keys
from deepinfer.model.errors import CheckpointError
from deepinfer.qtensor import quantize_blocks


@pytest.fixture(scope="module")
def v4_plain(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4")
    v4.v4_checkpoint(path, 5, **v4.CONFIGS["plain"])
    return path


def _edited(src, dst, name_end: str, edit):
    """A copy of the checkpoint ``src`` in ``dst`` with the tensor whose name ends in ``name_end`` passed through
    ``edit``; returns ``(dst, that tensor's name)``."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    (file,) = src.glob("*.safetensors")
    tensors = load_file(str(file))
    (name,) = [n for n in tensors if n.endswith(name_end)]
    edit(tensors[name])
    save_file(tensors, str(dst / file.name), metadata={"format": "pt"})
    return dst, name


@pytest.mark.parametrize("bad", [8, 100, -1])  # the checkpoint has 8 routed experts
def test_hash_routing_table_naming_no_expert_is_refused(v4_plain, tmp_path, bad):
    path, name = _edited(v4_plain, tmp_path / "ckpt", "gate.tid2eid", lambda t: t.__setitem__((5, 0), bad))
    with pytest.raises(CheckpointError) as e:
        LLM(path, "reference", dtype="float32", progress=False)
    message = str(e.value)
    assert name in message and str(bad) in message and "[0, 8)" in message


@pytest.fixture(scope="module")
def v4_quantised(v4_plain, tmp_path_factory):
    """``v4_plain`` with its FP8 linears (fp32 scales), FP8 routed experts (fp32 scales) and FP4 routed experts (ue8m0
    scales) quantised: ``{experts: path}``."""
    oracle = v4.DeepseekV4ForCausalLM.from_pretrained(v4_plain, dtype=torch.float32)
    made = {}
    for ue8m0, experts in ((False, "fp8"), (True, "fp4")):
        path = tmp_path_factory.mktemp(f"v4-{experts}") / "ckpt"
        v4.quantised_copy(v4_plain, path, oracle, ue8m0=ue8m0, expert_dtype=experts)
        made[experts] = path
    return made


def _poison(value):
    def edit(scale: torch.Tensor) -> None:
        if scale.dtype == torch.float8_e8m0fnu:
            scale.view(torch.uint8).view(-1)[0] = 255  # ue8m0's NaN
        else:
            scale.view(-1)[0] = value

    return edit


@pytest.mark.parametrize(
    "experts, scale_of, value",
    [
        ("fp8", "layers.1.attn.wq_a.weight_scale_inv", float("nan")),
        ("fp8", "layers.1.attn.wq_a.weight_scale_inv", float("inf")),
        ("fp8", "layers.1.ffn.experts.0.w1.weight_scale_inv", float("nan")),
        ("fp4", "layers.1.attn.wq_a.weight_scale_inv", float("nan")),
        ("fp4", "layers.1.ffn.experts.0.w1.weight_scale_inv", float("nan")),
    ],
)
def test_v4_block_scale_that_is_not_finite_is_refused(v4_quantised, tmp_path, experts, scale_of, value):
    path, name = _edited(v4_quantised[experts], tmp_path / "ckpt", scale_of, _poison(value))
    with pytest.raises(CheckpointError) as e:
        LLM(path, "reference", dtype="float32", progress=False)
    message = str(e.value)
    assert name in message and "expected finite scales" in message


def test_mtp_layer_whose_experts_mix_fp8_and_float_is_refused_at_open(tmp_path):
    shapes = dict(hidden_size=128, intermediate_size=128, moe_intermediate_size=128, q_lora_rank=128, kv_lora_rank=128)
    src = hf_checkpoint(tmp_path / "bf16", 4, num_hidden_layers=2, v_head_dim=32, **shapes)
    path = fp8_copy(src, tmp_path / "fp8", tmp_path / "oracle")[0]
    cfg = ModelConfig.from_dir(path)
    layer = cfg.num_hidden_layers
    tensors = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    for name, e in mtp_layer_keys(dataclasses.replace(cfg, num_nextn_predict_layers=1), layer).items():
        if not e.optional:
            tensors[name] = (0.1 * torch.randn(e.shape, generator=g)).to(torch.bfloat16)
    expert = f"model.layers.{layer}.mlp.experts.0."
    for w in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"):  # expert 0 in FP8, the others bf16
        q = quantize_blocks(tensors[expert + w].float())
        tensors[expert + w], tensors[expert + w + "_scale_inv"] = q.data, q.scale
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text()) | {"num_nextn_predict_layers": 1}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"routed experts of layer {layer} mix FP8 and float"):
        Checkpoint.open(path)
