"""Trains the embedded model (``deepinfer.model.embedded``) and writes its checkpoints and training record.

    python training/train_embedded.py --out DIR [--minutes 5.5] [--steps N] [--seed 0] [--layers 4]
        [--distill-minutes M | --distill-steps N] [--distill-from EARLIER_OUT]

On one GPU. The corpus is the running interpreter's standard library (``stdlib_documents``: train split only); the
tokenizer is a byte-level BPE of 4096 tokens trained on it with the ``tokenizers`` library; the model is
transformers' own ``DeepseekV3ForCausalLM`` (MLA with low-rank queries, YaRN rope, a dense first layer, then
group-limited sigmoid routing of each token to 2 of 8 experts beside a shared one) plus one multi-token-prediction
(MTP) layer as DeepSeek-V3 defines it:

    h'_i = block(eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]))  at position i,   logits = lm_head(norm'(h'_i))

where ``h_i`` is the main model's final hidden state (after its last norm, the one ``lm_head`` reads),
``embed`` and ``lm_head`` are shared with the main model, and the logits predict ``t_{i+2}``. Loss: next-token
cross-entropy plus 0.3 times the MTP's. Experts are balanced as DeepSeek-V3 does without an auxiliary loss: after
each step every router's ``e_score_correction_bias`` moves by ``bias_rate`` towards the mean load. A validation
split of the training files (``is_validation``, never trained on) is scored every ``eval_every`` steps and the
weights of the best score are kept: the corpus is small, and later epochs overfit it.

``--distill-minutes`` adds a second phase for speculative decoding: the model frozen, the MTP layer alone is trained
to the model's own distribution of each next-next token (KL divergence, ``distill_loss``), since verification
accepts a draft when it is the model's choice, not the text's; the MTP weights of the best validation agreement are
kept, and the record gives the held-out agreement before and after. The shipped model has no such phase.
``--distill-from`` runs that phase alone on the model an earlier run wrote (read back from its bf16 weights, with its
tokenizer and hyper-parameters), so that a longer joint training and the distillation each fit a device call.

When ``--steps`` is not given, the step count is what fits ``--minutes``, measured on the first steps (the record
keeps the count, so ``--steps`` reproduces the run). Writes into ``--out``: ``bf16/`` and ``fp8/`` (config.json,
model.safetensors, tokenizer.json: MTP weights under ``model.layers.{num_hidden_layers}.*``) and ``training.json``
(corpus provenance, hyper-parameters, loss curve, held-out bits per byte beside a unigram baseline, the MTP's top-1
agreement with the model's next-next token).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.masking_utils import create_causal_mask
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3DecoderLayer,
    DeepseekV3RMSNorm,
    DeepseekV3TopkRouter,
)

from deepinfer.model.embedded import HELDOUT_BELOW, stdlib_documents, unigram_bits
from deepinfer.qtensor import quantize_blocks

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
VOCAB = 4096
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=256,
    intermediate_size=768,
    moe_intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    routed_scaling_factor=2.5,
    kv_lora_rank=128,
    q_lora_rank=128,
    qk_rope_head_dim=32,
    v_head_dim=64,
    qk_nope_head_dim=64,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    hidden_act="silu",
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling={
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    rope_interleave=True,
    attention_bias=False,
    tie_word_embeddings=False,
    num_nextn_predict_layers=1,
    bos_token_id=0,
    eos_token_id=1,
    initializer_range=0.02,
)
HPARAMS = dict(
    seq_len=1024,
    batch=64,
    lr=2e-3,
    min_lr_ratio=0.1,
    warmup_steps=100,
    weight_decay=0.1,
    betas=(0.9, 0.95),
    grad_clip=1.0,
    mtp_loss_weight=0.3,
    bias_rate=1e-3,
    eval_every=100,
    distill_lr=1e-3,
    distill_warmup_steps=20,
    precision="bf16 autocast, fp32 master weights",
)
LICENCE = "Python Software Foundation License Version 2 (the standard library's source)"


# ---------------------------------------------------------------- corpus and tokenizer


def is_validation(path: str) -> bool:
    """Training-split files kept out of training to choose the step to keep (about 5% of the files)."""
    return hashlib.sha256(path.encode()).digest()[0] < 2 * HELDOUT_BELOW


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """Byte-level BPE of ``VOCAB`` tokens; ids 0 and 1 are begin/end of sentence; BOS is added to every encoding."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    return tok


