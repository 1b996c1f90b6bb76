"""The KV codecs on MLX: round-trip bounds of what the cache holds, attention on it, and the
shipped SmolLM2 serving every codec fused, forked and with its prefix reused."""

from __future__ import annotations

import concurrent.futures
import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from butter.backend import KVSpec, SamplingParams, Work
from butter.kvcodec import KVCodec
from butter.library import default_plugins
from butter.testing.conformance import greedy

mx = pytest.importorskip("mlx.core")

from butter_backend_mlx.kvcache import CodecKVCache, Rotation  # noqa: E402
from butter_kvcodecs.plugin import affine, aura  # noqa: E402

pytestmark = pytest.mark.slow  # MLX on a CPU: seconds per request

KV_HEADS, Q_HEADS, HEAD_DIM = 3, 9, 64  # SmolLM2-135M's attention
CODECS = {codec.name: codec for codec in (affine(8), affine(4), aura(4, 4), aura(4, 2))}
SHAPES = settings(max_examples=25, deadline=None)


def _tokens(seed: int, length: int, magnitude: float, rows: int = 1,
            heads: int = KV_HEADS) -> mx.array:
    rng = np.random.default_rng(seed)
    data = rng.standard_normal((rows, heads, length, HEAD_DIM)) * magnitude \
        + rng.uniform(-magnitude, magnitude, (rows, heads, 1, HEAD_DIM))
    return mx.array(data.astype(np.float16))


def _f32(array: mx.array) -> np.ndarray:
    return np.array(array.astype(mx.float32))


def _step(x: np.ndarray, bits: int) -> np.ndarray:
    """One quantization step of each token's groups of 64 (the head dimension)."""
    return (x.max(-1) - x.min(-1)) / (2 ** bits - 1)


def _stored(codec: KVCodec, keys: mx.array, values: mx.array, chunks=None, *,
            mirror: bool = False) -> CodecKVCache:
    cache = CodecKVCache(codec, layer=7, mirror=mirror)
    start = 0
    for size in chunks or [keys.shape[2]]:
        cache.update_and_fetch(keys[..., start:start + size, :],
                               values[..., start:start + size, :])
        start += size
    return cache


def _round_trip(name: str, seed: int, length: int, magnitude: float):
    """The codec, random keys and values of ``length`` tokens, and what it holds of them."""
    codec = CODECS[name]
    keys, values = _tokens(seed, length, magnitude), _tokens(seed + 1, length, magnitude)
    return codec, keys, values, _stored(codec, keys, values).held()


# ---- round trips -------------------------------------------------------------------


@SHAPES
@given(name=st.sampled_from(["affine8", "affine4"]), seed=st.integers(0, 2**31),
       length=st.integers(1, 90), magnitude=st.floats(0.01, 40.0))
def test_affine_round_trip_is_within_a_step_per_group(name, seed, length, magnitude):
    codec, keys, values, held = _round_trip(name, seed, length, magnitude)
    for original, back in zip((keys, values), held):
        x, y = _f32(original), _f32(back)
        # mx.quantize rounds to within one step of the group's range; float16 scales and
        # biases add a little.
        bound = _step(x, codec.key_bits) + np.abs(x).max(-1) * 2 ** -9
        assert (np.abs(x - y).max(-1) <= bound).all()


@SHAPES
@given(name=st.sampled_from(["aura4v4", "aura4v2"]), seed=st.integers(0, 2**31),
       length=st.integers(1, 90), magnitude=st.floats(0.01, 40.0))
