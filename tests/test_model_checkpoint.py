"""The checkpoint loader: Hugging Face layouts it accepts, and the clear errors (naming the file and the tensor,
raised before any weight is read or any compute runs) for everything it refuses."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from model_helpers import fp8_copy, hf_checkpoint, one_thread, random_prompts, small_checkpoint  # noqa: F401
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from deepinfer import QTensor
from deepinfer.model import LLM, Checkpoint, CheckpointError, ModelConfig, SamplingParams, expected_layout
from deepinfer.model import deepseek_v3 as ds
from deepinfer.model.checkpoint import model_layout_size, mtp_layer_keys
from deepinfer.qtensor import quantize_blocks

FILE = "model.safetensors"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return small_checkpoint(tmp_path_factory.mktemp("base"), seed=3)


def variant(base: Path, dst: Path, edit=None, config=None) -> Path:
    """A copy of ``base`` with its tensors passed through ``edit(dict)`` and its config through ``config(dict)``."""
    shutil.copytree(base, dst)
    if edit is not None:
        tensors = load_file(str(base / FILE))
        edit(tensors)
        save_file(tensors, str(dst / FILE), metadata={"format": "pt"})
    if config is not None:
        cfg = json.loads((base / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def greedy(path: Path, **kw) -> list[list[int]]:
    llm = LLM(path, progress=False, block_size=8, **kw)
    prompts = random_prompts(llm.config.vocab_size, [7, 19], seed=0)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0))]


def refused(path: Path, *fragments: str, monkeypatch=None) -> str:
    """Loading ``path`` raises a CheckpointError containing every fragment, before the model is built."""
    if monkeypatch is not None:
        monkeypatch.setattr(ds.DeepseekV3, "load", lambda *a, **k: pytest.fail("weights were read before the check"))
    with pytest.raises(CheckpointError) as e:
        LLM(path, progress=False)
    msg = str(e.value)
    for f in fragments:
        assert f in msg, msg
    return msg


def test_sharded_checkpoint_with_index_loads_like_one_file(tmp_path):
    one = hf_checkpoint(tmp_path / "one", seed=1)
    from transformers import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM.from_pretrained(one, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    shards = sorted((tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert greedy(tmp_path / "sharded") == greedy(one)


def mtp_tensors(cfg: ModelConfig, *, optional: bool) -> dict[str, torch.Tensor]:
    """Every tensor of the MTP layer ``num_hidden_layers`` of ``cfg`` (declared with one MTP layer), bf16."""
    keys = mtp_layer_keys(dataclasses.replace(cfg, num_nextn_predict_layers=1), cfg.num_hidden_layers)
    return {n: torch.full(e.shape, 0.5, dtype=torch.bfloat16) for n, e in keys.items() if optional or not e.optional}


@pytest.mark.parametrize("optional", [False, True], ids=["required-only", "with-head-and-embed"])
def test_complete_mtp_layer_is_checked_and_kept_out(base, tmp_path, optional):
    cfg = ModelConfig.from_dir(base)
    mtp = mtp_tensors(cfg, optional=optional)
    layer = cfg.num_hidden_layers
    assert f"model.layers.{layer}.mlp.experts.0.up_proj.weight" in mtp  # a whole decoder layer, MoE by its index
    path = variant(base, tmp_path / "mtp", lambda t: t.update(mtp), lambda c: c.update(num_nextn_predict_layers=1))
    ckpt = Checkpoint.open(path)
    assert sorted(ckpt.mtp_keys) == sorted(mtp) and not set(ckpt.layout) & set(mtp)
    assert greedy(path) == greedy(base)
    stray = variant(base, tmp_path / "stray", lambda t: t.update(mtp))  # no num_nextn_predict_layers: unexpected
    refused(stray, "unexpected tensor", f"model.layers.{layer}.")


@pytest.mark.parametrize(
    "edit, fragments",
    [
        (lambda t, p: t.pop(p + "enorm.weight"), ["incomplete multi-token-prediction layer", "enorm.weight"]),
        (lambda t, p: t.pop(p + "mlp.experts.3.down_proj.weight"), ["incomplete", "experts.3.down_proj"]),
        (
            lambda t, p: t.update({p + "eh_proj.weight": t[p + "eh_proj.weight"][:, :-8].clone()}),
            ["eh_proj", "has shape"],
        ),
        (
            lambda t, p: t.update({p + "shared_head.head.weight": t[p + "enorm.weight"].clone()}),
            ["shared_head.head", "shape"],
        ),
        (
            lambda t, p: t.update({p + "extra.weight": t[p + "enorm.weight"].clone()}),
            ["unexpected tensor", "extra.weight"],
        ),
    ],
    ids=["no-enorm", "no-expert", "misshaped-eh-proj", "misshaped-optional-head", "extra"],
)
def test_partial_or_misshaped_mtp_layer_is_refused(base, tmp_path, monkeypatch, edit, fragments):
    cfg = ModelConfig.from_dir(base)
    mtp = mtp_tensors(cfg, optional=False)
    edit(mtp, f"model.layers.{cfg.num_hidden_layers}.")
    path = variant(base, tmp_path / "x", lambda t: t.update(mtp), lambda c: c.update(num_nextn_predict_layers=1))
    refused(path, *fragments, monkeypatch=monkeypatch)


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return hf_checkpoint(tmp_path_factory.mktemp("hf"), seed=6)


def test_transformers_checkpoint_declares_mtp_without_weights_and_loads(hf):
    assert json.loads((hf / "config.json").read_text())["num_nextn_predict_layers"] == 1
    ckpt = Checkpoint.open(hf)
    assert ckpt.config.num_nextn_predict_layers == 1 and ckpt.mtp_keys == [] and ckpt.mtp_layout
    assert greedy(hf)[0]


@pytest.mark.parametrize("fewer", [1, 2])
def test_config_with_fewer_layers_than_the_weights_is_refused(hf, tmp_path, monkeypatch, fewer):
    """The last decoder layers of the weights are not passed off as MTP layers (nor silently dropped): with one
    layer fewer, that layer is an incomplete MTP layer; with two, the last one is unexpected."""
    layers = json.loads((hf / "config.json").read_text())["num_hidden_layers"]
    path = variant(hf, tmp_path / "x", config=lambda c: c.update(num_hidden_layers=layers - fewer))
    if fewer == 1:
        refused(path, f"incomplete multi-token-prediction layer {layers - 1}", "enorm", monkeypatch=monkeypatch)
    else:
        refused(path, "unexpected tensor", f"model.layers.{layers - 1}.", monkeypatch=monkeypatch)


def test_prepare_weight_sees_every_op_weight_once(base, monkeypatch):
    seen: list[str] = []
    monkeypatch.setattr(ds, "prepare_weight", lambda name, w: seen.append(name) or w)
    LLM(base, progress=False)
    assert len(seen) == len(set(seen)), "a weight was prepared twice"
    cfg = ModelConfig.from_dir(base)
    last = cfg.num_hidden_layers - 1
    for name in (
        "lm_head.weight",
        f"model.layers.{last}.mlp.experts.gate_up_proj",
        f"model.layers.{last}.mlp.experts.down_proj",
        f"model.layers.{last}.self_attn.w_uk",
        "model.layers.0.mlp.gate_up_proj.weight",
    ):
        assert name in seen
    assert "model.embed_tokens.weight" not in seen  # looked up by index, never an op argument


def test_weights_stream_with_byte_counts(base):
    ckpt = Checkpoint.open(base)
    streamed = []
    ds.DeepseekV3.load(ckpt, on_progress=streamed.append)
    assert (
        sum(streamed)
        == ckpt.total_bytes(ckpt.layout)
        == (base / FILE).stat().st_size - 8 - int.from_bytes((base / FILE).read_bytes()[:8], "little")
    )


def test_config_forms_agree(base):
    raw = json.loads((base / "config.json").read_text())
    hub = ModelConfig.from_dict(raw)
    v5 = dict(raw)
    v5["rope_parameters"] = dict(raw.pop("rope_scaling"), rope_theta=raw["rope_theta"], rope_type="yarn")
    del v5["rope_scaling"], v5["rope_theta"]
    assert ModelConfig.from_dict(v5).rope_scaling == hub.rope_scaling
    lite = ModelConfig.from_dict(dict(raw, q_lora_rank=None, n_group=None, topk_group=None))
    assert (
        lite.q_lora_rank is None
        and lite.n_group == 1
        and "model.layers.0.self_attn.q_proj.weight" in expected_layout(lite)
    )


def test_missing_tensor(base, tmp_path, monkeypatch):
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    refused(variant(base, tmp_path / "x", lambda t: t.pop(name)), "missing tensor", name, monkeypatch=monkeypatch)


def test_unexpected_tensor(base, tmp_path, monkeypatch):
    name = "model.layers.0.self_attn.rotary_emb.inv_freq"
    path = variant(base, tmp_path / "x", lambda t: t.update({name: torch.ones(4)}))
    refused(path, "unexpected tensor", name, FILE, monkeypatch=monkeypatch)


def test_misshaped_tensor(base, tmp_path, monkeypatch):
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    path = variant(base, tmp_path / "x", lambda t: t.update({name: t[name][:, :-1].contiguous()}))
    refused(path, name, "has shape", "config.json implies", FILE, monkeypatch=monkeypatch)


def test_integer_tensor(base, tmp_path, monkeypatch):
    name = "model.norm.weight"
    path = variant(base, tmp_path / "x", lambda t: t.update({name: t[name].to(torch.int32)}))
    refused(path, name, "dtype I32", monkeypatch=monkeypatch)


def test_truncated_file(base, tmp_path, monkeypatch):
    path = variant(base, tmp_path / "x")
    data = (path / FILE).read_bytes()
    (path / FILE).write_bytes(data[: len(data) - 1000])
    refused(path, "truncated", str(path / FILE), monkeypatch=monkeypatch)


def test_corrupt_header(base, tmp_path, monkeypatch):
    path = variant(base, tmp_path / "x")
    data = bytearray((path / FILE).read_bytes())
    data[8:12] = b"}}}}"
    (path / FILE).write_bytes(bytes(data))
    refused(path, "corrupt safetensors header", str(path / FILE), monkeypatch=monkeypatch)


def bf16_entry(start: int, shape=(1,), dtype="BF16") -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [start, start + 2]}


@pytest.mark.parametrize(
    "header, data_bytes, fragments",
    [
        ({"a": bf16_entry(0, dtype=["BF16"])}, 2, ["'a'", "a dtype that is not a string"]),
        ({"a": bf16_entry(0, shape=(True,))}, 2, ["'a'", "negative or non-integer sizes"]),
        ({"a": bf16_entry(0), "b": bf16_entry(0)}, 2, ["'b' starts at byte 0 of the data, expected 2", "overlaps"]),
        ({"a": bf16_entry(2)}, 4, ["'a' starts at byte 2 of the data, expected 0", "leaves bytes 0 .. 2 unused"]),
    ],
)
def test_malformed_safetensors_header_is_refused_before_any_weight_is_read(
    base, tmp_path, monkeypatch, header, data_bytes, fragments
):
    """A header that safetensors itself would refuse when the file is opened (a dtype that is not a string, a
    bool for a size, tensors whose bytes overlap or leave a gap) is refused when the headers are checked, naming
    the file and the tensor, not when the weights are read."""
    path = variant(base, tmp_path / "x")
    raw = json.dumps(header).encode()
    bad = path / "extra.safetensors"
    bad.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(data_bytes))
    refused(path, str(bad), "corrupt header", *fragments, monkeypatch=monkeypatch)


def test_wrong_architecture(base, tmp_path, monkeypatch):
    path = variant(
        base, tmp_path / "x", config=lambda c: c.update(model_type="llama", architectures=["LlamaForCausalLM"])
    )
    refused(path, "unsupported architecture", "llama", "config.json", monkeypatch=monkeypatch)


@pytest.mark.parametrize(
    "qc, fragment",
    [
        ({"quant_method": "gptq", "bits": 4}, "quant_method='gptq'"),
        ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_block_size"),
        ({"quant_method": "fp8", "weight_block_size": 128}, "weight_block_size=128"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "activation_scheme"),
    ],
)
def test_unsupported_quantization(base, tmp_path, monkeypatch, qc, fragment):
    path = variant(base, tmp_path / "x", config=lambda c: c.update(quantization_config=qc))
    refused(path, "unsupported", fragment, monkeypatch=monkeypatch)


def test_pickle_files_are_refused(base, tmp_path, monkeypatch):
    path = tmp_path / "pickled"
    path.mkdir()
    shutil.copy(base / "config.json", path)
    torch.save({"model.norm.weight": torch.ones(4)}, path / "pytorch_model.bin")
    refused(path, "pickle", "pytorch_model.bin", "refused", monkeypatch=monkeypatch)


def test_index_naming_a_missing_file(base, tmp_path, monkeypatch):
    path = variant(base, tmp_path / "x")
    tensors = load_file(str(base / FILE))
    weight_map = {n: FILE for n in tensors} | {"model.norm.weight": "model-00002-of-00002.safetensors"}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    refused(path, "model-00002-of-00002.safetensors", "missing", monkeypatch=monkeypatch)


@pytest.fixture(scope="module")
def fp8(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fp8")
    shapes = dict(hidden_size=128, intermediate_size=128, moe_intermediate_size=128, q_lora_rank=128, kv_lora_rank=128)
    src = hf_checkpoint(root / "bf16", 4, num_hidden_layers=2, v_head_dim=32, **shapes)
    return fp8_copy(src, root / "fp8", root / "oracle")[0]


def test_fp8_checkpoint_loads_as_block_scaled_weights(fp8):
    ckpt = Checkpoint.open(fp8)
    assert ckpt.config.fp8 is not None and ckpt.is_fp8("model.layers.1.mlp.experts.0.down_proj.weight")
    model = ds.DeepseekV3.load(ckpt)
    w13 = model.layers[1][3].w13
    assert w13.data.dtype == torch.float8_e4m3fn and tuple(w13.scale.shape) == (8, 2, 1)  # [E, 2I/128, H/128]
    assert model.layers[0][3].w13.block == (128, 128)
    # q_a_proj (128 rows: whole blocks) and kv_a_proj_with_mqa stacked into one FP8 product, neither kept apart
    attn = model.layers[0][1].w
    qkv_a = attn["qkv_a_proj.weight"]
    assert isinstance(qkv_a, QTensor) and qkv_a.shape[0] == 128 + 128 + ckpt.config.qk_rope_head_dim
    assert "q_a_proj.weight" not in attn and "kv_a_proj_with_mqa.weight" not in attn


def test_low_rank_projections_are_stacked_only_where_their_format_stays():
    """``q_a_proj`` over ``kv_a_proj_with_mqa`` in one product: float weights always; FP8 weights where the first
    ends on a whole 128-row block (else they stay apart, rather than be dequantised to stack)."""
    fp8 = lambda rows: quantize_blocks(torch.randn(rows, 256))
    kv = fp8(576)
    assert ds._stack_keeps_format([torch.randn(1536, 256), torch.randn(576, 256)])
    assert ds._stack_keeps_format([fp8(1536), kv])
    assert not ds._stack_keeps_format([fp8(48), kv])
    assert not ds._stack_keeps_format([torch.randn(1536, 256), kv])


def test_fp8_scale_missing_or_misshaped(fp8, tmp_path, monkeypatch):
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    refused(variant(fp8, tmp_path / "a", lambda t: t.pop(name)), "has no", name, monkeypatch=monkeypatch)
    bad = variant(fp8, tmp_path / "b", lambda t: t.update({name: torch.ones(2, 2)}))
    refused(bad, name, "expected float or F8_E8M0 [1, 1]", monkeypatch=monkeypatch)
    no_config = variant(fp8, tmp_path / "c", config=lambda c: c.pop("quantization_config"))
    refused(no_config, "is FP8 but config.json has no fp8 quantization_config", monkeypatch=monkeypatch)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_fp8_scale_that_is_not_finite_is_refused(fp8, tmp_path, value):
    """A NaN or infinite block scale would make every value of its block NaN or inf: the load names the tensor."""
    name = "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"

    def spoil(tensors):
        scale = tensors[name].clone()
        scale.view(-1)[-1] = value
        tensors[name] = scale

    refused(variant(fp8, tmp_path / "x", spoil), name, f"a scale of {value}", "expected finite scales")


def test_ue8m0_scales_stored_as_e8m0_load_as_their_values(tmp_path):
    """ue8m0 block scales (powers of two) stored as safetensors' F8_E8M0, as DeepSeek-V4 checkpoints store theirs,
    load as the same values stored in fp32 give: the same greedy tokens and prompt log-probabilities. The E8M0 NaN
    byte is refused like any NaN scale."""
    shapes = dict(hidden_size=128, intermediate_size=128, moe_intermediate_size=128, q_lora_rank=128, kv_lora_rank=128)
    src = hf_checkpoint(tmp_path / "bf16", 4, num_hidden_layers=2, v_head_dim=32, **shapes)
    fp32 = fp8_copy(src, tmp_path / "fp32", tmp_path / "oracle", ue8m0=True)[0]
    scales = lambda t: [n for n in t if n.endswith("_scale_inv")]
    e8m0 = variant(fp32, tmp_path / "e8m0", lambda t: t.update({n: t[n].to(torch.float8_e8m0fnu) for n in scales(t)}))
    with safe_open(e8m0 / FILE, "pt") as f:
        assert {f.get_slice(n).get_dtype() for n in scales(f.keys())} == {"F8_E8M0"}
    prompts = random_prompts(json.loads((src / "config.json").read_text())["vocab_size"], [7, 19], seed=0)
    outs = []
    for path in (fp32, e8m0):
        llm = LLM(path, progress=False, block_size=8)
        got = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=0))
        outs.append([(o.outputs[0].token_ids, o.prompt_logprobs) for o in got])
    assert outs[0] == outs[1]
    name = "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"

    def spoil(tensors):
        scale = tensors[name].clone()
        scale.view(torch.uint8).view(-1)[-1] = 0xFF  # E8M0's NaN
        tensors[name] = scale

    refused(variant(e8m0, tmp_path / "nan", spoil), name, "a scale of nan", "expected finite scales")


def raised_beside_a_fifo(run, fifo: Path, what: str) -> BaseException | None:
    """What ``run`` raises (None if nothing), run in a thread: where it blocks reading ``fifo`` (a regression), a
    writer is connected so that the reader sees end of file and returns, and the test fails as ``what`` blocked
    instead of hanging."""
    outcome: list[BaseException | None] = []

    def target():
        try:
            run()
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout=30)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(timeout=30)
        pytest.fail(f"{what} blocked")
    (error,) = outcome
    return error


def test_a_weights_file_that_is_not_a_regular_file_is_refused_without_opening_it(base, tmp_path):
    """A ``*.safetensors`` symlink to a FIFO would block ``open`` until a writer comes: it is refused first. The load
    runs in a thread, so that a regression fails here (a writer is then connected to unblock it) instead of hanging."""
    path = variant(base, tmp_path / "x")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (path / FILE).unlink()
    (path / FILE).symlink_to(fifo)
    error = raised_beside_a_fifo(lambda: Checkpoint.open(path), fifo, "opening a checkpoint whose weights are a FIFO")
    assert isinstance(error, CheckpointError), error
    assert str(path / FILE) in str(error) and "not a regular file" in str(error), error


def test_a_config_json_that_is_a_fifo_is_refused_without_opening_it(base, tmp_path):
    """``LLM`` first asks whether config.json declares DeepSeek-V4; a FIFO there would block that read until a writer
    comes. It is refused as not a regular file instead (in a thread, so that a regression fails rather than hangs)."""
    path = variant(base, tmp_path / "x")
    (path / "config.json").unlink()
    os.mkfifo(path / "config.json")
    fifo = path / "config.json"
    error = raised_beside_a_fifo(
        lambda: LLM(path, progress=False), fifo, "loading a checkpoint whose config.json is a FIFO"
    )
    assert isinstance(error, CheckpointError), error
    assert str(path / "config.json") in str(error) and "not a regular file" in str(error), error


ABSURD = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_DATA, (3 << 30, 3 << 30))
from deepinfer.model import Checkpoint, CheckpointError
out = []
for path in sys.argv[1:]:
    try:
        Checkpoint.open(path)
        out.append("accepted")
    except CheckpointError as e:
        out.append(str(e))
    except MemoryError:
        out.append("MemoryError")
print(json.dumps(out))
"""


