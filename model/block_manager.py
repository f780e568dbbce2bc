"""``BlockAllocator``: the pages of the paged latent cache, with automatic prefix caching.

The cache is ``num_blocks`` pages of ``block_size`` token slots; a sequence owns the pages in its block table, and
token ``i`` of the sequence lives in slot ``block_table[i // block_size] * block_size + i % block_size``. A model
that also keeps a fixed state per sequence in pages (DeepSeek-V4, ``seq_pages``) has those pages first in the table:
token ``i`` is then in page ``block_table[seq_pages + i // block_size]``.

Prefix caching (``enable_prefix_caching``, on by default). A full page of prompt tokens, once computed, is
registered under the key of its tokens chained to the key of the page before it (so a key identifies the whole
prefix up to the page's end). Pages are reference-counted: several sequences may share a registered page (they only
read it; a sequence writes only slots past its shared prefix). A page whose last reference goes stays registered and
counts as free; free pages are handed out least recently freed first, and handing out a registered one forgets its
key (eviction). ``match`` finds the longest registered prefix of a prompt and takes a reference on each of its pages.
Keys are exact (the tokens themselves are compared, not only a hash), and one allocator serves one engine, so one
model and one cache format: a page's content is a function of its key.

With a host tier (``host``, a ``HostPageCache``) an evicted page is copied to host memory under its key first, and
``match`` continues a prompt's cached prefix with the keys held there, copying them back into fresh pages (for
state pages, below).

With state pages (``seq_pages``: DeepSeek-V4's windows and unfinished compressor windows, which depend on the whole
prefix) a prefix is reusable only at a point where its state was kept: when a sequence's computed prompt reaches a
multiple of ``reuse_tokens`` (the page size and every compression rate divide it, so every entry of the pages
before it is written), its token pages are registered and a copy of its state pages is kept as a **snapshot**
under the key of its last page (``copy_pages`` copies pages on the device, in order with the steps). A token page
there holds compressed entries whose windows may end in the pages after it (where the page size is not a multiple
of a rate: V4-Flash's pages of 64 tokens and its rate of 128), so its key covers the tokens up to the end of its
group of ``reuse_tokens`` tokens (``page_keys``): two prompts that differ only after a page's end, within its
group, never share that page. ``match`` then
gives a prompt the token pages of its longest prefix that ends at a snapshot, and fresh state pages holding a copy
of it. Snapshot pages are free pages like registered ones: handing one out forgets the whole snapshot on the
device. With a host tier every page of the snapshot is first copied there (page ``i`` of the snapshot under
``key`` as ``snapshot_key(key, i)``), and ``match`` takes the longest prefix whose token pages are each on the
device or in the host tier and that ends at a snapshot on the device or wholly in the host tier: the host tier's
token pages are copied back into fresh pages (registered again) and its snapshot straight into the fresh state
pages, while free pages last (a shorter prefix, or none, otherwise).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from .sequence import Sequence

if TYPE_CHECKING:
    from .host_cache import HostPageCache

PageKey = tuple  # (key of the previous page or None, the page's tokens)
SNAPSHOT = "state"  # marks a snapshot's pages in the page -> key map (a page key starts with None or a key)
PARTIAL = "partial"  # starts the key of a page whose group of ``reuse_tokens`` does not end in the prompt


def snapshot_key(key: PageKey, i: int) -> tuple:
    """The host tier's key for page ``i`` of the snapshot kept under ``key``."""
    return (SNAPSHOT, key, i)