def test_aura_round_trip_keeps_sinks_and_recent_tokens_exact(name, seed, length, magnitude):
    codec, keys, values, (held_keys, held_values) = _round_trip(name, seed, length, magnitude)
    x, y = _f32(keys), _f32(held_keys)
    exact = np.zeros(length, bool)
    exact[:codec.sinks] = True
    exact[max(0, length - codec.recent):] = True
    assert (x[..., exact, :] == y[..., exact, :]).all()
    assert (_f32(values)[..., exact, :] == _f32(held_values)[..., exact, :]).all()
    # The rest: the rotation is orthogonal, so a token's key error (L2) is its error in
    # the rotated basis, where each group is within one step.
    rotated = _f32(Rotation(7, HEAD_DIM).apply(keys))
    bound = np.sqrt(HEAD_DIM) * (_step(rotated, codec.key_bits)
                                 + np.abs(rotated).max(-1) * 2 ** -8)
    error = np.linalg.norm(x - y, axis=-1)
    assert (error[..., ~exact] <= bound[..., ~exact]).all()
    v, w = _f32(values), _f32(held_values)  # values are not rotated
    step = _step(v, codec.value_bits) + np.abs(v).max(-1) * 2 ** -9
    assert (np.abs(v - w).max(-1)[..., ~exact] <= step[..., ~exact]).all()
    if (~exact).any():  # quantized tokens really are quantized
        assert not np.array_equal(x[..., ~exact, :], y[..., ~exact, :])


# ---- attention on what is held -------------------------------------------------------


