"""DeepSeek-V4 against transformers' ``DeepseekV4ForCausalLM`` (fp32 oracle, eager attention).

Tiny random checkpoints are written by transformers itself (DeepSeek's tensor names, as transformers saves them),
with every layer type (sliding window, compressed sparse, heavily compressed), hash-routed and top-k routed MoE
layers, ``hc_mult`` 2 or 3, a sliding window of 8 or 5 tokens, compression rates 4 / 8 (and 3 / 6), an
``index_topk`` of 3 or 2, and prompts up to 45 tokens: longer than the window, spanning several windows of each
compressor, and with more compressed entries than the indexer keeps, so window, entries and the indexer's choice all
decide what a query attends to. Weights are redrawn so that every part matters (sinks, the compressors' position
biases and the mHC biases and scales of order one; the hash table random; ``swiglu_limit`` 1 so the clipping
bites).

Sixteen indexer heads: with few heads every ``relu`` of a key is often zero, so keys tie at score 0, and
transformers' ``topk`` breaks ties in no documented order (ours: the lower entry).

Bounds (fp32 on both sides; measured at most 1e-5): log-probabilities of every prompt token within 1e-3 nats, with
all prompts of a batch in one forward; the same through chunked prefill and one-token decode steps for several
sequences at once; greedy tokens for 12 steps equal to the oracle's (a step where the oracle's two best differ by
less than the bound may go either way). Planted bugs (window ignored, sinks ignored, top-k ignored, compressed
entries ignored) fail the same comparison.

Quantised copies (FP8 linears with 128 x 128 block scales, FP4 or FP8 routed experts) against the oracle holding the
values transformers' ``Fp8Dequantize`` decodes. Where every FP8 linear's K is a whole number of 128-blocks the model
holds them in FP8 and its GEMMs quantise their activations, so the oracle quantises the same activations (DeepSeek's
recipe, emulated) and the bounds are those of ``test_model_vs_transformers``' FP8 check: median error below 5e-3
nats (measured 1.9e-6 with ue8m0 scales and FP4 experts, 2.9e-6 with fp32 scales and FP8 experts), at most 10% of
greedy steps differing (measured 0 of 32). The maximum is no bound: a 1-ulp difference of an fp32 sum can move an
activation across an e4m3 rounding boundary, and the tiny MoE amplifies it (measured 1.3 nats on one prompt from
its 16th token on, where the oracle itself moves as much when its quantised activations are scaled by 1 - 1e-7).
Planted bugs (the scale grids reversed, the activations not quantised) fail by a median of 4.8 and 0.3 nats. With
bf16 activations, through ``LLM``, against the oracle without activation quantisation: the median error below 12% of
the log-probabilities' spread, as there (measured 4.2%). Where K is 32, 48 or 64 the linears are dequantised at
load and the fp32 bound holds (measured 9e-6).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import math
from pathlib import Path

import pytest
import torch
from model_helpers import act_quant, one_thread  # noqa: F401 (autouse fixture)
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from deepinfer import FP4Tensor, QTensor, ops
from deepinfer.model import deepseek_v4
from deepinfer.model.config_v4 import V4Checkpoint, V4Config
from deepinfer.model.deepseek_v4 import DeepseekV4
from deepinfer.model.errors import CheckpointError
from deepinfer.selection import use

TOL = 1e-3
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
BASE = dict(
    vocab_size=160,
    hidden_size=64,
    moe_intermediate_size=32,
    num_attention_heads=4,
    head_dim=32,
    q_lora_rank=48,
    num_experts_per_tok=2,
    n_routed_experts=8,
    partial_rotary_factor=8 / 32,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=16,
    index_head_dim=16,
    max_position_embeddings=512,
    swiglu_limit=1.0,
    bos_token_id=0,
    eos_token_id=1,
)
CONFIGS = {
    "yarn": dict(
        num_hidden_layers=5,
        layer_types=[SLIDING, CSA, HCA, CSA, HCA],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"],
        compress_rates={CSA: 4, HCA: 8},
        sliding_window=8,
        index_topk=3,
        hc_mult=2,
        rope_parameters={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64},
    ),
    "plain": dict(
        num_hidden_layers=4,
        layer_types=[HCA, CSA, SLIDING, CSA],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        compress_rates={CSA: 3, HCA: 6},
        sliding_window=5,
        index_topk=2,
        hc_mult=3,
        hc_sinkhorn_iters=5,
    ),
}
LENGTHS = [1, 7, 19, 33, 45]


def v4_checkpoint(path, seed: int, **cfg):
    """A tiny random ``DeepseekV4ForCausalLM`` saved by transformers (fp32); returns the oracle too."""
    config = DeepseekV4Config(**(BASE | cfg))
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "inv_freq" in name:
                continue
            if "tid2eid" in name:
                p.copy_(torch.randint(0, config.n_routed_experts, p.shape, generator=g))
                continue
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.2 * noise)
            elif "e_score_correction_bias" in name:
                p.copy_(0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            elif "lm_head" in name:
                p.copy_(0.5 * noise)
            elif name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                p.copy_(noise)
            elif name.endswith(("scale", "hc_scale")):
                p.copy_(1 + 0.3 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))
    model.save_pretrained(path)
    return model.eval()


def checkpoint_maker(tmp_path_factory, prefix: str, first_seed: int):
    """``get(name)``: the checkpoint of ``CONFIGS[name]`` (written once, seeds from ``first_seed`` on) and its
    oracle."""
    made = {}

    def get(name: str):
        if name not in made:
            path = tmp_path_factory.mktemp(f"{prefix}-{name}")
            made[name] = (path, v4_checkpoint(path, seed=len(made) + first_seed, **CONFIGS[name]))
        return made[name]

    return get


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return checkpoint_maker(tmp_path_factory, "v4", 3)


def prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 160, (n,), generator=g).tolist() for n in LENGTHS]


def oracle_logprobs(oracle, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(oracle(torch.tensor([ids])).logits[0].float(), -1)


@pytest.fixture
def load(deepinfer_backend, deepinfer_device):
    def make(path) -> DeepseekV4:
        with use(deepinfer_backend):
            import deepinfer

            device = deepinfer_device or deepinfer.current_backend().device_type
            return DeepseekV4.load(V4Checkpoint.open(path), dtype=torch.float32, device=device)

    with use(deepinfer_backend):
        yield make


def run(model: DeepseekV4, states, chunks: list[list[int]]) -> torch.Tensor:
    """One forward of ``chunks[b]`` new tokens for sequence ``b``; log-probabilities ``[T, vocab]``."""
    ids = torch.tensor([t for c in chunks for t in c], device=model.device)
    batch = model.batch(states, ids, [len(c) for c in chunks])
    return torch.log_softmax(model.compute_logits(model.forward(ids, batch)), -1).cpu()


def prompt_errors(model, oracle, ps, chunk: int | None = None) -> float:
    """Worst |ours - oracle| prompt log-probability (``prompt_error_values``; inf where one is not finite)."""
    worst = prompt_error_values(model, oracle, ps, chunk).max().item()
    return worst if math.isfinite(worst) else math.inf  # (a NaN fails every bound)


def prompt_error_values(model, oracle, ps, chunk: int | None = None, quantised=contextlib.nullcontext) -> torch.Tensor:
    """|ours - oracle| of every prompt token's log-probability and of each prompt's whole next-token distribution;
    all prompts in one batch, whole or in chunks of ``chunk`` tokens (the last chunks of a prompt as single-token
    steps when ``chunk`` is 1). The oracle runs inside ``quantised()``."""
    states = [model.new_state() for _ in ps]
    got: list[list[torch.Tensor]] = [[] for _ in ps]
    step = chunk or max(map(len, ps))
    for start in range(0, max(map(len, ps)), step):
        live = [b for b, p in enumerate(ps) if start < len(p)]
        chunks = [ps[b][start : start + step] for b in live]
        lp, o = run(model, [states[b] for b in live], chunks), 0
        for b, c in zip(live, chunks):
            got[b].append(lp[o : o + len(c)])
            o += len(c)
    errs = []
    for p, rows in zip(ps, got):
        with quantised():
            ref = oracle_logprobs(oracle, p)
        ours, idx = torch.cat(rows), torch.tensor(p[1:], dtype=torch.long)[:, None]
        errs.append((ours[:-1].gather(1, idx) - ref[:-1].gather(1, idx)).abs().flatten())
        errs.append((ours[-1] - ref[-1]).abs())  # the whole next-token distribution
    return torch.cat(errs).nan_to_num(math.inf, math.inf)


@pytest.mark.parametrize("name", ["yarn", "plain"])
def test_prompt_logprobs_match_transformers(name, checkpoints, load):
    path, oracle = checkpoints(name)
    model = load(path)
    assert prompt_errors(model, oracle, prompts(1)) < TOL


@pytest.mark.parametrize("chunk", [1, 4, 11])
def test_chunked_prefill_and_decode_match_transformers(chunk, checkpoints, load):
    path, oracle = checkpoints("yarn")
    assert prompt_errors(load(path), oracle, prompts(2), chunk) < TOL


def test_greedy_tokens_match_transformers_decode(checkpoints, load):
    """Several sequences decode together, each step one token each; the oracle decodes with its own cache."""
    path, oracle = checkpoints("plain")
    model, ps, steps = load(path), prompts(3)[1:], 12
    states = [model.new_state() for _ in ps]
    lp = run(model, states, ps)
    ends = torch.tensor([len(p) for p in ps]).cumsum(0) - 1
    ours = [[int(lp[e].argmax())] for e in ends]
    ours_lp = [[lp[e]] for e in ends]
    for _ in range(steps - 1):
        lp = run(model, states, [[o[-1]] for o in ours])
        for b in range(len(ps)):
            ours[b].append(int(lp[b].argmax()))
            ours_lp[b].append(lp[b])
    for p, gen, rows in zip(ps, ours, ours_lp):
        ref = oracle_logprobs(oracle, p + gen)[len(p) - 1 :][:steps]
        assert (torch.stack(rows) - ref).abs().max().item() < TOL
        for j, t in enumerate(gen):
            row = ref[j]
            assert int(row.argmax()) == t or float(row.max() - row[t]) < TOL


def test_transformers_own_decode_agrees_with_its_prompt_forward(checkpoints):
    """The oracle's incremental path (its V4 caches) gives its full-prompt log-probabilities: decode is checked
    against the full forward above, and this ties the two oracles together."""
    from transformers import DynamicCache

    _, oracle = checkpoints("yarn")
    ids = torch.tensor([prompts(4)[-1]])
    with torch.no_grad():
        full = oracle(ids).logits[0]
        cache = DynamicCache(config=oracle.config)
        steps = [oracle(ids[:, :20], cache=cache, use_cache=True).logits[0]]
        steps += [oracle(ids[:, i : i + 1], cache=cache, use_cache=True).logits[0] for i in range(20, ids.shape[1])]
    assert (torch.cat(steps) - full).abs().max().item() < 1e-4


def _sinks_ignored(real):
    def planted(q, kv, indices, sinks, *, softmax_scale):
        return real(q, kv, indices, torch.full_like(sinks, float("-inf")), softmax_scale=softmax_scale)

    return planted


def _topk_ignored(real):
    def planted(q, weights, keys, key_start, key_count, *, topk, max_count=None):
        return real(q, weights, keys, key_start, key_count, topk=4096, max_count=max_count)

    return planted


WINDOW = CONFIGS["yarn"]["sliding_window"]


def _entries_ignored(real):
    def planted(q, kv, indices, sinks, *, softmax_scale):  # the window's columns come first
        return real(q, kv, indices[:, :WINDOW].contiguous(), sinks, softmax_scale=softmax_scale)

    return planted


@pytest.mark.parametrize("bug", ["window ignored", "sinks ignored", "top-k ignored", "entries ignored"])
def test_planted_bugs_fail_the_comparison(bug, checkpoints, load, monkeypatch):
    path, oracle = checkpoints("yarn")
    model = load(path)
    assert prompt_errors(model, oracle, prompts(5)) < TOL  # the comparison passes without the bug
    if bug == "window ignored":
        for _, attn, _, _, _ in model.layers:
            attn.cfg = dataclasses.replace(attn.cfg, sliding_window=4096)
    elif bug == "sinks ignored":
        monkeypatch.setattr(ops, "sparse_attention_sinks", _sinks_ignored(ops.sparse_attention_sinks))
    elif bug == "top-k ignored":
        monkeypatch.setattr(ops, "indexer_topk_entries", _topk_ignored(ops.indexer_topk_entries))
    else:
        monkeypatch.setattr(ops, "sparse_attention_sinks", _entries_ignored(ops.sparse_attention_sinks))
    assert prompt_errors(model, oracle, prompts(5)) > 10 * TOL


def test_the_model_computes_through_deepinfer_ops_only():
    """The model file calls no torch function that a backend would accelerate (matmul, softmax, einsum)."""
    src = Path(deepseek_v4.__file__).read_text()
    for banned in ("torch.matmul(", ".softmax(", "torch.einsum(", " @ ", "F.linear(", "torch.bmm("):
        assert banned not in src, banned


# --- config and checkpoint ------------------------------------------------------------------------------------------


def test_config_reads_transformers_and_legacy_fields():
    raw = json.loads(json.dumps({"model_type": "deepseek_v4", **BASE, **CONFIGS["plain"]}))
    cfg = V4Config.from_dict(raw)
    assert cfg.layer_types == tuple(CONFIGS["plain"]["layer_types"]) and cfg.qk_rope_head_dim == 8
    assert cfg.compress_rate(0) == 6 and cfg.compress_rate(1) == 3 and cfg.compress_rate(2) == 0
    legacy = {k: v for k, v in raw.items() if k not in ("layer_types", "mlp_layer_types", "partial_rotary_factor")}
    legacy |= {"compress_ratios": [128, 4, 0, 4], "num_hash_layers": 1, "qk_rope_head_dim": 8}
    cfg = V4Config.from_dict(legacy)
    assert cfg.layer_types == (HCA, CSA, SLIDING, CSA) and cfg.mlp_layer_types == ("hash_moe", "moe", "moe", "moe")
    assert cfg.compress_rate(0) == 6  # compress_rates still applies


@pytest.mark.parametrize(
    "change, message",
    [
        ({"layer_types": [SLIDING, "full_attention", SLIDING, SLIDING]}, "layer_types"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"quantization_config": {"quant_method": "awq"}}, "quant_method"),
        (
            {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "expert_dtype": "fp2"}},
            "fp2",
        ),
        ({"compress_rates": {CSA: 0, HCA: 6}}, "compress_rates"),
        ({"swiglu_limit": float("nan")}, "swiglu_limit"),
        ({"n_shared_experts": 2}, "n_shared_experts"),
        ({"rope_parameters": {"rope_type": "longrope"}}, "compress rope type"),
        ({"architectures": 5}, "'architectures' must be a list of class names, got 5"),
        ({"eos_token_id": 10**6}, "'eos_token_id' must hold token ids below vocab_size"),
        ({"bos_token_id": -1}, "'bos_token_id' must be null or a token id in"),
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": 128}}, "weight_block_size=128"),
        (
            {"rope_parameters": {"rope_type": "yarn", "original_max_position_embeddings": True, "factor": 2}},
            "original_max_position_embeddings .an int > 0., got True",
        ),
        (
            {
                "rope_parameters": {"rope_type": "yarn", "original_max_position_embeddings": 16},
                "max_position_embeddings": "x",
            },
            "without 'factor' needs max_position_embeddings .an int > 0., got 'x'",
        ),
        (
            {
                "rope_parameters": {
                    "main": {"rope_type": "default", "partial_rotary_factor": 0.25},
                    "compress": {"rope_type": "default", "partial_rotary_factor": 0.5},
                }
            },
            "rotate 8 channels on sliding-window layers and 16 on compressed ones",
        ),
    ],
)
def test_bad_configs_are_refused(change, message):
    raw = {"model_type": "deepseek_v4", **BASE, **CONFIGS["plain"], **change}
    with pytest.raises(CheckpointError, match=message):
        V4Config.from_dict(raw)


def test_a_config_that_is_not_a_json_object_is_refused():
    with pytest.raises(CheckpointError, match="expected a JSON object, got list"):
        V4Config.from_dict([{"model_type": "deepseek_v4"}])


def test_mtp_layer_of_a_config_without_num_nextn_predict_layers_loads_as_transformers_reads_it(tmp_path, load):
    """A config.json that leaves ``num_nextn_predict_layers`` out declares transformers' default of one
    multi-token-prediction layer, so the checkpoint's ``mtp.0.*`` tensors belong to it (transformers skips them);
    the model computes the oracle's prompt log-probabilities."""
    from test_speculative_v4 import add_mtp

    path = tmp_path / "ckpt"
    v4_checkpoint(path, seed=17, **CONFIGS["plain"])
    add_mtp(path, seed=18)
    raw = json.loads((path / "config.json").read_text())
    del raw["num_nextn_predict_layers"]
    (path / "config.json").write_text(json.dumps(raw))
    oracle = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    assert oracle.config.num_nextn_predict_layers == 1
    ckpt = V4Checkpoint.open(path)
    assert ckpt.config.num_nextn_predict_layers == 1 and ckpt.mtp_keys
    assert prompt_errors(load(path), oracle, prompts(17)) < TOL