def token_stream(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    """Every document as BOS, its tokens, EOS, one after the other."""
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(1)
    return torch.tensor(ids, dtype=torch.int64)


# ---------------------------------------------------------------- model


class MTPLayer(torch.nn.Module):
    """DeepSeek-V3's multi-token-prediction module (module docstring); ``embed``/``lm_head`` are the model's."""

    def __init__(self, config: DeepseekV3Config):
        super().__init__()
        h = config.hidden_size
        self.enorm = DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)
        self.hnorm = DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
        self.block = DeepseekV3DecoderLayer(config, layer_idx=config.num_hidden_layers)
        self.norm = DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)

    def forward(self, model: DeepseekV3ForCausalLM, hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """Logits for ``t_{i+2}`` from ``hidden[:, i]`` (the model's final hidden state) and ``next_ids[:, i]``."""
        x = self.eh_proj(torch.cat([self.enorm(model.model.embed_tokens(next_ids)), self.hnorm(hidden)], dim=-1))
        positions = torch.arange(x.shape[1], device=x.device)[None]
        mask = create_causal_mask(
            config=model.config, inputs_embeds=x, attention_mask=None, cache=None, position_ids=positions
        )
        rope = model.model.rotary_emb(x, positions)
        x = self.block(x, attention_mask=mask, position_ids=positions, position_embeddings=rope)
        return model.lm_head(self.norm(x))


def build(device: str, config: dict) -> tuple[DeepseekV3ForCausalLM, MTPLayer]:
    config = DeepseekV3Config(**config)
    model = DeepseekV3ForCausalLM._from_config(config, attn_implementation="sdpa", experts_implementation="grouped_mm")
    mtp = MTPLayer(model.config)
    mtp.apply(model._init_weights)
    return model.to(device), mtp.to(device)


class ExpertLoad:
    """Counts each router's expert choices in training forwards, and moves ``e_score_correction_bias`` towards
    balance after each step (DeepSeek-V3's auxiliary-loss-free balancing)."""

    def __init__(self, modules: list[torch.nn.Module]):
        self.routers = [m for root in modules for m in root.modules() if isinstance(m, DeepseekV3TopkRouter)]
        self.counts = [torch.zeros(r.num_experts, device=r.weight.device) for r in self.routers]
        for router, count in zip(self.routers, self.counts):
            router.register_forward_hook(lambda mod, args, out, c=count: self._count(mod, out, c))

    @staticmethod
    def _count(router, out, count: torch.Tensor) -> None:
        if router.training:
            count += torch.bincount(out[2].flatten(), minlength=count.numel())

    @torch.no_grad()
    def update(self, rate: float) -> float:
        """Applies one update; returns the worst layer's max-load / mean-load since the last one."""
        worst = 0.0
        for router, count in zip(self.routers, self.counts):
            mean = count.mean()
            router.e_score_correction_bias += rate * torch.sign(mean - count)
            worst = max(worst, (count.max() / mean.clamp(min=1)).item())
            count.zero_()
        return worst


def losses(model, mtp, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Main and MTP cross-entropy (nats per token) on ``window [B, T + 1]``."""
    inp, tgt = window[:, :-1], window[:, 1:]
    hidden = model.model(input_ids=inp).last_hidden_state
    logits = model.lm_head(hidden)
    main = F.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten())
    mtp_logits = mtp(model, hidden[:, :-1], inp[:, 1:])
    extra = F.cross_entropy(mtp_logits.flatten(0, 1).float(), tgt[:, 1:].flatten())
    return main, extra


def distill_loss(model, mtp, window: torch.Tensor) -> torch.Tensor:
    """KL divergence (nats per position) of the MTP's distribution of ``t_{i+2}`` from the frozen model's own, which
    it predicts at position ``i + 1``: what the MTP's drafts must match for verification to accept them."""
    inp = window[:, :-1]
    with torch.no_grad():
        hidden = model.model(input_ids=inp).last_hidden_state
        teacher = F.log_softmax(model.lm_head(hidden[:, 1:]).float(), dim=-1)
    student = F.log_softmax(mtp(model, hidden[:, :-1], inp[:, 1:]).float(), dim=-1)
    return F.kl_div(student.flatten(0, 1), teacher.flatten(0, 1), log_target=True, reduction="batchmean")


def lr_at(step: int, total: int, hp: dict) -> float:
    if step < hp["warmup_steps"]:
        return hp["lr"] * (step + 1) / hp["warmup_steps"]
    t = (step - hp["warmup_steps"]) / max(1, total - hp["warmup_steps"])
    return hp["lr"] * (hp["min_lr_ratio"] + (1 - hp["min_lr_ratio"]) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


# ---------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(model, mtp, stream: torch.Tensor, seq_len: int, batch: int) -> dict:
    """Over ``stream`` cut into windows of ``seq_len + 1`` tokens (one shared): the summed NLL (nats) of every
    predicted token but begin-of-sentence, their count, the model's top-1 accuracy, and the MTP's top-1 agreement
    with the model's own next-next prediction and with the text."""
    modes = model.training, mtp.training
    model.eval()
    mtp.eval()
    n = -(-(stream.numel() - 1) // seq_len)
    stream = F.pad(stream, (0, n * seq_len + 1 - stream.numel()), value=0)  # padding targets are BOS: not counted
    windows = torch.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])
    nll = count = correct = agree = mtp_correct = mtp_count = 0
    for w in windows.split(batch):
        w = w.to(model.device)
        inp, tgt = w[:, :-1], w[:, 1:]
        with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=model.device.type == "cuda"):
            hidden = model.model(input_ids=inp).last_hidden_state
            logits = model.lm_head(hidden).float()
            mtp_logits = mtp(model, hidden[:, :-1], inp[:, 1:]).float()
        keep = tgt != 0
        nll += F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), reduction="none")[keep.flatten()].sum().item()
        count += keep.sum().item()
        pred = logits.argmax(-1)
        correct += ((pred == tgt) & keep).sum().item()
        mtp_pred = mtp_logits.argmax(-1)
        agree += (mtp_pred == pred[:, 1:]).sum().item()
        mtp_correct += (mtp_pred == tgt[:, 1:]).sum().item()
        mtp_count += mtp_pred.numel()
    model.train(modes[0])
    mtp.train(modes[1])
    return dict(
        nll_nats=nll,
        tokens=count,
        top1=correct / count,
        mtp_agreement=agree / mtp_count,
        mtp_top1=mtp_correct / mtp_count,
    )