def _reference(cache: CodecKVCache, queries: mx.array, scale: float) -> np.ndarray:
    """Softmax attention of the newest positions' queries on ``held()``, in float32."""
    keys, values = (_f32(a) for a in cache.held())
    q = _f32(queries).reshape(1, KV_HEADS, Q_HEADS // KV_HEADS, queries.shape[2], HEAD_DIM)
    scores = q @ keys[:, :, None].swapaxes(-1, -2) * scale
    scores -= scores.max(-1, keepdims=True)
    probs = np.exp(scores) / np.exp(scores).sum(-1, keepdims=True)
    return (probs @ values[:, :, None]).reshape(1, Q_HEADS, queries.shape[2], HEAD_DIM)


@SHAPES
@given(name=st.sampled_from(sorted(CODECS)), seed=st.integers(0, 2**31),
       chunks=st.lists(st.integers(1, 40), min_size=1, max_size=5))
def test_chunked_prefill_and_both_decode_paths_attend_on_what_the_cache_holds(name, seed,
                                                                             chunks):
    codec, length = CODECS[name], sum(chunks)
    keys, values = _tokens(seed, length + 1, 1.0), _tokens(seed + 1, length + 1, 1.0)
    query = _tokens(seed + 2, 1, 1.0, heads=Q_HEADS)
    outputs = []
    for mirror in (False, True):
        cache = _stored(codec, keys[..., :length, :], values[..., :length, :], chunks,
                        mirror=mirror)
        cache.update_and_fetch(keys[..., length:, :], values[..., length:, :])  # decode
        outputs.append(_f32(cache.attend(query, scale=0.125)))
    expected = _reference(cache, query, 0.125)
    # The compressed path scores in float16 (quantized_matmul): over 300 draws its worst
    # difference from the float32 reference was 0.009, the mirror's 0.002.
    for output, bound in zip(outputs, (2e-2, 5e-3)):
        assert np.abs(output - expected).max() < bound


def test_a_batch_of_rows_attends_as_each_row_alone():
    """Rows of different lengths (one cut back, one shorter than the sinks) merged,
    extended, filtered and extracted give each row's own attention, bit for bit."""
    for codec in (CODECS["affine4"], CODECS["aura4v2"]):
        long_ = _stored(codec, _tokens(1, 50, 1.0), _tokens(2, 50, 1.0))
        cut = _stored(codec, _tokens(3, 70, 1.0), _tokens(4, 70, 1.0))
        cut.trim(25)
        short = _stored(codec, _tokens(5, 2, 1.0), _tokens(6, 2, 1.0))
        alone = [c.prefix(c.size()) for c in (long_, cut, short)]
        batch = CodecKVCache.merge([long_, cut])
        batch.extend(CodecKVCache.merge([short]))
        for step in range(40):
            if step == 20:
                batch.filter(mx.array([0, 2]))
                alone.pop(1)
            rows = len(alone)
            keys, values = _tokens(10 + step, 1, 1.0, rows), _tokens(90 + step, 1, 1.0, rows)
            queries = _tokens(200 + step, 1, 1.0, rows, Q_HEADS)
            batch.update_and_fetch(keys, values)
            fused = _f32(batch.attend(queries, scale=0.125))
            for row, cache in enumerate(alone):
                cache.update_and_fetch(keys[row:row + 1], values[row:row + 1])
                own = _f32(cache.attend(queries[row:row + 1], scale=0.125))
                assert np.array_equal(own, fused[row:row + 1]), (codec.name, step, row)
        extracted = batch.extract(1)
        assert extracted.size() == alone[1].size() == 42
        for mine, theirs in zip(extracted.held(), alone[1].held()):
            assert np.array_equal(_f32(mine), _f32(theirs))


def test_a_short_row_left_alone_in_the_batch_keeps_only_its_own_float16_tail():
    """A long AURA row leaves the batch while one shorter than the recent window stays:
    the float16 tail shrinks to the short row's, and it attends as alone."""
    codec = CODECS["aura4v2"]
    long_ = _stored(codec, _tokens(1, 100, 1.0), _tokens(2, 100, 1.0))
    short = _stored(codec, _tokens(3, 5, 1.0), _tokens(4, 5, 1.0))
    alone = short.prefix(short.size())
    batch = CodecKVCache.merge([long_, short])
    batch.filter(mx.array([1]))
    keys, values = _tokens(5, 1, 1.0), _tokens(6, 1, 1.0)
    queries = _tokens(7, 1, 1.0, heads=Q_HEADS)
    batch.update_and_fetch(keys, values)
    alone.update_and_fetch(keys, values)
    assert batch.tail_k.shape[2] == alone.tail_k.shape[2] == 6
    assert np.array_equal(_f32(batch.attend(queries, scale=0.125)),
                          _f32(alone.attend(queries, scale=0.125)))


# ---- the shipped SmolLM2 -----------------------------------------------------------

PROMPTS = ["<|im_start|>user\nName the capital city of France.<|im_end|>\n"
           "<|im_start|>assistant\n",
           "<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nWhat is the "
           "largest planet in the solar system?<|im_end|>\n<|im_start|>assistant\n"]
DRAWN = 8


def _runtime(loaded, codec: KVCodec | None, path: str = "compressed", capacity: int = 1024):
    kv = KVSpec(codec=codec, decode_path=path) if codec else KVSpec(decode_path=path)
    return loaded.create_runtime(kv=kv, capacity=capacity, n_sessions=4, max_batch=128,
                                 options={})


_SERVED: dict[tuple[str, str], dict] = {}


def _serve(loaded, name: str, path: str = "compressed") -> dict:
    """One runtime's answers: a prompt alone; both prompts decoding fused in one batch;
    the first prompt forked, and cut back, to all but its last token and continued."""
    if (name, path) in _SERVED:
        return _SERVED[(name, path)]
    runtime = _runtime(loaded, CODECS.get(name), path)
    prompts = [loaded.tokenize(p, add_special=False, parse_special=True) for p in PROMPTS]
    first = prompts[0]
    try:
        served = {"alone": greedy(runtime, 0, first, DRAWN)}
        sampler = runtime.new_sampler(SamplingParams(temperature=0.0, top_p=1.0, seed=0))
        fused = [[t] for t in runtime.step([Work(1, first, sampler),
                                            Work(2, prompts[1], sampler)])]
        for _ in range(DRAWN - 1):
            drawn = runtime.step([Work(1, (fused[0][-1],), sampler),
                                  Work(2, (fused[1][-1],), sampler)])
            for answer, token in zip(fused, drawn):
                answer.append(token)
        served["fused"] = fused
        served["batch"] = [type(layer).__name__ for layer in runtime._batch]
        served["rows"] = {len(layer._pads) for layer in runtime._batch} \
            if name != "raw" else {2}
        assert runtime.fork(0, 3, len(first) - 1)
        served["forked"] = greedy(runtime, 3, first[-1:], 3)
        assert runtime.truncate(1, len(first) - 1)  # prefix reuse: cut back, continue
        served["reused"] = greedy(runtime, 1, first[-1:], 3)
        served["describe"] = runtime.describe()
    finally:
        runtime.close()
    _SERVED[(name, path)] = served
    return served


def _text(loaded, tokens) -> str:
    return b"".join(loaded.token_piece(t) for t in tokens).decode(errors="replace")


@pytest.mark.parametrize("name", ["affine8", "affine4", "aura4v4"])
def test_each_codec_serves_fused_forked_and_reused(loaded, name):
    served = _serve(loaded, name)
    assert served["describe"]["kv_codec"] == name
    assert served["batch"] == ["CodecKVCache"] * len(served["batch"]) \
        and served["rows"] == {2}  # both sessions decoded as rows of one batch
    assert served["fused"][0] == served["alone"]  # fused or alone: the same answer
    assert served["forked"] == served["alone"][:3]
    assert served["reused"] == served["alone"][:3]
    assert "Paris" in _text(loaded, served["alone"])
    assert _text(loaded, served["fused"][1]).strip()


@pytest.mark.parametrize("name", ["affine4", "aura4v4"])
def test_compressed_and_dequant_mirror_give_the_same_tokens(loaded, name):
    compressed, mirror = _serve(loaded, name), _serve(loaded, name, "dequant-mirror")
    assert mirror["describe"]["kv_decode_path"] == "dequant-mirror"
    for part in ("alone", "fused", "forked", "reused"):
        assert mirror[part] == compressed[part], part


def test_affine8_answers_agree_with_raw(loaded):
    raw, affine8 = _serve(loaded, "raw"), _serve(loaded, "affine8")
    assert raw["describe"]["kv_codec"] == "raw"
    assert affine8["alone"] == raw["alone"]
    assert affine8["fused"] == raw["fused"]  # both prompts, every drawn token


def test_admission_counts_each_codec_bytes(loaded):
    raw = _runtime(loaded, None)
    facts = {name: _runtime(loaded, codec).kv for name, codec in CODECS.items()}
    mirror = _runtime(loaded, CODECS["affine4"], "dequant-mirror").kv
    layers, kv_heads, head_dim = loaded.kv_shape()
    elements = layers * kv_heads * head_dim
    assert raw.kv.token_bytes == loaded.kv_token_bytes() == elements * 2 * 2
    for name, kv in facts.items():
        assert kv.budget_bytes == raw.kv.budget_bytes  # the same memory...
        assert kv.token_bytes == CODECS[name].token_bytes(elements, elements)
        assert kv.capacity > raw.kv.capacity  # ...holds more tokens
        assert kv.max_positions <= loaded.info.n_ctx_train
    assert facts["affine8"].token_bytes < raw.kv.token_bytes // 1.8
    assert facts["aura4v2"].token_bytes <= raw.kv.token_bytes // 4
    assert mirror.token_bytes == facts["affine4"].token_bytes + raw.kv.token_bytes


def test_what_mlx_cannot_store_is_served_raw_with_one_log_line(loaded, caplog):
    backend = default_plugins().backends["mlx"]
    assert {"compressed", "dequant-mirror"} <= backend.decode_paths
    for codec in CODECS.values():
        assert backend.kv_storage(codec)
    odd = KVCodec(name="odd3", family="lattice", key_bits=3, value_bits=3)
    assert backend.kv_storage(odd) is None
    with caplog.at_level(logging.WARNING, logger="butter.mlx"):
        runtime = _runtime(loaded, odd)
        _runtime(loaded, odd).close()
    assert runtime.describe()["kv_codec"] == "raw"
    assert runtime.kv.token_bytes == loaded.kv_token_bytes()
    lines = [r.getMessage() for r in caplog.records if "odd3" in r.getMessage()]
    assert len(lines) == 1 and "raw" in lines[0]


def test_butter_serve_answers_with_affine8(start_server):
    import openai

    server = start_server("--backend", "mlx", "--kv-cache", "affine8", "--parallel", "2")
    assert server.metrics()["butter_kv_token_bytes"] == 12240  # 8.5 bits of 16
    client = openai.OpenAI(base_url=server.base_url, api_key="-", max_retries=0, timeout=300)

    def ask(question: str):
        return client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": question}], max_tokens=8,
            temperature=0)

    questions = ["Name the capital city of France.", "What is 2 plus 2?"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(ask, questions))
    assert "Paris" in replies[0].choices[0].message.content
    assert replies[1].choices[0].message.content
    again = ask(questions[0])
    assert again.choices[0].message.content == replies[0].choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens > 0
