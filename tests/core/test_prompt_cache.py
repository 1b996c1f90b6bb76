"""The prompt cache's policy: which saved cache a prompt loads, what is kept, what goes."""

from __future__ import annotations

from butter.engine.promptcache import PromptCache


def test_the_longest_shared_prefix_wins_and_one_prompt_token_is_left_to_read():
    cache = PromptCache(budget=100)
    cache.keep([1, 2, 3, 4, 5], "a", 10)
    cache.keep([1, 2, 9, 9], "b", 10)
    entry, shared = cache.best([1, 2, 3, 4, 7], better_than=0)
    assert entry.data == "a" and shared == 4
    entry, shared = cache.best([1, 2, 3, 4, 5], better_than=0)
    assert entry.data == "a" and shared == 4  # the last prompt token is read for its logits
    assert cache.best([1, 2, 3, 4, 7], better_than=4) == (None, 0)  # the session holds as much
    assert cache.best([8, 8], better_than=0) == (None, 0)


def test_an_entry_that_another_extends_goes_and_a_covered_one_is_not_needed():
    cache = PromptCache(budget=100)
    cache.keep([1, 2, 3], "short", 10)
    cache.keep([1, 2, 3, 4, 5], "long", 20)
    assert len(cache) == 1 and cache.bytes == 20
    assert cache.covers([1, 2, 3]) and cache.covers([1, 2, 3, 4, 5])
    assert not cache.covers([1, 2, 3, 4, 5, 6]) and not cache.covers([2])


def test_the_least_recently_used_go_first_and_an_entry_past_the_budget_is_not_kept():
    cache = PromptCache(budget=30)
    cache.keep([1, 1], "a", 10)
    cache.keep([2, 2], "b", 10)
    cache.keep([3, 3], "c", 10)
    cache.best([1, 1, 5], better_than=0)  # "a" is used: "b" is now the oldest
    cache.keep([4, 4], "d", 10)
    assert cache.bytes == 30 and len(cache) == 3
    assert cache.best([2, 2, 5], better_than=0) == (None, 0)
    assert cache.best([1, 1, 5], better_than=0)[0].data == "a"
    cache.keep([5, 5], "huge", 31)
    assert cache.bytes == 30 and not cache.covers([5, 5])


def test_a_load_is_cut_where_the_runtime_can_cut_it():
    """Recurrent state comes back only at a snapshot: ``reach`` moves the shared prefix
    down to one, and an entry that then shares less may lose to another."""
    cache = PromptCache(budget=100)
    cache.keep(list(range(40)), "snapshots at 8 and 32", 10)
    cache.keep(list(range(20)) + [99] * 10, "anywhere", 10)
    snapshots = {"snapshots at 8 and 32": (8, 32)}

    def reach(data, keep):
        return max((at for at in snapshots.get(data, (keep,)) if at <= keep), default=0)

    prompt = list(range(30)) + [7]
    entry, shared = cache.best(prompt, better_than=0, reach=reach)
    assert (entry.data, shared) == ("anywhere", 20)  # 30 shared with the first, cut to 8
    entry, shared = cache.best(list(range(36)), better_than=0, reach=reach)
    assert (entry.data, shared) == ("snapshots at 8 and 32", 32)
    assert cache.best(prompt, better_than=20, reach=reach) == (None, 0)
