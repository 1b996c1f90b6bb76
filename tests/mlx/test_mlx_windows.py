"""KV windows on the MLX back end: a query sees its row's first S tokens and the newest
W - S, whatever the chunking; old positions leave the storage; windowed rows batch, merge,
extract, fork and cut like any other; and on the shipped SmolLM2 an answer runs past its
window, fused with another, through a real server too."""

from __future__ import annotations

import attrs
import numpy as np
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from butter.backend import KVSpec, SamplingParams, Work
from butter.kvcodec import RAW

mx = pytest.importorskip("mlx.core")
from butter_backend_mlx.kvcache import DROP_AFTER, CodecKVCache  # noqa: E402
from butter_kvcodecs.plugin import affine, aura  # noqa: E402

pytestmark = pytest.mark.slow  # MLX on a CPU: seconds per request

KV_HEADS, Q_HEADS, HEAD_DIM = 3, 9, 64  # SmolLM2-135M's attention
CODECS = {codec.name: codec for codec in (RAW, affine(8), aura(4, 4))}
SCALE = 0.125


def _tokens(seed: int, length: int, rows: int = 1, heads: int = KV_HEADS) -> mx.array:
    rng = np.random.default_rng(seed)
    data = rng.standard_normal((rows, heads, length, HEAD_DIM)) \
        + rng.uniform(-1, 1, (rows, heads, 1, HEAD_DIM))
    return mx.array(data.astype(np.float16))


def _f32(array: mx.array) -> np.ndarray:
    return np.array(array.astype(mx.float32))


