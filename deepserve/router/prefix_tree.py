"""An approximate radix tree of the request texts sent to each replica: which replica probably still holds a
prompt's prefix in its KV cache.

"Approximate" because it is built from what the router sent, not read from the replicas: a replica may have
evicted a prefix the tree still lists, or cached one it got elsewhere. The tree is a guess good enough to
route by, as sgl-router's is; a wrong guess costs a prefill, never a wrong answer.

One tree is shared by all replicas ("tenants"): each node keeps an edge of text and, per tenant that sent a
text through it, the time it last did. Invariant: a tenant on a node is on every ancestor too (a text stamps
its whole path; eviction takes a tenant off leaves first), so the deepest node a tenant is on gives its
longest match. Each tenant's size is the characters of the nodes it is on; past a budget, its least recently
used leaves go first.

Texts are characters (no tokenizer in the router); token-id prompts are turned into text by routing_key.py.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable


class _Node:
    __slots__ = ("text", "children", "parent", "tenants")

    def __init__(self, text: str, parent: _Node | None) -> None:
        self.text = text                          # the edge from the parent
        self.children: dict[str, _Node] = {}     # first character of the child's edge -> child
        self.parent = parent
        self.tenants: dict[str, float] = {}       # tenant -> last time a text through this node was sent there


class PrefixTree:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._root = _Node("", None)
        self._chars: dict[str, int] = {}
        self._clock = clock

    def insert(self, text: str, tenant: str) -> None:
        """Record that `text` was sent to `tenant`: every node on its path gets the tenant, stamped now."""
        now = self._clock()
        node = self._root
        self._stamp(node, tenant, now)
        i = 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                child = _Node(text[i:], node)
                node.children[text[i]] = child
                self._stamp(child, tenant, now)
                return
            common = common_prefix_len(child.text, text, i)
            if common < len(child.text):
                child = self._split(child, common)
            self._stamp(child, tenant, now)
            node, i = child, i + common

    def match(self, text: str) -> dict[str, int]:
        """For each tenant, the length of the longest prefix of `text` it was sent (tenants with none absent)."""
        matched: dict[str, int] = {}
        node, i = self._root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                break
            common = common_prefix_len(child.text, text, i)
            for tenant in child.tenants:          # deeper nodes overwrite: the last write is the longest
                matched[tenant] = i + common
            if common < len(child.text):
                break
            node, i = child, i + common
        return matched

    def tenant_chars(self, tenant: str) -> int:
        return self._chars.get(tenant, 0)

    def tenants(self) -> list[str]:
        return sorted(self._chars)

    def remove_tenant(self, tenant: str) -> None:
        """Forget everything sent to `tenant` (a replica removed from the set, or restarted with a cold cache)."""
        for node in self._post_order(tenant):
            del node.tenants[tenant]
            self._drop_if_empty(node)
        self._chars.pop(tenant, None)

    def evict(self, max_chars: int) -> None:
        """Take each tenant over `max_chars` back under it, least recently used leaves first."""
        for tenant in [t for t, chars in self._chars.items() if chars > max_chars]:
            self._evict_tenant(tenant, max_chars)

    # --- internals -------------------------------------------------------------------------------
    def _stamp(self, node: _Node, tenant: str, now: float) -> None:
        if tenant not in node.tenants:
            self._chars[tenant] = self._chars.get(tenant, 0) + len(node.text)
        node.tenants[tenant] = now

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut `child`'s edge after `at` characters; return the new upper node (same tenants, so sizes hold)."""
        parent = child.parent
        assert parent is not None
        upper = _Node(child.text[:at], parent)
        upper.tenants = dict(child.tenants)
        parent.children[upper.text[0]] = upper
        child.text = child.text[at:]
        child.parent = upper
        upper.children[child.text[0]] = child
        return upper

    def _post_order(self, tenant: str) -> list[_Node]:
        """The nodes `tenant` is on, children before parents."""
        order, stack = [], [self._root] if tenant in self._root.tenants else []
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(c for c in node.children.values() if tenant in c.tenants)
        return order[::-1]

    def _is_leaf_of(self, node: _Node, tenant: str) -> bool:
        return tenant in node.tenants and not any(tenant in c.tenants for c in node.children.values())

    def _evict_tenant(self, tenant: str, max_chars: int) -> None:
        leaves = [(n.tenants[tenant], id(n), n) for n in self._post_order(tenant)
                  if n is not self._root and self._is_leaf_of(n, tenant)]
        heapq.heapify(leaves)
        while leaves and self._chars[tenant] > max_chars:
            _, _, node = heapq.heappop(leaves)
            del node.tenants[tenant]
            self._chars[tenant] -= len(node.text)
            parent = node.parent
            self._drop_if_empty(node)
            if parent is not None and parent is not self._root and self._is_leaf_of(parent, tenant):
                heapq.heappush(leaves, (parent.tenants[tenant], id(parent), parent))

    def _drop_if_empty(self, node: _Node) -> None:
        if node is not self._root and not node.tenants and not node.children and node.parent is not None:
            del node.parent.children[node.text[0]]


def common_prefix_len(edge: str, text: str, start: int) -> int:
    """Length of the common prefix of `edge` and `text[start:]`, by bisection over str.startswith (C speed:
    a 100k-character prompt costs a few scans, not 100k Python steps)."""
    low, high = 0, min(len(edge), len(text) - start)
    if text.startswith(edge[:high], start):
        return high
    while low < high:                       # invariant: the answer is in [low, high]
        mid = (low + high + 1) // 2
        if text.startswith(edge[:mid], start):
            low = mid
        else:
            high = mid - 1
    return low
