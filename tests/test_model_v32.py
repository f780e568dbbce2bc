"""DeepSeek-V3.2 (sparse attention) against transformers' ``DeepseekV32ForCausalLM``.

Tiny random checkpoints are written by transformers itself with an ``index_topk`` far below the prompt lengths, so
the indexer's choice decides what every later query attends to. deepinfer (fp32 activations, bf16 latent and
indexer-key caches) runs chunked prefill over several cache pages, then paged decode, with every query attending
through ``indexer_topk`` and ``sparse_mla``. The oracle is transformers in fp32 (eager attention, which folds the
indexer's top-k into the attention mask) over a cache that stores the latent and the indexer keys in bf16 as ours
does: the prompt in one forward, then the generated tokens one at a time.

Sixteen indexer heads (DeepSeek-V3.2 has 64): with a few, every head's ``relu`` is zero for many keys, which then
tie at score 0, and transformers' ``topk`` breaks ties in no documented order (ours: the lower position).

With ``kv_format="fp8_ds_mla"`` the latent cache holds FP8 records and the indexer keys are stored in FP8
(``fp8_ds_index``), rotated by a Hadamard matrix first; the oracle's cache rounds both the same way, written here from
the formats' definitions.

Bounds: every prompt and generated log-probability within 1e-2 nats (5e-2 with FP8 caches), and the same greedy
tokens, except at a step where the oracle's two best tokens are closer than that (a numerical tie either may break;
allowed once).

The routers' expert choice is discrete too: where the oracle's own top-k scores of a token differ by less than
1e-4 relative (``ROUTE_TIE``), fp32 noise may pick either expert, and one such prompt is excused.

The indexer's selection is discrete over rounded keys: an fp32 key within a few ulps of a bf16 rounding midpoint
rounds one way in the oracle and the other in ours (their fp32 activations differ in the last bits), which moves
that token's score by about 2^-8 of itself; where it sits at a query's top-k boundary with a closer runner-up, that
query attends a different token, and every later position of its prompt differs too. The oracle's key rounding is
therefore only defined up to such flips: a prompt is also compared with the oracle whose keys are scaled by
``1 +- KEY_NUDGE`` before rounding (which flips exactly the values that close to a midpoint), and it is judged
against the closest of the three. Planted bugs (the indexer ignored, so attention is dense; a top-k of half the
size) must fail the same comparison.
"""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch
from model_helpers import (  # noqa: F401 (one_thread: autouse fixture)
    BASE,
    LatentPrecisionCache,
    fp8_activations,
    fp8_copy,
    hf_checkpoint,
    one_thread,
    random_prompts,
    replay_graphs_on_cpu,
    round_bf16,
    round_fp8_ds_mla,
)
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

from deepinfer import ops, registry
from deepinfer.model import LLM, SamplingParams
from deepinfer.model.errors import CheckpointError

TOL = 1e-2
FP8_TOL = 5e-2  # as the V3 cross-check's fp8_ds_mla bound [measured: at most 7.7e-4 over 3 seeds]
TOPK = 8
LENGTHS = [1, 19, 40, 63]
STEPS = 12
KEY_NUDGE = 1e-6  # relative; fp32 activations of ours and the oracle's differ by less [seed 55328 needs -1e-6]
V32 = dict(index_n_heads=16, index_head_dim=32, index_topk=TOPK, first_k_dense_replace=1)


def v32_checkpoint(path, seed: int, **overrides):
    """A tiny random ``DeepseekV32ForCausalLM`` saved by transformers, weights redrawn as ``hf_checkpoint`` does."""
    return hf_checkpoint(path, seed, (DeepseekV32Config, DeepseekV32ForCausalLM), **(V32 | overrides))


def sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h


