"""What one llama_decode costs per row, on the pinned llama.cpp alone (no butter code).

The minimal reproduction behind the concurrency limit in ``bench/README.md``: on this
CPU, SmolLM2's Q4_1 matrix products (ggml's ``vec_dot_q4_1_q8_1``, one weight row
against one activation row at a time) cost the same per row whether a pass holds one
row or many. A pass is a fixed cost plus a per-row cost, so batching saves only the fixed
part, and two servers that run these kernels on the same rows take the same time.

    .venv/bin/python bench/row_cost.py [--threads 2] [--reps 15]

It opens one context the way llama-server ``-np 8`` does (a KV stream per slot), puts
100 tokens in each stream, then times, median of ``--reps``:

* ``N decode rows``: one token in each of N streams, one pass (llama-server's decode
  step at N lanes);
* ``N-row chunk``: N prompt tokens of one stream, one pass (prefill).

and prints the milliseconds, the milliseconds per row, and a least-squares fit
``fixed + per_row * N`` over the decode rows. Then it fills every stream to ``--long``
tokens and times eight decode rows in one pass against one pass each: what butter's
per-session layout pays to keep a long row's answer the same alone or in company (a
lone row over 512 cells takes ggml's split-KV path, a row in company does not, so
butter always runs such a row alone).

``--prefill N`` times instead one prompt of N tokens read into a fresh one-stream
context (8,192 cells, as ``--parallel 1``) in three ways, median of ``--reps``: in
512-row passes (llama-server's micro-batch), as butter's GGUF back end reads it
(positions below 63 in one pass, row by row, then ``--chunk``-row passes, each filled
to 64 rows so that ggml's flash attention tiles it), and as butter read it before
(positions below 256 in passes of at most 63 rows, later ones in ``--chunk``-row
passes): where a prompt's time goes, without either server.

``--paths`` is the minimal reproduction of why a verify is exact only while its rows
stay within a stream's first 256 cells on a float cache. It reads one prompt of L
tokens, then gets token X's logits at position L twice: alone in a pass (a plain decode
row) and as the first of two rows (a verify of one draft), and says whether they are
equal bit for bit, for L on both sides of 256 and for an F16 and a Q8_0 cache
(``--kv-cache affine8``). It also times the lone row against the two-row pass: what
giving every lone long row a throwaway companion (so that no row takes the split path)
would cost plain decoding.

``--oracle`` is the minimal reproduction of the 1-lane quote targets' reach: the fastest
any exact drafter could answer the quote workload's request on this CPU. It reads the
request's prompt (SmolLM2's template, its default system message) in one pass, decodes
the greedy answer plainly (a pass a token), then feeds that very answer back as verify
passes of up to 62 drafts, every row with its logits, as if every draft were right
(each row's greedy draw is checked against the answer). The last verify row stays
below 256 cells, as butter's exact verifies on a float cache do; past them, a pass a
token. Speculation on / off can be no better than (prompt + plain) / (prompt + oracle).

``--draw`` times what a greedy row costs after its pass: llama.cpp's greedy sampler
(``llama_sampler_sample`` on a chain of greedy alone, which first copies every one of
the vocabulary's candidates) against butter's GGUF back end, which reads the first
highest logit straight off the row (``GGUFSampler``), median of ``--reps`` over every row
of one real 64-row pass, and checks that both draw the same token on each.

``--tail N`` times a short turn after a cached prefix of ``--long`` tokens: its N rows
alone in a pass against the same rows filled to 64 (butter's fixed attention path), and
the save and load of the prefix to and from host memory (``--cache-ram``).

``--twins N`` is the minimal reproduction of how finely one start of a server can be
told from another on this machine: two identical contexts (as llama-server ``-np 8``
opens one), opened one after the other in one process, read the same N-token prompt in
512-row passes, in turn, ``--reps`` times (the first of each pair alternates). It prints
the median and quartiles of the per-pair ratio second / first. The same passes on the
same weights differ only in where the contexts' buffers landed.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from pathlib import Path

import llama_cpp as ll

from butter.resolvers import shipped_model_path
from butter_backend_gguf.native import MAX_DRAFT, SPLIT_KV_FREE_CELLS, model_params

STREAMS = 8
FILLED = 100  # tokens already in every stream
STREAM_CELLS = 2048
SLOT_CELLS = 4608  # bench/long_prompt.py's --slot-context: a long-prompt server's stream
ANSWER_TOKENS = 160  # bench/speculation.py's --max-tokens
# SmolLM2's template adds this system message when a request has none (as butter renders it).
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@ll.llama_log_callback
def _quiet(_level: int, _text: bytes, _user_data: ctypes.c_void_p) -> None:
    """llama.cpp's load log is not the point here."""


