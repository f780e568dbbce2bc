"""``HostPageCache``: the prefix cache's second tier, pages evicted from the device kept in host memory.

When the device cache hands out a registered page (evicting it: ``BlockAllocator.allocate``), its contents in every
paged cache (the latent cache, and DeepSeek-V3.2's indexer-key cache) are copied to a host slot under the page's
prefix key. A later request whose prompt continues its device-cached prefix with keys held here gets fresh device
pages with those contents copied back (``BlockAllocator.match``), registered as device pages again, and prefills only
the rest. DeepSeek-V4's pages of bytes go the same way, and so do its state snapshots: handing out one page of a
snapshot copies all of them out, each under its own key (``snapshot_key``), and a hit copies them back into the
request's fresh state pages. Slots are reused least recently used first. A page's contents are a function of its
key (one engine, one model, one cache format), so a copy back gives the same bits the page had.

Overlap. On an accelerator the copies run on a stream of their own, from and to pinned host memory, so they overlap
the step in flight; the host never waits for them. Two orders keep them right:

- A copy waits for the steps queued before it only where they may still touch its page: a page freed since the step
  before the one in flight was launched (``launched`` counts launches, ``freed`` records when each page was freed).
  A page freed earlier is touched by no step that can still be running, since the engine has read that step's
  results (and waited for it) before it launches the next but one.
- Everything queued on the step's stream after a batch of copies waits for them (``BlockAllocator`` fences after
  each), so no later step, swap-in or draft reads a page before its copy back or overwrites it before its copy out.

Without an accelerator the copies are plain, in program order.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from .block_manager import PageKey


class HostPageCache:
    """``capacity`` pages of each of ``caches`` (``[layers, num_blocks, block_size, width]`` device tensors) in host
    memory, pinned where the caches live on an accelerator. ``stream``: the stream copies run on (by default a new
    one on the caches' accelerator, None on the CPU)."""

    def __init__(self, caches: list[torch.Tensor], capacity: int, stream: torch.Stream | None = None):
        if capacity < 1:
            raise ValueError(f"a host cache of at least one page, got {capacity}")
        self.caches = caches
        device = caches[0].device
        pin = device.type != "cpu"
        self.host = [torch.empty((capacity, c.shape[0], *c.shape[2:]), dtype=c.dtype, pin_memory=pin) for c in caches]
        self.capacity = capacity
        self._slot_of: OrderedDict[PageKey, int] = OrderedDict()  # least recently used first
        self._free = list(range(capacity - 1, -1, -1))
        self.saved = self.loaded = 0  # pages copied out and back, so far
        self.stream = stream if stream is not None or not pin else torch.Stream(device=device)
        self.launches = 0  # steps launched so far (``launched``)
        self._freed_at: dict[int, int] = {}  # page -> ``launches`` when it was last freed
        self._pending = False  # copies issued since the last fence

    @staticmethod
    def page_bytes(caches: list[torch.Tensor]) -> int:
        """Host bytes one page of ``caches`` takes."""
        return sum(c[:, 0].numel() * c.element_size() for c in caches)

    def __contains__(self, key: PageKey) -> bool:
        return key in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def launched(self) -> None:
        """The engine launched a step."""
        self.launches += 1

    def freed(self, pages) -> None:
        """``pages`` were freed (no sequence holds them) now."""
        for page in pages:
            self._freed_at[page] = self.launches

    def touch(self, keys: list[PageKey]) -> None:
        """Marks ``keys`` (those held) most recently used: they are dropped last."""
        for key in keys:
            if key in self._slot_of:
                self._slot_of.move_to_end(key)

    def save(self, key: PageKey, page: int) -> None:
        """Copies device page ``page`` out under ``key`` (a key held already is only marked used)."""
        if key in self._slot_of:
            self._slot_of.move_to_end(key)
            return
        if self._free:
            slot = self._free.pop()
        else:
            _, slot = self._slot_of.popitem(last=False)
        self._copy(page, [(host[slot], cache[:, page]) for host, cache in zip(self.host, self.caches)])
        self._slot_of[key] = slot
        self.saved += 1

    def load(self, key: PageKey, page: int) -> None:
        """Copies the page held under ``key`` into device page ``page``."""
        slot = self._slot_of[key]
        self._slot_of.move_to_end(key)
        self._copy(page, [(cache[:, page], host[slot]) for host, cache in zip(self.host, self.caches)])
        self.loaded += 1

    def fence(self) -> None:
        """Makes whatever is queued on the step's stream from now on wait for the copies issued so far."""
        if self._pending:
            torch.accelerator.current_stream(self.caches[0].device).wait_stream(self.stream)
            self._pending = False

    def _copy(self, page: int, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if self.stream is None:
            for dst, src in pairs:
                dst.copy_(src)
            return
        if self._freed_at.get(page, -1) >= self.launches - 1:  # a step that may still run can touch it
            self.stream.wait_stream(torch.accelerator.current_stream(self.caches[0].device))
        with self.stream:
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        self._pending = True