# ---------------------------------------------------------------- checkpoint


def mtp_tensors(mtp: MTPLayer, layer: int, config: DeepseekV3Config) -> dict[str, torch.Tensor]:
    """The MTP layer under DeepSeek's key names (per-expert keys, as transformers saves the main layers)."""
    p = f"model.layers.{layer}."
    out = {
        p + "enorm.weight": mtp.enorm.weight,
        p + "hnorm.weight": mtp.hnorm.weight,
        p + "eh_proj.weight": mtp.eh_proj.weight,
        p + "shared_head.norm.weight": mtp.norm.weight,
    }
    out.update(block_tensors(mtp.block, p, config))
    return out


def block_tensors(block: DeepseekV3DecoderLayer, prefix: str, config: DeepseekV3Config) -> dict[str, torch.Tensor]:
    """A decoder block's tensors under hub names: the fused expert tensors split per expert into
    ``gate_proj``/``up_proj``/``down_proj``."""
    out = {}
    inter = config.moe_intermediate_size
    for name, t in block.state_dict().items():
        if name == "mlp.experts.gate_up_proj":
            for e in range(t.shape[0]):
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = t[e, inter:]
        elif name == "mlp.experts.down_proj":
            for e in range(t.shape[0]):
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = t[e]
        else:
            out[prefix + name] = t
    return out


