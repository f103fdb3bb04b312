"""Stage 4 (graded): the KV slot allocator - pages handed out once, returned on free, filled in
order, and every misuse refused with a clear error and no change to the pool."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from s04_paged_kv_pool.allocator import TokenToKVPoolAllocator
from s04_paged_kv_pool.memory_pool import PoolExhaustedError

PAGE_SIZES = [1, 4, 16]


def snapshot(allocator):
    return sorted(allocator.free_pages), allocator.page_allocated.clone(), allocator.available_size()


def assert_unchanged(allocator, before, what):
    after = snapshot(allocator)
    assert after[0] == before[0] and torch.equal(after[1], before[1]) and after[2] == before[2], (
        f"{what} must leave the allocator as it was; free slots went from {before[2]} to {after[2]}"
    )


def refused(free, slots, what):
    """free(slots) must raise ValueError (saying what is wrong) and change nothing."""
    __tracebackhide__ = True
    try:
        free(slots)
    except ValueError as error:
        assert "free" in str(error), f"{what}: the ValueError should say what could not be freed, got: {error}"
    else:
        pytest.fail(
            f"{what} was accepted: free() must refuse pages that are not allocated (a double free, or slots "
            "never handed out) with a ValueError, before changing anything"
        )


class Request:
    """A request as the allocator sees it: the slots of its positions 0..len-1, in order."""

    def __init__(self):
        self.slots: list[int] = []

    def grow(self, allocator, n):
        prefix = len(self.slots)
        last = self.slots[-1] if self.slots else -1
        new = allocator.alloc_extend([prefix], [prefix + n], [last])
        assert isinstance(new, torch.Tensor) and new.dtype == torch.int64, (
            f"alloc_extend should return an int64 tensor, got {new!r}"
        )
        assert new.numel() == n, f"growing a request of {prefix} tokens by {n} should give {n} slots, got {new.numel()}"
        self.slots += new.tolist()
        return new


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_alloc_hands_out_distinct_slots_and_free_returns_every_page(page_size):
    allocator = TokenToKVPoolAllocator(size=32 * page_size, page_size=page_size)
    lens = [5, 1, 17, 9]
    out = allocator.alloc_extend([0] * len(lens), lens, [-1] * len(lens))
    assert out.numel() == sum(lens), (
        f"prefills of {lens} tokens need {sum(lens)} slots, alloc_extend returned {out.numel()}"
    )
    slots = out.tolist()
    assert len(set(slots)) == len(slots), (
        f"a slot was handed out twice: {sorted(s for s in set(slots) if slots.count(s) > 1)}"
    )
    assert all(page_size <= s < 33 * page_size for s in slots), (
        f"slots must lie in {page_size}..{33 * page_size - 1} (page 0 is the reserved dummy), got "
        f"{sorted(slots)[:3]}...{sorted(slots)[-3:]}"
    )
    pages = sum(-(-n // page_size) for n in lens)
    assert allocator.available_size() == (32 - pages) * page_size, (
        f"with page size {page_size}, requests of {lens} tokens hold {pages} whole pages; "
        f"{(32 - pages) * page_size} slots should be free, available_size() says {allocator.available_size()}"
    )
    start = 0
    owners = []
    for n in lens:
        owners.append(out[start : start + n])
        start += n
    allocator.check_invariants(owners)
    for owned in owners:
        allocator.free(owned)
    assert allocator.available_size() == 32 * page_size, (
        f"after freeing every request all {32 * page_size} slots should be free, {allocator.available_size()} are"
    )
    allocator.check_invariants(owners=[])


@pytest.mark.parametrize("page_size", [4, 16])
def test_a_request_fills_its_last_page_before_taking_a_new_one(page_size):
    allocator = TokenToKVPoolAllocator(size=8 * page_size, page_size=page_size)
    a, b = Request(), Request()
    # Grow two requests in turns, by a chunk and then a token at a time, like prefill + decode.
    for step, n in enumerate([3, 1, 1, page_size, 1, 2 * page_size - 1, 1]):
        a.grow(allocator, n)
        b.grow(allocator, 1 if step else page_size + 2)
        for name, req in (("A", a), ("B", b)):
            for j, slot in enumerate(req.slots):
                assert slot % page_size == j % page_size, (
                    f"page size {page_size}, request {name}: position {j} should sit at offset {j % page_size} of "
                    "its page, "
                    f"its slot {slot} is at offset {slot % page_size} (slots of {name}: {req.slots})"
                )
                page_start = req.slots[j - j % page_size] // page_size
                assert slot // page_size == page_start, (
                    f"page size {page_size}, request {name}: positions {j - j % page_size}..{j} should share one page "
                    f"(its last page is filled before a new one is taken), slots: {req.slots}"
                )
        pages = [-(-len(r.slots) // page_size) for r in (a, b)]
        assert allocator.available_size() == (8 - sum(pages)) * page_size, (
            f"requests of {len(a.slots)} and {len(b.slots)} tokens hold {sum(pages)} pages; "
            f"available_size() should be {(8 - sum(pages)) * page_size}, got {allocator.available_size()}"
        )
    assert not {s // page_size for s in a.slots} & {s // page_size for s in b.slots}, "two requests share a page"
    allocator.check_invariants([torch.tensor(a.slots), torch.tensor(b.slots)])


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_over_allocation_raises_and_changes_nothing(page_size):
    allocator = TokenToKVPoolAllocator(size=4 * page_size, page_size=page_size)
    first = allocator.alloc_extend([0], [2 * page_size + 1], [-1])  # 3 of the 4 pages
    before = snapshot(allocator)
    with pytest.raises(PoolExhaustedError) as error:
        allocator.alloc_extend([0, 0], [1, page_size + 1], [-1, -1])  # needs 3 pages, 1 is free
    message = str(error.value)
    assert "3" in message and "1" in message, (
        f"the error should say how much was needed and how much is free, got: {message}"
    )
    assert_unchanged(allocator, before, "a failed allocation")
    allocator.free(first)
    assert allocator.available_size() == 4 * page_size, (
        "after the failed allocation, freeing the first request should empty the pool"
    )


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_double_free_raises_and_changes_nothing(page_size):
    allocator = TokenToKVPoolAllocator(size=8 * page_size, page_size=page_size)
    a = allocator.alloc_extend([0], [page_size + 1], [-1])
    b = allocator.alloc_extend([0], [3], [-1])
    allocator.free(b)
    before = snapshot(allocator)
    refused(allocator.free, b, f"freeing request B's slots a second time (page size {page_size}) is a double free")
    assert_unchanged(allocator, before, "a refused double free")
    # half valid (A's pages come first), half already free: nothing may be freed
    refused(allocator.free, torch.cat([a, b]), "freeing A's slots together with B's already freed ones (a double free)")
    assert_unchanged(
        allocator, before, "a refused free of partly allocated slots (check every page before freeing any)"
    )
    allocator.free(a)
    allocator.check_invariants(owners=[])


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_freeing_slots_never_allocated_raises(page_size):
    allocator = TokenToKVPoolAllocator(size=8 * page_size, page_size=page_size)
    owned = allocator.alloc_extend([0], [2], [-1])
    never = next(
        s for s in range(page_size, 9 * page_size) if s // page_size not in {o // page_size for o in owned.tolist()}
    )
    before = snapshot(allocator)
    for bad, what in (
        (never, "a slot never handed out"),
        (0, "the dummy slot 0"),
        (9 * page_size, "a slot past the end"),
    ):
        refused(allocator.free, torch.tensor([bad]), f"freeing {what} (slot {bad}, page size {page_size})")
        assert_unchanged(allocator, before, f"a refused free of slot {bad}")


operations = st.lists(
    st.tuples(st.sampled_from(["new", "grow", "free"]), st.integers(0, 7), st.integers(1, 40)), min_size=1, max_size=30
)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@settings(  # derandomize: the same cases on every run and for every learner (see stage 6's property test)
    max_examples=25,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(ops=operations)
def test_random_alloc_and_free_keep_every_invariant(page_size, ops):
    num_pages = 12
    allocator = TokenToKVPoolAllocator(size=num_pages * page_size, page_size=page_size)
    live: list[Request] = []
    for op, pick, n in ops:
        if op == "new" or not live:
            req, grow_by = Request(), n
        else:
            req, grow_by = live[pick % len(live)], (n if op == "grow" else 0)
        if op == "free" and live:
            allocator.free(torch.tensor(req.slots))
            live.remove(req)
        else:
            prefix = len(req.slots)
            pages_needed = -(-(prefix + grow_by) // page_size) - (-(-prefix // page_size))
            if pages_needed * page_size > allocator.available_size():
                before = snapshot(allocator)
                with pytest.raises(PoolExhaustedError):
                    req.grow(allocator, grow_by)
                assert_unchanged(allocator, before, "a failed allocation")
            else:
                req.grow(allocator, grow_by)
                if req not in live:
                    live.append(req)
        all_slots = [s for r in live for s in r.slots]
        assert len(all_slots) == len(set(all_slots)), f"after {op}: a slot is owned by two requests or twice by one"
        held = sum(-(-len(r.slots) // page_size) for r in live)
        assert allocator.available_size() == (num_pages - held) * page_size, (
            f"after {op}: live requests hold {held} pages, so {(num_pages - held) * page_size} slots should be free, "
            f"available_size() says {allocator.available_size()}"
        )
        allocator.check_invariants([torch.tensor(r.slots, dtype=torch.int64) for r in live])
    for req in live:
        allocator.free(torch.tensor(req.slots))
    assert allocator.available_size() == num_pages * page_size, (
        "after freeing every request the whole pool should be free"
    )