def batch_of(rows: list[tuple[int, int, int, bool]]):
    """A llama_batch of ``(seq, token, position, logits)`` rows."""
    batch = ll.llama_batch_init(len(rows), 0, 1)
    for i, (seq, token, position, logits) in enumerate(rows):
        batch.token[i], batch.pos[i] = token, position
        batch.n_seq_id[i], batch.seq_id[i][0] = 1, seq
        batch.logits[i] = int(logits)
    batch.n_tokens = len(rows)
    return batch


def timed(ctx, memory, passes, reps: int) -> float:
    """Median milliseconds of decoding every batch in ``passes`` (lists of rows), each
    time after dropping those rows again."""
    batches = [batch_of(rows) for rows in passes]
    seconds = []
    try:
        for _ in range(reps):
            for rows in passes:
                for seq, _, position, _ in rows:
                    ll.llama_memory_seq_rm(memory, seq, position, -1)
            start = time.perf_counter()
            for batch in batches:
                if ll.llama_decode(ctx, batch) != 0:
                    raise SystemExit("llama_decode failed")
            seconds.append(time.perf_counter() - start)
    finally:
        for batch in batches:
            ll.llama_batch_free(batch)
    return statistics.median(seconds) * 1000


def fill(ctx, memory, length: int, start: int, streams: int = STREAMS) -> None:
    """Put prompt tokens ``start..length`` in the first ``streams`` streams (after
    dropping what is there)."""
    for seq in range(streams):
        ll.llama_memory_seq_rm(memory, seq, start, -1)
        for begin in range(start, length, 512):
            rows = [(seq, 1000 + i % 500, i, False) for i in range(begin, min(length, begin + 512))]
            batch = batch_of(rows)
            ll.llama_decode(ctx, batch)
            ll.llama_batch_free(batch)


def open_context(model, streams: int, cells: int, threads: int, cache: int | None = None):
    """A context as llama-server ``-np streams -c cells`` opens it (a KV stream per slot,
    512-row micro-batches), with ``cache`` (a ggml type) for keys and values and flash
    attention if given: ``(ctx, memory)``."""
    params = ll.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = cells, 512, 512
    params.n_seq_max, params.kv_unified = streams, False
    params.n_threads = params.n_threads_batch = threads
    if cache is not None:
        params.type_k = params.type_v = cache
        params.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED
    ctx = ll.llama_init_from_model(model, params)
    return ctx, ll.llama_get_memory(ctx)


def pieces(length: int, first: int, size: int, head: int = 0,
           least: int = 0) -> list[list[tuple]]:
    """Prompt rows ``0..length`` of stream 0 in passes: ``head`` positions in passes of
    at most ``first`` rows, then passes ending at multiples of ``size`` (as butter's
    chunks end), each of those at least ``least`` rows (filler positions past the
    prompt)."""
    cuts, at = [], 0
    while at < length:
        step = min(first, head - at) if at < head else size - at % size
        end = min(length, at + step)
        if at >= head:
            end = max(end, at + least)
        cuts.append([(0, 1000 + i % 500, i, False) for i in range(at, end)])
        at += step
    return cuts


