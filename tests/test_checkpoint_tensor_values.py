"""Checkpoint tensors whose shapes and dtypes are right but whose values the model cannot use: refused when they
are read, with a ``CheckpointError`` naming the file, the tensor, the value and what was expected, before a
request is served.

DeepSeek-V4's hash-routed layers take each token's experts from ``gate.tid2eid [vocab, k]``: an id outside
``[0, n_routed_experts)`` names no expert, and an op indexing with it reads out of bounds (an error on the CPU,
other memory on a GPU where the engine's forward checks no values).
"""

from __future__ import annotations

import pytest
import test_model_v4 as v4
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
