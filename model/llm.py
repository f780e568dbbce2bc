"""``LLM``: offline generation in the style of vLLM.

Prompts are text (with a ``tokenizer.json`` in the checkpoint) or lists of token ids::

    from deepinfer.model import LLM, SamplingParams
    llm = LLM("path/to/deepseek-checkpoint")          # or LLM() for the embedded model
    outs = llm.generate(["Hello", [0, 17, 42]], SamplingParams(max_tokens=32, temperature=0))
    outs[0].outputs[0].text, outs[1].outputs[0].token_ids

With the routed experts sharded over the ``N`` processes of a ``torch.distributed`` group (started by torchrun,
group initialised by the caller or by ``deepinfer generate --ep N``), every rank builds ``LLM(path, ..., ep=N)``
with the same arguments and calls ``generate`` with the same prompts; every rank returns the same outputs::

    torch.distributed.init_process_group(deepinfer.current_backend().dist_backend)  # None: gloo on the CPU
    llm = LLM("path/to/deepseek-checkpoint", ep=torch.distributed.get_world_size())
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import deepinfer
from deepinfer.errors import InputError
from deepinfer.kv_cache import KV_FORMATS
from deepinfer.selection import require
from deepinfer.validation import Check

from .checkpoint import Checkpoint
from .config_v4 import V4Checkpoint, is_v4_checkpoint
from .deepseek_v3 import DeepseekV3
from .deepseek_v4 import DeepseekV4
from .embedded import default_checkpoint
from .engine import LLMEngine, cache_page_bytes, check_kv_format
from .eplb import ExpertLoadBalancer, nodes_of
from .errors import RequestError
from .outputs import CompletionOutput, RequestOutput
from .parallel import RankSync, expert_parallel
from .sampling_params import SamplingParams
from .scheduler import PREEMPTION_MODES
from .sequence import Sequence
from .speculative import SpeculativeConfig
from .streaming import RequestStream
from .structured_output import Grammars
from .tokenizer import Tokenizer

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}
PROGRESS_MIN_PROMPTS = 8


class LLM:
    """A DeepSeek-V3-family checkpoint served by the continuous-batching engine on one backend.

    model: a Hugging Face layout directory (None: the embedded model, ``deepinfer.model.embedded``).
    backend: a backend name or alias (None: the selected one, as ``deepinfer.current_backend()``); every op of
    this LLM runs on it. dtype: activations and float weights, ``bfloat16`` (default) or ``float32``.
    kv_format: ``bf16`` or ``fp8_ds_mla``. block_size: tokens per cache page. num_blocks / kv_cache_gb: cache
    size (default: see ``LLMEngine``; ``kv_cache_gb`` holds at least one page). max_num_seqs: sequences running at
    once; max_num_batched_tokens: tokens per step; prefill_chunk_size: prefill chunk length; max_model_len: context
    limit (default: the model's).
    preemption_mode: ``swap`` (pages to host memory and back) or ``recompute``. enforce_eager: no CUDA graphs.
    async_scheduling: schedule and launch each step before the previous step's tokens are read back, so the host's
    work overlaps the device's (see ``LLMEngine``). enable_prefix_caching: a prompt reuses the cache pages of the
    longest prefix an earlier request computed, in whole prefill chunks, and prefills only the rest (each output's
    ``num_cached_tokens``; ``last_stats``' ``cached_prompt_tokens`` and ``prefilled_tokens``). host_cache_gb: a
    second tier of the prefix cache in host memory: pages evicted from the device (DeepSeek-V4's state snapshots
    included) are kept there and copied back on a hit (``last_stats``' ``host_cache``: pages copied out and back).
    device: torch device (default: the backend's device type). progress: progress bars for loading and for
    batches of at least 8 prompts (on rank 0 only under expert parallelism).

    ep: expert parallelism over this many ranks (None or 1: this process holds every expert). Above 1,
    ``torch.distributed`` must be initialised and ``ep_group`` (default: the default group) must have exactly ``ep``
    ranks, and ``ep`` must divide the model's routed experts plus ``num_redundant_experts`` (``ParallelError`` naming
    the argument otherwise, before any weight is read). This rank then loads only the experts its placement gives
    it (without redundant experts, its contiguous block); the rest of the model is replicated.
    Every rank must construct the LLM with the same arguments and make the same ``generate`` calls with the same
    prompts; all ranks then return the same outputs, the same as one process gives. Ranks that diverge anyway raise
    ``RankDivergenceError``; a rank that dies or hangs surfaces as the process group's error after its timeout.
    Over NCCL, drop the LLM (or call ``llm.engine.drop_cuda_graphs()``) before destroying the process group: its
    CUDA graphs hold captured collectives, which the destruction would wait for.

    Expert load balancing (vLLM's names; ``eplb.py``): num_redundant_experts: extra copies of experts (with
    ``ep`` above 1 and ``enable_eplb``; ``E + num_redundant_experts`` must be a multiple of ``ep``), placed by
    ``rebalance_experts`` on a uniform load at start; a hot expert's tokens are spread over its copies. enable_eplb:
    measure the tokens per expert of every MoE layer over the last ``eplb_window_size`` steps (``expert_load()``)
    and, every ``eplb_step_interval`` steps (None: never), re-place the experts from that load while serving: the
    new placement is computed off the step loop, then the weights of at most
    ``eplb_rebalance_layers_per_chunk`` MoE layers (SGLang's name; None: all at once) move between ranks in place
    per step, each layer switching to its new placement as its weights arrive, on every rank at the same step
    (``rebalance_experts()`` re-places at once). Outputs do not depend on the placement beyond fp32 reassociation
    in ``ep_combine`` (none in batch-invariant mode).
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        backend: str | None = None,
        *,
        dtype: str | torch.dtype = "bfloat16",
        kv_format: str = "bf16",
        block_size: int = 64,
        num_blocks: int | None = None,
        kv_cache_gb: float | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 4096,
        prefill_chunk_size: int = 1024,
        max_model_len: int | None = None,
        preemption_mode: str = "swap",
        enforce_eager: bool = False,
        async_scheduling: bool = True,
        enable_prefix_caching: bool = True,
        host_cache_gb: float = 0,
        device: str | torch.device | None = None,
        progress: bool = True,
        ep: int | None = None,
        ep_group: Any = None,
        speculative_config: SpeculativeConfig | dict | None = None,
        enable_eplb: bool = False,
        num_redundant_experts: int = 0,
        eplb_window_size: int = 1000,
        eplb_step_interval: int | None = 3000,
        eplb_rebalance_layers_per_chunk: int | None = 1,
    ):
        self.speculative_config = SpeculativeConfig.from_value(speculative_config)
        _check_arguments(
            dtype=dtype,
            kv_format=kv_format,
            block_size=block_size,
            num_blocks=num_blocks,
            kv_cache_gb=kv_cache_gb,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            prefill_chunk_size=prefill_chunk_size,
            max_model_len=max_model_len,
            preemption_mode=preemption_mode,
            host_cache_gb=host_cache_gb,
        )
        _check_eplb(
            enable_eplb, eplb_window_size, eplb_step_interval, eplb_rebalance_layers_per_chunk, num_redundant_experts
        )
        if model is None:
            model = default_checkpoint()
        self.path = Path(model)
        if backend is None:
            self.backend = deepinfer.current_backend().name
        else:
            # checks it is installed and available; this LLM pins it per call
            self.backend = require(backend, f"LLM(backend={backend!r})").name
        self.dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
        self.progress = progress
        with deepinfer.use(self.backend) as spec:
            self.device = torch.device(device if device is not None else spec.device_type)
            ckpt = V4Checkpoint.open(self.path) if is_v4_checkpoint(self.path) else Checkpoint.open(self.path)
            self.config = ckpt.config
            positions = self.config.max_position_embeddings
            if max_model_len is not None and max_model_len > positions:
                ckpt.close()
                raise InputError(
                    "LLM",
                    "max_model_len",
                    f"at most the model's max_position_embeddings ({positions}, {self.path / 'config.json'})",
                    str(max_model_len),
                )
            try:
                self.ep = expert_parallel(
                    ep,
                    self.config.n_routed_experts,
                    ep_group,
                    num_redundant_experts=num_redundant_experts,
                    num_groups=getattr(self.config, "n_group", 1) or 1,
                )
                if self.ep.world_size > 1:  # the load balancer's collectives run at steps its settings decide
                    RankSync(self.ep.group, self.device).check(
                        "engine start",
                        {
                            "expert load balancing settings": (
                                enable_eplb,
                                num_redundant_experts,
                                eplb_window_size,
                                eplb_step_interval,
                                eplb_rebalance_layers_per_chunk,
                                nodes_of(self.ep.world_size),
                            )
                        },
                    )
                mtp_layers = 1 if self.speculative_config is not None else 0
                if mtp_layers and not self.config.num_nextn_predict_layers:
                    raise InputError(
                        "LLM",
                        "speculative_config",
                        "a checkpoint with MTP layers (num_nextn_predict_layers >= 1) for method 'mtp'",
                        f"num_nextn_predict_layers 0 in {self.path / 'config.json'}",
                    )
                if mtp_layers and isinstance(ckpt, V4Checkpoint) and not ckpt.mtp_keys:
                    raise InputError(
                        "LLM",
                        "speculative_config",
                        "a checkpoint holding its MTP layers (mtp.0.*) for method 'mtp'",
                        f"none in {self.path}",
                    )
                check_kv_format(self.config, kv_format, "LLM", f", {self.path / 'config.json'}")
                elem = self.dtype.itemsize
                page_bytes = cache_page_bytes(self.config, kv_format, block_size, mtp_layers, elem)
                least, pages = "one cache page", 1
                if isinstance(ckpt, V4Checkpoint):  # a sequence's state pages come with its first token page
                    drafts = self.speculative_config.num_speculative_tokens if mtp_layers else 0
                    state = self.config.cache_layout(block_size, elem, kv_format, mtp_layers, drafts).state_pages
                    least, pages = f"one sequence's {state} state pages and one cache page", state + 1
                if kv_cache_gb is not None and kv_cache_gb * (1 << 30) < pages * page_bytes:
                    raise InputError(
                        "LLM", "kv_cache_gb", f"at least {least} ({pages * page_bytes} bytes)", repr(kv_cache_gb)
                    )
            except BaseException:
                ckpt.close()
                raise
            if self.ep.rank != 0:
                self.progress = False
            self.tokenizer = Tokenizer.from_dir(self.path, self.config.bos_token_id)
            self._grammars: Grammars | None = None  # built on the first structured-output request
            self._grammars_lock = threading.Lock()  # a server compiles constraints on threads of its own
            self.model = self._load(ckpt)
            self.eplb: ExpertLoadBalancer | None = None
            if enable_eplb:  # before the engine: CUDA graphs capture the counting
                self.eplb = ExpertLoadBalancer(
                    self.model,
                    window_size=eplb_window_size,
                    step_interval=eplb_step_interval,
                    num_nodes=nodes_of(self.ep.world_size),
                    layers_per_step=eplb_rebalance_layers_per_chunk,
                )
            self.engine = LLMEngine(
                self.model,
                kv_format=kv_format,
                block_size=block_size,
                num_blocks=num_blocks,
                kv_cache_bytes=None if kv_cache_gb is None else int(kv_cache_gb * (1 << 30)),
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                chunk_size=prefill_chunk_size,
                max_model_len=max_model_len,
                preemption_mode=preemption_mode,
                cuda_graphs=not enforce_eager,
                async_scheduling=async_scheduling,
                enable_prefix_caching=enable_prefix_caching,
                speculative_config=self.speculative_config,
                host_cache_bytes=int(host_cache_gb * (1 << 30)),
            )
            if self.eplb is not None:
                self.eplb.reset()
                self.engine.eplb = self.eplb
        self.last_stats: dict[str, float] = {}

    @property
    def max_model_len(self) -> int:
        """The context length: prompt plus generated tokens of one sequence, at most."""
        return self.engine.max_model_len

    def _load(self, ckpt: Checkpoint | V4Checkpoint) -> DeepseekV3 | DeepseekV4:
        if isinstance(ckpt, V4Checkpoint):
            mtp = self.speculative_config is not None
            total = ckpt.total_bytes() + (ckpt.mtp_bytes() if mtp else 0)

            def build(on_progress=None):
                return DeepseekV4.load(
                    ckpt, dtype=self.dtype, device=self.device, on_progress=on_progress, ep=self.ep, mtp=mtp
                )
        else:
            local = {f".experts.{e}." for e in self.ep.local}
            mtp = self.speculative_config is not None
            names = [*ckpt.layout, *(n for n in ckpt.mtp_layout if n in ckpt.tensors and mtp)]
            total = ckpt.total_bytes(n for n in names if ".experts." not in n or any(e in n for e in local))

            def build(on_progress=None):
                return DeepseekV3.load(
                    ckpt, dtype=self.dtype, device=self.device, ep=self.ep, on_progress=on_progress, mtp=mtp
                )

        if not self.progress:
            model = build()
            ckpt.close()
            return model
        with Progress(
            TextColumn("loading weights"),
            BarColumn(),
            DownloadColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=True,
        ) as bar:
            task = bar.add_task("load", total=total)
            model = build(lambda n: bar.advance(task, n))
        ckpt.close()
        return model

    def expert_load(self) -> torch.Tensor:
        """``[MoE layers, E]`` int64: tokens routed to each logical expert of each MoE layer over the last
        ``eplb_window_size`` steps, all ranks together (needs ``enable_eplb=True``; a collective under ``ep``: every
        rank calls it)."""
        if self.eplb is None:
            raise RequestError("expert load is measured only with LLM(..., enable_eplb=True)")
        return self.eplb.expert_load()

    def rebalance_experts(self) -> bool:
        """Re-places every MoE layer's experts now from the load over the last ``eplb_window_size`` steps (a
        rebalance under way is completed first) and moves the weights that change rank; returns whether a placement
        changed. Needs ``enable_eplb=True``; a collective under ``ep``: every rank calls it between the same two
        ``generate`` calls. The CUDA graphs stay valid (each layer's dispatch tables are rewritten in place)."""
        if self.eplb is None:
            raise RequestError("experts are re-placed only with LLM(..., enable_eplb=True)")
        return self.eplb.rebalance()

    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    def _to_ids(self, prompt: Any) -> tuple[list[int], str | None]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"]), prompt.get("prompt")
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"text prompts need a tokenizer.json in {self.path}; pass token ids instead")
            return self.tokenizer.encode(prompt), prompt
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt), None
        raise RequestError(f"a prompt is a str, a list of token ids or a dict; got {type(prompt).__name__}")

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | dict | list[SamplingParams | dict] | None = None,
        *,
        progress: bool | None = None,
    ) -> list[RequestOutput]:
        """Generates for each prompt (a str, a list of token ids, or a list of those); returns one
        ``RequestOutput`` per prompt, in order. ``sampling_params``: one for all, or one per prompt; each a
        ``SamplingParams`` or a dict of its fields (``{"max_tokens": 8, "temperature": 0}``).

        A call that raises, or is interrupted (``KeyboardInterrupt``), aborts every request it queued (and any
        queued directly on ``self.engine`` and not finished) and frees their cache pages first: the next call
        starts from a clean engine."""
        prompts, params = _requests(prompts, sampling_params)
        show = (self.progress if progress is None else progress) and len(prompts) >= PROGRESS_MIN_PROMPTS
        engine = self.engine
        start = time.perf_counter()
        gen0, prompt0 = engine.stats["generated_tokens"], engine.stats["prompt_tokens"]
        prefilled0 = engine.stats["prefilled_tokens"]
        spec0 = dataclasses.replace(engine.spec_stats)
        with deepinfer.use(self.backend):
            try:
                groups = self._add_all(prompts, params)
                seqs = [s for group in groups for s in group]
                # requests with stop strings: their text is followed step by step, and each ends at its stop string
                streams = [
                    RequestStream(s, self.tokenizer, s.params.stop, s.params.include_stop_str_in_output)
                    for s in seqs
                    if s.params.stop
                ]
                if show:
                    self._run_with_progress(len(seqs), start, gen0, streams)
                elif streams:
                    while engine.has_unfinished():
                        engine.step()
                        for stream in streams:
                            stream.update(engine)
                    engine.check_ranks_done()
                else:
                    engine.run_until_done()
            except BaseException:  # Ctrl-C included: nothing of this call may stay queued or hold cache pages
                engine.abort_all()
                raise
        elapsed = time.perf_counter() - start
        self.last_stats = {
            "requests": len(groups),
            "prompt_tokens": engine.stats["prompt_tokens"] - prompt0,
            "generated_tokens": engine.stats["generated_tokens"] - gen0,
            "prefilled_tokens": engine.stats["prefilled_tokens"] - prefilled0,
            "cached_prompt_tokens": sum(s.num_cached_tokens for s in seqs),
            "seconds": elapsed,
        }
        if engine.host_cache_stats is not None:
            self.last_stats["host_cache"] = engine.host_cache_stats
        texts = {id(st.seq): st.text for st in streams}
        if self.speculative_config is not None:
            self.last_stats["speculative"] = engine.spec_stats.since(spec0).as_dict()
        return [self._output(group, [texts.get(id(s)) for s in group]) for group in groups]

    def stream(
        self,
        prompts: Any,
        sampling_params: SamplingParams | dict | list[SamplingParams | dict] | None = None,
    ) -> Iterator[RequestOutput]:
        """Generates as ``generate`` does, yielding outputs as they grow: after each engine step, one
        ``RequestOutput`` per request that gained tokens or text, holding all of them so far (``finished`` False),
        and for each request once its final output (``finished`` True, the same as ``generate``'s). The text of an
        unfinished output never ends in an incomplete character or in what may be the start of a stop string.
        Closing the iterator early (``break``, an exception in the loop) aborts the requests still running and frees
        their pages. With ``n > 1`` each output yielded holds the one completion that changed (its ``index`` says
        which), and each completion ends with its own final output."""
        prompts, params = _requests(prompts, sampling_params)
        engine = self.engine
        with deepinfer.use(self.backend):
            groups = self._add_all(prompts, params)
        index = {id(s): i for group in groups for i, s in enumerate(group)}
        seqs = [s for group in groups for s in group]
        streams = [RequestStream(s, self.tokenizer, s.params.stop, s.params.include_stop_str_in_output) for s in seqs]
        try:
            while engine.has_unfinished() and any(not st.finished for st in streams):
                with deepinfer.use(self.backend):
                    engine.step()
                    updated = [st for st in streams if st.update(engine) is not None]
                for st in updated:
                    out = self._output([st.seq], [st.text])
                    out.outputs[0].index = index[id(st.seq)]
                    if not st.finished:
                        done = st.sent_tokens
                        out.outputs[0].token_ids = out.outputs[0].token_ids[:done]
                        for name in ("logprobs", "top_logprobs"):
                            values = getattr(out.outputs[0], name)
                            if values is not None:
                                setattr(out.outputs[0], name, values[:done])
                        out.outputs[0].finish_reason, out.finished = None, False
                    yield out
        finally:
            with deepinfer.use(self.backend):
                for st in streams:
                    engine.abort(st.seq)  # nothing for those already finished
                if not engine.has_unfinished():
                    engine.check_ranks_done()

    def _add_all(self, prompts: list, params: list[SamplingParams]) -> list[list[Sequence]]:
        """Queues every prompt's ``n`` completions; returns them by prompt."""
        encoded = [self._to_ids(p) for p in prompts]  # every prompt and constraint checked before any is queued
        children = [sp.children() for sp in params]
        matchers = [[self._matcher(c) for c in group] for group in children]
        return [
            [self.engine.add_request(ids, c, prompt=text, matcher=m) for c, m in zip(group, ms)]
            for (ids, text), group, ms in zip(encoded, children, matchers)
        ]

    def _matcher(self, params: SamplingParams):
        """The grammar matcher of a structured-output request (None without a constraint). Thread-safe."""
        if params.structured_outputs is None:
            return None
        with self._grammars_lock:
            if self._grammars is None:
                file = self.path / "tokenizer.json"
                if not file.is_file():
                    raise RequestError(f"structured output needs the checkpoint's tokenizer ({file} not found)")
                self._grammars = Grammars(file, self.config.vocab_size, self.config.eos_token_ids)
        return self._grammars.matcher(params.structured_outputs)

    def _run_with_progress(self, total: int, start: float, gen0: int, streams: list[RequestStream]) -> None:
        engine = self.engine
        with Progress(
            TextColumn("generating"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=True,
        ) as bar:
            task = bar.add_task("generate", total=total, rate="")
            while engine.has_unfinished():
                ended = {id(seq) for seq in engine.step()}
                for st in streams:  # requests ended at a stop string are not among those the step reports
                    delta = st.update(engine)
                    if delta is not None and delta.finished and id(st.seq) not in ended:
                        ended.add(id(st.seq))
                done = len(ended)
                rate = (engine.stats["generated_tokens"] - gen0) / max(time.perf_counter() - start, 1e-9)
                bar.update(task, advance=done, rate=f"{rate:.1f} tok/s")
        engine.check_ranks_done()

    def _output(self, seqs: list[Sequence], texts: list[str | None]) -> RequestOutput:
        """The output of one prompt's completions ``seqs`` (prompt-level fields from the first); ``texts``: each
        one's text where a ``RequestStream`` followed it (stop strings), else None."""
        completions = []
        for i, (seq, text) in enumerate(zip(seqs, texts)):
            p, ids = seq.params, seq.generated_ids
            if text is None:
                text = self.tokenizer.decode(ids, p.skip_special_tokens) if self.tokenizer is not None else ""
            completions.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=ids,
                    logprobs=list(seq.logprobs) if p.logprobs is not None else None,
                    top_logprobs=list(seq.top_logprobs) if p.logprobs else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        seq, p = seqs[0], seqs[0].params
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
            outputs=completions,
            prompt_logprobs=list(seq.prompt_logprobs) if p.prompt_logprobs is not None else None,
            prompt_top_logprobs=list(seq.prompt_top_logprobs) if p.prompt_logprobs else None,
            metrics={"preemptions": sum(s.num_preemptions for s in seqs)}
            | (
                {"drafted": sum(s.num_drafted for s in seqs), "accepted": sum(s.num_accepted for s in seqs)}
                if self.speculative_config
                else {}
            ),
            num_cached_tokens=seq.num_cached_tokens,
        )