def logits_of(ctx, model, index: int) -> bytes:
    """The raw float32 bytes of row ``index``'s logits."""
    n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    return ctypes.string_at(ll.llama_get_logits_ith(ctx, index), 4 * n_vocab)


def paths(model, args: argparse.Namespace) -> None:
    print(f"SmolLM2-135M Q4_1, {args.threads} threads; token X's logits at position L, "
          "alone in a pass against first of two rows")
    for name, cache in (("F16", ll.GGML_TYPE_F16), ("Q8_0", ll.GGML_TYPE_Q8_0)):
        ctx, memory = open_context(model, 1, STREAM_CELLS, args.threads, cache)
        for length in (200, 255, 256, 300, 1000):
            fill(ctx, memory, length, 0, streams=1)
            lone = [(0, 100, length, True)]
            pair = [(0, 100, length, True), (0, 101, length + 1, True)]
            lone_ms = timed(ctx, memory, [lone], args.reps)
            alone = logits_of(ctx, model, 0)
            pair_ms = timed(ctx, memory, [pair], args.reps)
            verified = logits_of(ctx, model, 0)
            same = "equal" if alone == verified else "DIFFERENT"
            print(f"{name:5s} L={length:5d} ({length + 1} cells): {same:9s}   lone row "
                  f"{lone_ms:5.2f} ms, two rows {pair_ms:5.2f} ms "
                  f"({pair_ms / lone_ms:.2f}x)")
        ll.llama_free(ctx)


def quote_prompt(model) -> list[int]:
    """The quote workload's prompt as SmolLM2's chat template renders it, tokenized."""
    data = json.loads((Path(__file__).parent / "data" / "speculation.json").read_text())
    (message,) = data["workloads"]["quote"]
    chat = (ll.llama_chat_message * 2)(ll.llama_chat_message(b"system", SYSTEM.encode()),
                                       ll.llama_chat_message(b"user", message["content"].encode()))
    template = ll.llama_model_chat_template(model, None)
    size = ll.llama_chat_apply_template(template, chat, 2, True, None, 0)
    text = ctypes.create_string_buffer(size + 1)
    ll.llama_chat_apply_template(template, chat, 2, True, text, size + 1)
    tokens = (ll.llama_token * (size + 8))()
    vocab = ll.llama_model_get_vocab(model)
    count = ll.llama_tokenize(vocab, text.value, size, tokens, len(tokens), False, True)
    return list(tokens[:count])


def draw(ctx, model, index: int) -> int:
    """The greedy draw from row ``index``'s logits."""
    row = logits_of(ctx, model, index)
    values = memoryview(row).cast("f")
    return max(range(len(values)), key=values.__getitem__)


def decode(ctx, rows: list[tuple[int, int, int, bool]]) -> float:
    """Seconds one pass of ``rows`` takes."""
    batch = batch_of(rows)
    start = time.perf_counter()
    failed = ll.llama_decode(ctx, batch)
    took = time.perf_counter() - start
    ll.llama_batch_free(batch)
    if failed:
        raise SystemExit("llama_decode failed")
    return took


def answer_plainly(ctx, memory, model, prompt: list[int]) -> tuple[float, float, list[int]]:
    """Read ``prompt`` in one pass, then decode greedily a pass a token: (prompt seconds,
    decode seconds, the answer)."""
    ll.llama_memory_seq_rm(memory, 0, 0, -1)
    vocab = ll.llama_model_get_vocab(model)
    read = decode(ctx, [(0, token, i, i == len(prompt) - 1) for i, token in enumerate(prompt)])
    answer, seconds = [draw(ctx, model, len(prompt) - 1)], 0.0
    while len(answer) < ANSWER_TOKENS and not ll.llama_vocab_is_eog(vocab, answer[-1]):
        seconds += decode(ctx, [(0, answer[-1], len(prompt) + len(answer) - 1, True)])
        answer.append(draw(ctx, model, 0))
    return read, seconds, answer


