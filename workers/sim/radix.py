"""The simulated engine's prefix cache: SGLang 0.5.23's radix cache (srt/mem_cache/radix_cache.py),
page size 1, reduced to what the scheduler needs. `match_prefix` walks the tree and splits an
edge where a match ends inside it (`_split_node`); a node used by a running request is locked
(`inc_lock_ref`/`dec_lock_ref`, counted up to the root) and never evicted; `evict` frees the
least recently used unlocked leaves first (`evict`, a heap on `last_access_time`); `reset` is
`flush_cache`. Sizes are in KV tokens: `evictable_size` + `protected_size` is what the tree holds.
"""

from __future__ import annotations

import heapq
import itertools


class _Node:
    __slots__ = ("children", "parent", "key", "lock_ref", "last_access")

    def __init__(self, key: list[int], parent: _Node | None):
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.key = key
        self.lock_ref = 0
        self.last_access = 0


class RadixCache:
    def __init__(self) -> None:
        self._clock = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        self.root = _Node([], None)
        self.root.lock_ref = 1  # never evicted, as SGLang's root
        self.evictable_size = 0
        self.protected_size = 0

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def match_prefix(self, ids: list[int]) -> tuple[int, _Node]:
        """(length of the longest cached prefix of `ids`, its last node); touches the path."""
        node, matched, now = self.root, 0, next(self._clock)
        node.last_access = now
        while matched < len(ids):
            child = node.children.get(ids[matched])
            if child is None:
                break
            child.last_access = now  # before a split: both halves were used (`_match_prefix_helper`)
            common = _common_length(child.key, ids, matched)
            if common < len(child.key):
                child = self._split(child, common)
            node, matched = child, matched + common
            if common < len(child.key):
                break
        return matched, node

    def insert(self, ids: list[int]) -> int:
        """Cache `ids`; returns how many of them were cached already (their KV is a duplicate
        the caller frees, as SGLang's `cache_finished_req` frees it)."""
        matched, node = self.match_prefix(ids)
        if matched < len(ids):
            leaf = _Node(list(ids[matched:]), node)
            leaf.last_access = next(self._clock)
            node.children[ids[matched]] = leaf
            self.evictable_size += len(leaf.key)
        return matched

    def lock(self, node: _Node) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: _Node) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node = node.parent  # type: ignore[assignment]

    def evict(self, tokens: int) -> int:
        """Free at least `tokens` (if that many are evictable), least recently used leaves first."""
        leaves = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < tokens and leaves:
            _t, _i, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            freed += len(leaf.key)
            self.evictable_size -= len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        return freed

    def _leaves(self) -> list[_Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                out.append(node)
        return out

    def _split(self, child: _Node, at: int) -> _Node:
        """Split `child`'s edge after `at` tokens; returns the new upper node (SGLang's `_split_node`)."""
        parent = child.parent
        assert parent is not None
        upper = _Node(child.key[:at], parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        parent.children[child.key[0]] = upper
        child.key = child.key[at:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper


def _common_length(key: list[int], ids: list[int], start: int) -> int:
    n = min(len(key), len(ids) - start)
    i = 0
    while i < n and key[i] == ids[start + i]:
        i += 1
    return i
