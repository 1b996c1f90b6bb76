"""KV codecs against raw, teacher-forced on shipped public-domain text, per back end.

Every codec's runtime reads the same tokens of ``data/coriolanus-act1.txt`` (Shakespeare,
public domain) one decode step at a time, so each next-token distribution comes from
attention over the cache as that codec stores it. All runtimes advance in lockstep with
a raw one on the same loaded model, and per codec we report:

- KV bytes per token against raw (``KVFacts.token_bytes``: what admission charges);
- next-token agreement: the codec's most likely token equals raw's;
- perplexity of the text and its delta against raw;
- mean KL(raw || codec) over the vocabulary;
- decode tokens/s of one session holding 512 and 4,096 tokens of context;
- the longest context a fixed KV budget (``--budget-mib``) admits.

With ``--floor`` (MLX) a ``raw-floor`` row stores float16 but attends through the codec
cache's own arithmetic (float16 scores, one softmax over its parts, as a windowed raw
cache does): its agreement with raw is what arithmetic alone costs, with no quantization.

On GGUF the codecs run as llama.cpp cache types (``affine8`` = q8_0, ``affine4`` = q4_0,
AURA recipes rounded up to those), so those rows are llama.cpp's own q8_0/q4_0.

    .venv/bin/python bench/kv_codecs.py [--backend gguf|mlx] [--tokens 2048]
        [--codecs raw,affine8,affine4,aura4v4,aura4v2,aura8v4,aura4v2+rv] [--floor]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import attrs
import numpy as np

from butter.backend import KVSpec, SamplingParams, Work
from butter.kvcodec import KVCodec
from butter.library import Model, default_plugins

TEXT = Path(__file__).parent / "data" / "coriolanus-act1.txt"
DEFAULT_CODECS = "raw,affine8,affine4,aura4v4,aura4v2,aura8v4"
SPEED_CONTEXTS = (512, 4096)
SPEED_STEPS = 32
MLX_CHUNK = 128


class Capture:
    """A sampler that keeps the step's log-probabilities and answers greedy."""

    def __init__(self, read) -> None:
        self.read = read
        self.last = None
        self.logprobs: np.ndarray | None = None

    def keep(self, logits) -> int:
        row = np.asarray(logits, dtype=np.float64)
        row = row - row.max()
        self.logprobs = row - math.log(np.exp(row).sum())
        return int(row.argmax())

    def close(self) -> None:
        pass


class GGUFCapture(Capture):
    def sample(self, ctx, index, mask=None) -> int:
        import ctypes

        import llama_cpp as ll

        pointer = ll.llama_get_logits_ith(ctx, index)
        return self.keep(np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(
            ctypes.c_float)), shape=(self.read,)))


class MLXCapture(Capture):
    def sample(self, logits, mask=None) -> int:
        import mlx.core as mx

        return self.keep(np.array(logits.astype(mx.float32)))


FLOOR = "raw-floor"


def runtime_for(model: Model, codec, capacity: int):
    kv = KVSpec(codec=codec)
    if codec.name == FLOOR:  # float16 storage attended on as the MLX codecs attend
        kv = KVSpec(codec=default_plugins().kv_codec("raw"), window=capacity)
    return model.loaded.create_runtime(kv=kv, capacity=capacity, n_sessions=1,
                                       max_batch=512, options={})


def stepped(runtime, tokens: list[int], sampler):
    """Each position's log-probabilities, one decode step at a time (GGUF)."""
    for token in tokens:
        runtime.step([Work(0, [token], sampler)])
        yield sampler.logprobs


def chunked(runtime, tokens: list[int], chunk: int = MLX_CHUNK):
    """Each position's log-probabilities from prefill chunks through the runtime's own
    caches (MLX: a step returns its last position only, and decoding 2,048 tokens one at a
    time takes an hour on a CPU). The codec caches attend within a chunk as decoding token
    by token would (see butter_backend_mlx.kvcache), so the numbers are the same."""
    import mlx.core as mx

    caches = runtime._new_caches()
    for start in range(0, len(tokens), chunk):
        logits = runtime._network(mx.array([tokens[start:start + chunk]]), cache=caches)
        rows = np.array(logits[0].astype(mx.float32), dtype=np.float64)
        rows -= rows.max(-1, keepdims=True)
        rows -= np.log(np.exp(rows).sum(-1, keepdims=True))
        yield from rows


