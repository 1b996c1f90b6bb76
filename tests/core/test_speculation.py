"""Prompt-lookup speculation on the fake runtime: what is drafted, verified, kept and cut.

The fake's model copies its context (the token that followed the last occurrence of the
last two tokens is the likeliest next one), with logits that depend on everything a
session holds: a verify that kept a rejected position, or drew with another random
state than plain decoding, answers differently.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from fakes.runtime import FakeModel

from butter.engine.events import Failed, Finished, SyncChannel, TextDelta
from butter.engine.planner import Planner
from butter.engine.records import Phase, Request, Session
from butter.engine.scheduler import Engine, EngineConfig
from butter.engine.speculation import Drafter
from butter.generation import GenerationParams

VOCAB = 64


def copying_logits(held) -> np.ndarray:
    """Favour the token after the latest earlier occurrence of the last two tokens, over
    a context-hashed noise floor."""
    noise = np.random.default_rng(zlib.crc32(bytes(t % 256 for t in held[-16:])))
    logits = noise.normal(0.0, 1.0, VOCAB)
    tail = tuple(held[-2:])
    for end in range(len(held) - 1, 1, -1):
        if tuple(held[end - 2:end]) == tail:
            logits[held[end] % VOCAB] += 4.0
            break
    return logits


class CopyingModel(FakeModel):
    def create_runtime(self, **options):
        runtime = super().create_runtime(**options)
        runtime.next_token, runtime.logits = None, copying_logits
        return runtime


PARAGRAPH = [int(t) for t in np.random.default_rng(3).integers(0, VOCAB, 40)]
PROMPT = PARAGRAPH + [1, 2] + PARAGRAPH[:3]  # "repeat it": the answer copies the paragraph


def generate(engine: Engine, prompt: list[int], **params) -> tuple[list[int], Finished]:
    channel = SyncChannel()
    request = Request(prompt, GenerationParams(**{"max_tokens": 30, **params}), channel)
    engine.submit(request)
    while True:
        event = channel.get(timeout=10)
        assert not isinstance(event, Failed), event
        if isinstance(event, Finished):
            return request.generated, event
        assert isinstance(event, (TextDelta, object))


@pytest.fixture
def engine_for():
    engines: list[Engine] = []

    def start(speculation: str = "ngram", **config) -> tuple[Engine, CopyingModel]:
        model = CopyingModel()
        engine = Engine(model, EngineConfig(parallel=3, capacity=512, max_batch=64,
                                            speculation=speculation, **config))
        engine.start()
        engines.append(engine)
        return engine, model

    yield start
    for engine in engines:
        engine.stop()


@pytest.mark.parametrize("sampling", [{"temperature": 0.0},
                                      {"temperature": 0.9, "seed": 11, "top_k": 20,
                                       "frequency_penalty": 0.3}],
                         ids=["greedy", "seeded"])
def test_drafts_change_no_token_and_the_cache_holds_what_was_kept(engine_for, sampling):
    plain, _ = engine_for(speculation="none")
    expected, finished = generate(plain, PROMPT, **sampling)
    assert finished.usage.accepted_prediction_tokens == 0

    engine, model = engine_for()
    tokens, finished = generate(engine, PROMPT, **sampling)
    assert tokens == expected
    verifies = model.runtime.verifies
    assert verifies, "a prompt that repeats itself drafts"
    accepted = sum(kept for _, _, kept in verifies)
    assert accepted > 0
    usage = finished.usage
    assert usage.accepted_prediction_tokens == accepted
    assert usage.rejected_prediction_tokens == sum(len(d) - k for _, d, k in verifies)
    metrics = engine.metrics
    assert metrics.draft_tokens == sum(len(d) for _, d, _ in verifies)
    assert metrics.draft_accepted_tokens == accepted
    assert metrics.draft_verifies == len(verifies)
    # Fewer model passes than tokens: that is the point.
    assert metrics.model_passes < plain.metrics.model_passes
    # What the session holds is the prompt and the answer but its last token, as after
    # plain decoding (rejected positions left the cache).
    assert model.runtime.held[0] == PROMPT + tokens[:-1]

    # The request field turns it off, with the same tokens.
    again, finished = generate(engine, PROMPT, speculation=False, **sampling)
    assert again == expected and finished.usage.rejected_prediction_tokens == 0
    assert len(model.runtime.verifies) == len(verifies)


def test_a_sure_request_drafts_beside_others_with_the_same_answers(engine_for):
    """A request that has drafted well alone goes on drafting once others join (its
    drafts then pay for a verify pass of their own); a fresh one beside others does not."""
    plain, _ = engine_for(speculation="none")
    prompts = [PROMPT, PROMPT[5:], list(range(30, 60))]
    expected = [generate(plain, p, temperature=0.0, max_tokens=60)[0] for p in prompts]
    engine, model = engine_for()
    channels = []
    for prompt in prompts:
        channel = SyncChannel()
        request = Request(prompt, GenerationParams(max_tokens=60, temperature=0.0), channel)
        engine.submit(request)
        channels.append((request, channel))
        while len(channels) == 1 and len(model.runtime.verifies) < 3:
            assert not isinstance(channel.get(timeout=10), (Finished, Failed))
    joined = len(model.runtime.verifies)
    for (request, channel), want in zip(channels, expected):
        while not isinstance(event := channel.get(timeout=10), (Finished, Failed)):
            pass
        assert isinstance(event, Finished) and request.generated == want
    first = channels[0][0].session.seq_id
    assert any(session == first for session, _, _ in model.runtime.verifies[joined:])


def test_a_verify_never_feeds_past_what_plain_decoding_would(engine_for):
    engine, model = engine_for()
    tokens, finished = generate(engine, PROMPT, temperature=0.0, max_tokens=9)
    assert finished.reason == "length" and len(tokens) == 9
    assert len(model.runtime.held[0]) <= len(PROMPT) + 9 - 1


def test_drafter_proposes_what_followed_the_last_match_and_pauses_after_misses():
    drafter = Drafter(max_draft=4)
    drafter.extend([5, 6, 7, 8, 9, 1, 5, 6])
    drafter.verified(4, 4)
    assert drafter.propose(10) == (7, 8, 9, 1)
    assert drafter.propose(2) == (7, 8)
    drafter.verified(4, 0)  # nothing accepted: one plain token before looking again
    assert drafter.propose(4) == ()
    drafter.extend([7])
    # What follows the match, as many tokens as the (now lower) acceptance pays for.
    assert drafter.propose(4) == (8, 9, 1, 5)[:drafter.length(1)] and drafter.length(1)
    drafter.verified(4, 0)  # the pause doubles: 2 plain tokens
    drafter.extend([1])
    assert drafter.propose(4) == ()
    fresh = Drafter()
    fresh.extend([1, 2, 3])
    assert fresh.propose(4) == ()  # no earlier match: no draft


def test_drafts_are_as_long_as_they_pay_for_the_lanes_decoding():
    sure, likely, unsure, failing = (Drafter(max_draft=16) for _ in range(4))
    assert sure.length(1) == 3 and sure.length(4) == 0  # the prior: p = 8/9
    for _ in range(6):
        sure.verified(12, 12)
        likely.verified(8, 7)
        unsure.verified(4, 1)
        failing.verified(4, 0)
    # A sure quote drafts as long as a verify may be, even beside seven others (the
    # verify pass it adds still yields more per row than the pass they share).
    assert sure.length(1) == sure.length(8) == 16
    # A likely one drafts a few tokens alone, none beside seven others.
    assert 1 < likely.length(1) < 16 and likely.length(8) == 0
    # An unsure one drafts one token alone; one whose drafts all fail stops drafting.
    assert unsure.length(1) == 1 and unsure.length(2) == 0
    assert failing.length(1) == 0


def test_a_short_match_drafts_only_where_its_own_length_pays():
    looping = Drafter()
    looping.extend([1, 2, 3] * 5)  # an answer caught in a loop of three tokens
    for _ in range(20):
        looping.verified(3, 3)
    # Sure enough to draft twelve tokens beside seven others, but the loop offers three:
    # a verify of three yields too little for the pass it adds to the step.
    assert looping.length(8) == 12 and looping.length(8, 3) == 0
    assert looping.propose(12, lanes=8) == ()
    assert looping.propose(12, lanes=1) == (1, 2, 3)  # alone, three pay


def test_a_drafter_that_stopped_drafts_again_once_decoding_quotes():
    quote = list(range(100, 140))
    drafter = Drafter()
    drafter.extend([1, 2, *quote, 3, 4])
    for _ in range(3):  # the first drafts failed: the answer began in its own words
        drafter.verified(4, 0)
    drafter.extend([5, 6, 7])
    assert drafter.length(1) == 0
    drafted = []
    for token in quote:  # then it quotes
        drafted.append(drafter.propose(8))
        drafter.extend([token])
    # The drafts it did not send were watched against what decoding drew; the quote's
    # first matching n-gram starts counting, and drafting resumes within the quote.
    assert drafter.length(1) > 0
    assert not drafted[0] and any(drafted)
    assert drafter.drafted == 12  # only real verifies count as drafted


def test_planner_drafts_only_into_room_the_next_prefill_chunk_does_not_need():
    asked = []

    def draft(record, limit):
        asked.append(limit)
        return tuple(range(100, 100 + min(limit, 8)))

    planner = Planner(max_batch=20, prefill_chunk=16, draft=draft)
    decoding = Request([1, 2, 3], GenerationParams(), SyncChannel())
    decoding.prompt_tokens, decoding.session = [1, 2, 3], Session(seq_id=0)
    decoding.phase, decoding.last_token, decoding.sampler = Phase.DECODE, 9, object()
    prefilling = Request(list(range(40)), GenerationParams(), SyncChannel())
    prefilling.prompt_tokens, prefilling.session = list(range(40)), Session(seq_id=1)
    prefilling.phase = Phase.PREFILL
    plan = planner.tick([decoding, prefilling])
    work = {p.request.id: p.work for p in plan}
    assert work[decoding.id].tokens == (9, 100, 101, 102)
    assert work[decoding.id].draft == (100, 101, 102)
    assert len(work[prefilling.id].tokens) == 16  # its whole chunk still fits
    assert asked == [20 - 1 - 16]
