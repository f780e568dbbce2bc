"""Checkpoint tensors whose shapes and dtypes are right but whose values the model cannot use: refused when they
are read, with a ``CheckpointError`` naming the file, the tensor, the value and what was expected, before a
request is served.

DeepSeek-V4's hash-routed layers take each token's experts from ``gate.tid2eid [vocab, k]``: an id outside
``[0, n_routed_experts)`` names no expert, and an op indexing with it reads out of bounds (an error on the CPU,
other memory on a GPU where the engine's forward checks no values).

A NaN or infinite block scale of a quantised DeepSeek-V4 weight (fp32, or the ue8m0 byte 255) makes every value of
its block NaN or infinite, and every log-probability NaN; refused as DeepSeek-V3's are (``test_model_checkpoint``).
"""

from __future__ import annotations

import pytest
import test_model_v4 as v4
import torch
from model_helpers import one_thread  # noqa: F401 (autouse fixture)
from safetensors.torch import load_file, save_file

from deepinfer.model import LLM
from deepinfer.model.errors import CheckpointError


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
