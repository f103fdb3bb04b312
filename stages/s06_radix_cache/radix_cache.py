"""``RadixCache``: finished requests' K/V kept in a radix tree over token ids, for reuse.

Each edge of the tree holds a run of token ids (``key``) and the pool slots holding their K/V
(``value``, one slot per token). A path from the root spells a sequence that some earlier request
computed; the slots along it are exactly that sequence's K/V, so a new request whose prompt starts
with it points its table row at those slots and computes only the rest::

    after "The cat sat" and "The cat ran" (tokens shown as words):

        root ── "The cat" ─┬─ "sat"
                           └─ "ran"

    insert "The dog": the match ends INSIDE the edge "The cat", after "The"; the edge is split
    at that point (the slots split with it) and the new tail hangs off the split node:

        root ── "The" ─┬─ "cat" ─┬─ "sat"
                       │         └─ "ran"
                       └─ "dog"

A node read by a running request is *locked* (``lock_ref`` > 0 on it and every node above it):
its slots must stay. Unlocked leaves are *evictable*: when the pool runs short they are given
back to the allocator, least recently used first, and a parent left without children becomes an
evictable leaf in turn.

With pages bigger than one slot the tree works in whole pages: keys are cut to a multiple of
``page_size``, a match is rounded down to whole pages and children are keyed by their first
page. A page is never shared between a node and a request, so the allocator frees whole pages as
before. (SGLang's ``RadixCache`` does the same.)

This implements stage 5's ``PrefixCache`` protocol (see ``s05_continuous_batching.prefix_cache``).
"""

from __future__ import annotations

import heapq  # noqa: F401
import itertools
from typing import Sequence

import torch

from s04_paged_kv_pool.allocator import TokenToKVPoolAllocator
from s05_continuous_batching.prefix_cache import PrefixMatch


def check_present_covers_match(present: int, match: PrefixMatch) -> None:
    """``present`` (what ``insert`` returned) covers the request's own match: that prefix is
    locked, so it is still in the tree, and the slots of [match.cached_len, present) are freed."""
    if present < match.cached_len:
        raise AssertionError(
            f"insert returned {present}, fewer than the {match.cached_len} tokens this request matched; they are "
            "locked, so still in the tree: insert must return how many leading tokens the tree already held"
        )


class TreeNode:
    def __init__(
        self, node_id: int, key: list[int], value: torch.Tensor, parent: TreeNode | None, last_access_time: int
    ):
        self.key = key  # the token ids of the edge from the parent to this node
        self.value = value  # int64 [len(key)]: the slot holding each token's K/V
        self.parent = parent
        self.children: dict[int | tuple[int, ...], TreeNode] = {}  # keyed by the child's first token (page)
        self.lock_ref = 0  # running requests reading this node's slots (directly or through a descendant)
        self.last_access_time = last_access_time
        self.id = node_id  # creation order: the eviction heap's tie-breaker, and a name in messages

    def __lt__(self, other: TreeNode) -> bool:  # heap order: least recently used first
        return (self.last_access_time, self.id) < (other.last_access_time, other.id)