def _requests(prompts: Any, sampling_params: Any) -> tuple[list, list[SamplingParams]]:
    """The prompts of a ``generate`` call as a list, and one ``SamplingParams`` for each."""
    single = isinstance(prompts, (str, dict)) or (
        isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts)
    )
    prompts = [prompts] if single else list(prompts)
    if sampling_params is None:
        sampling_params = SamplingParams()
    params = [
        _sampling_params(p)
        for p in (sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts))
    ]
    if len(params) != len(prompts):
        raise RequestError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
    return prompts, params


def _sampling_params(p: Any) -> SamplingParams:
    if isinstance(p, SamplingParams):
        return p
    if isinstance(p, dict):
        return SamplingParams.from_dict(p)
    raise RequestError(
        f"sampling_params: expected a SamplingParams, a dict of its fields or a list of those, got {type(p).__name__}"
    )


def _check_eplb(enable: Any, window: Any, interval: Any, layers_per_chunk: Any, redundant: Any) -> None:
    c = Check("LLM")
    if not isinstance(enable, bool):
        raise c.fail("enable_eplb", "a bool", repr(enable))
    c.positive_int("eplb_window_size", window)
    if interval is not None:
        c.positive_int("eplb_step_interval", interval)
    if layers_per_chunk is not None:
        c.positive_int("eplb_rebalance_layers_per_chunk", layers_per_chunk)
    if not enable and redundant != 0 and isinstance(redundant, int) and not isinstance(redundant, bool):
        # redundant copies are placed, and kept up to date, by the load balancer
        raise c.fail("num_redundant_experts", "0 without enable_eplb=True", repr(redundant))


