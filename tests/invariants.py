"""Shared by the stage 5 to 7 tests: check the scheduler's and the radix tree's invariants, saying
where, make a radix cache's evict speak for itself when it frees what it must not, and step an
engine to the end without looping forever."""

from __future__ import annotations

import torch


def check_chunked_req_not_running(engine, what: str) -> None:
    """Stage 7's half-prefilled request (``chunked_req``) must not be in the running list too:
    else the next step schedules it twice, and the first symptom (a token for a request that
    already finished, two rows writing one slot) names nothing the learner wrote."""
    pending = getattr(engine.scheduler, "chunked_req", None)
    if pending is not None and any(req is pending for req in engine.scheduler.running):
        if pending.device_len >= len(pending.fill_ids):  # its last chunk ran: the pointer is what is stale
            raise AssertionError(
                f"{what}: chunked_req still names request {pending.rid}, whose last chunk has run (it is running, "
                "decoding): the scheduler takes a request out of chunked_req when it schedules its next chunk "
                "(admit_new_requests), so that the next step does not schedule it a second time"
            )
        raise AssertionError(
            f"{what}: request {pending.rid} is half prefilled (chunked_req) and still in the running list: a request "
            "whose prefill is unfinished has no token to decode; it leaves the running list until its last chunk"
        )


def check_all(engine, what: str) -> None:
    """Raise AssertionError (prefixed with ``what``) unless the engine's memory bookkeeping holds."""
    check_chunked_req_not_running(engine, what)
    try:
        engine.scheduler.check_invariants()
        if engine.tree_cache is not None:
            engine.tree_cache.check()
    except AssertionError as error:
        hint = ""
        if engine.tree_cache is not None and "leaked" in str(error):
            hint = (
                "\n  (with the radix cache, a leaving request's pages are either kept by the tree or freed: its own "
                "copies of tokens the tree already held - duplicates - and its last partial page must be freed)"
            )
        raise AssertionError(f"{what}: {error}{hint}") from None


def watch_evict(cache):
    """Wrap ``cache.evict`` (on this instance) so that, while it runs, every slot it frees is
    checked: the slots of a locked node, of a node that still has children, or of one node a second time, fail
    with a message about evict - rather than with the allocator's "double free" some frees later.
    Returns the cache."""
    real_evict, allocator = cache.evict, cache.allocator

    def evict(num_tokens):
        freed: list[list[int]] = []
        own_free = vars(allocator).get("free")  # an instance attribute already there (None: the class's method)

        def free(slots):
            key = sorted(torch.as_tensor(slots).reshape(-1).tolist())
            node = next((n for n in cache._all_nodes() if sorted(n.value.tolist()) == key), None) if key else None
            if node is not None and node.lock_ref > 0:
                raise AssertionError(
                    f"evict freed the slots of node {node.id} ({len(node.key)} tokens) while it is locked (lock_ref "
                    f"{node.lock_ref}): a running request reads those slots, so a locked node is never evicted. The "
                    "heap starts with the UNLOCKED leaves, and a parent joins it only if nothing locks it"
                )
            if node is not None and node.children:
                children = [len(child.key) for child in node.children.values()]
                raise AssertionError(
                    f"evict freed the slots of node {node.id} ({len(node.key)} tokens) while it still has "
                    f"{len(children)} "
                    f"child(ren) (of {children} tokens), which hang below its tokens: only leaves are evicted. A "
                    "parent "
                    "joins the heap when its LAST child is gone (and nothing locks it)"
                )
            if key and key in freed:
                raise AssertionError(
                    f"evict freed the same node's {len(key)} slots twice: each node is evicted once (a parent joins "
                    "the "
                    "heap once, when its last child is gone; the heap starts with the unlocked leaves only)"
                )
            freed.append(key)
            return (own_free or type(allocator).free.__get__(allocator))(slots)

        allocator.free = free
        try:
            return real_evict(num_tokens)
        finally:
            if own_free is None:
                del allocator.free
            else:
                allocator.free = own_free

    cache.evict = evict
    return cache


def capped_steps(engine, max_steps: int = 2000, what: str = ""):
    """Yield 1, 2, ... while ``engine`` has work, for the caller to run one step each: a loop
    ``while engine.has_work`` that cannot run forever. After ``max_steps`` it fails (its message
    prefixed with ``what``), naming any finished request still in the running list (nothing would
    ever take it out)."""
    for step in range(1, max_steps + 1):
        if not engine.has_work:
            return
        yield step
    stayed = [req.rid for req in engine.scheduler.running if req.finished]
    raise AssertionError(
        f"{what + ': ' if what else ''}the engine still has work after {max_steps} steps: is a request stuck?"
        + (
            f" Request(s) {stayed} finished but are still in the running list: a finished request leaves it (and is "
            "released) in the step it finishes"
            if stayed
            else ""
        )
    )