@pytest.mark.parametrize("damage", ["missing", "misshaped", "unexpected", "float table"])
def test_damaged_checkpoints_are_refused_before_loading(damage, checkpoints, tmp_path):
    path, _ = checkpoints("plain")
    tensors = load_file(path / "model.safetensors")
    key = "model.layers.1.attn.indexer.compressor.ape"
    if damage == "missing":
        del tensors[key]
    elif damage == "misshaped":
        tensors[key] = tensors[key][:, :-1].contiguous()
    elif damage == "unexpected":
        key = "model.layers.2.attn.compressor.ape"  # a sliding-window layer has no compressor
        tensors[key] = tensors["model.layers.1.attn.compressor.ape"].clone()
    else:
        key = "model.layers.0.ffn.gate.tid2eid"
        tensors[key] = tensors[key].float()
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(CheckpointError, match=key.removeprefix("model.").replace(".", r"\.")):
        V4Checkpoint.open(tmp_path)


# --- serving ---------------------------------------------------------------------------------------------------------


def serve(path, backend, device, **kw):
    from deepinfer.model import LLM

    args = dict(dtype="float32", block_size=4, prefill_chunk_size=8, max_num_batched_tokens=32, progress=False)
    return LLM(path, backend, device=device, **(args | kw))


def test_llm_serves_v4_as_transformers_computes_it(checkpoints, deepinfer_backend, deepinfer_device):
    """``LLM`` on a V4 checkpoint: chunked prefill, continuous batching, greedy decode; prompt and generated
    log-probabilities against the oracle over the whole completion."""
    from deepinfer.model import SamplingParams

    path, oracle = checkpoints("yarn")
    llm = serve(path, deepinfer_backend, deepinfer_device)
    ps = prompts(7)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    for p, out in zip(ps, llm.generate(ps, params)):
        gen = out.outputs[0].token_ids
        full, ref = p + gen, oracle_logprobs(oracle, p + gen)
        errs = [abs(ref[j - 1, full[j]].item() - out.prompt_logprobs[j]) for j in range(1, len(p))]
        errs += [abs(ref[len(p) - 1 + j, t].item() - lp) for j, (t, lp) in enumerate(zip(gen, out.outputs[0].logprobs))]
        assert len(gen) == 10 and max(errs) < TOL
        for j, t in enumerate(gen):
            row = ref[len(p) - 1 + j]
            assert int(row.argmax()) == t or float(row.max() - row[t]) < TOL