class IndexedPrecisionCache(LatentPrecisionCache):
    """The oracle's cache with the latent and the indexer keys stored as our paged caches hold them: ``bf16``, or
    ``fp8_ds_mla`` beside FP8 indexer keys. Those are stored rotated by the +-1 Hadamard matrix ``H`` (as DeepSeek's
    inference code rotates them before quantising) with the queries rotated alike, so the oracle's key becomes
    ``fp8(k H) H / dim``, which gives the query ``q`` the score ``(q H) . fp8(k H) / dim``."""

    def __init__(self, *args, key_nudge: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.key_nudge = key_nudge

    def update_indexer(self, indexer_key_states, layer_idx):
        k = indexer_key_states * (1 + self.key_nudge)
        if self.kv_format == "fp8_ds_mla":
            h = sylvester(k.shape[-1])
            k = round_fp8_ds_mla(k @ h) @ h / k.shape[-1]
        else:
            k = round_bf16(k)
        return super().update_indexer(k, layer_idx)


def oracle_logprobs(
    model, prompt: list[int], generated: list[int], kv_format: str = "bf16", key_nudge: float = 0.0
) -> torch.Tensor:
    cache = IndexedPrecisionCache(config=model.config, kv_format=kv_format, key_nudge=key_nudge)
    with torch.no_grad():
        logits = [model(torch.tensor([prompt]), cache=cache, use_cache=True).logits[0]]
        for t in generated[:-1]:
            logits.append(model(torch.tensor([[t]]), cache=cache, use_cache=True).logits[0])
    return torch.log_softmax(torch.cat(logits).float(), dim=-1)


FP8_SHAPES = dict(index_head_dim=128, kv_lora_rank=128)  # the FP8 caches group 128 values under one scale
# FP8 weights: every K a multiple of 128.
FP8_WEIGHTS = dict(
    FP8_SHAPES,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=128,
    q_lora_rank=128,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=64,
    num_attention_heads=2,
    num_key_value_heads=2,
    vocab_size=256,
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(name: str):
        """``bf16`` or ``fp8_ds_mla`` (a bf16 checkpoint for that cache), or ``fp8_weights`` (FP8 linears with ue8m0
        scales; the oracle runs their dequantised values)."""
        if name not in made:
            seed = int(os.environ.get("DEEPINFER_TEST_SEED", int.from_bytes(os.urandom(2), "little")))
            print(f"DeepSeek-V3.2 checkpoint {name}: seed {seed}")
            root = tmp_path_factory.mktemp("v32")
            shapes = {"bf16": {}, "fp8_ds_mla": FP8_SHAPES, "fp8_weights": FP8_WEIGHTS}[name]
            path = oracle_path = v32_checkpoint(root / "bf16", seed, **shapes)
            if name == "fp8_weights":
                path, oracle_path = fp8_copy(path, root / "fp8", root / "oracle", ue8m0=True)
            oracle = DeepseekV32ForCausalLM.from_pretrained(
                oracle_path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
            ).eval()
            made[name] = path, oracle
        return made[name]

    return get


def generate(path, backend, device, prompts, steps: int = STEPS, kv_format: str = "bf16"):
    llm = LLM(
        path,
        backend,
        device=device,
        dtype="float32",
        kv_format=kv_format,
        block_size=8,
        prefill_chunk_size=16,
        max_num_batched_tokens=48,
        progress=False,
    )
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    return llm.generate(prompts, params)


def errors(oracle, prompts, outs, kv_format: str = "bf16", tol: float = TOL, fp8: bool = False):
    """Every |ours - oracle| log-probability (prompt tokens, then generated tokens), and the greedy steps where
    ours differs from the oracle's best token by more than a numerical tie. ``fp8``: the oracle quantises the
    activations of its FP8 linears as DeepSeek's FP8 GEMMs do (ue8m0 scales; ``kv_b_proj`` not, since sparse
    attention is absorbed in prefill too)."""
    errs, mismatches, excused = [], 0, False
    for p, o in zip(prompts, outs):
        gen = o.outputs[0].token_ids
        best, tie = None, False
        for nudge in (0.0, KEY_NUDGE, -KEY_NUDGE):  # the oracle's key rounding, up to flips (the docstring says why)
            quantised = fp8_activations(oracle, ue8m0=True, kv_b=False) if fp8 else contextlib.nullcontext()
            with quantised, routing_ties() as gaps:
                lp = oracle_logprobs(oracle, p, gen, kv_format, nudge)
            e, m = prompt_errors(lp, p, o, tol)
            tie = tie or min(gaps, default=1.0) < ROUTE_TIE
            if best is None or max(e, default=0) < max(best[0], default=0):
                best = e, m
            if max(best[0], default=0) <= tol:
                break
        if max(best[0], default=0) > tol and tie and not excused:
            excused = True  # the oracle's own expert choice was a numerical tie: this prompt may go either way
            continue
        errs += best[0]
        mismatches += best[1]
    return errs, mismatches


ROUTE_TIE = 1e-4  # relative gap at the router's top-k boundary below which fp32 noise may choose either expert


@contextlib.contextmanager
def routing_ties():
    """Inside the block, the relative gap between the k-th and (k+1)-th score of every router ``topk`` (2-d scores)
    is appended to the list yielded."""
    gaps: list[float] = []
    real = torch.topk

    def recording(x, k, *args, **kwargs):
        if x.dim() == 2 and x.shape[-1] > k:
            v = x.sort(dim=-1, descending=True).values
            gaps.append(float(((v[:, k - 1] - v[:, k]).abs() / v[:, k - 1].abs().clamp_min(1e-30)).min()))
        return real(x, k, *args, **kwargs)

    torch.topk = recording
    try:
        yield gaps
    finally:
        torch.topk = real


def prompt_errors(lp: torch.Tensor, prompt: list[int], out, tol: float) -> tuple[list[float], int]:
    """One request's |ours - oracle| log-probabilities and its greedy steps off by more than a tie."""
    gen = out.outputs[0].token_ids
    full = prompt + gen
    errs = [abs(lp[j - 1, full[j]].item() - out.prompt_logprobs[j]) for j in range(1, len(prompt))]
    mismatches = 0
    for j, t in enumerate(gen):
        row = lp[len(prompt) - 1 + j]
        errs.append(abs(row[t].item() - out.outputs[0].logprobs[j]))
        mismatches += int(row.argmax()) != t and float(row.max() - row[t]) > tol
    return errs, mismatches


@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
def test_logprobs_and_greedy_tokens_match_transformers(kv_format, checkpoints, deepinfer_backend, deepinfer_device):
    path, oracle = checkpoints(kv_format)
    tol = TOL if kv_format == "bf16" else FP8_TOL
    prompts = random_prompts(oracle.config.vocab_size, LENGTHS, seed=3)
    outs = generate(path, deepinfer_backend, deepinfer_device, prompts, kv_format=kv_format)
    errs, mismatches = errors(oracle, prompts, outs, kv_format, tol)
    off = [(i, round(e, 4)) for i, e in enumerate(errs) if e > tol]
    assert len(off) <= 1, f"log-probabilities off by more than {tol} (entry, error): {off[:8]}"
    assert mismatches == 0


def test_fp8_weights_match_with_activation_quantisation(checkpoints, deepinfer_backend, deepinfer_device):
    """FP8 linears (the indexer's ``wq_b`` and ``wk`` among them) with ue8m0 scales, fp32 activations: as the V3
    cross-check's FP8 test, most positions agree to rounding, but a 1-ulp difference can move an activation across
    an e4m3 boundary, so the median error is bounded and 90% of greedy steps must agree [measured over 6 seeds:
    medians at most 2.7e-7, no greedy step differing]."""
    where = deepinfer_device or registry.get().lookup(deepinfer_backend).device_type
    if torch.device(where).type != "cpu":
        pytest.skip("needs the oracle's fp32 CPU arithmetic (test_model_vs_transformers.py says why)")
    path, oracle = checkpoints("fp8_weights")
    prompts = random_prompts(oracle.config.vocab_size, LENGTHS, seed=5)
    outs = generate(path, deepinfer_backend, deepinfer_device, prompts)
    errs, mismatches = errors(oracle, prompts, outs, fp8=True)
    median = torch.tensor(errs).median().item()
    assert median < 5e-3, f"median difference {median:.2e}"
    assert mismatches <= 0.1 * len(prompts) * STEPS


def test_bf16_logprobs_as_close_as_transformers_bf16(checkpoints, deepinfer_backend, deepinfer_device):
    """bf16 activations (the production path) against the fp32 oracle, measured against transformers' own bf16 run
    on the same prompts: the median prompt log-probability error within twice transformers' (+0.01)."""
    path, oracle = checkpoints("bf16")
    prompts = random_prompts(oracle.config.vocab_size, LENGTHS, seed=6)
    llm = LLM(path, deepinfer_backend, device=deepinfer_device, block_size=8, prefill_chunk_size=16, progress=False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0))
    hf_bf16 = DeepseekV32ForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    ours, theirs = [], []
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = torch.log_softmax(oracle(torch.tensor([p])).logits[0].float(), -1)
            bf16 = torch.log_softmax(hf_bf16(torch.tensor([p])).logits[0].float(), -1)
        ours += [abs(o.prompt_logprobs[j] - ref[j - 1, p[j]].item()) for j in range(1, len(p))]
        theirs += [abs(bf16[j - 1, p[j]].item() - ref[j - 1, p[j]].item()) for j in range(1, len(p))]
    ours_median, theirs_median = torch.tensor(ours).median().item(), torch.tensor(theirs).median().item()
    assert ours_median <= 2 * theirs_median + 0.01, (ours_median, theirs_median)


@pytest.mark.parametrize("bug", ["indexer ignored", "half the top-k"])
def test_planted_indexer_bugs_fail_the_comparison(bug, checkpoints, monkeypatch, deepinfer_backend, deepinfer_device):
    path, oracle = checkpoints("bf16")
    real = ops.indexer_topk

    def planted(q, weights, index_cache, block_table, cu_seqlens_q, seq_lens, *, topk):
        if bug == "indexer ignored":  # every visible position (at most 512 here): dense attention
            return real(q, weights, index_cache, block_table, cu_seqlens_q, seq_lens, topk=512)
        half = real(q, weights, index_cache, block_table, cu_seqlens_q, seq_lens, topk=topk // 2)
        return torch.cat([half, torch.full_like(half, -1)], dim=1)

    monkeypatch.setattr(ops, "indexer_topk", planted)
    prompts = random_prompts(oracle.config.vocab_size, [40, 63], seed=4)
    outs = generate(path, deepinfer_backend, deepinfer_device, prompts, steps=4)
    errs, _ = errors(oracle, prompts, outs)
    assert max(errs) > 10 * TOL, f"{bug}: worst error {max(errs):.4f} went unnoticed"


def test_index_topk_above_max_position_embeddings_loads_and_matches_transformers(tmp_path):
    """transformers' default ``index_topk`` (2048) above a checkpoint's ``max_position_embeddings`` (512): its
    indexer keeps ``min(index_topk, keys)`` tokens, every visible one, so it attends densely; so does ours."""
    path = v32_checkpoint(tmp_path / "v32", 7, index_topk=2048)
    oracle = DeepseekV32ForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    assert oracle.config.index_topk > oracle.config.max_position_embeddings
    prompts = random_prompts(oracle.config.vocab_size, [19, 40], seed=8)
    outs = generate(path, "reference", None, prompts, steps=2)
    errs, mismatches = errors(oracle, prompts, outs)
    assert max(errs) <= TOL and mismatches == 0, f"worst error {max(errs):.4f}"


def test_scoring_func_softmax_in_config_routes_by_sigmoid_as_transformers(tmp_path):
    """transformers' DeepseekV32 routes by sigmoid with ``e_score_correction_bias`` whatever ``scoring_func`` says
    (it has no such field, and writes that bias): such a checkpoint loads and matches it."""
    path = v32_checkpoint(tmp_path / "v32", 9, scoring_func="softmax")
    assert json.loads((path / "config.json").read_text())["scoring_func"] == "softmax"
    oracle = DeepseekV32ForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    prompts = random_prompts(oracle.config.vocab_size, [19, 40], seed=8)
    outs = generate(path, "reference", None, prompts, steps=2)
    errs, mismatches = errors(oracle, prompts, outs)
    assert max(errs) <= TOL and mismatches == 0, f"worst error {max(errs):.4f}"


def test_v32_checkpoint_without_its_indexer_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    path = v32_checkpoint(tmp_path / "v32", 0)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.indexer.wk.weight"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"indexer\.wk\.weight"):
        LLM(path, progress=False)


def test_v32_mtp_layer_is_recognised_with_its_indexer(tmp_path):
    """DeepSeek-V3.2's MTP layer is a whole decoder layer, its indexer included: accepted and kept out of the model;
    without its indexer it is refused as incomplete."""
    from dataclasses import replace

    from safetensors.torch import load_file, save_file

    from deepinfer.model import Checkpoint, ModelConfig
    from deepinfer.model.checkpoint import mtp_layer_keys

    path = v32_checkpoint(tmp_path / "v32", 0)
    cfg = ModelConfig.from_dir(path)
    mtp = mtp_layer_keys(replace(cfg, num_nextn_predict_layers=1), cfg.num_hidden_layers)
    prefix = f"model.layers.{cfg.num_hidden_layers}.self_attn.indexer."
    assert {prefix + "wq_b.weight", prefix + "weights_proj.weight"} <= set(mtp)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    tensors = load_file(str(path / "model.safetensors"))
    tensors |= {n: torch.randn(e.shape).to(torch.bfloat16) for n, e in mtp.items() if not e.optional}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    ckpt = Checkpoint.open(path)
    assert prefix + "wk.weight" in ckpt.mtp_keys and not any(n.startswith(prefix) for n in ckpt.layout)
    del tensors[prefix + "wk.weight"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"indexer\.wk\.weight"):
        Checkpoint.open(path)


def test_short_prompts_in_the_decode_graphs(tmp_path, monkeypatch):
    """A short prompt (``engine.SHORT_PROMPT_TOKENS``; far longer than ``index_topk``, so the indexer selects) runs as
    decode rows inside the decode graphs (each replay run eagerly on the CPU; padding rows are padding sequences of
    the indexer), each row's indexer over its own prefix: greedy tokens and log-probabilities, the prompt's
    included, agree with an eager engine's prefill path in fp32."""
    monkeypatch.delenv("DEEPINFER_BATCH_INVARIANT", raising=False)
    path = v32_checkpoint(tmp_path, seed=21)
    prompts = random_prompts(BASE["vocab_size"], [57, 23], seed=22)
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, logprobs=0, prompt_logprobs=0)
    want = LLM(path, "reference", dtype="float32", enforce_eager=True, progress=False).generate(prompts, params)
    replayed = replay_graphs_on_cpu(monkeypatch)
    llm = LLM(path, "reference", dtype="float32", max_num_seqs=2, progress=False)
    assert llm.engine.scheduler.decode_row_tokens > max(map(len, prompts))
    for prompt, expected in zip(prompts, want):
        replayed.clear()
        got = llm.generate([prompt], params)[0]
        assert replayed[0][0] >= len(prompt)  # the prompt's step replayed a bucket of its rows
        assert got.outputs[0].token_ids == expected.outputs[0].token_ids
        assert got.outputs[0].logprobs == pytest.approx(expected.outputs[0].logprobs, abs=1e-4)
        assert got.prompt_logprobs[1:] == pytest.approx(expected.prompt_logprobs[1:], abs=1e-4)
    got = llm.generate(prompts, params)  # both at once: one step of 80 rows (a bucket of 80)
    assert [g.outputs[0].token_ids for g in got] == [e.outputs[0].token_ids for e in want]