class BlockAllocator:
    """Hands out and takes back cache pages; reused least-recently-freed first (FIFO without prefix caching)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        seq_pages: int = 0,
        host: HostPageCache | None = None,
        reuse_tokens: int | None = None,
        copy_pages: Callable[[list[int], list[int]], None] | None = None,
    ):
        if num_blocks < 1 or block_size < 1 or seq_pages < 0:
            raise ValueError(
                f"need num_blocks >= 1, block_size >= 1 and seq_pages >= 0, got {num_blocks}, {block_size}, {seq_pages}"
            )
        if seq_pages and enable_prefix_caching and copy_pages is None:
            raise ValueError("prefix caching with state pages needs copy_pages (for their snapshots)")
        if host is not None and not enable_prefix_caching:
            raise ValueError("a host tier needs prefix caching")
        self.num_blocks, self.block_size, self.seq_pages = num_blocks, block_size, seq_pages
        self.reuse_tokens = reuse_tokens or block_size  # a reused prefix is a multiple of it
        if self.reuse_tokens % block_size:
            raise ValueError(f"reuse_tokens {self.reuse_tokens} is not a multiple of block_size {block_size}")
        self.enable_prefix_caching = enable_prefix_caching
        self.host = host
        self.copy_pages = copy_pages
        self.reset()

    @property
    def num_free(self) -> int:
        """Pages no sequence holds (registered ones included: they are given up when needed)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Registered pages (held or free)."""
        return len(self._page_of)

    def blocks_for(self, num_tokens: int) -> int:
        """Pages that a sequence of ``num_tokens`` tokens holds (its state pages included)."""
        return self.seq_pages + math.ceil(num_tokens / self.block_size)

    def missing(self, seq: Sequence, num_tokens: int) -> int:
        """Pages ``seq`` still needs to hold ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.missing(seq, num_tokens) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extends ``seq.block_table`` to hold ``num_tokens`` tokens; raises if there are not enough free pages."""
        need = self.missing(seq, num_tokens)
        if need > self.num_free:
            raise RuntimeError(f"{need} cache pages needed, {self.num_free} free")
        seq.block_table.extend(self.allocate(need))

    def allocate(self, n: int) -> list[int]:
        """``n`` free pages, one reference each; registered pages among them are forgotten (evicted)."""
        if n > len(self._free):
            raise RuntimeError(f"{n} cache pages needed, {len(self._free)} free")
        blocks = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            key = self._key_of.pop(b, None)
            if key is not None and key[0] == SNAPSHOT:
                snapshot = self._snapshot_of.pop(key[1])  # one page gone: the whole snapshot is
                for i, page in enumerate(snapshot):
                    self._key_of.pop(page, None)
                    if self.host is not None:  # each of its pages before any is reused
                        self.host.save(snapshot_key(key[1], i), page)
            elif key is not None:
                del self._page_of[key]
                if self.host is not None:
                    self.host.save(key, b)
            self._refs[b] = 1
            blocks.append(b)
        if self.host is not None:
            self.host.fence()
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drops one reference of each page; a page left with none becomes free (with prefix caching the last of
        ``blocks`` first, so that a prefix's first pages, shared most, are evicted last)."""
        for b in reversed(blocks) if self.enable_prefix_caching else blocks:
            refs = self._refs.get(b, 0)
            if refs < 1:
                raise RuntimeError(f"page {b} freed twice or never allocated")
            if refs == 1:
                del self._refs[b]
                self._free[b] = None
                if self.host is not None:
                    self.host.freed((b,))
            else:
                self._refs[b] = refs - 1

    def reset(self) -> None:
        """Takes back every page and forgets every registered one, as a new allocator (for when no sequence holds
        any)."""
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.num_blocks))
        self._refs: dict[int, int] = {}
        self._page_of: dict[PageKey, int] = {}
        self._key_of: dict[int, PageKey] = {}  # a snapshot's pages: (SNAPSHOT, the key it is kept under)
        self._snapshot_of: dict[PageKey, list[int]] = {}
        if self.host is not None:
            self.host.freed(range(self.num_blocks))

    def release(self, seq: Sequence) -> None:
        """Takes back every page of ``seq``."""
        self.free(seq.block_table)
        seq.block_table = []
        seq.num_registered_pages = 0

    def slot(self, seq: Sequence, position: int) -> int:
        page = seq.block_table[self.seq_pages + position // self.block_size]
        return page * self.block_size + position % self.block_size

    # --- prefix caching ---

    def page_keys(self, seq: Sequence, num_pages: int) -> list[PageKey]:
        """The keys of ``seq``'s first ``num_pages`` full pages: each page's tokens chained to the key of the page
        before (kept on ``seq``). With state pages a token page also holds compressed entries whose windows end in
        the pages after it (an entry lives in the page of its window's first token), so its contents depend on the
        tokens up to the end of its group of ``reuse_tokens`` tokens, a multiple of every rate: its key is then the
        chained key of its group's last page and its place in the group, and a page whose group does not end within
        the prompt gets a key that is never registered (``PARTIAL``)."""
        if not self.seq_pages:
            return self._chained_keys(seq, num_pages)
        per = self.reuse_tokens // self.block_size
        complete = min(seq.num_prompt_tokens // self.reuse_tokens * per, -(-num_pages // per) * per)
        chained = self._chained_keys(seq, max(num_pages, complete))
        return [
            (chained[i // per * per + per - 1], i % per) if i < complete else (PARTIAL, chained[i])
            for i in range(num_pages)
        ]

    def _chained_keys(self, seq: Sequence, num_pages: int) -> list[PageKey]:
        """The chained keys of ``seq``'s first ``num_pages`` pages (``page_keys`` without state pages)."""
        keys = seq.page_keys
        bs = self.block_size
        while len(keys) < num_pages:
            i = len(keys)
            keys.append((keys[-1] if keys else None, tuple(seq.token_ids[i * bs : (i + 1) * bs])))
        return keys[:num_pages]

    def match(self, seq: Sequence, max_tokens: int, align: int) -> int:
        """Gives ``seq`` (holding no page) the registered pages of its longest cached prefix of at most
        ``max_tokens`` tokens, cut to a multiple of ``align`` tokens (a multiple of ``block_size``), one reference
        each; returns the number of tokens they hold (0 with prefix caching off)."""
        if not self.enable_prefix_caching or seq.block_table:
            return 0
        if self.seq_pages:
            return self._match_snapshot(seq, max_tokens, align)
        keys = self.page_keys(seq, max_tokens // self.block_size)
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        in_host = 0  # the keys after those that only the host tier holds (one also on the device ends the run)
        if self.host is not None:
            while len(pages) + in_host < len(keys):
                key = keys[len(pages) + in_host]
                if key not in self.host or key in self._page_of:
                    break
                in_host += 1
        per_align = align // self.block_size
        whole = (len(pages) + in_host) // per_align * per_align
        pages = pages[:whole]
        # the host tier's part takes free pages, those left after these: the whole prefix stays in whole aligns
        free = self.num_free - sum(b in self._free for b in pages)
        whole = min(whole, (len(pages) + free) // per_align * per_align)
        pages = pages[:whole]
        for b in pages:
            if b in self._free:
                del self._free[b]
            self._refs[b] = self._refs.get(b, 0) + 1
        wanted = keys[len(pages) : whole]
        if wanted:  # device pages for the host tier's part
            pages += self._load(wanted, len(pages), per_align)
            whole = len(pages) // per_align * per_align
            self.free(pages[whole:])  # the host tier held too little to complete the device part's last align
            pages = pages[:whole]
        seq.block_table = pages
        seq.num_registered_pages = len(pages)
        return len(pages) * self.block_size

    def _load(self, keys: list[PageKey], before: int, per_align: int) -> list[int]:
        """Fresh pages holding the host tier's copies of the first of ``keys`` (registered under them, one
        reference each): all of them unless the host tier is smaller than the load, then as many as make ``before``
        pages (the device's part of the prefix) and them a multiple of ``per_align`` (none where no number does).
        Every later step reads them after their copies (``HostPageCache.fence``)."""
        self.host.touch(keys)  # the evictions that free these pages copy others out: these keys are dropped last
        fresh = self.allocate(len(keys))
        held = 0
        while held < len(keys) and keys[held] in self.host:  # all, unless the host tier is smaller than the load
            held += 1
        if held < len(keys):
            held = max(0, (before + held) // per_align * per_align - before)
        self.free(fresh[held:])
        for key, page in zip(keys[:held], fresh):
            self.host.load(key, page)
            self._page_of[key] = page
            self._key_of[page] = key
        self.host.fence()
        return fresh[:held]

    def _match_snapshot(self, seq: Sequence, max_tokens: int, align: int) -> int:
        """``match`` with state pages: the longest prefix, in whole ``align``s, whose token pages are each registered
        or held by the host tier and that ends at a snapshot on the device or (all its pages) in the host tier, for
        which free pages last (``_reuse``); a shorter one otherwise, or none."""
        keys = self.page_keys(seq, max_tokens // self.block_size)
        found = 0
        while found < len(keys) and (keys[found] in self._page_of or self._in_host([keys[found]])):
            found += 1
        per_align = align // self.block_size
        for n in range(found // per_align * per_align, 0, -per_align):
            end = keys[n - 1]
            snapshot_kept = end in self._snapshot_of or self._in_host(
                [snapshot_key(end, i) for i in range(self.seq_pages)]
            )
            if snapshot_kept and self._reuse(seq, keys[:n]):
                return n * self.block_size
        return 0

    def _in_host(self, keys: list) -> bool:
        return self.host is not None and all(key in self.host for key in keys)

    def _reuse(self, seq: Sequence, keys: list[PageKey]) -> bool:
        """Gives ``seq`` fresh state pages holding a copy of the snapshot kept under ``keys[-1]`` (copied on the
        device, else from the host tier), then the pages of ``keys`` (registered ones shared, the host tier's copied
        into fresh pages and registered), as ``_load`` does; False, with nothing taken, where free pages or the host
        tier's copies run out."""
        snapshot = self._snapshot_of.get(keys[-1], [])
        held = [self._page_of[key] for key in keys if key in self._page_of] + snapshot
        loads = [key for key in keys if key not in self._page_of]
        if self.num_free - sum(b in self._free for b in held) < self.seq_pages + len(loads):
            return False
        for b in held:  # the allocation below must not hand these out
            if b in self._free:
                del self._free[b]
            self._refs[b] = self._refs.get(b, 0) + 1
        from_host = loads + ([] if snapshot else [snapshot_key(keys[-1], i) for i in range(self.seq_pages)])
        if from_host:
            self.host.touch(from_host)  # the evictions that free pages below copy others out: these are dropped last
        fresh = self.allocate(self.seq_pages + len(loads))
        if from_host and not self._in_host(from_host):  # the host tier is smaller than the load
            self.free(held + fresh)
            return False
        state, loaded = fresh[: self.seq_pages], dict(zip(loads, fresh[self.seq_pages :]))
        if snapshot:
            self.copy_pages(snapshot, state)
            self.free(snapshot)
        else:
            for i, page in enumerate(state):
                self.host.load(snapshot_key(keys[-1], i), page)
        for key, page in loaded.items():
            self.host.load(key, page)
            self._page_of[key] = page
            self._key_of[page] = key
        if from_host:
            self.host.fence()
        seq.block_table = state + [self._page_of[key] for key in keys]
        seq.num_registered_pages = len(keys)
        return True

    def register(self, seq: Sequence, num_tokens: int, state_tokens: int | None = None) -> None:
        """Registers ``seq``'s full pages among its first ``num_tokens`` tokens (tokens whose cache entries are
        computed, or queued to be before any later step reads them). A key already registered to another page
        keeps that page. With state pages, only at a multiple of ``reuse_tokens`` and where the state pages hold
        exactly ``num_tokens`` tokens (``state_tokens``, default ``num_tokens``; a recomputed sequence's chunk may
        run past its prompt), where its state pages are also kept as a snapshot (their contents then, queued after
        the step that computes them)."""
        if not self.enable_prefix_caching:
            return
        k = self.seq_pages
        if k and (num_tokens % self.reuse_tokens or (state_tokens is not None and state_tokens != num_tokens)):
            return
        full = min(num_tokens // self.block_size, len(seq.block_table) - k)
        if full <= seq.num_registered_pages:
            return
        keys = self.page_keys(seq, full)
        for i, key in enumerate(keys[seq.num_registered_pages :], seq.num_registered_pages):
            page = seq.block_table[k + i]
            if key not in self._page_of and page not in self._key_of:
                self._page_of[key] = page
                self._key_of[page] = key
        seq.num_registered_pages = full
        if k and keys[-1] not in self._snapshot_of and self.num_free >= k:
            snapshot = self.allocate(k)
            self.copy_pages(seq.block_table[:k], snapshot)
            self.free(snapshot)
            self._snapshot_of[keys[-1]] = snapshot
            for page in snapshot:
                self._key_of[page] = (SNAPSHOT, keys[-1])