def state_pages(path, dtype: str = "float32", block_size: int = 4, kv_format: str = "bf16") -> int:
    """The state pages each sequence of the checkpoint at ``path`` holds (its windows, ``V4CacheLayout``)."""
    elem_bytes = getattr(torch, dtype).itemsize
    return V4Checkpoint.open(path).config.cache_layout(block_size, elem_bytes, kv_format).state_pages


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_resumes_v4_requests(mode, checkpoints, deepinfer_backend, deepinfer_device):
    """A cache of two sequences' state pages and 12 token pages of 4 tokens preempts requests; they resume (their
    pages swapped out and back, or rebuilt from the prompt on recomputation) with the tokens of a run that never
    preempts."""
    from deepinfer.model import SamplingParams

    path, _ = checkpoints("yarn")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    ps = prompts(8)
    roomy = serve(path, deepinfer_backend, deepinfer_device)
    tight = serve(
        path, deepinfer_backend, deepinfer_device, num_blocks=2 * state_pages(path) + 12, preemption_mode=mode
    )
    want, got = roomy.generate(ps, params), tight.generate(ps, params)
    assert tight.engine.num_preemptions > 0
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert max(abs(a - b) for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs)) < TOL


def test_v4_refusals_at_serving(checkpoints, deepinfer_backend):
    from deepinfer.errors import InputError

    path, _ = checkpoints("yarn")
    with pytest.raises(InputError, match="kv_format"):
        serve(path, deepinfer_backend, None, kv_format="fp8_e5m2")
    with pytest.raises(InputError, match="max_model_len"):
        serve(path, deepinfer_backend, None, max_model_len=10**6)
    with pytest.raises(InputError, match="speculative_config"):
        serve(path, deepinfer_backend, None, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    raw = json.loads((Path(path) / "config.json").read_text())
    layout = V4Config.from_dict(raw).cache_layout(4, 4)  # serve's pages: 4 tokens, fp32
    fits = (layout.state_pages + 1) * layout.page_bytes
    with pytest.raises(InputError, match=r"kv_cache_gb.*state pages and one cache page"):
        serve(path, deepinfer_backend, None, kv_cache_gb=(fits - 1) / (1 << 30))
    serve(path, deepinfer_backend, None, kv_cache_gb=fits / (1 << 30))  # one sequence's pages: accepted


def test_cli_generates_from_a_v4_checkpoint(checkpoints, tmp_path, capsys):
    from deepinfer import cli

    path, _ = checkpoints("plain")
    batch = tmp_path / "prompts.txt"
    batch.write_text("[5, 17, 33, 2, 9, 11, 40]\n[7, 7, 7]\n")
    argv = ["generate", "--model", str(path), "--batch", str(batch), "--max-tokens", "6", "--backend", "reference"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "2 request(s), 10 prompt + 12 generated tokens" in out, out


def test_bf16_logprobs_as_close_as_transformers_bf16(checkpoints, deepinfer_backend, deepinfer_device):
    """bf16 weights and activations (caches in bf16) against the fp32 oracle, measured against transformers' own
    bf16 run on the same prompts: the median prompt log-probability error within twice transformers' (+0.01)."""
    from deepinfer.model import SamplingParams

    path, oracle = checkpoints("yarn")
    ps = prompts(9)
    llm = serve(path, deepinfer_backend, deepinfer_device, dtype="bfloat16")
    outs = llm.generate(ps, SamplingParams(max_tokens=1, prompt_logprobs=0))
    hf_bf16 = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ours, theirs = [], []
    for p, o in zip(ps, outs):
        ref = oracle_logprobs(oracle, p)
        bf16 = oracle_logprobs(hf_bf16, p)
        ours += [abs(o.prompt_logprobs[j] - ref[j - 1, p[j]].item()) for j in range(1, len(p))]
        theirs += [abs(bf16[j - 1, p[j]].item() - ref[j - 1, p[j]].item()) for j in range(1, len(p))]
    ours_median, theirs_median = torch.tensor(ours).median().item(), torch.tensor(theirs).median().item()
    assert ours_median <= 2 * theirs_median + 0.01, (ours_median, theirs_median)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_batch_invariance_alone_in_batches_and_under_preemption(
    dtype, checkpoints, monkeypatch, deepinfer_backend, deepinfer_device
):
    """With ``DEEPINFER_BATCH_INVARIANT=1``, 16 mixed requests (greedy and seeded sampling, prompts of 1 to 45
    tokens in chunks) give bitwise the tokens and log-probabilities they get alone, in batches of any size and on a
    cache so small that requests are preempted (swap and recomputation)."""
    import random

    import deepinfer
    from deepinfer import registry
    from deepinfer.model import SamplingParams

    if "batch_invariant" not in registry.get().lookup(deepinfer_backend).capabilities:
        pytest.skip(f"{deepinfer_backend} does not declare batch_invariant")
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    assert deepinfer.batch_invariant_enabled()
    rng = random.Random(11)
    path, _ = checkpoints("yarn")
    g = torch.Generator().manual_seed(12)
    ps = [torch.randint(2, 160, (rng.randint(1, 45),), generator=g).tolist() for _ in range(16)]
    params = [
        SamplingParams(
            max_tokens=rng.randint(3, 10),
            temperature=0.0 if i % 3 == 0 else rng.choice([0.5, 1.0]),
            top_k=rng.choice([0, 5]),
            seed=rng.randint(0, 1 << 40),
            ignore_eos=True,
            logprobs=1,
        )
        for i in range(16)
    ]

    def result(out):
        return out.outputs[0].token_ids, out.outputs[0].logprobs, out.outputs[0].top_logprobs

    llm = serve(path, deepinfer_backend, deepinfer_device, dtype=dtype, max_num_seqs=16)
    everything = [result(o) for o in llm.generate(ps, params)]
    assert len({tuple(r[0]) for r in everything}) > 8, "the requests are meant to differ"
    for size in (1, 1, 3, 7):
        chosen = rng.sample(range(16), size)
        for i, out in zip(chosen, llm.generate([ps[i] for i in chosen], [params[i] for i in chosen])):
            assert result(out) == everything[i], f"request {i} differs in a batch of {size}"
    for mode in ("swap", "recompute"):
        pages = 2 * state_pages(path, dtype) + 16
        tight = serve(path, deepinfer_backend, deepinfer_device, dtype=dtype, num_blocks=pages, preemption_mode=mode)
        assert [result(o) for o in tight.generate(ps, params)] == everything, mode
        assert tight.engine.num_preemptions > 0


# --- quantised checkpoints -------------------------------------------------------------------------------------------


def _e8m0(x: torch.Tensor) -> torch.Tensor:
    """The next power of two at or above ``x``, stored as ue8m0."""
    return torch.exp2(torch.ceil(torch.log2(x.clamp_min(2.0**-100)))).to(torch.float8_e8m0fnu)


def _fp8_blocks(w: torch.Tensor, ue8m0: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 data and the scales of its 128 x 128 block grid: ``amax / 448``, as fp32 or rounded up to a power of two
    stored as ue8m0."""
    n, k = w.shape
    rows, cols = math.ceil(n / 128), math.ceil(k / 128)
    scale = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            scale[i, j] = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].abs().max() / 448
    if ue8m0:
        scale = _e8m0(scale)
    full = scale.float().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return (w / full).to(torch.float8_e4m3fn), scale


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _fp4_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two e2m1 values a byte (low nibble first), one ue8m0 scale per 32 values of a row."""
    n, k = w.shape
    scale = _e8m0(w.view(n, k // 32, 32).abs().amax(-1) / 6)
    x = w / scale.float().repeat_interleave(32, 1)
    code = (x.abs()[..., None] - E2M1).abs().argmin(-1) | ((x < 0).long() << 3)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale


# The linears transformers' FP8 integration converts (the indexer's wq_b included), besides the experts.
FP8_LINEARS = (".wq_a.weight", ".wq_b.weight", ".attn.wkv.weight", ".wo_a.weight", ".wo_b.weight")


def _spread(w: torch.Tensor) -> torch.Tensor:
    """``w`` with its 128 x 128 block ``(i, j)`` times ``2^((i + 2 j) % 3 - 1)``: neighbouring blocks get other
    scales, so that a scale applied to the wrong block shows."""
    n, k = w.shape
    i, j = torch.arange(n)[:, None] // 128, torch.arange(k)[None, :] // 128
    return w * torch.exp2(((i + 2 * j) % 3 - 1).float())


def quantised_copy(path, dst, oracle, *, ue8m0: bool = True, expert_dtype: str = "fp4", spread: bool = False):
    """Writes ``dst``: the checkpoint at ``path`` with the linears DeepSeek-V4 stores in FP8 (``FP8_LINEARS``, the
    shared expert) as e4m3 with 128 x 128 block scales (ue8m0, or fp32 amax / 448), and its routed experts FP4 or
    FP8 (``expert_dtype``); ``spread``: the quantised weights ``_spread`` first. Returns a copy of transformers'
    ``oracle`` (eager experts) holding the values transformers' ``Fp8Dequantize`` decodes from the file, and the
    parameters of that copy that hold them."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    tensors = load_file(path / "model.safetensors")
    out = {}
    for name, w in tensors.items():
        expert = ".ffn.experts." in name
        if expert or name.endswith(FP8_LINEARS) or ".shared_experts." in name:
            w = _spread(w.float()) if spread else w.float()
            q = _fp4_rows(w) if expert and expert_dtype == "fp4" else _fp8_blocks(w, ue8m0)
            out[name], out[name + "_scale_inv"] = q
        else:
            out[name] = w
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, dst / "model.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = dict(
        quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[128, 128]
    )
    cfg["quantization_config"] |= {"expert_dtype": expert_dtype} | ({"scale_fmt": "ue8m0"} if ue8m0 else {})
    (dst / "config.json").write_text(json.dumps(cfg))

    decode = Fp8Dequantize(None)._dequantize_one
    values = {n: decode(out[n], out[n + "_scale_inv"], torch.float32) for n in out if n + "_scale_inv" in out}
    ref = copy.deepcopy(oracle)
    ref.set_experts_implementation("eager")  # one F.linear per expert (fp8_activations_v4 finds its weights)
    held = []
    with torch.no_grad():
        for layer in range(len(ref.model.layers)):
            src, dst_layer = f"model.layers.{layer}.", ref.model.layers[layer]
            attn, sh = dst_layer.self_attn, dst_layer.mlp.shared_experts
            pairs = [(attn.q_a_proj, "attn.wq_a"), (attn.q_b_proj, "attn.wq_b"), (attn.kv_proj, "attn.wkv")]
            pairs += [(attn.o_a_proj, "attn.wo_a"), (attn.o_b_proj, "attn.wo_b")]
            pairs += [(sh.gate_proj, "ffn.shared_experts.w1"), (sh.up_proj, "ffn.shared_experts.w3")]
            pairs += [(sh.down_proj, "ffn.shared_experts.w2")]
            if src + "attn.indexer.wq_b.weight" in values:
                pairs.append((attn.compressor.indexer.q_b_proj, "attn.indexer.wq_b"))
            for mod, key in pairs:
                mod.weight.copy_(values[src + key + ".weight"])
                held.append(mod.weight)
            experts = dst_layer.mlp.experts
            for e in range(experts.num_experts):
                p = f"{src}ffn.experts.{e}."
                experts.gate_up_proj[e].copy_(torch.cat([values[p + "w1.weight"], values[p + "w3.weight"]]))
                experts.down_proj[e].copy_(values[p + "w2.weight"])
            held += [experts.gate_up_proj, experts.down_proj]
    return ref, held


@contextlib.contextmanager
def fp8_activations_v4(oracle, weights: list[torch.Tensor], ue8m0: bool):
    """Inside the block, the oracle quantises the input of every product with one of ``weights`` as DeepSeek's FP8
    GEMMs do (``model_helpers.act_quant``: per token per 128 channels to e4m3, the scale a power of two with
    ``ue8m0``; written from the recipe, independently of deepinfer's ops): ``F.linear`` calls on them (the routed
    experts' per expert, with eager experts) and the grouped ``o_a_proj`` (a ``torch.bmm``: its input, per group)."""
    import torch.nn.functional as F

    quantised = {w.untyped_storage().data_ptr() for w in weights}
    grouped = [
        layer.self_attn.o_a_proj
        for layer in oracle.model.layers
        if layer.self_attn.o_a_proj.weight.untyped_storage().data_ptr() in quantised
    ]
    original = F.linear

    def linear(x, w, b=None):
        if w.untyped_storage().data_ptr() in quantised:
            x = act_quant(x, ue8m0)
        return original(x, w, b)

    handles = [m.register_forward_pre_hook(lambda mod, args: (act_quant(args[0], ue8m0),)) for m in grouped]
    F.linear = linear
    try:
        yield
    finally:
        F.linear = original
        for h in handles:
            h.remove()


def test_fp8_linears_the_fp8_ops_cannot_take_load_as_transformers_dequantises_them(checkpoints, tmp_path, load):
    """A copy of a checkpoint with FP8 linears (128 x 128 ue8m0 block scales) and FP4 routed experts (one ue8m0
    scale per 32 values), all of whose linears have a K of 32, 48 or 64 (not whole 128-blocks, which the FP8 GEMMs
    need): the linears are dequantised at load, so the model is held to the fp32 bound against the oracle holding
    the values transformers' ``Fp8Dequantize`` decodes."""
    path, oracle = checkpoints("plain")
    ref, _ = quantised_copy(path, tmp_path / "q", oracle)
    assert not torch.equal(ref.model.layers[1].mlp.experts.down_proj, oracle.model.layers[1].mlp.experts.down_proj)
    model = load(tmp_path / "q")
    attn, moe = model.layers[1][1], model.layers[1][3]
    dense = [attn.w[k] for k in ("wq_a.weight", "wq_b.weight", "wkv.weight", "wo_a", "wo_b.weight")]
    assert all(type(w) is torch.Tensor and w.dtype == torch.float32 for w in [*dense, moe.s13, moe.s2])
    # The routed experts stay packed and run through ops.grouped_gemm's FP4 path (every in-tree backend has one).
    assert isinstance(moe.w13, FP4Tensor) and isinstance(moe.w2, FP4Tensor)
    assert moe.w13.shape == (moe.w2.shape[0], 2 * moe.w2.shape[2], moe.w2.shape[1])
    assert prompt_errors(model, ref, prompts(10)) < TOL


# Every K of an FP8 linear a multiple of 128 (hidden size, q_lora_rank, a group of wo_a's input, wo_b's o_groups x
# o_lora_rank, the experts' intermediate size) and wo_a's groups whole 128-row blocks: every FP8 linear runs in FP8.
FP8_SHAPES = dict(
    hidden_size=128,
    q_lora_rank=128,
    num_attention_heads=2,
    head_dim=128,
    partial_rotary_factor=8 / 128,
    o_groups=2,
    o_lora_rank=128,
    moe_intermediate_size=128,
)
# Bounds of test_model_vs_transformers' FP8 check (DeepSeek-V3): the median log-probability error, and the share of
# greedy steps that may differ. Most positions agree to fp32 rounding, but a 1-ulp difference of a sum can move an
# activation across an e4m3 rounding boundary, which the tiny MoE may amplify. One fixed checkpoint, as there.
FP8_MEDIAN_TOL, FP8_GREEDY_OFF = 5e-3, 0.1
FP8_SEED = 1234


@pytest.fixture(scope="module")
def fp8_source(tmp_path_factory):
    """A checkpoint of ``CONFIGS["plain"]`` at ``FP8_SHAPES`` (fp32) and its oracle."""
    path = tmp_path_factory.mktemp("v4-fp8-source")
    return path, v4_checkpoint(path, seed=FP8_SEED, **(CONFIGS["plain"] | FP8_SHAPES))


def fp8_errors(model, ref, held, ue8m0: bool, seed: int) -> tuple[torch.Tensor, int, int]:
    """``model`` against the oracle ``ref`` with DeepSeek's activation quantisation on the products with ``held``:
    every prompt and generated log-probability error (prompts in one prefill; prompts decoded token by token, several
    sequences at once; 8 greedy steps of several sequences), and how many of the greedy steps differ from the
    oracle's argmax, of how many."""
    quantised = functools.partial(fp8_activations_v4, ref, held, ue8m0)
    errs = [prompt_error_values(model, ref, prompts(seed), None, quantised)]
    errs.append(prompt_error_values(model, ref, prompts(seed + 1)[1:4], 1, quantised))
    ps, steps = prompts(seed + 2)[1:], 8
    states = [model.new_state() for _ in ps]
    lp = run(model, states, ps)
    ends = torch.tensor([len(p) for p in ps]).cumsum(0) - 1
    gen, rows = [[int(lp[e].argmax())] for e in ends], [[lp[e]] for e in ends]
    for _ in range(steps - 1):
        lp = run(model, states, [[g[-1]] for g in gen])
        for b in range(len(ps)):
            gen[b].append(int(lp[b].argmax()))
            rows[b].append(lp[b])
    off = 0
    for p, g, r in zip(ps, gen, rows):
        with quantised():
            ref_lp = oracle_logprobs(ref, p + g)[len(p) - 1 :][:steps]
        ours = torch.stack(r)
        errs.append((ours.gather(1, torch.tensor(g)[:, None]) - ref_lp.gather(1, torch.tensor(g)[:, None])).abs())
        off += int((ref_lp.argmax(-1) != torch.tensor(g)).sum())
    return torch.cat([e.flatten() for e in errs]).nan_to_num(math.inf, math.inf), off, steps * len(ps)


@pytest.mark.parametrize("scales, experts", [("ue8m0", "fp4"), ("fp32", "fp8")])
def test_fp8_linears_run_in_fp8_as_deepseek_runs_them(scales, experts, fp8_source, tmp_path, load):
    """A quantised copy (DeepSeek-V4-Flash's format: ue8m0 scales, FP4 routed experts; or fp32 scales, FP8 routed
    experts) whose FP8 linears all have whole 128-blocks: they load as ``QTensor`` (the FP4 experts as
    ``FP4Tensor``), the compressors, the indexer's head weights, the router and the head stay float; against the
    oracle on the decoded values with DeepSeek's activation quantisation emulated where a weight is FP8 (the FP4
    experts' activations go in unquantised, as the model runs them), within ``test_model_vs_transformers``' FP8
    bounds."""
    path, oracle = fp8_source
    ue8m0 = scales == "ue8m0"
    ref, held = quantised_copy(path, tmp_path / "q", oracle, ue8m0=ue8m0, expert_dtype=experts, spread=True)
    if experts == "fp4":
        held = [w for w in held if w.dim() == 2]  # not the routed experts
    model = load(tmp_path / "q")
    fmt = "ue8m0" if ue8m0 else "fp32"
    for i, (_, attn, _, moe, _) in enumerate(model.layers):
        fp8 = [attn.w[k] for k in ("wq_a.weight", "wq_b.weight", "wkv.weight", "wo_a", "wo_b.weight")]
        fp8 += [moe.s13, moe.s2] + ([attn.w["indexer.wq_b.weight"]] if attn.indexer else [])
        assert all(isinstance(w, QTensor) and w.scale_format == fmt for w in fp8), i
        assert moe.w13.shape == (8, 256, 128) and moe.w2.shape == (8, 128, 128)
        assert all(isinstance(w, FP4Tensor if experts == "fp4" else QTensor) for w in (moe.w13, moe.w2)), i
        high = [v for k, v in attn.w.items() if "compressor." in k or "weights_proj" in k] + [moe.gate]
        assert high and all(type(w) is torch.Tensor and w.dtype == torch.float32 for w in high), i
    assert type(model.lm_head) is torch.Tensor
    if model.device.type != "cpu":
        pytest.skip("the comparison needs the oracle's fp32 CPU arithmetic (test_model_vs_transformers' FP8 check)")
    errs, off, steps = fp8_errors(model, ref, held, ue8m0, 20)
    print(f"{scales} / {experts}: median {errs.median():.2e}, max {errs.max():.2e}, greedy off {off} of {steps}")
    assert errs.median() < FP8_MEDIAN_TOL, f"median difference {errs.median():.2e}"
    assert off <= FP8_GREEDY_OFF * steps, f"{off} of {steps} greedy steps differ"


def test_fp8_linears_with_bf16_activations_close_to_the_dequantised_oracle(
    fp8_source, tmp_path, deepinfer_backend, deepinfer_device
):
    """The production path: ``LLM`` in bf16 on the ue8m0 / FP4-expert copy against the plain fp32 oracle on the
    decoded values (no activation quantisation): the median prompt log-probability error below 12% of their spread
    (``test_model_vs_transformers``' bound for DeepSeek-V3's FP8 weights with bf16 activations)."""
    from deepinfer.model import SamplingParams

    path, oracle = fp8_source
    ref, _ = quantised_copy(path, tmp_path / "q", oracle, spread=True)
    llm = serve(tmp_path / "q", deepinfer_backend, deepinfer_device, dtype="bfloat16")
    assert isinstance(llm.model.layers[0][1].w["wq_a.weight"], QTensor)
    ps = prompts(12)[1:]
    ours, want = [], []
    for p, out in zip(ps, llm.generate(ps, SamplingParams(max_tokens=1, prompt_logprobs=0))):
        lp = oracle_logprobs(ref, p)
        ours += out.prompt_logprobs[1:]
        want += [lp[j - 1, p[j]].item() for j in range(1, len(p))]
    ours, want = torch.tensor(ours), torch.tensor(want)
    relative = ((ours - want).abs().median() / want.std()).item()
    print(f"bf16 activations: median error {relative:.3f} of the spread")
    assert relative < 0.12, f"median error {relative:.3f} of the spread of the log-probabilities"


def _scales_reversed(real):
    def planted(self, key, device):
        q = real(self, key, device)
        return q if q is None else dataclasses.replace(q, scale=q.scale.flip(0, 1).contiguous())

    return planted


def _activations_unquantised(real):
    def planted(a, w, **kw):
        return real(a, w.dequantize(a.dtype) if isinstance(w, QTensor) and not isinstance(a, QTensor) else w, **kw)

    return planted


@pytest.mark.parametrize("bug", ["scale grid reversed", "activations unquantised"])
def test_planted_fp8_bugs_fail_the_fp8_comparison(bug, fp8_source, tmp_path, load, monkeypatch):
    """Every FP8 weight's block scales read in reverse order (the copy's neighbouring blocks have other scales), or
    the ``ops.gemm`` linears (all but ``wo_a`` and the routed experts) computed on the FP8 weights' values without
    quantising their activations: the comparison above fails by far."""
    path, oracle = fp8_source
    ref, held = quantised_copy(path, tmp_path / "q", oracle, ue8m0=False, expert_dtype="fp8", spread=True)
    if bug == "scale grid reversed":
        monkeypatch.setattr(V4Checkpoint, "read_fp8", _scales_reversed(V4Checkpoint.read_fp8))
    else:
        monkeypatch.setattr(ops, "gemm", _activations_unquantised(ops.gemm))
    model = load(tmp_path / "q")
    if model.device.type != "cpu":
        pytest.skip("the comparison needs the oracle's fp32 CPU arithmetic (test_model_vs_transformers' FP8 check)")
    errs, off, steps = fp8_errors(model, ref, held, False, 20)
    print(f"{bug}: median {errs.median():.2e}, max {errs.max():.2e}, greedy off {off} of {steps}")
    assert errs.median() > 10 * FP8_MEDIAN_TOL


def test_fp8_weights_that_cannot_stay_fp8_are_dequantised_at_load(tmp_path, load):
    """With ``scale_fmt: ue8m0``, a weight whose fp32 scales are not powers of two, and ``wo_a`` whose groups are not
    whole 128-row blocks (``o_lora_rank`` 64: one block scale covers rows of both groups), are dequantised at load,
    to the values transformers' ``Fp8Dequantize`` decodes; the other FP8 linears stay FP8."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    src, dst = tmp_path / "src", tmp_path / "q"
    oracle = v4_checkpoint(src, seed=5, **(CONFIGS["plain"] | FP8_SHAPES | {"o_lora_rank": 64}))
    quantised_copy(src, dst, oracle, expert_dtype="fp8")
    tensors = load_file(dst / "model.safetensors")
    odd = "model.layers.0.attn.wq_a.weight"
    tensors[odd + "_scale_inv"] = tensors[odd + "_scale_inv"].float() * 0.75
    save_file(tensors, dst / "model.safetensors")
    decode = Fp8Dequantize(None)._dequantize_one
    model = load(dst)
    attn = model.layers[0][1]
    want = decode(tensors[odd], tensors[odd + "_scale_inv"], torch.float32)
    assert type(attn.w["wq_a.weight"]) is torch.Tensor and torch.equal(attn.w["wq_a.weight"].cpu(), want)
    wo_a = "model.layers.0.attn.wo_a.weight"
    want = decode(tensors[wo_a], tensors[wo_a + "_scale_inv"], torch.float32).view(2, 64, -1)
    assert type(attn.w["wo_a"]) is torch.Tensor and torch.equal(attn.w["wo_a"].cpu(), want)
    assert all(isinstance(attn.w[k], QTensor) for k in ("wq_b.weight", "wkv.weight", "wo_b.weight"))
    assert isinstance(model.layers[1][1].w["wq_a.weight"], QTensor)


def test_fp4_experts_with_fp32_scales_that_are_not_powers_of_two_are_dequantised_at_load(checkpoints, tmp_path, load):
    """fp32 scales ue8m0 cannot hold keep the load-time dequantisation: dense expert stacks holding the values
    transformers decodes."""
    path, _ = checkpoints("plain")
    tensors = load_file(path / "model.safetensors")
    out = dict(tensors)
    for name, w in tensors.items():
        if ".ffn.experts." in name:
            data, scale = _fp4_rows(w.float())
            out[name], out[name + "_scale_inv"] = data, scale.float() * 0.75
    save_file(out, tmp_path / "model.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = dict(quant_method="fp8", fmt="e4m3", weight_block_size=[128, 128], expert_dtype="fp4")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = load(tmp_path)
    moe = model.layers[1][3]
    assert isinstance(moe.w13, torch.Tensor) and moe.w13.dtype == torch.float32
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    decode = Fp8Dequantize(None)._dequantize_one
    p = "model.layers.1.ffn.experts.0."
    want = torch.cat([decode(out[p + k], out[p + k + "_scale_inv"], torch.float32) for k in ("w1.weight", "w3.weight")])
    assert torch.equal(moe.w13[0].cpu(), want)


@pytest.mark.parametrize("damage", ["no scale", "fp8 router", "fp4 shared expert", "scale grid", "no config"])
def test_damaged_quantised_checkpoints_are_refused(damage, checkpoints, tmp_path):
    path, _ = checkpoints("plain")
    tensors = load_file(path / "model.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = dict(quant_method="fp8", weight_block_size=[128, 128], expert_dtype="fp4")
    name = {
        "no scale": "model.layers.0.attn.wq_a.weight",
        "fp8 router": "model.layers.1.ffn.gate.weight",
        "fp4 shared expert": "model.layers.1.ffn.shared_experts.w1.weight",
        "scale grid": "model.layers.1.attn.wo_b.weight",
        "no config": "model.layers.1.attn.wo_b.weight",
    }[damage]
    packed = _fp4_rows if damage == "fp4 shared expert" else _fp8_blocks
    tensors[name], scale = packed(tensors[name].float())
    if damage == "scale grid":
        scale = torch.ones(2, 2)
    if damage != "no scale":
        tensors[name + "_scale_inv"] = scale
    if damage == "no config":
        del cfg["quantization_config"]
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        V4Checkpoint.open(tmp_path)


def test_cache_budget_per_token_follows_the_layer_types():
    """V4-Flash-shaped config (transformers' defaults: 43 layers, 2 HCA then CSA and HCA alternating): per token of
    context every CSA layer grows by one entry of 512 and one indexer key of 128 per 4 tokens, every HCA layer by
    one entry of 512 per 128 tokens, in bf16."""
    raw = {"model_type": "deepseek_v4", "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048}
    raw |= {"num_hidden_layers": 43, "num_attention_heads": 64, "n_routed_experts": 256}
    cfg = V4Config.from_dict(raw)
    csa, hca = cfg.layer_types.count(CSA), cfg.layer_types.count(HCA)
    assert (csa, hca) == (20, 23)
    assert cfg.cache_bytes_per_token() == csa * (512 + 128) / 4 * 2 + hca * 512 / 128 * 2 == 6584
    # pages of 128 tokens hold 32 CSA entries and one HCA entry a layer, no slot unused
    assert cfg.cache_page_bytes("bf16", 128) == 6584 * 128
    assert cfg.cache_layout(128, 2).bytes_per_token == 6584
    # pages of 64 tokens: 16 CSA entries, and one HCA slot a page that every other page leaves unused
    assert cfg.cache_page_bytes("bf16", 64) == (csa * 16 * (512 + 128) + hca * 1 * 512) * 2
    # per sequence: 127 window keys a layer and each compressor's last rows of kv and gate (HCA one window, 128 rows;
    # CSA two windows, 8 rows of two series, the same for the indexer)
    csa_state = 2 * 8 * 2 * 512 + 2 * 8 * 2 * 128
    assert cfg.cache_bytes_per_sequence() == (43 * 127 * 512 + hca * 2 * 128 * 512 + csa * csa_state) * 2
    layout = cfg.cache_layout(128, 2)
    assert layout.state_pages == math.ceil(cfg.cache_bytes_per_sequence() / layout.page_bytes)
    # room for 3 rejected drafts: 3 more rows in every ring; the MTP layer (sliding-window attention) adds a window
    spec = cfg.cache_layout(128, 2, mtp_layers=0, drafts=3)
    assert spec.state_elems - layout.state_elems == 43 * 3 * 512 + hca * 2 * 3 * 512 + csa * (2 * 3 * 2 * (512 + 128))
    raw |= {"num_nextn_predict_layers": 1}
    mtp = V4Config.from_dict(raw).cache_layout(128, 2, mtp_layers=1, drafts=3)
    assert mtp.state_elems - spec.state_elems == 130 * 512
    assert mtp.page_bytes == spec.page_bytes  # a window layer keeps nothing in the token pages
    # FP8 records: an entry is 448 e4m3 values, 7 one-byte ue8m0 scales and 64 bf16 rope channels; an indexer key 128
    # e4m3 values and one scale
    entry, key = 448 + 7 + 64 * 2, 128 + 1
    fp8 = cfg.cache_layout(128, 2, "fp8_ds_mla")
    assert (fp8.entry_bytes, fp8.index_bytes) == (entry, key) == (583, 129)
    held = csa * 32 * (entry + key) + hca * entry
    assert fp8.page_bytes == -(-held // 16) * 16 == cfg.cache_page_bytes("fp8_ds_mla", 128)  # whole 16-byte units
    assert fp8.bytes_per_token == fp8.page_bytes / 128
    with pytest.raises(CheckpointError, match="kv_format one of"):
        cfg.cache_page_bytes("fp8_e5m2", 64)


def test_stop_tokens_and_asynchronous_scheduling(checkpoints, deepinfer_backend, deepinfer_device):
    """A request that stops on a sampled stop token under asynchronous scheduling (it takes one more step, whose
    token is dropped, and its caches go with it) leaves its neighbours and the next requests as a synchronous run
    gives them."""
    from deepinfer.model import SamplingParams

    path, _ = checkpoints("yarn")
    ps = prompts(11)
    free = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    sync = serve(path, deepinfer_backend, deepinfer_device, async_scheduling=False)
    base = [o.outputs[0].token_ids for o in sync.generate(ps, free)]
    stop = base[2][3]  # the fourth token of the third request
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=[stop], logprobs=0)
    want = []
    for toks in base:
        cut = toks.index(stop) + 1 if stop in toks else len(toks)
        want.append(toks[:cut])
    for llm in (sync, serve(path, deepinfer_backend, deepinfer_device, async_scheduling=True)):
        for _ in range(2):  # the same engine serves the next call alike
            outs = llm.generate(ps, params)
            assert [o.outputs[0].token_ids for o in outs] == want
            assert outs[2].outputs[0].finish_reason == "stop"
