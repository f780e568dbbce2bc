"""CUDA graphs of the decode step, for backends whose ``BackendSpec.capabilities`` contain ``cuda_graphs``.

One graph per batch bucket (1, 2, 4, 8, then multiples of 16 up to ``max_batch``, then a few up to a short prompt's
rows: ``buckets``) is captured over static input
buffers; a decode step of ``n`` sequences packs its inputs for the smallest bucket ``>= n`` on the host and copies
them in with two transfers (int64 and int32 fields), copies in on the device the tokens that the previous step is
still sampling (asynchronous scheduling, ``engine.py``), then replays the graph. With speculative steps launched
ahead (``launch_ahead``) the graphs also move each row on by a shift a step copies in on the device (the drafts the
step in flight accepts; zero otherwise), computing positions, lengths and slots from the static inputs inside the
graph (``forward_batch.moved_decode_rows``). A short prompt's chunk replays them as decode rows too, one row per
token (``scheduler.PrefillChunk.short``). Padding rows have ``seq_len`` 0 (``mla_decode`` returns zeros for them,
``indexer_topk`` keeps no slot), slot -1 (``write_kv_cache`` skips them) and token 0; their logits are dropped.
The captured forward dispatches experts in ``low_latency`` mode (fixed capacity, no host synchronisation) and
computes the logits of every row and their greedy tokens (``greedy.py``); other sampling stays outside the graph.

The graphs hold the kernels of the mode that was on at capture, default or batch-invariant: they are replayed only
in that mode. In batch-invariant mode a row's bits do not depend on the bucket, the padding or the dispatch mode, so
a step replayed from a graph gives the bits of the same step run eagerly.

Capture needs every op on the decode path to be free of host synchronisation on the chosen backend; if capture
fails (for example an op falls back to the reference), the graphs are dropped with a warning and decode runs
eagerly.

A model whose caches are state pages (DeepSeek-V4) reads and writes them through each row's block table, whatever
its sequence length: its padding rows get the table of a scratch page (``pad_page``) that no sequence holds, so
their writes land there. Its decode step takes its shapes from the bucket and the tables' width only
(``deepseek_v4.DecodeRows``), and reads every compressed entry (or indexer key) that width holds: so its graphs are
captured for several widths too (``width_buckets``), and a step replays the narrowest that holds its longest
table, reading at most four times its longest sequence's entries instead of ``max_model_len``'s. Such models are
not captured with speculative decoding.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

import deepinfer

from .deepseek_v3 import DeepseekV3
from .forward_batch import ForwardBatch, moved_decode_rows
from .greedy import greedy_tokens
from .speculative import MTPDrafter

CAPABILITY = "cuda_graphs"


def can_capture(backend, device: torch.device) -> bool:
    """Whether decode steps on ``device`` can be captured: a CUDA device and a backend with the capability."""
    return CAPABILITY in backend.capabilities and device.type == "cuda"


NARROWEST_TOKENS = 4096  # the narrowest width captured holds at least this many tokens' pages


def width_buckets(state_pages: int, token_pages: int, least: int) -> list[int]:
    """Block-table widths that get graphs of their own, smallest first: ``state_pages`` (pages every table starts
    with) plus ``token_pages``, then plus a quarter of the token pages before while that is at least ``least``."""
    out = [token_pages]
    while out[-1] // 4 >= least:
        out.append(out[-1] // 4)
    return [state_pages + t for t in reversed(out)]


def buckets(max_batch: int, prompt_rows: int = 0) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, 16, 32, 48, ... up to ``max_batch`` (which is always one); then, for
    a short prompt's rows, powers of two from 32 and ``prompt_rows`` itself (fewer buckets where rows are only a
    prompt's: a few padding rows cost less than a graph's outputs)."""
    out = [b for b in (1, 2, 4, 8) if b < max_batch]
    out += list(range(16, max_batch, 16))
    out += [b for b in (32, 64, 128, 256, 512) if max_batch < b < prompt_rows]
    return sorted({*out, max_batch, max(max_batch, prompt_rows)})


