"""Sharded checkpoints (``model.safetensors.index.json``) whose shards split a quantised weight from its
``weight_scale_inv``: transformers' ``save_pretrained`` cuts shards by size in key order, so a weight and its
scales may land in different files, and the index says which holds each. Such a DeepSeek-V4 checkpoint loads and
runs as transformers computes it (the fp32 bound of ``test_model_v4``, its linears' K too small for the FP8 ops so
they are dequantised at load, its FP4 experts kept packed).

A directory holding an index and also a ``model.safetensors`` the index does not list holds two checkpoints:
transformers loads the single file, the index names the shards. Refused, naming both.
"""

from __future__ import annotations

import json
import shutil

import pytest
import test_model_v4 as v4
import torch
from model_helpers import hf_checkpoint, one_thread  # noqa: F401 (autouse fixture)
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3ForCausalLM

from deepinfer.model import LLM, CheckpointError
from deepinfer.model.config_v4 import V4Checkpoint
from deepinfer.model.deepseek_v4 import DeepseekV4
from deepinfer.selection import use


def _scales_apart(src, dst) -> int:
    """``src``'s single file split into two shards with an index: every ``*_scale_inv`` in the second, the rest in
    the first. Returns the number of scales moved."""
    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    shards = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    first, second = shards
    for name, t in tensors.items():
        shards[second if name.endswith("_scale_inv") else first][name] = t
    for file, part in shards.items():
        save_file(part, str(dst / file), metadata={"format": "pt"})
    weight_map = {name: file for file, part in shards.items() for name in part}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return len(shards[second])


@pytest.mark.parametrize("experts", ["fp4", "fp8"])
def test_v4_scales_in_another_shard_than_their_weights(experts, tmp_path, deepinfer_backend, deepinfer_device):
    path = tmp_path / "bf16"
    oracle = v4.v4_checkpoint(path, 5, **v4.CONFIGS["plain"])
    ref, _ = v4.quantised_copy(path, tmp_path / "q", oracle, ue8m0=experts == "fp4", expert_dtype=experts)
    assert _scales_apart(tmp_path / "q", tmp_path / "sharded") > 0
    with use(deepinfer_backend):
        import deepinfer

        device = deepinfer_device or deepinfer.current_backend().device_type
        model = DeepseekV4.load(V4Checkpoint.open(tmp_path / "sharded"), dtype=torch.float32, device=device)
        assert v4.prompt_errors(model, ref, v4.prompts(10)) < v4.TOL


def test_single_file_beside_a_sharded_index_that_does_not_list_it_is_refused(tmp_path):
    """transformers loads ``model.safetensors`` where a directory holds it, whatever index lies beside it; a
    directory with both, the index not listing it, holds two checkpoints, and which one is served is not for the
    loader to guess."""
    one = hf_checkpoint(tmp_path / "one", 1)
    other = hf_checkpoint(tmp_path / "other", 2)
    DeepseekV3ForCausalLM.from_pretrained(one, dtype=torch.bfloat16).save_pretrained(
        tmp_path / "both", max_shard_size="40KB"
    )
    assert (tmp_path / "both" / "model.safetensors.index.json").is_file()
    shutil.copy(other / "model.safetensors", tmp_path / "both" / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"holds both model\.safetensors and model\.safetensors\.index\.json"):
        LLM(tmp_path / "both", "reference", progress=False)
