"""The DeepSeek-V4 model on deepinfer ops, with per-sequence caches it owns.

Forward (numerics of transformers' ``DeepseekV4ForCausalLM``): the token embedding copied into ``hc_mult`` residual
streams; per layer, ``hc_pre`` collapses the streams into the block input, RMSNorm, the block, and ``hc_post`` forms
the next streams, once for attention and once for the MoE; ``hc_head`` folds the streams, a final RMSNorm, the head.

Attention of layer ``i`` over one key=value head of ``head_dim`` ``D`` (the key is the value):

- ``q = rope(rmsnorm_unweighted(wq_b(rmsnorm(wq_a(x)))))`` per head, ``kv = rope(rmsnorm(wkv(x)))``; rope rotates
  the last ``qk_rope_head_dim`` channels, interleaved, with the ``main`` table on sliding-window layers and the
  ``compress`` table (YaRN as ``config_v4`` reads it) on compressed layers.
- Every query at position ``p`` attends the window, the keys at positions ``p - sliding_window + 1 .. p``.
- A compressed layer of rate ``m`` also attends compressed entries. Entry ``w`` pools the tokens of window
  ``[w m, (w + 1) m)``: ``compress_kv`` over ``wkv`` / ``wgate`` projections plus a learned per-slot bias (``ape``),
  then RMSNorm and rope at position ``w m``. It is visible to query ``p`` once its window has closed:
  ``w < (p + 1) // m``. Heavily compressed attention (HCA) attends every visible entry. Compressed sparse attention
  (CSA) projects ``2 D`` per token, two series: an entry pools the first series of the previous window and the
  second of its own (``2m`` slots, overlapping windows); its lightning indexer (an own compressor at
  ``index_head_dim``, queries from the query's low-rank projection) keeps the ``index_topk`` visible entries of
  highest ``sum_h w_h relu(q_h . k)`` (``indexer_topk_entries``).
- ``sparse_attention_sinks`` attends window and entries alike with a learned sink per head, softmax scale
  ``D^-0.5``; the output's rope channels are rotated back by the query's position (the key was its value); the
  grouped low-rank output projection maps ``o_groups`` groups of heads through ``wo_a`` (one block per group,
  ``grouped_gemm``) and mixes them with ``wo_b``.

MoE: ``hash_moe`` layers take their experts from the frozen ``tid2eid[token]`` table (``moe_route_hash``), the others
route top-k by ``sqrtsoftplus`` scores plus a selection bias (``moe_route``); weights renormalised, times
``routed_scaling_factor``; experts and the shared expert use SwiGLU clipped at ``swiglu_limit``.

Weights of a quantised checkpoint keep its precision where the ops can take it (``load_weights``): FP8 linears are
``QTensor``s, whose activations ``ops.gemm`` / ``ops.grouped_gemm`` quantise per ``(1, 128)`` block; FP4 routed
experts are ``FP4Tensor`` stacks; the weights DeepSeek keeps in high precision (``config_v4.HIGH_PRECISION``) are
float.

Caches, in pages (``config_v4.V4CacheLayout`` has the layout): a sequence's block table starts with its state
pages (per layer the last keys as a ring; for a compressed layer the projections of its last positions, from which
it reads its unfinished window and, CSA, the window before it, the indexer's alike), then one token page per
``block_size`` tokens holding the compressed entries (and CSA indexer keys) whose windows start in it. ``V4State``
is one sequence's view of them: the engine's pages and the sequence's block table (``ForwardBatch.rows``), or pages
of its own (``DeepseekV4.new_state``). Entries and indexer keys are stored as ``kv_format`` records (the model's
dtype, or DeepSeek's FP8 records, ``fp8_ds_mla``, read back dequantised). Every layer reads what it attends from
the pages after writing what the step adds: the window's past keys, every entry so far (CSA: every indexer key,
then the entries the indexer chooses), gathered into the pools ``indexer_topk_entries`` and
``sparse_attention_sinks`` take: sequence by sequence, or, in a decode step of one new token per sequence on the
engine's pages, for all sequences at once (``DecodeRows``: their block tables and lengths on the device). A forward
takes any number of new tokens per sequence (a prompt, a chunk of one, one decode token); the result does not
depend on how a prompt is split, nor on where the pages are. Nothing in the pages is read beyond what the
sequence's length says is written (or read there and masked), so a recomputed sequence needs no clearing and a
swapped one resumes from its pages copied back.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer import ops, prepare_weight
from deepinfer.dispatch import explain
from deepinfer.qtensor import FP4_GROUP, UE8M0_DTYPE, FP4Tensor, QTensor

from .config_v4 import CSA, HCA, SLIDING, V4CacheLayout, V4Checkpoint, V4Config
from .forward_batch import ForwardBatch
from .mla import linear
from .moe import ExpertParallel, quantised_for, routed_experts, router_logits, router_weight
from .mtp import V4MTPLayer


def _rope_tail(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """Interleaved rope on the last ``rope_dim`` channels of ``x [T, H, D]``."""
    rotated = ops.rope(x[..., -rope_dim:], positions, table, True)
    return torch.cat([x[..., :-rope_dim], rotated], dim=-1)


def _rope_tail_back(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """``_rope_tail`` by the opposite angles: a pair ``(a, b)`` rotated back is the mirror ``(a, -b)`` rotated
    forward, mirrored again (so no second table is needed)."""

    def mirror(t: torch.Tensor) -> torch.Tensor:
        return torch.stack([t[..., 0::2], -t[..., 1::2]], -1).flatten(-2)

    return torch.cat([x[..., :-rope_dim], mirror(ops.rope(mirror(x[..., -rope_dim:]), positions, table, True))], -1)


def _state_chunks(
    layout: V4CacheLayout, tables: torch.Tensor, offset: int, rows: torch.Tensor, width: int
) -> tuple[torch.Tensor, int]:
    """Rows ``rows [B, R]`` (int64, on the device) of the ``[*, width]`` matrix at element ``offset`` of the state
    vector of each sequence whose block table is a row of ``tables [B, W]``, as ``[B, R, width / g]`` indices into
    the pages seen as ``[*, g]`` elements: ``g`` divides the width, the offset and a page, so that no chunk crosses a
    page and a row is read in a few whole chunks."""
    pe = layout.page_elems
    g = math.gcd(width, offset, pe)
    per_page = pe // g  # in chunks of g elements, as everything below (six kernels a call: a step calls it often)
    chunk = torch.arange(offset // g, (offset + width) // g, device=rows.device).add(rows[..., None], alpha=width // g)
    page = tables.gather(1, (chunk // per_page).reshape(rows.shape[0], -1)).view(chunk.shape)
    return (chunk % per_page).add_(page, alpha=per_page), g


def read_state_rows(
    flat: torch.Tensor, layout: V4CacheLayout, tables: torch.Tensor, offset: int, rows: torch.Tensor, width: int
) -> torch.Tensor:
    """Rows ``rows [B, R]`` of each sequence's ``[*, width]`` state matrix at element ``offset``, ``[B, R, width]``,
    from the pages ``flat`` (every page's elements in the model's dtype) through the block tables ``tables [B, W]``."""
    chunks, g = _state_chunks(layout, tables, offset, rows, width)
    return flat.view(-1, g)[chunks].view(*rows.shape, width)


def write_state_rows(
    flat: torch.Tensor,
    layout: V4CacheLayout,
    tables: torch.Tensor,
    offset: int,
    rows: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """Stores ``values [B, R, width]`` as rows ``rows [B, R]`` of each sequence's state matrix at ``offset``."""
    chunks, g = _state_chunks(layout, tables, offset, rows, values.shape[-1])
    flat.view(-1, g)[chunks] = values.reshape(*chunks.shape, g)