def quality(model: Model, codecs: list, tokens: list[int], capture) -> dict[str, dict]:
    """Teacher-force ``tokens`` through a runtime per codec, in lockstep with raw."""
    runtimes = {c.name: runtime_for(model, c, 4096) for c in codecs}
    stats = {name: {"agree": 0, "nll": 0.0, "kl": 0.0} for name in runtimes}
    fed = tokens[:-1]
    streams = {name: stepped(runtime, fed, capture(model.info.n_vocab))
               if capture is GGUFCapture else chunked(runtime, fed)
               for name, runtime in runtimes.items()}
    steps = len(tokens) - 1
    for position in range(steps):
        if position % 256 == 0:
            print(f"  teacher-forcing: {position}/{steps}", flush=True)
        rows = {name: next(stream) for name, stream in streams.items()}
        raw = rows["raw"]
        p_raw = np.exp(raw)
        best = int(raw.argmax())
        for name, row in rows.items():
            stats[name]["agree"] += int(row.argmax()) == best
            stats[name]["nll"] -= row[tokens[position + 1]]
            stats[name]["kl"] += float((p_raw * (raw - row)).sum())
    raw_bytes = runtimes["raw"].kv.token_bytes
    results = {}
    for name, runtime in runtimes.items():
        s = stats[name]
        results[name] = {
            "bytes_vs_raw": runtime.kv.token_bytes / raw_bytes,
            "agreement": s["agree"] / steps,
            "ppl": math.exp(s["nll"] / steps),
            "kl": s["kl"] / steps,
            "storage": runtime.describe().get("kv_cache_types") or runtime.describe().get(
                "kv_codec", name),
        }
        runtime.close()
    base = results["raw"]["ppl"]
    for row in results.values():
        row["ppl_delta"] = row["ppl"] - base
    return results