class RadixCache:
    def __init__(self, allocator: TokenToKVPoolAllocator):
        self.allocator = allocator
        self.page_size = allocator.page_size  # the tree matches and stores whole pages of the allocator
        self.device = allocator.device
        self._clock = itertools.count(1)  # a logical clock: deterministic LRU order, unlike wall time
        self._node_ids = itertools.count()
        self.root = TreeNode(next(self._node_ids), [], self._empty(), None, 0)
        self.root.lock_ref = 1  # the root holds nothing and is never evicted
        self.evictable_size_ = 0  # tokens in unlocked nodes
        self.protected_size_ = 0  # tokens in locked nodes
        self.evicted_tokens = 0

    # --- helpers ----------------------------------------------------------------------------------

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def _child_key(self, key: Sequence[int]) -> int | tuple[int, ...]:
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _match_len(self, a: Sequence[int], b: Sequence[int]) -> int:
        """Length of the common prefix of ``a`` and ``b``, in whole pages."""
        p, n, i = self.page_size, min(len(a), len(b)), 0
        while i + p <= n and a[i : i + p] == b[i : i + p]:
            i += p
        return i

    def _touch(self, node: TreeNode) -> None:
        node.last_access_time = next(self._clock)

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cut the edge into ``child`` after ``split_len`` tokens; returns the new middle node.

            parent ── [k0 .. k9] child      split at 4:     parent ── [k0..k3] new ── [k4..k9] child

        The new node takes the first part of the key and slots, the lock count and access time of
        ``child`` (the same requests read it), so the evictable and protected sizes do not change.
        """
        new = TreeNode(
            next(self._node_ids), child.key[:split_len], child.value[:split_len], child.parent, child.last_access_time
        )
        new.lock_ref = child.lock_ref
        new.children = {self._child_key(child.key[split_len:]): child}
        new.parent.children[self._child_key(new.key)] = new
        child.parent = new
        child.key, child.value = child.key[split_len:], child.value[split_len:]
        return new

    # --- the PrefixCache protocol -----------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """The longest cached prefix of ``token_ids`` (in whole pages): its length, its slots, and
        the node where it ends (an edge it ends inside is split, so that node ends exactly there).
        Every node on the path counts as just used."""
        key = list(token_ids)
        key = key[: len(key) // self.page_size * self.page_size]
        raise NotImplementedError(
            "Stage 6: the longest cached prefix of a key, splitting an edge it leaves in the middle - see stages/s06_radix_cache/README.md#what-you-write"  # noqa: E501 (one message, the learner's to read whole)
        )

    def insert(self, token_ids: Sequence[int], slots: torch.Tensor) -> int:
        """Add ``token_ids`` (a whole number of pages) with the slots holding their K/V. Returns how
        many leading tokens the tree already held: for those it keeps its own slots, and the
        caller's slots of them are duplicates (the caller frees them). The rest becomes a new leaf
        (evictable, since nobody locks it yet)."""
        key = list(token_ids)
        if len(key) % self.page_size or len(slots) != len(key):
            raise ValueError(
                f"insert needs whole pages of {self.page_size} tokens and one slot per token; "
                f"got {len(key)} tokens and {len(slots)} slots"
            )
        raise NotImplementedError(
            "Stage 6: insert a key with its slots; return how much of it was already there - see stages/s06_radix_cache/README.md#what-you-write"  # noqa: E501 (one message, the learner's to read whole)
        )

    def _update_lock(self, node: TreeNode, delta: int) -> None:
        """Add ``delta`` (+1 or -1) to the lock count of ``node`` and of every node above it (the
        root aside); a node going from unlocked to locked moves its tokens from the evictable size
        to the protected size, and back."""
        raise NotImplementedError(
            "Stage 6: lock or unlock the path from a node up to the root - see stages/s06_radix_cache/README.md#how-the-scheduler-uses-it-stage-5s-seam"  # noqa: E501 (one message, the learner's to read whole)
        )

    def lock(self, match: PrefixMatch) -> None:
        self._update_lock(match.node, +1)

    def unlock(self, match: PrefixMatch) -> None:
        """Undo one ``lock``. An unlock without a matching lock raises RuntimeError and changes
        nothing: a negative count would let eviction free slots that a running request reads."""
        self._update_lock(match.node, -1)

    def cache_finished_req(
        self, token_ids: Sequence[int], slots: torch.Tensor, match: PrefixMatch, insert: bool
    ) -> None:
        """A request leaves. With ``insert`` its whole pages go into the tree; slots of tokens the
        tree already held (its own match, or what another request inserted meanwhile) are
        duplicates: those the request allocated itself are freed, as is its last partial page.
        Without ``insert`` every slot it allocated itself is freed. Either way its match is unlocked."""
        if len(slots) != len(token_ids):
            raise ValueError(f"cache_finished_req got {len(token_ids)} tokens but {len(slots)} slots")
        raise NotImplementedError(
            "Stage 6: a leaving request's K/V: into the tree, or freed - see stages/s06_radix_cache/README.md#how-the-scheduler-uses-it-stage-5s-seam"  # noqa: E501 (one message, the learner's to read whole)
        )

    def evictable_size(self) -> int:
        return self.evictable_size_

    def evict(self, num_tokens: int) -> int:
        """Give unlocked leaves back to the allocator, least recently used first, until at least
        ``num_tokens`` slots are freed or nothing evictable is left. Returns the slots freed, and
        adds them to ``evicted_tokens`` (a running total of what the tree gave back)."""
        evicted = 0  # noqa: F841
        raise NotImplementedError(
            "Stage 6: evict unlocked leaves, least recently used first - see stages/s06_radix_cache/README.md#what-you-write"  # noqa: E501 (one message, the learner's to read whole)
        )

    def cached_slots(self) -> torch.Tensor:
        values = [node.value.reshape(-1).cpu() for node in self._all_nodes()]
        return torch.cat(values) if values else torch.empty(0, dtype=torch.int64)

    # --- inspection -------------------------------------------------------------------------------

    def _all_nodes(self) -> list[TreeNode]:
        """Every node but the root, parents before children."""
        nodes, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def total_size(self) -> int:
        return sum(len(node.key) for node in self._all_nodes())

    def check(self) -> None:
        """Raise AssertionError unless the tree is consistent: every edge non-empty, a whole number of
        pages, as many slots as tokens, filed under its first token (page) and pointing back at its
        parent; lock counts never negative and never smaller below than above (a lock covers the
        whole path); evictable + protected sizes add up to the tokens held; no slot twice, and every
        slot allocated in the allocator."""
        problems = []
        evictable = protected = 0
        for node in self._all_nodes():
            where = f"node {node.id} ({len(node.key)} tokens, lock_ref {node.lock_ref})"
            if not node.key or len(node.key) % self.page_size:
                problems.append(f"{where}: its key must be a non-empty whole number of pages of {self.page_size}")
                continue
            if len(node.value) != len(node.key):
                problems.append(f"{where}: {len(node.value)} slots for {len(node.key)} tokens")
            if node.parent.children.get(self._child_key(node.key)) is not node:
                problems.append(f"{where}: its parent does not file it under its first token")
            if node.lock_ref < 0:
                problems.append(f"{where}: negative lock count")
            if node.parent is not self.root and node.parent.lock_ref < node.lock_ref:
                problems.append(f"{where}: locked more often than its parent (lock_ref {node.parent.lock_ref})")
            if node.lock_ref > 0:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        if (evictable, protected) != (self.evictable_size_, self.protected_size_):
            problems.append(
                f"sizes: the nodes hold {evictable} evictable and {protected} protected tokens, the counters "
                f"say {self.evictable_size_} and {self.protected_size_}"
            )
        slots = self.cached_slots()
        if len(torch.unique(slots)) != len(slots):
            problems.append("a slot is held by the tree more than once")
        pages = torch.unique(slots // self.page_size)
        if len(pages) and not bool(self.allocator.page_allocated[pages].all()):
            problems.append("the tree holds slots whose pages the allocator counts as free")
        if problems:
            raise AssertionError("radix cache invariants broken:\n  " + "\n  ".join(problems))

    def pretty(self, tokenizer=None, max_chars: int = 28) -> str:
        """The tree as text: one line per node with its token count, lock count and the start of
        its key (decoded when a tokenizer is given)."""

        def label(node: TreeNode) -> str:
            text = tokenizer.decode(node.key, skip_special_tokens=False) if tokenizer else " ".join(map(str, node.key))
            text = text if len(text) <= max_chars else text[: max_chars - 3] + "..."
            return f"[{len(node.key)} tok, lock {node.lock_ref}] {text!r}"

        lines = [
            f"root ({self.total_size()} tokens cached, {self.evictable_size_} evictable, {self.protected_size_} locked)"
        ]

        def draw(node: TreeNode, indent: str) -> None:
            children = sorted(node.children.values(), key=lambda c: c.id)
            for i, child in enumerate(children):
                last = i == len(children) - 1
                lines.append(f"{indent}{'└── ' if last else '├── '}{label(child)}")
                draw(child, indent + ("    " if last else "│   "))

        draw(self.root, "")
        return "\n".join(lines)
