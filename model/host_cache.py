"""``HostPageCache``: the prefix cache's second tier, pages evicted from the device kept in host memory.

When the device cache hands out a registered page (evicting it: ``BlockAllocator.allocate``), its contents in every
paged cache (the latent cache, and DeepSeek-V3.2's indexer-key cache) are copied to a host slot under the page's
prefix key. A later request whose prompt continues its device-cached prefix with keys held here gets fresh device
pages with those contents copied back (``BlockAllocator.match``), registered as device pages again, and prefills only
the rest. Slots are reused least recently used first.

Copies are issued on the device's current stream, the one every step runs on, from and to pinned host memory
(``non_blocking``): the host does not wait for them, and the device runs them in order with the steps, so a page is
copied out before anything overwrites it and copied back before any step reads it. A page's contents are a function
of its key (one engine, one model, one cache format), so a copy back gives the same bits the page had.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from .block_manager import PageKey


class HostPageCache:
    """``capacity`` pages of each of ``caches`` (``[layers, num_blocks, block_size, width]`` device tensors) in host
    memory, pinned where the caches live on a GPU."""

    def __init__(self, caches: list[torch.Tensor], capacity: int):
        if capacity < 1:
            raise ValueError(f"a host cache of at least one page, got {capacity}")
        self.caches = caches
        pin = caches[0].device.type == "cuda"
        self.host = [torch.empty((capacity, c.shape[0], *c.shape[2:]), dtype=c.dtype, pin_memory=pin) for c in caches]
        self.capacity = capacity
        self._slot_of: OrderedDict[PageKey, int] = OrderedDict()  # least recently used first
        self._free = list(range(capacity - 1, -1, -1))
        self.saved = self.loaded = 0  # pages copied out and back, so far

    @staticmethod
    def page_bytes(caches: list[torch.Tensor]) -> int:
        """Host bytes one page of ``caches`` takes."""
        return sum(c[:, 0].numel() * c.element_size() for c in caches)

    def __contains__(self, key: PageKey) -> bool:
        return key in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

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
        for host, cache in zip(self.host, self.caches):
            host[slot].copy_(cache[:, page], non_blocking=True)
        self._slot_of[key] = slot
        self.saved += 1

    def load(self, key: PageKey, page: int) -> None:
        """Copies the page held under ``key`` into device page ``page``."""
        slot = self._slot_of[key]
        self._slot_of.move_to_end(key)
        for host, cache in zip(self.host, self.caches):
            cache[:, page].copy_(host[slot], non_blocking=True)
        self.loaded += 1