def is_fp32(name: str) -> bool:
    """The router's weight and bias stay fp32 (as DeepSeek's checkpoints keep them)."""
    return name.endswith(("mlp.gate.weight", "e_score_correction_bias"))


def is_fp8_linear(name: str) -> bool:
    """The linears DeepSeek-V3's FP8 checkpoints store in e4m3: every projection but the router and the head."""
    return name.endswith("proj.weight")


def save(model, mtp, tok: Tokenizer, out: Path) -> dict[str, int]:
    """Writes ``out/bf16`` and ``out/fp8``; returns each variant's weight-file size in bytes."""
    tmp = out / "transformers"
    model.save_pretrained(tmp)
    tensors = load_file(str(tmp / "model.safetensors"))
    config = json.loads((tmp / "config.json").read_text())
    layer = model.config.num_hidden_layers
    # the hand-made key mapping of the MTP block must be the one transformers applies to the main blocks
    mine = block_tensors(model.model.layers[layer - 1], f"model.layers.{layer - 1}.", model.config)
    theirs = {k: v for k, v in tensors.items() if k.startswith(f"model.layers.{layer - 1}.")}
    assert mine.keys() == theirs.keys(), sorted(set(mine) ^ set(theirs))
    assert all(torch.equal(mine[k].cpu().to(theirs[k].dtype), theirs[k]) for k in mine)
    tensors.update({k: v.detach().cpu() for k, v in mtp_tensors(mtp, layer, model.config).items()})
    tensors = {k: v.float() if is_fp32(k) else v.to(torch.bfloat16) for k, v in sorted(tensors.items())}
    config.pop("_experts_implementation", None)
    config.update(torch_dtype="bfloat16", dtype="bfloat16")
    sizes = {}
    for variant in ("bf16", "fp8"):
        d = out / variant
        d.mkdir(parents=True, exist_ok=True)
        weights, cfg = dict(tensors), dict(config)
        if variant == "fp8":
            for name in [n for n in tensors if is_fp8_linear(n)]:
                q = quantize_blocks(tensors[name].float(), (128, 128), "fp32")
                weights[name] = q.data
                weights[name.replace(".weight", ".weight_scale_inv")] = q.scale
            cfg["quantization_config"] = {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "weight_block_size": [128, 128],
            }
        save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        tok.save(str(d / "tokenizer.json"))
        sizes[variant] = (d / "model.safetensors").stat().st_size
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()
    return sizes


def load_trained(out: Path, device: str) -> tuple[DeepseekV3ForCausalLM, MTPLayer, Tokenizer, dict]:
    """The model, MTP layer, tokenizer and record that an earlier run wrote into ``out``, read back from its
    ``bf16/`` checkpoint (``save``'s inverse: each tensor copied into the view of a parameter that ``block_tensors``
    and ``mtp_tensors`` name it by; the weights as their bf16 values, the router's fp32)."""
    record = json.loads((out / "training.json").read_text())
    model, mtp = build("cpu", record["config"])
    tensors = load_file(str(out / "bf16" / "model.safetensors"))
    config = model.config
    targets = {k: v for k, v in model.state_dict().items() if not k.startswith("model.layers.")}
    for i, block in enumerate(model.model.layers):
        targets.update(block_tensors(block, f"model.layers.{i}.", config))
    targets.update(mtp_tensors(mtp, config.num_hidden_layers, config))
    if targets.keys() != tensors.keys():
        raise SystemExit(f"{out}: keys other than this script writes: {sorted(targets.keys() ^ tensors.keys())}")
    with torch.no_grad():
        for name, t in targets.items():
            t.copy_(tensors[name])
    return model.to(device), mtp.to(device), Tokenizer.from_file(str(out / "bf16" / "tokenizer.json")), record


# ---------------------------------------------------------------- training loop


