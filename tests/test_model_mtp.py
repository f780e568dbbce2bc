"""The multi-token-prediction layer (``model/mtp.py``) against an oracle built from transformers' own DeepSeek-V3
classes: the main model's final hidden states and the MTP block (``DeepseekV3DecoderLayer`` at the MTP's layer
index) composed as DeepSeek defines the layer. On a random checkpoint (fp32, every weight random, so every part
matters) and on the embedded trained model, whose MTP layer must also agree with the model's own next-next token
as often as its training recorded."""

from __future__ import annotations

import json

import pytest
import torch
from model_helpers import LatentPrecisionCache, one_thread  # noqa: F401 (autouse fixture)
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.masking_utils import create_causal_mask
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

import deepinfer
from deepinfer.model import Checkpoint, DeepseekV3
from deepinfer.model.embedded import checkpoint_dir, stdlib_documents, token_stream, windows
from deepinfer.model.forward_batch import ForwardBatch
from deepinfer.model.mtp import MTPLayer
from deepinfer.model.tiny import TINY_CONFIG, write_checkpoint
from deepinfer.model.tokenizer import Tokenizer


def oracle_mtp_logits(path, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers (fp32, eager, latents cached in bf16 as the engine caches them): the main model's log-softmax
    for every position, and the MTP layer's for the token after next of every position but the last."""
    model = DeepseekV3ForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    cfg: DeepseekV3Config = model.config
    layer = cfg.num_hidden_layers
    p = f"model.layers.{layer}."
    raw = {k[len(p) :]: v.float() for k, v in load_file(str(path / "model.safetensors")).items() if k.startswith(p)}
    block = DeepseekV3DecoderLayer(cfg, layer_idx=layer).eval()
    state = {k: v for k, v in raw.items() if k in block.state_dict()}
    if cfg.n_routed_experts:
        experts = range(cfg.n_routed_experts)
        state["mlp.experts.gate_up_proj"] = torch.stack(
            [
                torch.cat([raw[f"mlp.experts.{e}.gate_proj.weight"], raw[f"mlp.experts.{e}.up_proj.weight"]])
                for e in experts
            ]
        )
        state["mlp.experts.down_proj"] = torch.stack([raw[f"mlp.experts.{e}.down_proj.weight"] for e in experts])
    block.load_state_dict(state)

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w

    with torch.no_grad():  # latents cached at the paged cache's bf16, as the engine keeps them
        t = torch.tensor([ids])
        hidden = model.model(input_ids=t, cache=LatentPrecisionCache(config=cfg), use_cache=True).last_hidden_state
        main = model.lm_head(hidden)[0]
        x = torch.cat(
            [rms(model.model.embed_tokens(t[:, 1:]), raw["enorm.weight"]), rms(hidden[:, :-1], raw["hnorm.weight"])], -1
        )
        x = x @ raw["eh_proj.weight"].T
        pos = torch.arange(x.shape[1])[None]
        mask = create_causal_mask(config=cfg, inputs_embeds=x, attention_mask=None, cache=None, position_ids=pos)
        mtp_cache = LatentPrecisionCache(config=DeepseekV3Config(**{**cfg.to_dict(), "num_hidden_layers": layer + 1}))
        rope = model.model.rotary_emb(x, pos)
        x = block(x, attention_mask=mask, position_ids=pos, position_embeddings=rope, cache=mtp_cache, use_cache=True)
        mtp = model.lm_head(rms(x, raw["shared_head.norm.weight"]))[0]
    return torch.log_softmax(main, -1), torch.log_softmax(mtp, -1)


def load_with_mtp(path, dtype: torch.dtype) -> DeepseekV3:
    ckpt = Checkpoint.open(path)
    device = torch.device(deepinfer.current_backend().device_type)
    model = DeepseekV3.load(ckpt, dtype=dtype, device=device, mtp=True)
    ckpt.close()
    assert len(model.mtp) == 1
    return model


def mtp_logits(model: DeepseekV3, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """deepinfer on the selected backend: the prompt as one prefill chunk, then the MTP layer over the same
    positions (its own cache layer, the same slots)."""
    cfg, device, n = model.cfg, model.device, len(ids)

    def prefill(n: int) -> ForwardBatch:
        return ForwardBatch(
            positions=torch.arange(n, dtype=torch.int32, device=device),
            slot_mapping=torch.arange(n, device=device),
            cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=device),
            cu_seqlens_k=torch.tensor([0, n], dtype=torch.int32, device=device),
            context_slots=torch.arange(n, device=device),
        )

    def cache():
        return deepinfer.allocate_kv_cache(
            1, n, kv_lora_rank=cfg.kv_lora_rank, rope_dim=cfg.qk_rope_head_dim, device=device
        )

    tokens = torch.tensor(ids, device=device)
    hidden = model.forward(tokens, prefill(n), [cache() for _ in range(cfg.num_hidden_layers)])
    state = model.mtp[0].forward(hidden[:-1], tokens[1:], prefill(n - 1), cache())
    main = torch.log_softmax(model.compute_logits(hidden), -1)
    return main.cpu(), torch.log_softmax(model.mtp[0].compute_logits(state), -1).cpu()


@pytest.fixture(scope="module")
def random_mtp_checkpoint(tmp_path_factory):
    """A small checkpoint with one MTP layer: fp32, so that the comparison measures the code, with norms off 1, so
    that each one matters."""
    config = TINY_CONFIG | dict(
        vocab_size=258, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8, n_group=4, topk_group=2,
        num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, num_nextn_predict_layers=1, max_position_embeddings=256,
    )  # fmt: skip
    path = write_checkpoint(tmp_path_factory.mktemp("mtp"), config, seed=3)
    g = torch.Generator().manual_seed(1)
    weights = {
        k: v.float() * (1 + 0.3 * torch.randn(v.shape, generator=g)) if k.endswith("norm.weight") else v.float()
        for k, v in load_file(str(path / "model.safetensors")).items()
    }
    save_file(weights, str(path / "model.safetensors"))
    ids = torch.randint(2, 258, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    return path, ids, oracle_mtp_logits(path, ids)


def test_mtp_layer_matches_transformers_on_a_random_checkpoint(random_mtp_checkpoint):
    path, ids, (want_main, want_mtp) = random_mtp_checkpoint
    got_main, got_mtp = mtp_logits(load_with_mtp(path, torch.float32), ids)
    for got, want in ((got_main, want_main), (got_mtp, want_mtp)):
        err = (got - want).abs()
        assert err.median() < 2e-3 and err.max() < 5e-2, (err.median(), err.max())


def swap_norms(layer: MTPLayer) -> None:
    layer.enorm, layer.hnorm = layer.hnorm, layer.enorm


def swap_halves(layer: MTPLayer) -> None:
    h = layer.eh_proj.shape[0]
    layer.eh_proj = torch.cat([layer.eh_proj[:, h:], layer.eh_proj[:, :h]], dim=1)


def own_head_norm_skipped(layer: MTPLayer) -> None:
    layer.head_norm = torch.ones_like(layer.head_norm)


@pytest.mark.parametrize("bug", [swap_norms, swap_halves, own_head_norm_skipped])
def test_a_planted_bug_in_the_mtp_layer_fails_the_check(bug, random_mtp_checkpoint):
    path, ids, (_, want_mtp) = random_mtp_checkpoint
    model = load_with_mtp(path, torch.float32)
    bug(model.mtp[0])
    _, got_mtp = mtp_logits(model, ids)
    err = (got_mtp - want_mtp).abs()
    assert err.median() > 2e-2


def test_embedded_model_mtp_agrees_with_transformers_and_its_training_record():
    """On held-out text: the MTP's logits as transformers computes them, and its top-1 agreement with the model's
    own next-next token (what speculative decoding accepts) over 8 windows spread through the held-out split, within
    0.05 of what its training measured over the whole split."""
    path = checkpoint_dir()
    record = json.loads((path.parent / "training.json").read_text())
    tokenizer = Tokenizer.from_dir(path)
    ws = windows(token_stream(tokenizer.encode, record["tokenizer"]["eos"], stdlib_documents("heldout")), 1024)
    ws = ws[:: len(ws) // 8][:8]
    _, want_mtp = oracle_mtp_logits(path, ws[0][:257])
    model = load_with_mtp(path, torch.float32)
    _, got_mtp = mtp_logits(model, ws[0][:257])
    err = (got_mtp - want_mtp).abs()
    assert err.median() < 2e-3 and err.max() < 5e-2, (err.median(), err.max())
    agree = total = 0
    for w in ws:
        main, mtp = mtp_logits(model, w)
        agree += (mtp.argmax(-1) == main[1:].argmax(-1)).sum().item()
        total += mtp.shape[0]
    recorded = record["heldout"]["mtp_agreement_with_model_next_next_top1"]
    assert abs(agree / total - recorded) < 0.05, (agree / total, recorded)


@pytest.mark.parametrize("with_mtp", [False, True])
def test_mtp_weights_load_only_when_asked(with_mtp):
    ckpt = Checkpoint.open(checkpoint_dir())
    model = DeepseekV3.load(ckpt, dtype=torch.bfloat16, mtp=with_mtp)
    ckpt.close()
    assert len(model.mtp) == (1 if with_mtp else 0)
