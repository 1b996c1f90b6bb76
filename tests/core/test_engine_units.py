"""Admission arithmetic, session choice and text hold-back, without a model."""

import pytest

from butter.backend import ForkKind, KVFacts, TruncateKind
from butter.engine.admission import DEFAULT_MIN_COMPLETION, Admission, common_prefix
from butter.engine.events import SyncChannel
from butter.engine.records import Request, Session
from butter.engine.text import Detokenizer, StopMatcher
from butter.errors import ContextLengthExceededError
from butter.generation import GenerationParams


def kv(capacity: int, *, truncate=TruncateKind.ANYWHERE, window=None, token_bytes=4) -> KVFacts:
    return KVFacts(budget_bytes=capacity * token_bytes, token_bytes=token_bytes,
                   max_positions=capacity, fork=ForkKind.ALIAS, truncate=truncate,
                   window=window)


def request(tokens, max_tokens=None):
    r = Request(list(tokens), GenerationParams(max_tokens=max_tokens), SyncChannel())
    r.prompt_tokens = list(tokens)
    return r


def test_budget_explicit_default_and_refusal():
    admission = Admission(kv(1000), parallel=4)
    assert admission.plan(request(range(100), max_tokens=50)) == 50
    assert admission.plan(request(range(100))) == max(250 - 100, DEFAULT_MIN_COMPLETION)
    assert admission.plan(request(range(900))) == 100  # never past the context
    with pytest.raises(ContextLengthExceededError):
        admission.plan(request(range(990), max_tokens=20))
    with pytest.raises(ContextLengthExceededError):
        admission.plan(request(range(1000)))


def test_longest_prefix_then_least_recently_used():
    a = Session(seq_id=0, tokens=[1, 2, 3, 4], last_used=5)
    b = Session(seq_id=1, tokens=[1, 2, 9], last_used=1)
    c = Session(seq_id=2, tokens=[], last_used=0)
    admission = Admission(kv(100), parallel=1)
    session, reuse = admission.pick_session([a, b, c], [1, 2, 3, 4, 5])
    assert session is a and reuse == 4
    session, reuse = admission.pick_session([a, b, c], [7, 8])
    assert session is c and reuse == 0
    # The whole prompt cached: one token is left to prefill for fresh logits.
    session, reuse = admission.pick_session([a], [1, 2, 3, 4])
    assert reuse == 3


def test_best_source_is_any_session_with_a_longer_prefix():
    busy = Session(seq_id=0, tokens=[1, 2, 3, 4, 5])
    idle = Session(seq_id=1, tokens=[1, 2, 9])
    admission = Admission(kv(100), parallel=1)
    assert admission.best_source([busy, idle], [1, 2, 3, 7], better_than=2) == (busy, 3)
    assert admission.best_source([busy, idle], [1, 2, 9, 9], better_than=3) == (None, 0)
    # One prompt token is always left to prefill.
    assert admission.best_source([busy], [1, 2, 3], better_than=0) == (busy, 2)


def test_a_window_admits_answers_past_it_and_a_wrapped_session_is_never_reused():
    admission = Admission(kv(8, truncate=TruncateKind.UNTIL_WRAP, window=8), parallel=1)
    assert admission.plan(request(range(6), max_tokens=100)) == 100  # runs past the window
    with pytest.raises(ContextLengthExceededError):
        admission.plan(request(range(9), max_tokens=1))  # the prompt must fit it
    wrapped = Session(seq_id=0, tokens=list(range(12)))  # fed 12 tokens into 8 positions
    fresh = Session(seq_id=1, tokens=[0, 1, 2])
    prompt = list(range(14))
    assert admission.pick_session([wrapped], prompt) == (wrapped, 0)
    assert admission.best_source([wrapped, fresh], prompt, better_than=0) == (fresh, 3)


def test_state_that_cannot_rewind_is_reused_only_as_a_whole_prefix():
    a = Session(seq_id=0, tokens=[1, 2, 3], last_used=1)
    admission = Admission(kv(100, truncate=TruncateKind.NEVER), parallel=1)
    assert admission.pick_session([a], [1, 2, 3, 4]) == (a, 3)
    assert admission.pick_session([a], [1, 2, 7, 8])[1] == 0
    assert admission.pick_session([a], [1, 2, 3])[1] == 0


def test_a_window_can_be_cut_only_until_it_wraps():
    windowed = Admission(kv(100, truncate=TruncateKind.UNTIL_WRAP, window=4), parallel=1)
    short = Session(seq_id=0, tokens=[1, 2, 3], last_used=1)
    wrapped = Session(seq_id=1, tokens=[1, 2, 3, 4, 5, 6], last_used=1)
    assert windowed.pick_session([short], [1, 2, 9]) == (short, 2)
    assert windowed.pick_session([wrapped], [1, 2, 3, 4, 5, 9])[1] == 0


def test_costs_are_bytes_a_window_stops_growing_and_storage_grows_in_steps():
    facts = KVFacts(budget_bytes=10_000, token_bytes=10, max_positions=4096,
                    fork=ForkKind.COPY, truncate=TruncateKind.ANYWHERE, granule=256)
    assert facts.cost(1) == facts.cost(256) == 2560 and facts.cost(257) == 5120
    assert facts.capacity == 1000
    windowed = KVFacts(budget_bytes=10_000, token_bytes=10, max_positions=4096,
                       fork=ForkKind.NONE, truncate=TruncateKind.UNTIL_WRAP, window=100)
    assert windowed.cost(5000) == windowed.cost(100) == 1000


def test_make_room_evicts_idle_caches_lru_then_waits():
    admission = Admission(kv(100), parallel=2)
    active = request(range(30), max_tokens=30)
    active.reservation = 60
    old = Session(seq_id=1, tokens=list(range(20)), last_used=1)
    new = Session(seq_id=2, tokens=list(range(20)), last_used=2)
    target = Session(seq_id=3)
    incoming = request(range(10), max_tokens=10)
    incoming.reservation = 20
    assert admission.make_room(incoming, target, [active], [old, new, target]) == [old]
    incoming.reservation = 41
    assert admission.make_room(incoming, target, [active], [old, new, target]) is None


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([], [1]) == 0


def test_stop_strings_are_held_back_across_chunks():
    stops = StopMatcher(("END", "##"))
    assert stops.feed("hello E") == ("hello ", False)
    assert stops.feed("N") == ("", False)
    assert stops.feed("D more") == ("", True)
    other = StopMatcher(("END",))
    assert other.feed("EN") == ("", False)
    assert other.feed("x") == ("ENx", False)
    assert other.flush() == ""
    tail = StopMatcher(("END",))
    tail.feed("abcE")
    assert tail.flush() == "E"


def test_detokenizer_waits_for_whole_characters():
    detok = Detokenizer()
    data = "é😀".encode()
    out = "".join(detok.feed(data[i:i + 1]) for i in range(len(data)))
    assert out + detok.flush() == "é😀"
    assert Detokenizer().feed(b"\xc3") == ""


def test_a_character_cut_off_at_the_end_is_dropped_not_replaced():
    detok = Detokenizer()
    assert detok.feed("ラン".encode()[:5]) == "ラ"
    assert detok.flush() == ""  # no U+FFFD for the half of ン the model never finished
