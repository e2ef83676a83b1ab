"""The approximate prefix tree: longest match per replica, edge splits, LRU eviction under a budget, removal."""

from __future__ import annotations

import random

import pytest

from deepserve.router.prefix_tree import PrefixTree, common_prefix_len


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_longest_match_per_tenant():
    tree = PrefixTree()
    tree.insert("system: be brief. user: hi", "a")
    tree.insert("system: be brief. user: bye", "b")
    tree.insert("other prompt", "a")
    assert tree.match("system: be brief. user: hi there") == {"a": 26, "b": 24}
    assert tree.match("system: be verbose") == {"a": 11, "b": 11}
    assert tree.match("nothing shared") == {}
    assert tree.match("") == {}


def test_sizes_count_each_character_once_per_tenant_across_splits():
    tree = PrefixTree()
    tree.insert("abcdef", "a")
    tree.insert("abcxyz", "a")        # splits "abcdef" at 3
    tree.insert("abc", "b")
    assert tree.tenant_chars("a") == len("abc") + len("def") + len("xyz")
    assert tree.tenant_chars("b") == 3
    tree.insert("abcdef", "a")        # again: no growth
    assert tree.tenant_chars("a") == 9


def test_matches_agree_with_a_brute_force_reference():
    rng = random.Random(0)
    tree, sent = PrefixTree(), {"a": [], "b": [], "c": []}
    alphabet = "ab"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        tenant = rng.choice("abc")
        tree.insert(text, tenant)
        sent[tenant].append(text)
    for _ in range(200):
        query = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        expected = {}
        for tenant, texts in sent.items():
            best = max((common_prefix_len(t, query, 0) for t in texts), default=0)
            if best:
                expected[tenant] = best
        assert tree.match(query) == expected, query


def test_eviction_drops_least_recently_used_prefixes_first():
    tree = PrefixTree(clock=Clock())
    tree.insert("old prompt one", "a")
    tree.insert("new prompt two", "a")
    tree.insert("old prompt one", "b")
    tree.evict(max_chars=len("new prompt two"))
    assert tree.tenant_chars("a") <= len("new prompt two")
    assert tree.match("new prompt two") == {"a": 14}
    assert tree.match("old prompt one") == {"b": 14}       # b was under budget: untouched


def test_eviction_of_a_shared_prefix_keeps_the_newer_branch():
    tree = PrefixTree(clock=Clock())
    tree.insert("shared system prompt / q1", "a")
    tree.insert("shared system prompt / q2", "a")
    tree.evict(max_chars=tree.tenant_chars("a") - 1)
    assert tree.match("shared system prompt / q2") == {"a": 25}
    assert tree.match("shared system prompt / q1") == {"a": 24}


def test_remove_tenant_forgets_it_and_keeps_the_others():
    tree = PrefixTree()
    tree.insert("abc", "a")
    tree.insert("abd", "b")
    tree.remove_tenant("a")
    assert tree.match("abc") == {"b": 2}
    assert tree.tenant_chars("a") == 0 and tree.tenants() == ["b"]
    tree.remove_tenant("b")
    assert tree.match("abd") == {}


@pytest.mark.parametrize("edge, text, start, expected", [
    ("abc", "abc", 0, 3), ("abc", "abd", 0, 2), ("abc", "xab", 1, 2), ("abc", "x", 0, 0), ("", "abc", 0, 0),
    ("abcdef", "abc", 0, 3), ("a" * 1000 + "b", "a" * 1000 + "c", 0, 1000),
])
def test_common_prefix_len(edge, text, start, expected):
    assert common_prefix_len(edge, text, start) == expected