def answer_by_oracle(ctx, memory, model, prompt: list[int],
                     answer: list[int]) -> tuple[float, int, int]:
    """Feed ``answer`` after ``prompt`` (read already, as ``answer_plainly`` leaves it)
    as verifies whose drafts are all right, the last row of each below 256 cells and
    under the 64 rows from which flash attention tiles, as butter's verifies on a float
    cache: (seconds, passes, rows whose draw is not the answer's)."""
    ll.llama_memory_seq_rm(memory, 0, len(prompt), -1)  # the plain answer goes
    done, seconds, passes, wrong = 1, 0.0, 0, 0
    while done < len(answer):
        at = len(prompt) + done - 1  # the last drawn token's position
        drafts = max(0, min(MAX_DRAFT, SPLIT_KV_FREE_CELLS - 1 - at, len(answer) - done - 1))
        seconds += decode(ctx, [(0, answer[done - 1 + i], at + i, True)
                                for i in range(drafts + 1)])
        wrong += sum(draw(ctx, model, i) != answer[done + i] for i in range(drafts + 1))
        done, passes = done + drafts + 1, passes + 1
    return seconds, passes, wrong


def oracle(model, args: argparse.Namespace) -> None:
    ctx, memory = open_context(model, STREAMS, STREAMS * STREAM_CELLS, args.threads)
    prompt = quote_prompt(model)
    rounds = []  # (prompt, plain, oracle seconds), plain and oracle back to back
    for _ in range(max(3, args.reps // 3)):
        read, plain, answer = answer_plainly(ctx, memory, model, prompt)
        best, passes, wrong = answer_by_oracle(ctx, memory, model, prompt, answer)
        rounds.append((read, plain, best))
    read, plain, best = (statistics.median(r[i] for r in rounds) for i in range(3))
    ratios = sorted((r[0] + r[1]) / (r[0] + r[2]) for r in rounds)
    print(f"SmolLM2-135M Q4_1, {args.threads} threads; the quote request: a {len(prompt)}-"
          f"token prompt, a {len(answer)}-token greedy answer; medians of {len(rounds)} rounds")
    print(f"prompt, one pass: {read * 1000:.0f} ms; plain decoding, a pass a token: "
          f"{plain * 1000:.0f} ms ({len(answer) - 1} passes); oracle drafts (every draft "
          f"right): {best * 1000:.0f} ms ({passes} passes, {wrong} draws not the answer's)")
    print(f"speculation on / off at best, per round: median {statistics.median(ratios):.3f} "
          f"({ratios[0]:.3f} to {ratios[-1]:.3f}) for the request, "
          f"{plain / best:.3f} after its first token")
    print(f"1.5x for the request needs decoding in {((read + plain) / 1.5 - read) * 1000:.0f}"
          f" ms, {((read + plain) / 1.5 - read) / best:.2f}x the oracle's time")
    ll.llama_free(ctx)


def draws(model, args: argparse.Namespace) -> None:
    from butter.backend import SamplingParams
    from butter_backend_gguf.batch import GGUFSampler

    ctx, _ = open_context(model, 1, STREAM_CELLS, args.threads)
    rows = 64
    prompt = quote_prompt(model)[:rows]
    decode(ctx, [(0, token, position, True) for position, token in enumerate(prompt)])
    n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
    ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_greedy())
    ours = GGUFSampler(SamplingParams(temperature=0.0, top_p=1.0, seed=0), n_vocab)
    ways = {"llama.cpp's greedy sampler": lambda row: ll.llama_sampler_sample(chain, ctx, row),
            "butter (off the logits)": lambda row: ours.sample(ctx, row, None)}
    same = all(ways["llama.cpp's greedy sampler"](row) == ours.sample(ctx, row, None)
               for row in range(len(prompt)))
    print(f"SmolLM2-135M Q4_1, a greedy draw from each of {len(prompt)} rows "
          f"({n_vocab} logits), median of {args.reps}; same tokens: {same}")
    for name, way in ways.items():
        times = []
        for _ in range(args.reps):
            for row in range(len(prompt)):
                start = time.perf_counter()
                way(row)
                times.append(time.perf_counter() - start)
        print(f"{name:28} {1e6 * statistics.median(times):6.1f} µs a row")
    ours.close()
    ll.llama_sampler_free(chain)
    ll.llama_free(ctx)


def prefill(model, args: argparse.Namespace) -> None:
    ctx, memory = open_context(model, 1, 8192, args.threads)
    ways = {"512-row passes (llama-server)": pieces(args.prefill, 512, 512),
            f"butter: 63, then {args.chunk} (64 at least)": pieces(
                args.prefill, 63, args.chunk, head=63, least=64),
            f"butter before: 63 to 256, then {args.chunk}": pieces(
                args.prefill, 63, args.chunk, head=256)}
    print(f"SmolLM2-135M Q4_1, {args.threads} threads, one {args.prefill}-token prompt")
    reps = max(3, args.reps // 5)
    for label, passes in ways.items():
        ms = timed(ctx, memory, passes, reps)
        print(f"{label:42s} {ms / 1000:7.2f} s   {args.prefill / ms * 1000:7.1f} tok/s   "
              f"{len(passes)} passes")
    ll.llama_free(ctx)


def tail(model, args: argparse.Namespace) -> None:
    """A short turn after a cached prefix (``--long`` tokens): its ``--tail`` rows alone
    in one pass (llama-server), and filled to 64 rows (butter: every prompt position
    from 63 on takes the tiled attention path); and what saving the prefix to host
    memory and loading it back costs (butter's and llama-server's ``--cache-ram``)."""
    ctx, memory = open_context(model, 1, 8192, args.threads)
    fill(ctx, memory, args.long, 0, streams=1)
    rows = [(0, 100 + i % 50, args.long + i, False) for i in range(args.tail)]
    filler = [(0, 100, args.long + i, False) for i in range(args.tail, max(64, args.tail))]
    print(f"SmolLM2-135M Q4_1, {args.threads} threads, {args.tail} tokens after "
          f"{args.long} cached")
    for label, passes in {"its own rows (llama-server)": [rows],
                          "filled to 64 rows (butter)": [rows + filler]}.items():
        print(f"{label:30} {timed(ctx, memory, passes, args.reps):7.1f} ms")
    size = ll.llama_state_seq_get_size(ctx, 0)
    buf = (ctypes.c_uint8 * size)()
    saves, loads = [], []
    for _ in range(args.reps):
        start = time.perf_counter()
        ll.llama_state_seq_get_data(ctx, buf, size, 0)
        saves.append(time.perf_counter() - start)
        ll.llama_memory_seq_rm(memory, 0, 0, -1)
        start = time.perf_counter()
        ll.llama_state_seq_set_data(ctx, buf, size, 0)
        loads.append(time.perf_counter() - start)
    print(f"save {size / 2**20:.1f} MiB {1000 * statistics.median(saves):6.1f} ms, "
          f"load {1000 * statistics.median(loads):6.1f} ms")
    ll.llama_free(ctx)


def twins(model, args: argparse.Namespace) -> None:
    contexts = [open_context(model, STREAMS, STREAMS * SLOT_CELLS, args.threads)
                for _ in range(2)]
    passes = pieces(args.twins, 512, 512)
    ratios = []
    for rep in range(args.reps):
        order = (0, 1) if rep % 2 == 0 else (1, 0)
        ms = {i: timed(*contexts[i], passes, 1) for i in order}
        ratios.append(ms[1] / ms[0])
        print(f"pair {rep + 1:2d}: first {ms[0] / 1000:6.2f} s, second {ms[1] / 1000:6.2f} s, "
              f"second / first {ratios[-1]:.3f}", flush=True)
    low, median, high = statistics.quantiles(ratios, n=4)
    print(f"SmolLM2-135M Q4_1, {args.threads} threads, one {args.twins}-token prompt in "
          f"512-row passes: second / first {median:.3f} (quartiles {low:.3f} to {high:.3f})")
    for ctx, _ in contexts:
        ll.llama_free(ctx)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--long", type=int, default=1500, help="tokens per stream, long rows")
    parser.add_argument("--prefill", type=int, default=0, metavar="N",
                        help="time one N-token prompt's prefill instead (see above)")
    parser.add_argument("--chunk", type=int, default=256,
                        help="--prefill: butter's prefill chunk (--prefill-chunk)")
    parser.add_argument("--paths", action="store_true",
                        help="the split-path reproduction instead (see above)")
    parser.add_argument("--oracle", action="store_true",
                        help="the quote's best case under exact speculation (see above)")
    parser.add_argument("--tail", type=int, default=0, metavar="N",
                        help="an N-token turn after --long cached tokens (see above)")
    parser.add_argument("--twins", type=int, default=0, metavar="N",
                        help="an N-token prompt in two identical contexts (see above)")
    parser.add_argument("--draw", action="store_true",
                        help="a greedy draw's cost per row, both ways (see above)")
    args = parser.parse_args()
    ll.llama_log_set(_quiet, ctypes.c_void_p(0))
    ll.llama_backend_init()
    # As both servers run here (butter's GGUF back end; llama-server --no-repack on AMX).
    model = ll.llama_model_load_from_file(str(shipped_model_path()).encode(), model_params())
    # The first mode asked for runs instead of the default sweep.
    modes = ((args.paths, paths), (args.oracle, oracle), (args.draw, draws),
             (args.tail, tail), (args.twins, twins), (args.prefill, prefill))
    mode = next((run for asked, run in modes if asked), None)
    if mode is not None:
        mode(model, args)
        ll.llama_model_free(model)
        return 0
    ctx, memory = open_context(model, STREAMS, STREAMS * STREAM_CELLS, args.threads)
    fill(ctx, memory, FILLED, 0)

    print(f"SmolLM2-135M Q4_1, {args.threads} threads, {FILLED} tokens in each stream")
    decode = {}
    for n in range(1, STREAMS + 1):
        decode[n] = timed(ctx, memory, [[(s, 100, FILLED, True) for s in range(n)]], args.reps)
        print(f"{n} decode rows   {decode[n]:7.2f} ms   {decode[n] / n:5.2f} ms/row")
    for n in (16, 32, 63, 64, 128, 256):
        ms = timed(ctx, memory, [[(0, 100 + i % 50, FILLED + i, False) for i in range(n)]],
                   max(3, args.reps // 3))
        print(f"{n:3d}-row chunk   {ms:7.2f} ms   {ms / n:5.2f} ms/row")
    slope, fixed = statistics.linear_regression(list(decode), list(decode.values()))
    print(f"decode fit: {fixed:.2f} ms fixed + {slope:.2f} ms per row; "
          f"8 rows in one pass take {decode[8] / decode[1]:.2f}x one row")
    long = min(args.long, STREAM_CELLS - 1)
    fill(ctx, memory, long, FILLED)
    rows = [(s, 100, long, True) for s in range(STREAMS)]
    together = timed(ctx, memory, [rows], args.reps)
    apart = timed(ctx, memory, [[row] for row in rows], args.reps)
    print(f"8 decode rows at {long} tokens: {together:.1f} ms in one pass, "
          f"{apart:.1f} ms in one pass each ({apart / together:.2f}x)")
    ll.llama_free(ctx)
    ll.llama_model_free(model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
