"""``TokenToKVPoolAllocator``: which KV slots are free, handed out in whole pages.

The pool's ``size`` slots are cut into pages of ``page_size`` consecutive slots; page k holds
slots [k * page_size, (k + 1) * page_size). Page 0 is the reserved dummy, so pages 1..num_pages
are the ones handed out. A free list holds the free pages.

A request fills its pages in order: position j of a request lives at offset j % page_size of
the request's (j // page_size)-th page. So a new token goes into the request's last page while
that page has room, and only then is a fresh page taken::

    page_size 4, a request of 6 tokens grows by 3:
        before: page 5 = [t0 t1 t2 t3]  page 2 = [t4 t5 __ __]
        after:  page 5 = [t0 t1 t2 t3]  page 2 = [t4 t5 t6 t7]  page 9 = [t8 __ __ __]

page_size 1 is token-level allocation (no slot is ever wasted); bigger pages waste up to
page_size - 1 slots per request but make the table per page (what paged attention kernels and
prefix sharing in whole pages want).

Every mistake fails loudly and changes nothing: asking for more than is free, freeing a slot
twice, freeing a slot that was never handed out.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import torch

from s00_foundation.device import host_to_device

from .memory_pool import PoolExhaustedError


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold ``num_tokens`` positions of one request."""
    return -(-num_tokens // page_size)  # ceiling division


class TokenToKVPoolAllocator:
    def __init__(self, size: int, page_size: int = 1, device: torch.device | str = "cpu"):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if size < page_size or size % page_size:
            raise ValueError(f"the pool size ({size} slots) must be a positive multiple of page_size ({page_size})")
        self.size, self.page_size, self.device = size, page_size, device
        self.num_pages = size // page_size
        # Popped from the end, so page 1 goes first and a freed page is the next one reused.
        self.free_pages: list[int] = list(range(self.num_pages, 0, -1))
        # Bookkeeping lives on the CPU: it is consulted by Python code on every step.
        self.page_allocated = torch.zeros(self.num_pages + 1, dtype=torch.bool)

    def available_size(self) -> int:
        """Free slots, counted in whole free pages."""
        return len(self.free_pages) * self.page_size

    def _take_pages(self, num_pages: int) -> list[int]:
        pages = self.free_pages[len(self.free_pages) - num_pages :][::-1]
        del self.free_pages[len(self.free_pages) - num_pages :]
        self.page_allocated[pages] = True
        return pages

    def alloc_extend(
        self, prefix_lens: Sequence[int], seq_lens: Sequence[int], last_locs: Sequence[int]
    ) -> torch.Tensor:
        """Slots for positions [prefix_lens[i], seq_lens[i]) of every request, flattened in
        request order (the ``out_cache_loc`` of a forward pass).

        ``last_locs[i]`` is the slot of request i's position prefix_lens[i] - 1 (its newest
        stored token; ignored when prefix_lens[i] is 0): its page is filled up first.
        Raises PoolExhaustedError, with nothing allocated, when the free pages do not suffice.
        """
        p = self.page_size
        if not len(prefix_lens) == len(seq_lens) == len(last_locs):
            raise ValueError(
                f"{len(prefix_lens)} prefix lengths, {len(seq_lens)} seq lengths, {len(last_locs)} last locations"
            )
        for i, (prefix, seq, last) in enumerate(zip(prefix_lens, seq_lens, last_locs)):
            if not 0 <= prefix <= seq:
                raise ValueError(f"request {i}: prefix length {prefix} and seq length {seq} need 0 <= prefix <= seq")
            if prefix % p and not (p <= last < (self.num_pages + 1) * p and last % p == (prefix - 1) % p):
                raise ValueError(f"request {i}: last_loc {last} cannot hold position {prefix - 1} (page size {p})")
        needed = sum(pages_for(seq, p) - pages_for(prefix, p) for prefix, seq in zip(prefix_lens, seq_lens))
        if needed > len(self.free_pages):
            raise PoolExhaustedError(
                f"KV pool: {needed} pages ({needed * p} slots) needed, {len(self.free_pages)} pages "
                f"({self.available_size()} slots) free of {self.num_pages}; free finished requests or make the pool "
                "bigger"
            )
        # BEGIN EXERCISE: give every request the slots of its new positions, filling its last page first
        # [#what-you-write]
        fresh = self._take_pages(needed)
        out_cache_loc = []
        for prefix, seq, last in zip(prefix_lens, seq_lens, last_locs):
            # The request's pages from the one holding `prefix` on: its partly filled last
            # page if prefix is not page-aligned, then fresh ones.
            num_new = pages_for(seq, p) - pages_for(prefix, p)
            pages = ([last // p] if prefix % p else []) + fresh[:num_new]
            fresh = fresh[num_new:]
            first_page = prefix // p
            out_cache_loc += [pages[j // p - first_page] * p + j % p for j in range(prefix, seq)]
        return host_to_device(out_cache_loc, self.device, torch.int64)
        # END EXERCISE

    def free(self, slots: torch.Tensor) -> None:
        """Give back the pages that ``slots`` lie in (a finished request's slots: whole pages).

        Raises ValueError, with nothing freed, if any of them is not allocated right now
        (a double free, or slots this allocator never handed out).
        """
        slots = torch.as_tensor(slots).reshape(-1).cpu()
        if slots.numel() == 0:
            return
        p = self.page_size
        outside = slots[(slots < p) | (slots >= (self.num_pages + 1) * p)]
        if outside.numel():
            raise ValueError(
                f"cannot free slot(s) {outside[:8].tolist()}: usable slots are {p}..{(self.num_pages + 1) * p - 1} "
                f"(page 0, slots 0..{p - 1}, is the reserved dummy)"
            )
        pages = torch.unique(slots // p).tolist()
        # BEGIN EXERCISE: free pages: refuse a double free before changing anything [#what-you-write]
        not_allocated = [page for page in pages if not self.page_allocated[page]]
        if not_allocated:
            raise ValueError(
                f"cannot free page(s) {not_allocated[:8]} (slots {[q * p for q in not_allocated[:8]]}...): "
                "they are not allocated - a double free, or slots this allocator never handed out"
            )
        self.page_allocated[pages] = False
        self.free_pages.extend(pages)
        # END EXERCISE

    def free_orphans(self, held: torch.Tensor) -> None:
        """Free every allocated page that holds none of the slots in ``held``. A pass that failed
        midway may have allocated slots that no request's bookkeeping records; once every owner
        has given back what it vouches for, ``held`` is what is still owned (a prefix cache's
        slots), and every other allocated page is an orphan."""
        held_pages = torch.unique(torch.as_tensor(held).reshape(-1).cpu() // self.page_size)
        allocated = self.page_allocated.nonzero().flatten()
        self.free(allocated[~torch.isin(allocated, held_pages)] * self.page_size)

    def check_invariants(self, owners: Sequence[torch.Tensor] | None = None) -> None:
        """Raise AssertionError unless the bookkeeping is consistent.

        Always: every page 1..num_pages is either on the free list (exactly once) or marked
        allocated, never both. With ``owners`` (one tensor of slots per owner, e.g. each
        request's table row up to its length): no slot is owned twice, no page is shared by two
        owners, every owned slot is allocated, and every allocated page has an owner (no leak).
        """
        problems = []
        counts = Counter(self.free_pages)
        if twice := sorted(page for page, n in counts.items() if n > 1):
            problems.append(f"the free list holds page(s) more than once: {twice[:8]}")
        if outside := sorted(page for page in counts if not 1 <= page <= self.num_pages):
            problems.append(f"the free list holds pages outside 1..{self.num_pages}: {outside[:8]}")
        on_list = torch.zeros(self.num_pages + 1, dtype=torch.bool)
        on_list[[page for page in counts if 1 <= page <= self.num_pages]] = True
        if bool(self.page_allocated[0]):
            problems.append("the dummy page 0 is marked allocated")
        if both := (on_list & self.page_allocated).nonzero().flatten().tolist():
            problems.append(f"pages both free and allocated: {both[:8]}")
        if lost := ((~on_list & ~self.page_allocated).nonzero().flatten()[1:]).tolist():
            problems.append(f"pages neither free nor allocated (lost): {lost[:8]}")
        if owners is not None:
            owner_of_page: dict[int, int] = {}
            slot_counts: Counter[int] = Counter()
            for i, slots in enumerate(owners):
                slot_list = torch.as_tensor(slots).reshape(-1).tolist()
                slot_counts.update(slot_list)
                for page in sorted({s // self.page_size for s in slot_list}):
                    if page == 0:  # a table row's unset entries are 0: a position counted but never stored
                        problems.append(
                            f"owner {i}: owns slots of the dummy page 0, which no request is given: does it count a "
                            "position as cached (cached_len) before its K/V were stored?"
                        )
                    elif not 1 <= page <= self.num_pages or not bool(self.page_allocated[page]):
                        problems.append(f"owner {i}: owns slots of page {page}, which is not allocated")
                    elif owner_of_page.setdefault(page, i) != i:
                        problems.append(f"page {page} is shared by owners {owner_of_page[page]} and {i}")
            if twice := sorted(slot for slot, n in slot_counts.items() if n > 1):
                problems.append(f"slot(s) owned more than once: {twice[:8]}")
            allocated = self.page_allocated.nonzero().flatten().tolist()
            if leaked := [page for page in allocated if page not in owner_of_page]:
                problems.append(f"allocated pages nobody owns (leaked): {leaked[:8]}")
        if problems:
            raise AssertionError("KV allocator invariants broken:\n  " + "\n  ".join(problems))