def train_phase(
    modules, step_loss, score, data, hp, gen, load, *, minutes: float, steps: int | None, score_first: bool = False
) -> dict:
    """AdamW on the trainable parameters of ``modules`` over random windows of ``data``: ``step_loss(window)`` gives
    the loss and the values to log; every ``eval_every`` steps (and before the first where ``score_first``)
    ``score()`` gives a value to minimise and the values to log, and the modules' weights at the best score are
    restored at the end. ``steps``, or what fits ``minutes`` (measured on steps 10 to 40). Returns the step count, the
    kept step (0: the weights it started from), the seconds and the curves."""
    device = data.device.type
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [dict(params=decay, weight_decay=hp["weight_decay"]), dict(params=no_decay, weight_decay=0.0)],
        lr=hp["lr"],
        betas=hp["betas"],
        fused=device == "cuda",
    )
    total = steps or 10**9
    curve, val_curve, best, step, timing_start = [], [], None, 0, None
    if score_first:
        value, scored = score()
        val_curve.append(dict(step=0, **scored))
        best = (0, value, [copy.deepcopy(m.state_dict()) for m in modules])
    t_train = time.time()
    while step < total:
        starts = torch.randint(0, data.numel() - hp["seq_len"] - 1, (hp["batch"],), device=device, generator=gen)
        window = data[starts[:, None] + torch.arange(hp["seq_len"] + 1, device=device)]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, hp)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss, logged = step_loss(window)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, hp["grad_clip"])
        opt.step()
        imbalance = load.update(hp["bias_rate"])
        step += 1
        if steps is None and step == 10:
            if device == "cuda":
                torch.cuda.synchronize()
            timing_start = time.time()
        if steps is None and step == 40:
            if device == "cuda":
                torch.cuda.synchronize()
            per_step = (time.time() - timing_start) / 30
            total = max(step + 1, int((minutes * 60 - (time.time() - t_train)) / per_step) + step)
            print(f"{per_step * 1e3:.0f} ms a step: training {total} steps", flush=True)
        if step % 25 == 0 or step == total:
            row = dict(step=step, **{k: round(v.item(), 4) for k, v in logged.items()})
            row.update(lr=round(lr_at(step - 1, total, hp), 6), expert_imbalance=round(imbalance, 2))
            row["seconds"] = round(time.time() - t_train, 1)
            curve.append(row)
        if step % hp["eval_every"] == 0 or step == total:
            value, scored = score()
            row.update(scored)
            val_curve.append(dict(step=step, **scored))
            if best is None or value < best[1]:
                best = (step, value, [copy.deepcopy(m.state_dict()) for m in modules])
            print(json.dumps(row), flush=True)
    for m, state in zip(modules, best[2]):
        m.load_state_dict(state)
    return dict(
        steps=total,
        kept_step=best[0],
        seconds=round(time.time() - t_train, 1),
        loss_curve=curve,
        validation_curve=val_curve,
    )


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, help="training time budget when --steps is not given (default 5.5)")
    ap.add_argument("--steps", type=int, help="training steps (default: what fits --minutes)")
    ap.add_argument(
        "--distill-minutes",
        type=float,
        default=0.0,
        help="then train the MTP layer alone, for this long, to the frozen model's own next-next-token distribution "
        "(what speculative decoding's verification accepts); 0: no such phase, as for the shipped model",
    )
    ap.add_argument("--distill-steps", type=int, help="steps of that phase (default: what fits --distill-minutes)")
    ap.add_argument(
        "--distill-from",
        type=Path,
        help="skip the joint training: read the model an earlier run wrote into this directory (its bf16 weights, "
        "tokenizer and record, whose hyper-parameters it keeps), then distill (a longer main phase than one device "
        "call allows, in two)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-files", type=int, help="train on the first N files only (a smoke test)")
    ap.add_argument("--stdlib", type=Path, help="the library root to read (default: this interpreter's)")
    ap.add_argument("--stdlib-python", default=platform.python_version(), help="the Python version of --stdlib")
    ap.add_argument("--batch", type=int, help=f"sequences a step (default {HPARAMS['batch']})")
    ap.add_argument("--seq-len", type=int, help=f"tokens a sequence (default {HPARAMS['seq_len']})")
    ap.add_argument(
        "--layers",
        type=int,
        help="decoder layers before the MTP layer (default 4, the shipped model's; a deeper model makes its MTP layer "
        "a smaller share of a decode step, as DeepSeek-V3's one of 61 is)",
    )
    args = ap.parse_args(argv)
    joint = {"--minutes": args.minutes, "--steps": args.steps, "--layers": args.layers}
    joint |= {"--batch": args.batch, "--seq-len": args.seq_len}
    if args.distill_from and (given := [name for name, value in joint.items() if value is not None]):
        ap.error(f"{', '.join(given)}: the earlier run's, with --distill-from")
    layers = args.layers if args.layers is not None else CONFIG["num_hidden_layers"]
    if layers < 2:
        ap.error(f"--layers: expected at least 2 (a dense first layer, then MoE), got {layers}")
    hp = dict(HPARAMS, batch=args.batch or HPARAMS["batch"], seq_len=args.seq_len or HPARAMS["seq_len"])
    config = dict(CONFIG, num_hidden_layers=layers)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.time()
    torch.manual_seed(args.seed)
    prior = None
    if args.distill_from:
        model, mtp, tok, prior = load_trained(args.distill_from, device)
        config = prior["config"]
        hp.update({k: prior["hyperparameters"][k] for k in HPARAMS})

    train_docs, held_docs = stdlib_documents("train", args.stdlib), stdlib_documents("heldout", args.stdlib)
    if args.max_files:
        train_docs, held_docs = train_docs[: args.max_files], held_docs[: max(1, args.max_files // 20)]
    val_docs = [d for d in train_docs if is_validation(d.path)]
    train_docs = [d for d in train_docs if not is_validation(d.path)]
    corpus_hash = hashlib.sha256()
    for d in train_docs + val_docs + held_docs:
        corpus_hash.update(d.path.encode() + b"\0" + d.text.encode() + b"\0")
    if prior is None:
        tok = train_tokenizer([d.text for d in train_docs])
    elif prior["corpus"]["sha256"] != corpus_hash.hexdigest():
        raise SystemExit(f"--distill-from {args.distill_from}: trained on another corpus (its sha256 differs)")
    train = token_stream(tok, [d.text for d in train_docs])
    held = token_stream(tok, [d.text for d in held_docs])
    val = token_stream(tok, [d.text for d in val_docs])
    held_bytes = sum(len(d.text.encode()) for d in held_docs)
    print(
        f"corpus: {len(train_docs)} train files ({train.numel()} tokens), {len(held_docs)} held-out "
        f"({held.numel()} tokens, {held_bytes} bytes); {time.time() - t0:.0f}s",
        flush=True,
    )

    if prior is None:
        model, mtp = build(device, config)
    load = ExpertLoad([model, mtp])
    data = train.to(device)
    gen = torch.Generator(device=device).manual_seed(args.seed)

    def main_step(window: torch.Tensor) -> tuple[torch.Tensor, dict]:
        main_loss, mtp_loss = losses(model, mtp, window)
        return main_loss + hp["mtp_loss_weight"] * mtp_loss, dict(loss=main_loss, mtp_loss=mtp_loss)

    def main_score() -> tuple[float, dict]:
        v = evaluate(model, mtp, val, hp["seq_len"], hp["batch"])
        val_loss = round(v["nll_nats"] / v["tokens"], 4)  # the kept step is the first of the best rounded loss
        return val_loss, dict(val_loss=val_loss)

    if prior is None:
        main_phase = train_phase(
            [model, mtp],
            main_step,
            main_score,
            data,
            hp,
            gen,
            load,
            minutes=5.5 if args.minutes is None else args.minutes,
            steps=args.steps,
        )
    else:
        main_phase = {k: prior["hyperparameters"][k] for k in ("steps", "kept_step", "seed")}
        main_phase.update(
            seconds=prior["train_seconds"], loss_curve=prior["loss_curve"], validation_curve=prior["validation_curve"]
        )
    distilled = None
    if args.distill_minutes or args.distill_steps:
        before = evaluate(model, mtp, held, hp["seq_len"], hp["batch"])["mtp_agreement"]
        model.eval()  # frozen: its routers count no load, so their biases stay
        model.requires_grad_(False)
        dhp = dict(hp, lr=hp["distill_lr"], warmup_steps=hp["distill_warmup_steps"])

        def distill_score() -> tuple[float, dict]:
            agreement = evaluate(model, mtp, val, hp["seq_len"], hp["batch"])["mtp_agreement"]
            return -agreement, dict(val_mtp_agreement=round(agreement, 4))

        def distill_step(window: torch.Tensor) -> tuple[torch.Tensor, dict]:
            kl = distill_loss(model, mtp, window)
            return kl, dict(kl=kl)

        distilled = train_phase(
            [mtp],
            distill_step,
            distill_score,
            data,
            dhp,
            gen,
            load,
            minutes=args.distill_minutes,
            steps=args.distill_steps,
            score_first=True,
        )

    ev = evaluate(model, mtp, held, hp["seq_len"], hp["batch"])
    targets = held[1:]
    uni_bits = unigram_bits(train, targets[targets != 0], VOCAB)  # begin-of-sentence targets excluded
    ln2 = math.log(2)
    record = {
        "model": f"deepinfer tiny-py: DeepseekV3ForCausalLM of {config['num_hidden_layers']} layers + one MTP layer",
        "corpus": {
            "source": "the .py files of the Python standard library (deepinfer.model.embedded.stdlib_documents)",
            "python": args.stdlib_python,
            "licence": LICENCE,
            "train_files": len(train_docs),
            "heldout_files": len(held_docs),
            "train_tokens": train.numel(),
            "heldout_tokens": held.numel(),
            "heldout_bytes": held_bytes,
            "sha256": corpus_hash.hexdigest(),
            "split": "held out: first byte of sha256(relative path) < 13; validation (early stopping, not "
            "trained on): 13 to 25",
            "validation_files": len(val_docs),
        },
        "tokenizer": {"type": "byte-level BPE (tokenizers)", "vocab": VOCAB, "bos": 0, "eos": 1},
        "config": config,
        "hyperparameters": {
            **hp,
            "steps": main_phase["steps"],
            "kept_step": main_phase["kept_step"],
            "seed": main_phase.get("seed", args.seed),
            "tokens_seen": main_phase["steps"] * hp["batch"] * hp["seq_len"],
        },
        "hardware": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "software": {"torch": torch.__version__, "transformers": sys.modules["transformers"].__version__},
        "train_seconds": main_phase["seconds"],
        "heldout": {
            "bits_per_byte": ev["nll_nats"] / ln2 / held_bytes,
            "unigram_bits_per_byte": uni_bits / held_bytes,
            "loss_nats_per_token": ev["nll_nats"] / ev["tokens"],
            "top1": ev["top1"],
            "mtp_agreement_with_model_next_next_top1": ev["mtp_agreement"],
            "mtp_top1_vs_text": ev["mtp_top1"],
            "how": f"non-overlapping windows of {hp['seq_len']} tokens over the held-out files, begin-of-sentence "
            "targets excluded, bf16 autocast",
        },
        "loss_curve": main_phase["loss_curve"],
        "validation_curve": main_phase["validation_curve"],
    }
    if prior is not None:
        record["joint_training"] = f"read back from the bf16 weights of an earlier run ({args.distill_from.name})"
    if distilled is not None:
        record["mtp_distillation"] = dict(
            how="the model frozen; the MTP layer alone trained to the model's own distribution of each next-next "
            "token (distill_loss), the weights of the best validation agreement kept",
            **distilled,
        )
        record["heldout"]["mtp_agreement_before_distillation"] = before
    record["weights_bytes"] = save(model, mtp, tok, args.out)
    (args.out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: record[k] for k in ("heldout", "weights_bytes", "train_seconds")}, indent=1))
    print(f"total {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