def _windowed_reference(keys: np.ndarray, values: np.ndarray, queries: np.ndarray,
                        window: int, keep: int) -> np.ndarray:
    """Float32 attention of the last ``N`` positions' queries on every position, each
    query masked to its first ``keep`` and its newest ``window - keep`` positions."""
    length, n = keys.shape[2], queries.shape[2]
    q = queries.reshape(1, KV_HEADS, Q_HEADS // KV_HEADS, n, HEAD_DIM)
    scores = q @ keys[:, :, None].swapaxes(-1, -2) * SCALE
    at = np.arange(length - n, length)[:, None]
    position = np.arange(length)[None]
    seen = (position <= at) & ((position < keep) | (position > at - (window - keep)))
    scores = np.where(seen, scores, -np.inf)
    scores -= scores.max(-1, keepdims=True)
    probs = np.exp(scores) / np.exp(scores).sum(-1, keepdims=True)
    return (probs @ values[:, :, None]).reshape(1, Q_HEADS, n, HEAD_DIM)


@settings(max_examples=20, deadline=None)
@given(name=st.sampled_from(sorted(CODECS)), seed=st.integers(0, 2**31),
       window=st.integers(8, 48), keep=st.sampled_from([0, 1, 4]), mirror=st.booleans(),
       chunks=st.lists(st.integers(1, 40), min_size=2, max_size=8))
def test_a_query_sees_the_kept_tokens_and_its_window_however_it_was_chunked(
        name, seed, window, keep, mirror, chunks):
    """Against the same codec unwindowed (its float16 first tokens widened to the kept
    ones), masked in float32: what each chunk's queries read is their window exactly,
    before and after old positions leave the storage. (AURA's queries within a chunk
    read the newest tokens before each in float16: only a chunk's last is compared.)"""
    codec = CODECS[name]
    chunks = chunks + [1, 1]  # decode steps last (the mirror path decodes)
    length = sum(chunks)
    keys, values = _tokens(seed, length), _tokens(seed + 1, length)
    windowed = CodecKVCache(codec, layer=3, window=window, keep=keep, mirror=mirror)
    whole = CodecKVCache(attrs.evolve(codec, sinks=windowed.pinned), layer=3)
    start = 0
    for size in chunks:
        part = slice(start, start + size)
        start += size
        queries = _tokens(seed + start, size, heads=Q_HEADS)
        windowed.update_and_fetch(keys[..., part, :], values[..., part, :])
        whole.update_and_fetch(keys[..., part, :], values[..., part, :])
        whole.attend(queries, scale=SCALE)  # completes the pending step
        held_k, held_v = (_f32(a) for a in whole.held())
        expected = _windowed_reference(held_k, held_v, _f32(queries), window, keep)
        got = _f32(windowed.attend(queries, scale=SCALE))
        if codec.recent:  # earlier queries of a chunk read float16 what held() quantized
            got, expected = got[..., -1:, :], expected[..., -1:, :]
        # Scores and weights in float16: over 150 draws the worst difference was 0.004 on
        # float16 storage or the mirror, 0.006 for AURA, and 0.027 for affine8's
        # quantized_matmul on windows of a few positions (fewer to average errors over).
        quantized = not codec.raw and not (mirror and size == 1)
        bound = 4e-2 if quantized and not codec.recent else 1e-2
        assert np.abs(got - expected).max() < bound, (start, size)
    assert windowed.size() <= window + DROP_AFTER + max(chunks)  # old positions left


def _filled(codec, seed: int, length: int) -> CodecKVCache:
    """A row of ``length`` tokens under a 32-position window keeping 4, fed 16 at a time."""
    cache = CodecKVCache(codec, layer=2, window=32, keep=4)
    for start in range(0, length, 16):
        size = min(16, length - start)
        cache.update_and_fetch(_tokens(seed, size), _tokens(seed + 1, size))
        cache.attend(_tokens(seed + 2, size, heads=Q_HEADS), scale=SCALE)
        seed += 3
    return cache


def test_windowed_rows_batch_as_each_row_alone_after_dropping_old_positions():
    """Rows past their window by different amounts (negative padding), a short one and
    one cut back, merged, extended, filtered and extracted: each row's attention, bit for
    bit, as alone."""
    for codec in (RAW, CODECS["aura4v4"]):
        long_, longer = _filled(codec, 1, 150), _filled(codec, 20, 230)
        short, cut = _filled(codec, 40, 3), _filled(codec, 60, 30)
        cut.trim(10)  # a row that never passed its window cuts back exactly
        assert min(longer._pads) < 0 and min(long_._pads) < 0  # positions were dropped
        alone = [c.prefix(c._idx - c._pads[0]) for c in (long_, longer, short, cut)]
        batch = CodecKVCache.merge([long_, longer])
        batch.extend(CodecKVCache.merge([short, cut]))
        for step in range(90):
            if step == 40:
                batch.filter(mx.array([0, 2, 3]))
                alone.pop(1)
            rows = len(alone)
            keys, values = _tokens(100 + step, 1, rows), _tokens(300 + step, 1, rows)
            queries = _tokens(500 + step, 1, rows, Q_HEADS)
            batch.update_and_fetch(keys, values)
            fused = _f32(batch.attend(queries, scale=SCALE))
            for row, cache in enumerate(alone):
                cache.update_and_fetch(keys[row:row + 1], values[row:row + 1])
                own = _f32(cache.attend(queries[row:row + 1], scale=SCALE))
                assert np.array_equal(own, fused[row:row + 1]), (codec.name, step, row)
        extracted = batch.extract(1)  # the short row, now past its window
        assert extracted.offset == alone[1].offset == 3 + 90
        assert extracted.size() <= 32 + DROP_AFTER
        for mine, theirs in zip(extracted.held(), alone[1].held()):
            assert np.array_equal(_f32(mine)[..., -32:, :], _f32(theirs)[..., -32:, :])


# ---- the shipped SmolLM2 -----------------------------------------------------------

STORY = ("<|im_start|>user\nWrite a long story about a dragon who bakes bread.<|im_end|>\n"
         "<|im_start|>assistant\n")
QUESTION = ("<|im_start|>user\nName the capital city of France.<|im_end|>\n"
            "<|im_start|>assistant\n")


def _runtime(loaded, codec=RAW, window=None, keep=4):
    kv = KVSpec(codec=codec, window=window, keep=keep if window else 0)
    return loaded.create_runtime(kv=kv, capacity=1024, n_sessions=3, max_batch=128,
                                 options={})


def _decode(runtime, prompts: dict[int, list[int]], n: int) -> dict[int, list[int]]:
    """Greedy answers of ``n`` tokens, every session prefilled then decoded in one step."""
    sampler = runtime.new_sampler(SamplingParams(temperature=0.0, top_p=1.0, seed=0))
    answers = {s: [] for s in prompts}
    for session, tokens in prompts.items():  # prompts of different lengths: one at a time
        (token,) = runtime.step([Work(session, tokens, sampler)])
        answers[session].append(token)
    for _ in range(n - 1):
        drawn = runtime.step([Work(s, (a[-1],), sampler) for s, a in answers.items()])
        for answer, token in zip(answers.values(), drawn):
            answer.append(token)
    return answers


def _text(loaded, tokens) -> str:
    return b"".join(loaded.token_piece(t) for t in tokens).decode(errors="replace")


def _letters(text: str) -> float:
    return sum(c.isalpha() or c.isspace() or c in ".,;:'!?\"-" for c in text) / max(len(text), 1)


@pytest.mark.parametrize("name", ["raw", "affine8"])
def test_an_answer_runs_past_its_window_fused_and_alone_alike(loaded, name):
    story = loaded.tokenize(STORY, add_special=False, parse_special=True)
    question = loaded.tokenize(QUESTION, add_special=False, parse_special=True)
    runtime = _runtime(loaded, CODECS[name], window=96, keep=4)
    try:
        assert runtime.kv.window == 96 and runtime.kv.max_positions == 96
        fused = _decode(runtime, {0: story, 1: question}, 200)
        assert {type(layer).__name__ for layer in runtime._batch} == {"CodecKVCache"}
        assert runtime._batch[0].size() <= 96 + DROP_AFTER  # old positions left
        runtime.truncate(0, 0)
        alone = _decode(runtime, {0: story}, 200)
        assert runtime.describe()["kv_window"] == 96
    finally:
        runtime.close()
    assert alone[0] == fused[0]  # past the window, fused or alone: the same answer
    tail = _text(loaded, fused[0][-120:])  # written well past the window
    words = tail.split()
    assert _letters(tail) > 0.9 and len(set(words)) >= 8, tail
    assert "Paris" in _text(loaded, fused[1][:8])


def test_a_window_changes_nothing_before_it_fills_and_cuts_and_forks_until_then(loaded):
    question = loaded.tokenize(QUESTION, add_special=False, parse_special=True)
    plain = _runtime(loaded)
    windowed = _runtime(loaded, window=256)
    try:
        expected = _decode(plain, {0: question}, 12)[0]
        assert _decode(windowed, {0: question}, 12)[0] == expected
        assert windowed.kv.can_truncate(len(question) + 12, len(question) - 1)
        assert windowed.fork(0, 2, len(question) - 1)
        assert windowed.truncate(0, len(question) - 1)
        for session in (0, 2):
            again = _decode(windowed, {session: question[-1:]}, 6)[session]
            assert again == expected[:6]
        assert not windowed.kv.can_truncate(300, 10)  # past the window: never cut
    finally:
        plain.close()
        windowed.close()


def test_butter_serve_mlx_answers_past_its_window(start_server):
    server = start_server("--backend", "mlx", "--kv-window-size", "128", "--kv-window-keep",
                          "4", "--kv-cache", "affine8", "--parallel", "2")
    card = server.models()[0]
    assert card["context_length"] == 128 and card["butter"]["kv_window"] == 128
    client = openai.OpenAI(base_url=server.base_url, api_key="-", max_retries=0, timeout=300)
    story = [{"role": "user", "content": "Write a long story about a dragon who bakes bread."}]
    long = client.chat.completions.create(model="smollm2", messages=story, max_tokens=300,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert long.usage.completion_tokens == 300 and long.choices[0].finish_reason == "length"
    tail = long.choices[0].message.content[-600:]
    assert _letters(tail) > 0.9 and len(set(tail.split())) >= 8, tail
    # A conversation whose window moved on is prefilled afresh.
    history = story + [{"role": "assistant", "content": long.choices[0].message.content[:200]},
                       {"role": "user", "content": "Thanks."}]
    again = client.chat.completions.create(model="smollm2", messages=history, max_tokens=4)
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    with pytest.raises(openai.BadRequestError) as info:  # a prompt longer than the window
        client.chat.completions.create(model="smollm2", max_tokens=4, messages=[
            {"role": "user", "content": " ".join(["word"] * 200)}])
    assert info.value.code == "context_length_exceeded"
    server.stop()


def test_a_codec_and_window_hold_across_swaps_between_back_ends(start_server, mlx_folder):
    """One --kv-cache and --kv-window-size for the process: the MLX folder stores AURA
    itself, the GGUF on the other back end as llama.cpp's nearest cache types."""
    server = start_server("--kv-cache", "aura4v4", "--kv-window-size", "256",
                          model=str(mlx_folder))
    client = openai.OpenAI(base_url=server.base_url, api_key="-", max_retries=0, timeout=300)
    question = [{"role": "user", "content": "Name the capital city of France."}]
    for model, backend in ((str(mlx_folder), "mlx"), ("smollm2", "gguf"),
                           (str(mlx_folder), "mlx")):
        reply = client.chat.completions.create(model=model, messages=question, max_tokens=8,
                                               temperature=0)
        assert "Paris" in reply.choices[0].message.content
        card = server.models()[0]["butter"]
        assert card["backend"] == backend and card["kv_window"] == 256
        if backend == "mlx":
            assert card["kv_codec"] == "aura4v4"
        else:
            assert card["kv_cache"] == "aura4v4" and card["kv_cache_types"] == \
                "keys q4_0, values q4_0"
    server.stop()