class V4State:
    """One sequence's caches in paged storage (``V4CacheLayout``): ``pages`` ``[num_blocks, page_bytes]`` uint8
    (the engine's cache, or pages of its own), the sequence's ``block_table`` (state pages, then token pages) and
    ``length``, the tokens whose caches are in place. ``DeepseekV4.new_state()`` makes one that grows pages of its
    own as it goes (``ensure``); the engine's come from ``ForwardBatch.rows``."""

    def __init__(
        self, layout: V4CacheLayout, pages: torch.Tensor, block_table: list[int], length: int, dtype: torch.dtype
    ):
        self.layout, self.block_table, self.length, self.dtype = layout, block_table, length, dtype
        self.own = False
        self._bind(pages)

    def _bind(self, pages: torch.Tensor) -> None:
        self.pages = pages
        self.bytes = pages.reshape(-1)
        self.flat = self.bytes.view(self.dtype)
        self._table: torch.Tensor | None = None

    @classmethod
    def private(cls, layout: V4CacheLayout, dtype: torch.dtype, device: torch.device) -> V4State:
        st = cls(layout, torch.zeros(0, layout.page_bytes, dtype=torch.uint8, device=device), [], 0, dtype)
        st.own = True
        return st

    def ensure(self, num_tokens: int) -> None:
        """Pages for ``num_tokens`` tokens: grows a state's own pages; checks the engine's."""
        need = self.layout.pages_for(num_tokens)
        if self.own and need > len(self.block_table):
            more = need - self.pages.shape[0]
            self._bind(torch.cat([self.pages, self.pages.new_zeros(more, self.pages.shape[1])]))
            self.block_table = list(range(need))
        if len(self.block_table) < need:
            raise RuntimeError(
                f"{num_tokens} tokens need {need} cache pages, the sequence holds {len(self.block_table)}"
            )

    def table(self) -> torch.Tensor:
        if self._table is None:
            self._table = torch.tensor(self.block_table, dtype=torch.int64).to(self.flat.device)
        return self._table

    # The state vector (the window ring, the unfinished windows), over the state pages.
    def read_state(self, offset: int, rows: torch.Tensor, width: int) -> torch.Tensor:
        """Rows ``rows [R]`` of the ``[*, width]`` matrix at element ``offset`` of the state vector, ``[R, width]``."""
        rows = rows.to(self.flat.device)[None]
        return read_state_rows(self.flat, self.layout, self.table()[None], offset, rows, width)[0]

    def write_state(self, offset: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Stores ``values [R, width]`` as rows ``rows [R]`` of the state matrix at ``offset``."""
        rows = rows.to(self.flat.device)[None]
        write_state_rows(self.flat, self.layout, self.table()[None], offset, rows, values[None])

    # Compressed entries and indexer keys, records in the token pages.
    def _records(self, layer: int, index: bool) -> torch.Tensor:
        """``[num_blocks, entries_per_page, record bytes]``: a layer's entry (or indexer key) region of every page."""
        lay = self.layout
        off = lay.index_offset[layer] if index else lay.entry_offset[layer]
        rec = lay.index_bytes if index else lay.entry_bytes
        shape = (self.bytes.shape[0] // lay.page_bytes, lay.entries_per_page[layer], rec)
        return self.bytes.as_strided(shape, (lay.page_bytes, rec, 1), self.bytes.storage_offset() + off)

    def _entry_slots(self, m: int, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, slot) of entries ``w`` (int64) of a layer of rate ``m``."""
        column, slot = self.layout.entry_place(m, w)
        return self.table()[column], slot

    def read_entries(
        self, layer: int, m: int, count: int, index: bool = False, which: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Entries (or indexer keys) ``0 .. count - 1`` of ``layer`` (or only those numbered ``which``), ``[n,
        width]`` in the model's dtype."""
        w = torch.arange(count, device=self.flat.device) if which is None else which
        return self._decode(self._records(layer, index)[self._entry_slots(m, w)], index)

    def write_entries(self, layer: int, m: int, first: int, values: torch.Tensor, index: bool = False) -> None:
        """Stores ``values [n, width]`` as entries (or indexer keys) ``first .. first + n - 1`` of ``layer``."""
        w = torch.arange(first, first + values.shape[0], device=self.flat.device)
        self._records(layer, index)[self._entry_slots(m, w)] = self._encode(values, index)

    def _encode(self, values: torch.Tensor, index: bool) -> torch.Tensor:
        """Records ``[n, record bytes]`` of ``values [n, width]`` (``V4CacheLayout`` says the format)."""
        lay = self.layout
        if lay.kv_format == "bf16":
            return values.contiguous().view(torch.uint8)
        fp8 = values if index else values[:, : lay.entry_width - lay.rope_dim]
        q = ops.quantize_fp8(
            fp8.contiguous(), block=lay.index_group if index else lay.entry_group, scale_format="ue8m0"
        )
        parts = [q.data.view(torch.uint8), q.scale.to(torch.float8_e8m0fnu).view(torch.uint8)]  # powers of two
        if not index:
            parts.append(values[:, fp8.shape[1] :].contiguous().view(torch.uint8))
        return torch.cat(parts, dim=1)

    def _decode(self, records: torch.Tensor, index: bool) -> torch.Tensor:
        lay = self.layout
        if lay.kv_format == "bf16":
            return records.view(self.dtype)
        width = lay.index_width if index else lay.entry_width - lay.rope_dim
        group = lay.index_group if index else lay.entry_group
        end = width + width // group
        data = records[:, :width].contiguous().view(torch.float8_e4m3fn)
        scale = records[:, width:end].contiguous().view(torch.float8_e8m0fnu).float()
        values = QTensor(data, scale, (1, group), "ue8m0").dequantize(self.dtype)
        if index:
            return values
        rope = records[:, end:].reshape(-1).clone()  # (storage of its own: the slice may sit off the dtype's alignment)
        return torch.cat([values, rope.view(self.dtype).view(records.shape[0], self.layout.rope_dim)], dim=1)


class DecodeRows:
    """One new token of each of a batch's sequences, whose caches are on ``state0``'s pages: their block tables
    ``tables [B, W]`` and new positions ``start [B]`` on the device, so that a layer reads and writes every
    sequence's caches in a few gathers instead of a loop over the sequences. Every shape a step takes from it
    depends on the number of sequences and the width of the block tables only, never on the lengths, which stay on
    the device (a CUDA graph's static inputs are such tensors)."""

    def __init__(self, state0: V4State, tables: torch.Tensor, start: torch.Tensor):
        self.layout, self.flat, self.state0 = state0.layout, state0.flat, state0
        self.tables, self.start = tables.long(), start.long()
        self._derived: dict[tuple, object] = {}

    def derived(self, key: tuple, make: Callable[[], object]) -> object:
        """``make()``: indices that depend on the step's positions and tables alone (ring rows, window and entry
        indices, entry slots), made at the first layer that asks for ``key`` and shared by the others: the same
        kernels would run again in every layer of the step."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    @classmethod
    def of_states(cls, states: list[V4State]) -> DecodeRows:
        """The rows of ``states`` (whose pages are one tensor), each at its length."""
        device = states[0].flat.device
        width = max(len(st.block_table) for st in states)
        tables = [st.block_table + [0] * (width - len(st.block_table)) for st in states]
        start = [st.length for st in states]
        return cls(states[0], torch.tensor(tables).to(device), torch.tensor(start).to(device))

    def entry_capacity(self, m: int) -> int:
        """Entries of a layer of rate ``m`` that the block tables' token pages hold: at least any sequence's."""
        return (self.tables.shape[1] - self.layout.state_pages) * -(-self.layout.block_size // m)

    def read_state(self, offset: int, rows: torch.Tensor, width: int) -> torch.Tensor:
        """``read_state_rows`` of this batch's sequences: ``[B, R, width]``."""
        return read_state_rows(self.flat, self.layout, self.tables, offset, rows, width)

    def write_state(self, offset: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        """``write_state_rows`` of this batch's sequences."""
        write_state_rows(self.flat, self.layout, self.tables, offset, rows, values)

    def _entry_slots(self, m: int, w: torch.Tensor, key: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, slot) of entries ``w`` of a layer of rate ``m`` (past a sequence's pages: some page, masked by the
        callers); ``key``: ``w`` is the step's ``derived`` tensor of that name, so these are too."""

        def place() -> tuple[torch.Tensor, torch.Tensor]:
            column, slot = self.layout.entry_place(m, w)
            return self.tables.gather(1, column.clamp(max=self.tables.shape[1] - 1)), slot

        return place() if key is None else self.derived(("entry slots", m, key), place)

    def read_entries(
        self, layer: int, m: int, w: torch.Tensor, index: bool = False, key: str | None = None
    ) -> torch.Tensor:
        """Entries (or indexer keys) ``w [B, C]`` of each sequence, ``[B, C, width]`` in the model's dtype; an entry
        past what a sequence holds reads some record: callers mask it. ``key``: as in ``_entry_slots``."""
        pages, slots = self._entry_slots(m, w, key)
        records = self.state0._records(layer, index)[pages, slots]
        width = self.layout.index_width if index else self.layout.entry_width
        return self.state0._decode(records.reshape(-1, records.shape[-1]), index).view(*w.shape, width)

    def write_entries(
        self, layer: int, m: int, w: torch.Tensor, values: torch.Tensor, index: bool = False, key: str | None = None
    ) -> None:
        """Stores ``values [B, width]`` as entry (or indexer key) ``w [B]`` of each sequence (``key``: as in
        ``_entry_slots``)."""
        pages, slots = self._entry_slots(m, w[:, None], key)
        self.state0._records(layer, index)[pages[:, 0], slots[:, 0]] = self.state0._encode(values, index)


@dataclass
class V4Batch:
    """One forward: sequence ``b`` contributes ``lens[b]`` consecutive tokens (packed in order) and ``states[b]``
    its caches; ``positions [T]`` int32 of every token. Built by ``DeepseekV4.batch``. ``decode`` is the
    ``DecodeRows`` of a batch of one new token per sequence on shared pages (None otherwise); ``moe_mode`` the
    experts' ``ep_dispatch`` mode; ``counted [T]`` int64, where set, 1 for the rows that count towards the expert
    load (0 for a CUDA graph's padding rows)."""

    states: list[V4State]
    lens: list[int]
    positions: torch.Tensor
    input_ids: torch.Tensor
    moe_mode: str = "normal"
    decode: DecodeRows | None = None
    counted: torch.Tensor | None = None

    def __post_init__(self):
        pages = {id(st.pages) for st in self.states}
        one_each = self.states and all(n == 1 for n in self.lens) and len(pages) == 1
        if self.decode is None and one_each:
            self.decode = DecodeRows.of_states(self.states)

    @property
    def offsets(self) -> list[int]:
        out, o = [], 0
        for n in self.lens:
            out.append(o)
            o += n
        return out


class Compressor:
    """One compressor: ``wkv``, ``wgate`` (``[c D, hidden]``, ``c`` 2 when overlapping), ``ape [m, c D]`` fp32 and
    ``norm [D]``; rope at each entry's first position from ``table``. Its unfinished window and previous window are
    kept in the state under ``prefix`` (``V4CacheLayout``)."""

    def __init__(
        self, w: dict, m: int, dim: int, overlap: bool, table: torch.Tensor, rope_dim: int, eps: float, prefix: str
    ):
        self.wkv, self.wgate, self.norm = w["wkv.weight"], w["wgate.weight"], w["norm.weight"]
        ape = w["ape"]
        self.bias = torch.cat([ape[:, :dim], ape[:, dim:]], 0).contiguous() if overlap else ape
        self.m, self.dim, self.overlap, self.table, self.rope_dim, self.eps = m, dim, overlap, table, rope_dim, eps
        self.prefix = prefix

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return linear(x, self.wkv), linear(x, self.wgate)

    def step(self, kv: torch.Tensor, gate: torch.Tensor, st: V4State, layer: int) -> torch.Tensor:
        """Takes the new rows ``kv, gate [n, c D]`` of a sequence at ``st.length``: returns the entries of the
        windows they close ``[w, D]`` (in order, from entry ``st.length // m``) and keeps the rows in the state's
        ring, where the next step finds its unfinished window (and, overlapping, the window before it)."""
        m, d, start, n = self.m, self.dim, st.length, kv.shape[0]
        offs, rows = st.layout.state_offset[layer], st.layout.compressor_rows(layer)
        at_kv, at_gate = offs[self.prefix + "buf_kv"], offs[self.prefix + "buf_gate"]
        base = start // m * m  # the unfinished window's first position
        lo = base - m if self.overlap and base else base
        if start > lo:
            past = torch.arange(lo, start) % rows
            kv = torch.cat([st.read_state(at_kv, past, kv.shape[1]), kv])
            gate = torch.cat([st.read_state(at_gate, past, gate.shape[1]), gate])
        keep = min(n, rows)
        new = torch.arange(start + n - keep, start + n) % rows
        st.write_state(at_kv, new, kv[kv.shape[0] - keep :])
        st.write_state(at_gate, new, gate[gate.shape[0] - keep :])
        w = (start + n) // m - start // m  # windows closed
        if w == 0:
            return kv.new_zeros(0, d)
        ck, cg = kv[base - lo :][: w * m].view(w, m, -1), gate[base - lo :][: w * m].view(w, m, -1)
        prev_kv = prev_gate = None
        if self.overlap:  # the first series of the window before each (none before the first)
            prev_kv, prev_gate = ck.new_zeros(w, m, d), cg.new_full((w, m, d), float("-inf"))
            prev_kv[1:], prev_gate[1:] = ck[:-1, :, :d], cg[:-1, :, :d]
            if lo < base:
                prev_kv[0], prev_gate[0] = kv[:m, :d], gate[:m, :d]
        return self._entries(ck, cg, prev_kv, prev_gate, start // m + torch.arange(w, device=kv.device))

    def _entries(self, ck, cg, prev_kv, prev_gate, entry: torch.Tensor) -> torch.Tensor:
        """Entries ``entry [w]`` ``[w, D]`` from their windows' projections ``ck, cg [w, m, c D]`` and, overlapping,
        the first series of the window before each ``prev_kv, prev_gate [w, m, D]`` (each window's second series
        after it): pooled, normed, rope at the window's first position."""
        if self.overlap:
            d = self.dim
            ck, cg = torch.cat([prev_kv, ck[..., d:]], dim=1), torch.cat([prev_gate, cg[..., d:]], dim=1)
        out = ops.rms_norm(ops.compress_kv(ck.contiguous(), cg.contiguous(), self.bias), self.norm, self.eps)[0]
        return _rope_tail(out[:, None], (entry * self.m).to(torch.int32), self.table, self.rope_dim)[:, 0]

    def step_rows(self, proj: tuple[torch.Tensor, torch.Tensor], dr: DecodeRows, layer: int) -> None:
        """``step`` for one new row of each sequence of ``dr`` (``proj``: its ``kv, gate [B, c D]``): every row into
        its sequence's ring, then every sequence's window ending at its row compressed and stored as the entry of
        that window. Where the window is still open the entry is not yet visible (``(start + 1) // m`` entries are)
        and the step that closes the window writes it again: so no step depends on which windows close."""
        kv, gate = proj
        m, d, lay = self.m, self.dim, dr.layout
        rows, offs = lay.compressor_rows(layer), lay.state_offset[layer]
        at_kv, at_gate = offs[self.prefix + "buf_kv"], offs[self.prefix + "buf_gate"]
        start = dr.start
        slot = dr.derived(("ring row", rows), lambda: (start % rows)[:, None])
        dr.write_state(at_kv, slot, kv[:, None])
        dr.write_state(at_gate, slot, gate[:, None])
        span = (2 if self.overlap else 1) * m  # the window and, overlapping, the one before it
        past = dr.derived(
            ("ring rows", span, rows),
            lambda: (start[:, None] - span + 1 + torch.arange(span, device=kv.device)).remainder(rows),
        )
        ck = dr.read_state(at_kv, past, kv.shape[1])
        cg = dr.read_state(at_gate, past, gate.shape[1])
        prev_kv = prev_gate = None
        if self.overlap:  # the window before, whose first series comes first (none before the first window)
            first = dr.derived(("first window", m), lambda: (start < m)[:, None, None])
            prev_kv = torch.where(first, 0.0, ck[:, :m, :d])
            prev_gate = torch.where(first, float("-inf"), cg[:, :m, :d])
            ck, cg = ck[:, m:], cg[:, m:]
        entry = dr.derived(("entry", m), lambda: start // m)
        values = self._entries(ck, cg, prev_kv, prev_gate, entry)
        dr.write_entries(layer, m, entry, values, self.prefix == "i", key="current")


class V4Attention:
    """One layer's attention (module docstring). ``w``: the layer's weights below ``attn.``."""

    def __init__(self, cfg: V4Config, layer: int, w: dict, tables: dict, dtype: torch.dtype):
        self.cfg, self.layer, self.kind = cfg, layer, cfg.attention_type(layer)
        self.w = w
        self.heads, self.dim, self.rd = cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim
        self.eps = cfg.rms_norm_eps
        rope = "main" if self.kind == SLIDING else "compress"
        self.table = tables[rope]
        self.ones = torch.ones(self.dim, dtype=dtype, device=w["wkv.weight"].device)
        self.m = cfg.compress_rate(layer)
        self.compressor = self.indexer = None
        if self.kind != SLIDING:
            comp = {k.removeprefix("compressor."): v for k, v in w.items() if k.startswith("compressor.")}
            self.compressor = Compressor(
                comp, self.m, self.dim, self.kind == CSA, tables["compress"], self.rd, self.eps, ""
            )
        if self.kind == CSA:
            idx = {
                k.removeprefix("indexer.compressor."): v for k, v in w.items() if k.startswith("indexer.compressor.")
            }
            di = cfg.index_head_dim
            self.indexer = Compressor(idx, self.m, di, True, tables["compress"], self.rd, self.eps, "i")
            self.index_scale = (cfg.index_n_heads * di) ** -0.5

    def forward(self, x: torch.Tensor, batch: V4Batch) -> torch.Tensor:
        cfg, w, t, d, pos = self.cfg, self.w, x.shape[0], self.dim, batch.positions
        q_res = ops.rms_norm(linear(x, w["wq_a.weight"]), w["q_norm.weight"], self.eps)[0]
        q = ops.rms_norm(linear(q_res, w["wq_b.weight"]).view(t, self.heads, d), self.ones, self.eps)[0]
        q = _rope_tail(q, pos, self.table, self.rd)
        kv = ops.rms_norm(linear(x, w["wkv.weight"]), w["norm.weight"], self.eps)[0]
        kv = _rope_tail(kv[:, None], pos, self.table, self.rd)[:, 0]
        comp = self.compressor.project(x) if self.compressor else None
        idx = self.indexer.project(x) if self.indexer else None

        index_q = None
        if self.kind == CSA:  # the lightning indexer's queries and their head weights
            qi = linear(q_res, w["indexer.wq_b.weight"]).view(t, cfg.index_n_heads, cfg.index_head_dim)
            qi = _rope_tail(qi, pos, self.indexer.table, self.rd)
            index_q = (qi, ops.gemm(x.float(), w["indexer.weights_proj.weight"], out_dtype=torch.float32))
        if batch.decode is not None:
            pool, indices = self._decode_pools(kv, comp, idx, batch.decode, index_q)
        else:
            pool, indices = self._pools(kv, comp, idx, batch, index_q)
        indices = torch.cat(indices, dim=1).to(torch.int32)
        out = ops.sparse_attention_sinks(q, torch.cat(pool), indices, w["attn_sink"], softmax_scale=d**-0.5)
        out = _rope_tail_back(out, pos, self.table, self.rd)
        g = cfg.o_groups
        per_group = torch.full((g,), t, dtype=torch.int32, device=x.device)
        o = torch.empty(t, g, w["wo_a"].shape[1], dtype=x.dtype, device=x.device)  # wo_b's rows, written in place
        grouped = out.reshape(t, g, -1).transpose(0, 1)
        ops.grouped_gemm(grouped, w["wo_a"], masked_m=per_group, out_dtype=x.dtype, out=o.transpose(0, 1))
        return linear(o.view(t, -1), w["wo_b.weight"])

    def _choose(self, index_q, keys, key_start, key_count, max_count: int | None = None) -> torch.Tensor:
        """The lightning indexer's choice among each query's range of ``keys`` (``index_q``: its queries and head
        weights; ``max_count``: a bound on the ranges, where known)."""
        qi, head_w = index_q
        return ops.indexer_topk_entries(
            qi, head_w * self.index_scale, keys, key_start, key_count, topk=self.cfg.index_topk, max_count=max_count
        )

    def _pools(self, kv, comp, idx, batch: V4Batch, index_q) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The key=value pool rows and each query's rows of it (window, then entries), sequence by sequence: any
        number of new tokens a sequence; ``index_q``: the indexer's queries and head weights (CSA)."""
        cfg, d, dev = self.cfg, self.dim, kv.device
        sw = cfg.sliding_window
        ring = batch.states[0].layout.window_rows if batch.states else 0
        layer = self.layer
        pool: list[torch.Tensor] = []
        base = 0
        window_idx, entry_idx = [], []
        key_pool, key_start, key_count, owners = [], [], [], []
        key_base = 0
        for st, n, o in zip(batch.states, batch.lens, batch.offsets):
            rows = slice(o, o + n)
            start, wo = st.length, st.layout.state_offset[layer]["window"]
            held = min(start, sw - 1)
            past = st.read_state(wo, torch.arange(start - held, start) % ring, d) if held else kv.new_zeros(0, d)
            keys = torch.cat([past, kv[rows]])
            i = torch.arange(n, device=dev)
            j = (i + held)[:, None] - torch.arange(sw, device=dev)[None, :]
            window_idx.append(torch.where(j >= 0, j + base, -1))
            pool.append(keys)
            base += keys.shape[0]
            keep = min(n, ring)  # the new keys the next steps' windows may need
            if keep:
                st.write_state(wo, torch.arange(start + n - keep, start + n) % ring, kv[o + n - keep : o + n])
            if self.compressor is None:
                continue
            count = (start + n) // self.m
            new = self.compressor.step(comp[0][rows], comp[1][rows], st, layer)
            if new.shape[0]:
                st.write_entries(layer, self.m, start // self.m, new)
            visible = (batch.positions[rows].long() + 1) // self.m  # entries whose window has closed
            if self.indexer is None:
                e = torch.arange(count, device=dev)[None, :]
                entry_idx.append(torch.where(e < visible[:, None], e + base, -1))
                pool.append(st.read_entries(layer, self.m, count))
                base += count
            else:  # only the entries the indexer chooses are read (below)
                new = self.indexer.step(idx[0][rows], idx[1][rows], st, layer)
                if new.shape[0]:
                    st.write_entries(layer, self.m, start // self.m, new, index=True)
                key_pool.append(st.read_entries(layer, self.m, count, index=True))
                key_start.append(torch.full((n,), key_base, dtype=torch.int32, device=dev))
                key_count.append(visible.to(torch.int32))
                owners.append((st, key_base, count))
                key_base += count

        indices = [torch.cat(window_idx)]
        if self.kind == HCA:
            width = max(e.shape[1] for e in entry_idx)
            indices.append(
                torch.cat([torch.nn.functional.pad(e, (0, width - e.shape[1]), value=-1) for e in entry_idx])
            )
        elif self.kind == CSA:
            picked = self._choose(index_q, torch.cat(key_pool), torch.cat(key_start), torch.cat(key_count))
            indices.append(self._chosen_entries(picked, owners, pool, base))
        return pool, indices

    def _decode_pools(self, kv, comp, idx, dr: DecodeRows, index_q) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``_pools`` for one new token per sequence, every sequence at once and in shapes that do not depend on the
        sequences' lengths: the window's past keys in one gather (positions before 0 masked), the new key and
        compressor rows in one scatter, every sequence's current window compressed together, the entries up to the
        block tables' capacity (or, CSA, the indexer keys, then the chosen entries) in one gather each, those not
        yet visible masked."""
        cfg, d, dev, layer = self.cfg, self.dim, kv.device, self.layer
        sw, lay, b, start = cfg.sliding_window, dr.layout, dr.start.shape[0], dr.start
        ring, at = lay.window_rows, lay.state_offset[layer]["window"]
        seqs = dr.derived(("sequences",), lambda: torch.arange(b, device=dev)[:, None])
        h = sw - 1  # past keys a row reads at most
        keys = kv[:, None]
        if h:  # the rows of the past positions (negative ones masked below)
            past = dr.derived(
                ("ring rows", h, ring), lambda: (start[:, None] - h + torch.arange(h, device=dev)).remainder(ring)
            )
            keys = torch.cat([dr.read_state(at, past, d), keys], dim=1)

        def window_indices() -> torch.Tensor:
            back = torch.arange(sw, device=dev)[None, :]  # how far back each window column is
            return torch.where(back <= start.clamp(max=sw - 1)[:, None], seqs * (h + 1) + h - back, -1)

        window = dr.derived(("window", sw), window_indices)
        if ring:
            dr.write_state(at, dr.derived(("ring row", ring), lambda: (start % ring)[:, None]), kv[:, None])
        pool, indices, base = [keys.reshape(-1, d)], [window], b * (h + 1)
        if self.compressor is None:
            return pool, indices
        m = self.m
        self.compressor.step_rows(comp, dr, layer)
        if self.indexer is not None:
            self.indexer.step_rows(idx, dr, layer)
        c = dr.entry_capacity(m)
        # every entry of a closed window is visible to the new token
        count = dr.derived(("visible entries", m), lambda: (start + 1) // m)
        entry = dr.derived(("entries", m, c), lambda: torch.arange(c, device=dev)[None, :].expand(b, c))
        if self.indexer is None:
            pool.append(dr.read_entries(layer, m, entry, key="all").reshape(-1, d))
            indices.append(
                dr.derived(
                    ("entry indices", m, c, base),
                    lambda: torch.where(entry < count[:, None], base + seqs * c + entry, -1),
                )
            )
            return pool, indices
        keys = dr.read_entries(layer, m, entry, index=True, key="all").reshape(b * c, cfg.index_head_dim)
        picked = self._choose(index_q, keys, (seqs[:, 0] * c).to(torch.int32), count.to(torch.int32), c)
        valid = picked >= 0
        which = (picked.long() - seqs * c).clamp(min=0)  # each query's rows are its own sequence's keys
        pool.append(dr.read_entries(layer, m, which).reshape(-1, d))
        k = picked.shape[1]
        indices.append(torch.where(valid, base + seqs * k + torch.arange(k, device=dev)[None, :], -1))
        return pool, indices

    def _chosen_entries(self, chosen: torch.Tensor, owners: list, pool: list[torch.Tensor], base: int) -> torch.Tensor:
        """Reads the entries ``chosen`` names (rows of the batch's indexer keys; ``owners``: each sequence's state,
        first row and count there) into ``pool`` from row ``base`` on, each once; returns ``chosen`` as pool rows
        (-1 kept)."""
        valid = chosen >= 0
        rows, where = torch.unique(chosen[valid].long(), return_inverse=True)  # ascending: sequence by sequence
        for st, first, count in owners:
            mine = rows[(rows >= first) & (rows < first + count)]
            if mine.numel():
                pool.append(st.read_entries(self.layer, self.m, count, which=mine - first))
        out = torch.full_like(chosen, -1, dtype=torch.int64)
        out[valid] = where + base
        return out


class V4MoE:
    """Routed experts (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``: dense, FP8 ``QTensor``
    stacks, or packed ``FP4Tensor`` stacks that ``ops.grouped_gemm`` takes as they are), the fp32 router
    (``gate.weight``, and ``gate.bias`` or the ``gate.tid2eid`` table) and the shared expert (dense or FP8), SwiGLU
    clipped. FP8 weights take FP8 activations: the tokens quantised once before the dispatch, the SwiGLU output
    quantised by ``silu_and_mul``."""

    def __init__(self, cfg: V4Config, layer: int, w: dict, ep: ExpertParallel):
        self.cfg, self.ep = cfg, ep
        self.hash = cfg.mlp_type(layer) == "hash_moe"
        self.gate, self.bias, self.tid2eid = router_weight(w["gate.weight"]), w.get("gate.bias"), w.get("gate.tid2eid")
        self.w13, self.w2 = w["experts.gate_up_proj"], w["experts.down_proj"]
        self.s13, self.s2 = w["shared_experts.gate_up_proj"], w["shared_experts.down_proj"]
        self.load: torch.Tensor | None = None  # [E] int64: when set, each forward adds its tokens per expert (eplb.py)
        # A row of the hash table may name an expert more than once (the expert then runs once per naming): the
        # low-latency dispatch's fixed capacity must hold that many rows per token.
        self.repeats = 1
        if self.tid2eid is not None and self.tid2eid.numel():
            ids = self.tid2eid
            self.repeats = int((ids[:, :, None] == ids[:, None, :]).sum(-1).max())

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor, mode: str = "normal", counted: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x [T, H]`` of tokens ``input_ids [T]`` -> ``[T, H]``, dispatched in ``ep_dispatch`` ``mode``
        (``counted``: ``V4Batch.counted``). Over several ranks (``ep``) a collective: every rank calls it with the
        same rows, routes its share of them (``ExpertParallel.token_share``) through the experts of all ranks, and
        gets the whole batch's output, as DeepSeek-V3's ``MoE`` does."""

        def layer(start: int, end: int, capacity: int | None) -> torch.Tensor:
            part = counted[start:end] if counted is not None else None
            return self._forward(x[start:end], input_ids[start:end], mode, capacity, part)

        return self.ep.run_share(x, mode, layer)

    def _forward(
        self, x: torch.Tensor, input_ids: torch.Tensor, mode: str, capacity: int | None, counted: torch.Tensor | None
    ) -> torch.Tensor:
        cfg, limit = self.cfg, self.cfg.swiglu_limit
        logits = router_logits(x, self.gate)
        if self.hash:
            weights, ids = ops.moe_route_hash(
                logits,
                self.tid2eid[input_ids],
                routed_scaling_factor=cfg.routed_scaling_factor,
                scoring=cfg.scoring_func,
            )
        else:
            weights, ids = ops.moe_route(
                logits,
                self.bias,
                top_k=cfg.num_experts_per_tok,
                routed_scaling_factor=cfg.routed_scaling_factor,
                scoring=cfg.scoring_func,
            )
        if self.load is not None and ids.numel():
            ones = torch.ones_like(ids, dtype=torch.int64) if counted is None else counted[:, None].expand_as(ids)
            self.load.index_add_(0, ids.reshape(-1).long(), ones.reshape(-1))
        if mode == "low_latency" and self.repeats > 1:
            capacity = (x.shape[0] if capacity is None else capacity) * self.repeats
        out = routed_experts(
            x,
            ids,
            weights,
            self.w13,
            self.w2,
            self.ep,
            num_experts=cfg.n_routed_experts,
            mode=mode,
            capacity=capacity,
            limit=limit,
        )
        shared = ops.silu_and_mul(linear(x, self.s13), limit=limit, **quantised_for(self.s2))
        return out + ops.gemm(shared, self.s2, out_dtype=x.dtype)


class DeepseekV4:
    """The model. ``new_state()`` makes one sequence's caches; ``forward(input_ids, batch)`` runs the new tokens of
    the batch's sequences (``batch(...)`` builds it) and returns the final residual streams, advancing every state;
    ``compute_logits`` gives fp32 logits from them. ``mtp`` holds the multi-token-prediction layers when loaded
    (``mtp.V4MTPLayer``)."""

    def __init__(self, cfg: V4Config, weights: dict, *, dtype: torch.dtype, device: torch.device, ep: ExpertParallel):
        self.cfg, self.dtype, self.device, self.ep = cfg, dtype, device, ep
        # the pages of ``new_state``; an engine sets its own (``use_pages``)
        self.block_size, self.kv_format, self.mtp_layers, self.drafts = 64, "bf16", 0, 0
        self.embed, self.norm = weights["embed_tokens.weight"], weights["norm.weight"]
        self.lm_head = weights["embed_tokens.weight" if cfg.tie_word_embeddings else "head.weight"]
        self.hc_head = tuple(weights[f"hc_head.hc_{k}"] for k in ("fn", "base", "scale"))
        rd, pmax = cfg.qk_rope_head_dim, cfg.max_position_embeddings
        main = ops.rope_cos_sin_cache(rd, pmax, cfg.rope_theta).to(device)
        compress = ops.rope_cos_sin_cache(rd, pmax, cfg.compress_rope_theta, cfg.compress_rope_scaling).to(device)
        self.tables = {"main": main, "compress": compress}
        self.layers = [self.build_block(i, weights, f"layers.{i}.") for i in range(cfg.num_hidden_layers)]
        n = cfg.num_hidden_layers
        self.mtp = [
            V4MTPLayer(weights, f"mtp.{k}.", self, n + k)
            for k in range(cfg.num_nextn_predict_layers)
            if f"mtp.{k}.e_proj.weight" in weights
        ]

    def moe_layers(self) -> list[V4MoE]:
        """The MoE of every decoder block, in order (not the multi-token-prediction layers')."""
        return [moe for _, _, _, moe, _ in self.layers]

    def build_block(self, layer: int, weights: dict, prefix: str) -> tuple:
        """Decoder block ``layer`` (its attention type, rate and MoE routing by that index) from the weights under
        ``prefix``: ``(attn_norm, attention, ffn_norm, moe, hc)``."""
        below = {k.removeprefix(prefix): v for k, v in weights.items() if k.startswith(prefix)}
        w_attn = {k[5:]: v for k, v in below.items() if k.startswith("attn.")}
        attn = V4Attention(self.cfg, layer, w_attn, self.tables, self.dtype)
        moe = V4MoE(self.cfg, layer, {k[4:]: v for k, v in below.items() if k.startswith("ffn.")}, self.ep)
        hc = {s: tuple(below[f"hc_{s}_{k}"] for k in ("fn", "base", "scale")) for s in ("attn", "ffn")}
        return below["attn_norm.weight"], attn, below["ffn_norm.weight"], moe, hc

    def block_forward(
        self, streams: torch.Tensor, block: tuple, batch: V4Batch, input_ids: torch.Tensor
    ) -> torch.Tensor:
        """One decoder block on the residual streams ``[T, hc_mult, hidden]``: the streams after it."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        hc_kw = {"sinkhorn_iters": cfg.hc_sinkhorn_iters, "eps": cfg.hc_eps, "norm_eps": eps}
        attn_norm, attn, ffn_norm, moe, hc = block
        collapsed, post, comb = ops.hc_pre(streams, *hc["attn"], **hc_kw)
        y = attn.forward(ops.rms_norm(collapsed, attn_norm, eps)[0], batch)
        streams = ops.hc_post(y, streams, post, comb)
        collapsed, post, comb = ops.hc_pre(streams, *hc["ffn"], **hc_kw)
        y = moe.forward(ops.rms_norm(collapsed, ffn_norm, eps)[0], input_ids, batch.moe_mode, batch.counted)
        return ops.hc_post(y, streams, post, comb)

    @classmethod
    def load(
        cls,
        ckpt: V4Checkpoint,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        on_progress: Callable[[int], None] | None = None,
        ep: ExpertParallel | None = None,
        mtp: bool = False,
    ) -> DeepseekV4:
        """Builds the model from a checked checkpoint: every weight read once, assembled, prepared once; of the
        routed experts only ``ep``'s local ones (default: one process holding all). ``mtp``: also its
        multi-token-prediction layers (``self.mtp``, empty when the checkpoint has none)."""
        device = torch.device(device)
        cfg = ckpt.config
        ep = ep or ExpertParallel.single(cfg.n_routed_experts)
        mtp = mtp and bool(ckpt.mtp_keys)
        weights = load_weights(ckpt, dtype, device, on_progress, ep, mtp)
        return cls(cfg, weights, dtype=dtype, device=device, ep=ep)

    def cache_layout(
        self,
        block_size: int | None = None,
        kv_format: str | None = None,
        mtp_layers: int | None = None,
        drafts: int | None = None,
    ) -> V4CacheLayout:
        """The layout of the paged caches in the model's dtype, for pages of ``block_size`` tokens with
        ``kv_format`` records, ``mtp_layers`` multi-token-prediction layers' caches and room for ``drafts``
        rejected drafts a step (by default the engine's, ``use_pages``)."""
        return self.cfg.cache_layout(
            block_size or self.block_size,
            self.dtype.itemsize,
            kv_format or self.kv_format,
            self.mtp_layers if mtp_layers is None else mtp_layers,
            self.drafts if drafts is None else drafts,
        )

    def use_pages(self, block_size: int, kv_format: str = "bf16", mtp_layers: int = 0, drafts: int = 0) -> None:
        """The engine's pages: their size, record format, the multi-token-prediction layers they hold caches of
        and the drafts a speculative step verifies at most; the layout ``forward`` reads them with."""
        self.cache_layout(block_size, kv_format, mtp_layers, drafts)  # refuses a format it cannot lay out
        self.block_size, self.kv_format, self.mtp_layers, self.drafts = block_size, kv_format, mtp_layers, drafts

    def new_state(self) -> V4State:
        """A sequence's caches outside an engine, on pages of its own that grow as it goes."""
        return V4State.private(self.cache_layout(), self.dtype, self.device)

    def batch(self, states: list[V4State], input_ids: torch.Tensor, lens: list[int]) -> V4Batch:
        """The batch of ``input_ids`` (packed, ``lens[b]`` new tokens of sequence ``b``), each sequence continuing
        from its state's length."""
        for s, n in zip(states, lens):
            s.ensure(s.length + n)
        pos = [torch.arange(s.length, s.length + n, dtype=torch.int32) for s, n in zip(states, lens)]
        positions = torch.cat(pos).to(self.device) if pos else torch.zeros(0, dtype=torch.int32, device=self.device)
        return V4Batch(states, list(lens), positions, input_ids)

    def forward(
        self, input_ids: torch.Tensor, batch: V4Batch | ForwardBatch, kv_caches=None, index_caches=None
    ) -> torch.Tensor:
        """``input_ids [T]`` -> the final residual streams ``[T, hc_mult * hidden]`` (what ``compute_logits`` folds
        and the multi-token-prediction layers read), the caches advanced. ``batch``: a ``V4Batch``, or the engine's
        ``ForwardBatch``, whose ``rows`` name the sequence of each run of rows: its caches are in the engine's pages
        (``kv_caches[0]``, ``[num_blocks, page_bytes]`` bytes, laid out by ``cache_layout()``) that its block table
        names; a ``ForwardBatch`` without ``rows`` is a CUDA graph's batch of decode rows, whose sequences are known
        by their block tables and positions on the device only. ``index_caches`` is not used."""
        if isinstance(batch, ForwardBatch):
            batch = self.engine_batch(input_ids, batch, kv_caches[0])
        streams = self.embed[input_ids][:, None, :].expand(-1, self.cfg.hc_mult, -1).contiguous()
        for block in self.layers:
            streams = self.block_forward(streams, block, batch, input_ids)
        for st, n_new in zip(batch.states, batch.lens):
            st.length += n_new
        return streams.flatten(1)

    def engine_batch(self, input_ids: torch.Tensor, fb: ForwardBatch, pages: torch.Tensor) -> V4Batch:
        """The ``V4Batch`` of the engine's ``fb`` over its ``pages``. Each run of rows continues its sequence from
        its first position: a run from position 0 (a new request, or one recomputed after preemption) starts from
        nothing, whatever its pages held before."""
        layout = self.cache_layout()
        pages = pages.reshape(pages.shape[0], -1)
        if pages.shape[1] != layout.page_bytes:
            raise RuntimeError(f"the engine's pages have {pages.shape[1]} bytes, the layout {layout.page_bytes}")
        if fb.rows is None:  # a CUDA graph's decode rows: padding rows have seq_len 0 and a scratch page's table
            rows = DecodeRows(V4State(layout, pages, [], 0, self.dtype), fb.block_table, fb.positions)
            counted = (fb.seq_lens > 0).long()
            return V4Batch([], [], fb.positions, input_ids, fb.moe_mode, decode=rows, counted=counted)
        states, lens = [], []
        for seq, start, n in fb.rows:
            st = V4State(layout, pages, seq.block_table, start, self.dtype)
            st.ensure(start + n)
            states.append(st)
            lens.append(n)
        return V4Batch(states, lens, fb.positions, input_ids, fb.moe_mode)

    def compute_logits(self, streams: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]`` of ``forward``'s streams ``[N, hc_mult * hidden]``: ``hc_head`` folds them, a
        final RMSNorm, the head."""
        return self.head_logits(streams, self.hc_head, self.norm)

    def head_logits(self, streams: torch.Tensor, hc_head: tuple, norm: torch.Tensor) -> torch.Tensor:
        """fp32 logits of residual streams ``[N, hc_mult * hidden]`` folded by ``hc_head`` (fn, base, scale) and
        normed by ``norm``, through the model's head."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        h = ops.hc_head(streams.view(-1, cfg.hc_mult, cfg.hidden_size), *hc_head, eps=cfg.hc_eps, norm_eps=eps)
        return ops.gemm(ops.rms_norm(h, norm, eps)[0], self.lm_head, out_dtype=torch.float32)


def _fp32(key: str) -> bool:
    """Weights used in fp32: mHC, sinks, compressor biases, norms, the router, the indexer's head weights."""
    last = key.split(".")[-1]
    return (
        ".hc_" in key
        or key.startswith("hc_head.")
        or last in ("attn_sink", "ape")
        or key.endswith(("norm.weight", "ffn.gate.weight", "ffn.gate.bias", "indexer.weights_proj.weight"))
    )


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def fp4_experts_served(cfg: V4Config, experts: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the selected backend runs ``grouped_gemm`` of ``experts`` FP4 expert weights against activations of
    ``dtype``, in both expert layouts, with an implementation of its own (not the fallback to the reference; the
    reference backend always does). Asks only the implementations' ``supports``, with weights one row high."""
    if cfg.quantization is None or cfg.quantization.get("expert_dtype") != "fp4" or experts == 0:
        return False
    width = {cfg.hidden_size, cfg.moe_intermediate_size}
    for k in width:
        w = FP4Tensor(
            torch.zeros(experts, 1, k // 2, dtype=torch.int8, device=device),
            torch.full((experts, 1, k // FP4_GROUP), 127, dtype=torch.uint8, device=device).view(UE8M0_DTYPE),
        )
        offsets = torch.ones(experts + 1, dtype=torch.int32, device=device)
        offsets[0] = 0
        masked = torch.zeros(experts, dtype=torch.int32, device=device)
        masked[0] = 1
        for layout in ({"expert_offsets": offsets, "masked_m": None}, {"expert_offsets": None, "masked_m": masked}):
            a = torch.zeros(*([1] if layout["masked_m"] is None else [experts, 1]), k, dtype=dtype, device=device)
            choices = explain("grouped_gemm", {"a": a, "w": w, **layout, "out_dtype": dtype})
            if any(c.status == "fallback" for c in choices):
                return False
    return True


def _dense(w: torch.Tensor | QTensor, dtype: torch.dtype) -> torch.Tensor:
    return w.dequantize(dtype) if isinstance(w, QTensor) else w


def _cat_rows(parts: list[torch.Tensor | QTensor], dtype: torch.dtype) -> torch.Tensor | QTensor:
    """Weights concatenated along dim 0 (gate then up): FP8 ``QTensor``s stay FP8 where every part but the last has
    whole 128-row blocks (so that each block scale still covers rows of one part); any other mix is dequantised to
    ``dtype``."""
    if all(isinstance(w, QTensor) for w in parts) and all(w.shape[0] % w.block[0] == 0 for w in parts[:-1]):
        return QTensor(torch.cat([w.data for w in parts]), torch.cat([w.scale for w in parts]), *_like(parts[0]))
    return torch.cat([_dense(w, dtype) for w in parts])


def _like(w: QTensor) -> tuple[tuple[int, int], str]:
    return w.block, w.scale_format


def _stack(ws: list[torch.Tensor | QTensor], dtype: torch.dtype) -> torch.Tensor | QTensor:
    """``[E, N, K]`` of the experts' ``[N, K]`` weights: FP8 where all are FP8, else dequantised to ``dtype``."""
    if all(isinstance(w, QTensor) for w in ws):
        return QTensor(torch.stack([w.data for w in ws]), torch.stack([w.scale for w in ws]), *_like(ws[0]))
    return torch.stack([_dense(w, dtype) for w in ws])


def _by_group(w: torch.Tensor | QTensor, groups: int, dtype: torch.dtype) -> torch.Tensor | QTensor:
    """``wo_a [g r, K]`` as ``[g, r, K]``: FP8 where each group's rows are whole 128-row blocks (or there is one
    group), so that no block scale covers rows of two groups; otherwise dequantised to ``dtype``."""
    rows = w.shape[0] // groups
    if isinstance(w, QTensor) and (groups == 1 or rows % w.block[0] == 0):
        scale = w.scale.view(groups, -1, w.scale.shape[1]).contiguous()
        return QTensor(w.data.view(groups, rows, -1).contiguous(), scale, *_like(w))
    return _dense(w, dtype).view(groups, rows, -1).contiguous()


def load_weights(
    ckpt: V4Checkpoint,
    dtype: torch.dtype,
    device: torch.device,
    on_progress: Callable[[int], None] | None = None,
    ep: ExpertParallel | None = None,
    mtp: bool = False,
) -> dict:
    """Every weight by normalised name (``mtp``: the multi-token-prediction layers' too), read once, assembled
    (experts stacked gate-and-up in ``ep.local``'s order, ``wo_a`` by group) and passed through ``prepare_weight``
    once; routed experts other than ``ep``'s local ones are not read (a redundant expert is read by every rank whose
    slots hold it). FP8 linears stay FP8 (``QTensor``, ``V4Checkpoint.read_fp8``) as DeepSeek runs them: the
    attention's ``wq_a``, ``wq_b``, ``wkv``, ``wo_a``, ``wo_b``, the indexer's ``wq_b``, the shared expert, FP8
    routed experts, the multi-token-prediction layers' ``e_proj`` / ``h_proj``; one whose scales the FP8 ops cannot
    take, or that cannot be assembled in FP8 (``_cat_rows``, ``_by_group``), is dequantised to ``dtype``, as are all
    the routed experts of a layer where one of them is. FP4 routed experts stay packed (``FP4Tensor`` stacks) where
    the selected backend has a grouped GEMM of its own for them (``fp4_experts_served``); otherwise they are
    dequantised to ``dtype``. Weights stored in float (bf16 checkpoints; the compressors, the indexer's
    ``weights_proj``, the router, the head) are read in ``dtype``, or in fp32 where the model computes in fp32."""
    cfg = ckpt.config
    ep = ep or ExpertParallel.single(cfg.n_routed_experts)
    out: dict = {}
    packed = fp4_experts_served(cfg, len(ep.local), dtype, device)

    def counted(fn: Callable[[], object]):
        before = ckpt.bytes_read
        w = fn()
        if on_progress is not None:
            on_progress(ckpt.bytes_read - before)
        return w

    def read_fp4(key: str) -> FP4Tensor | None:
        return counted(lambda: ckpt.read_fp4(key, device))

    def fp4_stacks(f: str) -> tuple[FP4Tensor, FP4Tensor] | None:
        """``[E, 2I, H]`` and ``[E, H, I]`` packed stacks of the local experts, or None where any of their weights
        is not FP4 with power-of-two scales."""
        w13, w2 = [], []
        for e in experts:
            w1, w3, down = (read_fp4(f + e + name) for name in ("w1.weight", "w3.weight", "w2.weight"))
            if w1 is None or w3 is None or down is None:
                return None
            w13.append((torch.cat([w1.data, w3.data]), torch.cat([_bytes(w1.scale), _bytes(w3.scale)])))
            w2.append((down.data, _bytes(down.scale)))
        return tuple(  # type: ignore[return-value]
            FP4Tensor(torch.stack([d for d, _ in ws]), torch.stack([s for _, s in ws]).view(UE8M0_DTYPE))
            for ws in (w13, w2)
        )

    def read(key: str, as_dtype: torch.dtype | None = None) -> torch.Tensor | QTensor:
        """The weight ``key``: FP8 kept as a ``QTensor`` where the FP8 ops take its scales, else a tensor."""
        if as_dtype is None:
            q = counted(lambda: ckpt.read_fp8(key, device))
            if q is not None:
                return q
        return counted(lambda: ckpt.read(key, as_dtype or (torch.float32 if _fp32(key) else dtype), device))

    def put(name: str, w) -> None:
        out[name] = prepare_weight(name, w)

    out["embed_tokens.weight"] = read("embed_tokens.weight")
    if not cfg.tie_word_embeddings:
        put("head.weight", read("head.weight"))
    put("norm.weight", read("norm.weight"))
    for k in ("fn", "base", "scale"):
        put(f"hc_head.hc_{k}", read(f"hc_head.hc_{k}"))
    experts = [f"experts.{e}." for e in ep.local]
    blocks = [f"layers.{i}." for i in range(cfg.num_hidden_layers)]
    if mtp:
        blocks += [f"mtp.{k}." for k in range(cfg.num_nextn_predict_layers)]
    for p in blocks:
        for key in ckpt.names:
            if not key.startswith(p) or ".experts." in key or ".shared_experts." in key:
                continue
            if key.endswith("wo_a.weight"):
                put(p + "attn.wo_a", _by_group(read(key), cfg.o_groups, dtype))
            elif key.endswith("gate.tid2eid"):
                out[key] = read(key, torch.int64).to(torch.int32)  # indexed, never an op argument
            else:
                put(key, read(key))
        f = p + "ffn."
        stacks = fp4_stacks(f) if packed else None
        if stacks is None:
            w13 = [_cat_rows([read(f + e + "w1.weight"), read(f + e + "w3.weight")], dtype) for e in experts]
            stacks = _stack(w13, dtype), _stack([read(f + e + "w2.weight") for e in experts], dtype)
        put(f + "experts.gate_up_proj", stacks[0])
        put(f + "experts.down_proj", stacks[1])
        s = f + "shared_experts."
        put(s[:-1] + ".gate_up_proj", _cat_rows([read(s + "w1.weight"), read(s + "w3.weight")], dtype))
        put(s[:-1] + ".down_proj", read(s + "w2.weight"))
    return out