def test_absurd_config_sizes_are_refused_within_bounded_memory(base, tmp_path):
    """Counts in config.json that the files cannot hold (a hundred million layers, ten million experts, as many
    multi-token-prediction layers) are refused from the headers, before a layout of that size is built. They run in
    a process whose heap is capped at 3 GiB, which a layout built first would exceed."""
    cases = {
        "num_hidden_layers": ({"num_hidden_layers": 10**8}, ["num_hidden_layers = 100000000", "missing tensor"]),
        "n_routed_experts": ({"n_routed_experts": 10**7}, ["n_routed_experts", "10000000"]),
        "num_nextn_predict_layers": ({"num_nextn_predict_layers": 10**8}, ["num_nextn_predict_layers", "100000000"]),
        "mlp_layer_types": (
            {"num_hidden_layers": 10**5, "mlp_layer_types": ["sparse"] * 10**5},
            ["num_hidden_layers = 100000", "missing tensor"],
        ),
    }
    paths = [variant(base, tmp_path / name, config=lambda c, e=edit: c.update(e)) for name, (edit, _) in cases.items()]
    run = subprocess.run([sys.executable, "-c", ABSURD, *map(str, paths)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for (name, (_, fragments)), msg in zip(cases.items(), json.loads(run.stdout)):
        assert "config.json" in msg, (name, msg)
        for f in fragments:
            assert f in msg, (name, msg)


def test_max_position_embeddings_beyond_any_model_is_refused_before_the_weights(base, tmp_path, monkeypatch):
    path = variant(base, tmp_path / "x", config=lambda c: c.update(max_position_embeddings=10**12))
    refused(path, "config.json", "max_position_embeddings", "1000000000000", monkeypatch=monkeypatch)


@pytest.mark.parametrize(
    "edit",
    [
        {},
        {"tie_word_embeddings": True, "scoring_func": "softmax", "n_shared_experts": 0},
        {"q_lora_rank": None, "attention_bias": True, "first_k_dense_replace": 0},
        {"first_k_dense_replace": 9, "num_nextn_predict_layers": 2},
        {"n_routed_experts": 0},
        {"mlp_layer_types": ["sparse", "dense", "sparse"]},
        {"model_type": "deepseek_v32", "architectures": [], "index_n_heads": 2, "index_head_dim": 16, "index_topk": 4},
    ],
)
def test_the_counted_layout_size_is_the_layout_s(base, edit):
    """``model_layout_size`` (counted from the config, checked against the files before the layout is built) is the
    number of tensors of the model's layout."""
    cfg = ModelConfig.from_dict(json.loads((base / "config.json").read_text()) | edit)
    assert model_layout_size(cfg) == sum(not e.mtp for e in expected_layout(cfg).values())


def yarn(**fields):
    return lambda c: c["rope_scaling"].update(fields)


@pytest.mark.parametrize(
    "edit, fragments",
    [
        ({"rms_norm_eps": -1e-6}, ["'rms_norm_eps'", "a finite number > 0", "got -1e-06"]),
        ({"rms_norm_eps": math.nan}, ["'rms_norm_eps'", "a finite number > 0", "got nan"]),
        ({"routed_scaling_factor": -2.5}, ["'routed_scaling_factor'", "a finite number > 0", "got -2.5"]),
        ({"routed_scaling_factor": math.nan}, ["'routed_scaling_factor'", "got nan"]),
        ({"routed_scaling_factor": math.inf}, ["'routed_scaling_factor'", "got inf"]),
        ({"routed_scaling_factor": 10**400}, ["'routed_scaling_factor'", "a finite number"]),
        ({"rope_theta": math.nan}, ["rope_theta", "got nan"]),
        (yarn(factor=math.inf), ["yarn", "'factor'", "a finite number > 0", "got inf"]),
        (yarn(beta_fast=math.nan), ["yarn", "'beta_fast'", "got nan"]),
        (yarn(mscale_all_dim="x"), ["yarn", "'mscale_all_dim'", "got 'x'"]),
        (yarn(original_max_position_embeddings=True), ["original_max_position_embeddings", "got True"]),
        (
            lambda c: (c["rope_scaling"].pop("factor"), c.update(max_position_embeddings="4096")),
            ["without 'factor' needs max_position_embeddings", "got '4096'"],
        ),
        ({"architectures": "DeepseekV3ForCausalLM"}, ["'architectures'", "a list", "got 'DeepseekV3ForCausalLM'"]),
        ({"num_experts_per_tok": 0}, ["num_experts_per_tok", "[1,", "got 0"]),
        ({"eos_token_id": "x"}, ["'eos_token_id'", "an int >= 0, a list of them or null", "got 'x'"]),
        ({"eos_token_id": [1, 2.5]}, ["'eos_token_id'", "got [1, 2.5]"]),
        ({"n_shared_experts": -1}, ["'n_shared_experts'", ">= 0", "got -1"]),
        ({"eos_token_id": [1, 258]}, ["'eos_token_id'", "below vocab_size (258)", "got [258]"]),
        ({"bos_token_id": -5}, ["'bos_token_id'", "null or a token id in [0, 258)", "got -5"]),
    ],
)
def test_config_values_the_model_cannot_use_are_refused_at_load(base, tmp_path, monkeypatch, edit, fragments):
    """Values that parse but would fail at the first forward (with an op's error that does not say where they came
    from) or quietly give wrong tokens are refused when config.json is read, naming the file, the field, what it
    takes and what it holds."""
    path = variant(base, tmp_path / "x", config=edit if callable(edit) else lambda c: c.update(edit))
    refused(path, str(path / "config.json"), *fragments, monkeypatch=monkeypatch)


def test_the_router_runs_from_bf16_operands_only_where_its_fp32_weight_holds_bf16_values():
    from deepinfer.model.moe import router_logits, router_weight

    g = torch.Generator().manual_seed(3)
    exact = torch.randn(64, 512, generator=g).bfloat16().float()  # as DeepSeek's checkpoints store the router
    kept = router_weight(exact)
    assert kept.dtype == torch.bfloat16 and torch.equal(kept.float(), exact)
    inexact = exact.clone()
    inexact[5, 9] = inexact[5, 9] * (1 + 2**-12)  # one value between two bf16 values
    assert router_weight(inexact) is inexact
    x = torch.randn(40, 512, generator=g).bfloat16()
    want = (x.double() @ exact.double().T).float()
    for weight in (kept, exact):  # bf16 operands, and the fp32 product
        got = router_logits(x, weight)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(router_logits(x.float(), kept), want, rtol=1e-5, atol=1e-5)  # fp32 activations
    fp32 = torch.randn(64, 512, generator=g)  # a router no bf16 operand holds: its product stays fp32
    torch.testing.assert_close(
        router_logits(x, router_weight(fp32)), (x.double() @ fp32.double().T).float(), rtol=1e-4, atol=1e-4
    )  # fp32 sums of 512 terms; bf16 operands would be off by about 0.1
