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
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from model_helpers import one_thread  # noqa: F401 (autouse fixture)
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from deepinfer import FP4Tensor, ops
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
    """Worst |ours - oracle| prompt log-probability; all prompts in one batch, whole or in chunks of ``chunk``
    tokens (the last chunks of a prompt as single-token steps when ``chunk`` is 1)."""
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
    worst = 0.0
    for p, rows in zip(ps, got):
        ours, ref = torch.cat(rows), oracle_logprobs(oracle, p)
        idx = torch.tensor(p[1:], dtype=torch.long)[:, None]
        errs = [(ours[:-1].gather(1, idx) - ref[:-1].gather(1, idx)).abs().flatten()]
        errs.append((ours[-1] - ref[-1]).abs())  # the whole next-token distribution
        err = torch.cat(errs).max().item()
        worst = max(worst, err if math.isfinite(err) else math.inf)  # (max() would pass a NaN over)
    return worst


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
    ],
)
def test_bad_configs_are_refused(change, message):
    raw = {"model_type": "deepseek_v4", **BASE, **CONFIGS["plain"], **change}
    with pytest.raises(CheckpointError, match=message):
        V4Config.from_dict(raw)


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


def _fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 data and ue8m0 scales of one 128 x 128 block grid (the tiny weights fit one block each way)."""
    n, k = w.shape
    rows, cols = math.ceil(n / 128), math.ceil(k / 128)
    scale = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            scale[i, j] = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].abs().max() / 448
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


def test_fp8_and_fp4_expert_checkpoints_load_as_transformers_dequantises_them(checkpoints, tmp_path, load):
    """A copy of a checkpoint with FP8 linears (128 x 128 ue8m0 block scales) and FP4 routed experts (one ue8m0
    scale per 32 values) against the fp32 oracle holding the values transformers' ``Fp8Dequantize`` decodes."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    path, oracle = checkpoints("plain")
    tensors = load_file(path / "model.safetensors")
    out = {}
    for name, w in tensors.items():
        linear = name.endswith((".wq_a.weight", ".wq_b.weight", ".attn.wkv.weight", ".wo_a.weight", ".wo_b.weight"))
        expert = ".ffn.experts." in name
        if expert or linear or ".shared_experts." in name:
            out[name], out[name + "_scale_inv"] = (_fp4_rows if expert else _fp8_blocks)(w.float())
        else:
            out[name] = w
    save_file(out, tmp_path / "model.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = dict(
        quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[128, 128], scale_fmt="ue8m0"
    )
    cfg["quantization_config"]["expert_dtype"] = "fp4"
    (tmp_path / "config.json").write_text(json.dumps(cfg))

    decode = Fp8Dequantize(None)._dequantize_one
    values = {n: decode(out[n], out[n + "_scale_inv"], torch.float32) for n in out if n + "_scale_inv" in out}
    assert len(values) > 100
    ref = v4_checkpoint(tmp_path / "oracle", seed=0, **CONFIGS["plain"])
    ref.load_state_dict(oracle.state_dict())
    with torch.no_grad():
        for layer in range(len(ref.model.layers)):
            src, dst = f"model.layers.{layer}.", ref.model.layers[layer]
            attn = dst.self_attn
            for mod, key in ((attn.q_a_proj, "attn.wq_a"), (attn.q_b_proj, "attn.wq_b"), (attn.kv_proj, "attn.wkv")):
                mod.weight.copy_(values[src + key + ".weight"])
            attn.o_a_proj.weight.copy_(values[src + "attn.wo_a.weight"])
            attn.o_b_proj.weight.copy_(values[src + "attn.wo_b.weight"])
            if src + "attn.indexer.wq_b.weight" in values:
                attn.compressor.indexer.q_b_proj.weight.copy_(values[src + "attn.indexer.wq_b.weight"])
            sh = dst.mlp.shared_experts
            for mod, key in ((sh.gate_proj, "w1"), (sh.up_proj, "w3"), (sh.down_proj, "w2")):
                mod.weight.copy_(values[f"{src}ffn.shared_experts.{key}.weight"])
            experts = dst.mlp.experts
            for e in range(experts.num_experts):
                p = f"{src}ffn.experts.{e}."
                experts.gate_up_proj[e].copy_(torch.cat([values[p + "w1.weight"], values[p + "w3.weight"]]))
                experts.down_proj[e].copy_(values[p + "w2.weight"])
    assert not torch.equal(ref.model.layers[1].mlp.experts.down_proj, oracle.model.layers[1].mlp.experts.down_proj)
    model = load(tmp_path)
    # The routed experts stay packed and run through ops.grouped_gemm's FP4 path (every in-tree backend has one).
    moe = model.layers[1][3]
    assert isinstance(moe.w13, FP4Tensor) and isinstance(moe.w2, FP4Tensor)
    assert moe.w13.shape == (moe.w2.shape[0], 2 * moe.w2.shape[2], moe.w2.shape[1])
    assert prompt_errors(model, ref, prompts(10)) < TOL


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