def decode_speed(model: Model, codec, tokens: list[int], context: int) -> float:
    """Decode tokens/s of one session holding ``context`` tokens."""
    runtime = runtime_for(model, codec, context + 2 * SPEED_STEPS + 512)
    filled = (tokens * (context // len(tokens) + 1))[:context]
    if hasattr(runtime, "_new_caches"):  # MLX
        _fill_mlx(model, runtime, context - 1)
    else:
        for start in range(0, context - 1, 256):
            runtime.step([Work(0, filled[start:min(start + 256, context - 1)])])
    sampler = runtime.new_sampler(SamplingParams(temperature=0.0, top_p=1.0, seed=0))
    token = runtime.step([Work(0, filled[-1:], sampler)])[0]
    began = time.perf_counter()
    for _ in range(SPEED_STEPS):
        token = runtime.step([Work(0, [token], sampler)])[0]
    rate = SPEED_STEPS / (time.perf_counter() - began)
    runtime.close()
    return rate


def _fill_mlx(model: Model, runtime, length: int) -> None:
    """Session 0 holding ``length`` positions of random keys and values, stored through
    each layer's cache as a prefill would store them. MLX's CPU prefill of a quantized
    model runs a few tokens a second, and a decode step's cost depends on how much the
    cache holds, not on what."""
    import mlx.core as mx

    _, kv_heads, head_dim = model.loaded.kv_shape()
    dtype = model.loaded.activation_dtype
    caches = runtime._new_caches()
    for cache in caches:
        for start in range(0, length, 512):
            size = min(512, length - start)
            keys = mx.random.normal((1, kv_heads, size, head_dim)).astype(dtype)
            values = mx.random.normal((1, kv_heads, size, head_dim)).astype(dtype)
            cache.update_and_fetch(keys, values)
        mx.eval([a for a in cache.state if isinstance(a, mx.array)])
    runtime._caches[0], runtime._lengths[0] = caches, length


def longest_context(model: Model, codec, budget_mib: float) -> int:
    """The context one session may hold in ``budget_mib`` of KV, as admission sees it."""
    raw_runtime = runtime_for(model, default_plugins().kv_codec("raw"), 256)
    raw_bytes = raw_runtime.kv.token_bytes
    raw_runtime.close()
    raw_cells = int(budget_mib * 2**20 // raw_bytes) // 256 * 256
    runtime = runtime_for(model, codec, raw_cells)
    capacity = runtime.kv.capacity
    runtime.close()
    return capacity


def codec_named(plugins, name: str) -> KVCodec:
    """A registered codec, or one varied for a measurement: ``NAME+rv`` rotates its values
    too (``rotate_values``), ``NAME+vgN`` quantizes its values in groups of N, ``NAME+gN``
    keys and values."""
    base, *extras = name.split("+")
    codec = plugins.kv_codec(base)
    for extra in extras:
        if extra == "rv":
            codec = attrs.evolve(codec, rotate_values=True)
        elif extra.startswith("vg"):
            codec = attrs.evolve(codec, value_group_size=int(extra[2:]))
        elif extra.startswith("g"):
            codec = attrs.evolve(codec, group_size=int(extra[1:]))
        else:
            raise SystemExit(f"{name}: +rv (rotate values), +vgN (value groups of N) or "
                             "+gN (groups of N)")
    return attrs.evolve(codec, name=name) if extras else codec


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="gguf")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--codecs", default=DEFAULT_CODECS)
    parser.add_argument("--budget-mib", type=float, default=32.0)
    parser.add_argument("--no-speed", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--floor", action="store_true",
                        help="MLX: add a row for float16 storage attended on through the "
                             "codec cache's own arithmetic (the agreement that arithmetic "
                             "alone, without quantization, reaches)")
    args = parser.parse_args()
    plugins = default_plugins()
    codecs = [codec_named(plugins, name) for name in args.codecs.split(",")]
    if args.floor:
        if args.backend != "mlx":
            raise SystemExit("--floor is an MLX measurement")
        codecs.append(KVCodec(name=FLOOR))
    if codecs[0].name != "raw":
        codecs.insert(0, plugins.kv_codec("raw"))
    capture = GGUFCapture if args.backend == "gguf" else MLXCapture
    with Model.load("smollm2", backend=args.backend) as model:
        tokens = model.loaded.tokenize(TEXT.read_text(), add_special=False, parse_special=False)
        if len(tokens) < args.tokens + 1:
            raise SystemExit(f"the text holds {len(tokens)} tokens, fewer than {args.tokens}")
        results = quality(model, codecs, tokens[:args.tokens + 1], capture)
        for codec in codecs:
            row = results[codec.name]
            row["longest_context"] = longest_context(model, codec, args.budget_mib)
            if not args.no_speed:
                print(f"  decode speed: {codec.name}", flush=True)
                for context in SPEED_CONTEXTS:
                    row[f"decode_tps_{context}"] = decode_speed(model, codec, tokens, context)
    print(f"\n{args.backend}: {args.tokens} teacher-forced tokens of {TEXT.name}, "
          f"KV budget {args.budget_mib:g} MiB\n")
    header = ["codec", "storage", "bytes/raw", "agree", "ppl", "Δppl", "KL",
              *[f"tok/s@{c}" for c in SPEED_CONTEXTS], "longest ctx"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, row in results.items():
        speeds = [f"{row.get(f'decode_tps_{c}', float('nan')):.1f}" for c in SPEED_CONTEXTS]
        print(f"| {name} | {row['storage']} | {row['bytes_vs_raw']:.3f} | "
              f"{100 * row['agreement']:.2f}% | {row['ppl']:.3f} | {row['ppl_delta']:+.3f} | "
              f"{row['kl']:.5f} | {' | '.join(speeds)} | {row['longest_context']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"backend": args.backend, "tokens": args.tokens,
                                               "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