def _check_arguments(**kw: Any) -> None:
    """The constructor's arguments, before anything is read: ``InputError`` naming the argument, what it takes and
    what it got."""
    c = Check("LLM")
    dtype = kw["dtype"]
    if (DTYPES.get(dtype) if isinstance(dtype, str) else dtype) not in (torch.bfloat16, torch.float32):
        raise c.fail("dtype", "bfloat16 or float32 (a name or a torch.dtype)", repr(dtype))
    c.choice("kv_format", kw["kv_format"], KV_FORMATS)
    c.choice("preemption_mode", kw["preemption_mode"], PREEMPTION_MODES)
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size"):
        c.positive_int(name, kw[name])
    if kw["prefill_chunk_size"] > kw["max_num_batched_tokens"]:
        raise c.fail(
            "prefill_chunk_size",
            f"at most max_num_batched_tokens ({kw['max_num_batched_tokens']})",
            str(kw["prefill_chunk_size"]),
        )
    if kw["num_blocks"] is not None:
        c.positive_int("num_blocks", kw["num_blocks"])
    gb = kw["kv_cache_gb"]
    if gb is not None and (isinstance(gb, bool) or not isinstance(gb, (int, float)) or not 0 < gb < math.inf):
        raise c.fail("kv_cache_gb", "a finite number > 0 or None", repr(gb))
    host = kw["host_cache_gb"]
    if isinstance(host, bool) or not isinstance(host, (int, float)) or not 0 <= host < math.inf:
        raise c.fail("host_cache_gb", "a finite number >= 0", repr(host))
    if kw["max_model_len"] is not None:
        c.positive_int("max_model_len", kw["max_model_len"], minimum=2)  # one prompt token and one generated