class DecodeGraphs:
    """Captured decode steps of ``model`` over ``kv_cache`` (and ``index_cache``, for sparse attention) for batches
    up to ``max_batch`` rows (and up to ``prompt_rows``, a short prompt's) of up to ``max_blocks`` pages each;
    ``pad_page``: the scratch page of padding rows (models whose caches are state pages); ``widths``: the block-table
    widths captured (``width_buckets``; default ``max_blocks`` alone). Graphs and their outputs are keyed by (batch
    bucket, width)."""

    def __init__(
        self,
        model: DeepseekV3,
        kv_cache: torch.Tensor,
        index_cache: torch.Tensor | None,
        *,
        max_batch: int,
        max_blocks: int,
        block_size: int,
        drafter: MTPDrafter | None = None,
        pad_page: int | None = None,
        widths: list[int] | None = None,
        prompt_rows: int = 0,
    ):
        self.model, self.drafter, self.block_size, self.pad_page = model, drafter, block_size, pad_page
        self.kv_caches = list(kv_cache.unbind(0))
        self.index_caches = list(index_cache.unbind(0)) if index_cache is not None else None
        self.sizes = buckets(max_batch, prompt_rows)
        max_batch = self.sizes[-1]
        self.max_blocks = max_blocks
        self.widths = widths or [max_blocks]
        if self.widths[-1] != max_blocks or self.widths != sorted(self.widths):
            raise ValueError(f"widths {self.widths}: ascending, ending at max_blocks {max_blocks}")
        dev = kv_cache.device
        # Bucket b's inputs are the first elements of two buffers: [input_ids | slot_mapping] (b each) in `wide`,
        # [positions | seq_lens | shift | block_table (b x width)] in `narrow`, so one copy each fills them.
        self.wide = torch.zeros(2 * max_batch, dtype=torch.int64, device=dev)
        self.narrow = torch.zeros(max_batch * (3 + max_blocks), dtype=torch.int32, device=dev)
        # Speculative steps launched ahead: the graphs move their rows on by the shift (0 unless a step copies one
        # in), as shift_decode_rows does eagerly, so that a step's shift costs the host one copy, not eight ops.
        self.shifts = drafter is not None and drafter.config.launch_ahead
        self.rows: dict[tuple[int, int], ForwardBatch] = {}  # the metadata each decode graph ran (moved on)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, int], torch.Tensor] = {}
        self.greedy: dict[tuple[int, int], torch.Tensor] = {}
        self.hidden: dict[tuple[int, int], torch.Tensor] = {}  # the final normed states of every row (the MTP reads)
        # Speculative decoding: the MTP pass over a bucket's rows, a graph of its own over the same metadata buffers
        # and two inputs of its own, the states and the next tokens; outputs (states, drafts, their probabilities:
        # None without a confidence threshold, MTPDrafter.draft).
        self.mtp_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.mtp_out: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
        if drafter is not None:
            self.mtp_in = torch.zeros(max_batch, model.cfg.hidden_size, dtype=model.dtype, device=dev)
            self.mtp_ids = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.last = (0, max_blocks)  # the (bucket, width) replayed last
        self.invariant = False  # the batch-invariant mode of the capture

    def batch(self, b: int, width: int | None = None) -> ForwardBatch:
        """The metadata of bucket ``b`` with block tables ``width`` pages wide (default ``max_blocks``), over the
        static input buffers."""
        width = width or self.max_blocks
        return ForwardBatch(
            positions=self.narrow[:b],
            slot_mapping=self.wide[b : 2 * b],
            num_decode=b,
            block_table=self.narrow[3 * b : b * (3 + width)].view(b, width),
            seq_lens=self.narrow[b : 2 * b],
            moe_mode="low_latency",
        )

    def _shift(self, b: int) -> torch.Tensor:
        return self.narrow[2 * b : 3 * b]

    def _inputs(self, key: tuple[int, int]) -> ForwardBatch:
        """The metadata a captured forward of ``key`` runs: ``batch(*key)``, moved on by the shift where steps are
        launched ahead."""
        fb = self.batch(*key)
        return moved_decode_rows(fb, self._shift(key[0]), self.block_size) if self.shifts else fb

    def _forward(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b = key[0]
        self.rows[key] = fb = self._inputs(key)
        hidden = self.model.forward(self.wide[:b], fb, self.kv_caches, self.index_caches)
        logits = self.model.compute_logits(hidden)
        return logits, greedy_tokens(logits), hidden

    def _into(self, widest: tuple[int, int]):
        """A forward whose outputs are copied into those of the bucket's widest graph (captured before it), so that
        a bucket's widths hold one set of outputs: its logits are the largest tensors the graphs keep."""
        held = (self.logits[widest], self.greedy[widest], self.hidden[widest])

        def forward(key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            for out, new in zip(held, self._forward(key)):
                out.copy_(new)
            return held

        return forward

    def _mtp_forward(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        d, b = self.drafter, key[0]
        state = d.mtp.forward(self.mtp_in[:b], self.mtp_ids[:b], self._inputs(key), *d.caches)
        return (state, *d.draft(state))

    def _capture_one(self, forward, key: tuple[int, int], pool):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), deepinfer.value_checks(False):  # as the engine's eager forward
            for _ in range(2):  # warm-up: lazy initialisation and autotuning happen outside the graph
                forward(key)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = forward(key)
        return graph, out

    def capture(self) -> bool:
        """Captures every (bucket, width), largest first (they share one memory pool). Returns False, with a warning
        and no graphs kept, if any capture fails."""
        pool = None
        self.invariant = deepinfer.batch_invariant_enabled()
        try:
            for key in [(b, w) for b in reversed(self.sizes) for w in reversed(self.widths)]:
                b, w = key
                self.wide[b : 2 * b].fill_(-1)  # the warm-up runs write no cache slot
                if self.pad_page is not None:  # nor any page but the scratch page
                    self.narrow[3 * b : b * (3 + w)].fill_(self.pad_page)
                widest = (b, self.widths[-1])
                forward = self._forward if w == widest[1] else self._into(widest)
                graph, outs = self._capture_one(forward, key, pool)
                self.logits[key], self.greedy[key], self.hidden[key] = outs
                pool = graph.pool()
                self.graphs[key] = graph
                if self.drafter is not None:
                    self.mtp_graphs[key], self.mtp_out[key] = self._capture_one(self._mtp_forward, key, pool)
            torch.cuda.synchronize()
        except Exception as e:  # capture errors come from any op or from torch itself
            for outputs in (
                self.graphs,
                self.logits,
                self.greedy,
                self.hidden,
                self.rows,
                self.mtp_graphs,
                self.mtp_out,
            ):
                outputs.clear()
            warnings.warn(f"CUDA graph capture of the decode step failed, decoding eagerly: {e}", stacklevel=2)
            return False
        return True

    def fits(self, n: int) -> bool:
        return bool(self.graphs) and 0 < n <= self.sizes[-1]

    def replays_mtp(self, n: int) -> bool:
        """Whether ``n`` rows' MTP pass can replay a graph now (captured, and in the mode of the capture)."""
        return bool(self.mtp_graphs) and self.fits(n) and self.invariant == deepinfer.batch_invariant_enabled()

    def run(
        self,
        *,
        input_ids: list[int],
        positions: list[int],
        slot_mapping: list[int],
        block_tables: list[list[int]],
        seq_lens: list[int],
        pending: tuple[torch.Tensor, torch.Tensor] | None = None,
        shift: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replays the smallest bucket that holds ``n = len(input_ids)`` rows; returns their logits ``[n, V]`` and
        greedy tokens ``[n]``, views of the graph's outputs: valid until the next replay of this graph or of one
        captured before it (one memory pool; ``ReplayedForward`` in the tests). ``pending``: ``(rows, tokens)``,
        input ids already on the device, written over ``input_ids[rows]``; ``shift [n]``: positions each row moves
        on, known on the device only (``shift_decode_rows``; only where ``shifts``). The width replayed is the
        narrowest captured that holds the longest of ``block_tables``."""
        n = len(input_ids)
        key = self._load(input_ids, positions, slot_mapping, block_tables, seq_lens)
        if pending is not None:
            self.wide.index_copy_(0, *pending)
        if shift is not None:
            self._shift_in(key[0], shift)
        self.graphs[key].replay()
        self.last = key
        if n == key[0]:
            return self.logits[key], self.greedy[key]
        return self.logits[key][:n], self.greedy[key][:n]

    def _shift_in(self, b: int, shift: torch.Tensor) -> None:
        """Copies ``shift [n]`` in for the first ``n`` rows of bucket ``b`` (``_load`` zeroed every row's)."""
        if not self.shifts:
            raise RuntimeError("a shift for decode graphs captured without launch_ahead, which never move rows on")
        self._shift(b)[: shift.shape[0]].copy_(shift)

    def _load(
        self,
        input_ids: list[int],
        positions: list[int],
        slot_mapping: list[int],
        block_tables: list[list[int]],
        seq_lens: list[int],
    ) -> tuple[int, int]:
        """Copies ``n`` rows' inputs into the smallest bucket ``b >= n`` (padding rows after them), with block tables
        as wide as the narrowest captured width that holds the longest of ``block_tables``; returns ``(b, width)``
        (columns past a table's end name page 0: a step masks what lies past its sequences' lengths)."""
        n = len(input_ids)
        b = next(s for s in self.sizes if s >= n)
        longest = max(len(t) for t in block_tables)
        width = next(w for w in self.widths if w >= longest)
        pin = self.wide.is_cuda
        # filled through numpy views of the (pinned) host buffers: a handful of host tensor ops less per call
        wide = torch.empty(2 * b, dtype=torch.int64, pin_memory=pin)
        w = wide.numpy()
        w[:n], w[n:b], w[b : b + n], w[b + n :] = input_ids, 0, slot_mapping, -1
        narrow = torch.empty(b * (3 + width), dtype=torch.int32, pin_memory=pin)
        a = narrow.numpy()
        a[:n], a[n:b], a[b : b + n], a[b + n : 3 * b] = positions, 0, seq_lens, 0
        table = a[3 * b :].reshape(b, width)
        table[:n, :longest] = [t + [0] * (longest - len(t)) for t in block_tables]
        table[:n, longest:] = 0
        table[n:] = 0 if self.pad_page is None else self.pad_page
        self.wide[: 2 * b].copy_(wide, non_blocking=True)  # pinned sources: the host allocator keeps them alive
        self.narrow[: narrow.numel()].copy_(narrow, non_blocking=True)
        return b, width

    def run_mtp(
        self,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        rows: dict | None = None,
        shift: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The MTP pass from a graph: over the rows of the last replay (``rows`` None: ``hidden`` and ``next_ids``
        have that bucket's rows, padding included), or over ``n = len(next_ids)`` new decode rows whose metadata
        ``rows`` gives (``run``'s keywords but ``input_ids``), moved on by ``shift`` as in ``run``. Returns the
        states, drafts and their probabilities (None without a confidence threshold) of the ``n`` rows, views of the
        graph's outputs, valid as ``run``'s are."""
        n = next_ids.shape[0]
        key = self.last if rows is None else self._load([0] * n, **rows)
        if rows is not None and shift is not None:
            self._shift_in(key[0], shift)
        self.mtp_in[:n].copy_(hidden)
        self.mtp_ids[:n].copy_(next_ids)
        if n < key[0]:
            self.mtp_ids[n : key[0]].zero_()
        self.mtp_graphs[key].replay()
        if n == key[0]:
            return self.mtp_out[key]
        return tuple(None if t is None else t[:n] for t in self.mtp_out[key])

    def replayed(self) -> tuple[torch.Tensor, ForwardBatch]:
        """The final normed states ``[b, H]`` of every row of the last replay, padding included, and the metadata it
        ran: tensors of the graphs' shared memory pool, valid until the next replay of any graph."""
        rows = self.rows[self.last]
        return self.hidden[self.last], dataclasses.replace(rows, _made=dict(rows._made))  # (a caller's own cache)
