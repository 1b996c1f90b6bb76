"""The MLX back end against mlx-lm's own server, on one MLX folder, in one run.

Converts the shipped SmolLM2 GGUF into an MLX folder (config.json, safetensors,
tokenizer), then for each block starts ``butter serve --backend mlx --parallel 8`` or
``mlx_lm.server`` (continuous batching: ``--decode-concurrency 8
--prompt-concurrency 8``) on it, never both at once, and runs ``butter serve-bench``'s
code: synchronized waves at each concurrency level, with and without ``seed``.
mlx_lm.server serves seeded requests one at a time (it turns batching off when a
request carries a seed); butter batches them, each request drawing from its own key.
Ratios are butter/mlx_lm.server tokens per second (above 1: butter is faster).

    .venv/bin/python bench/mlx_peer.py [--levels 1,4,8] [--max-tokens 16] [--json out.json]

``--profile`` instead times butter's MLX decode path in-process: the model call of a
step, sampling and detokenizing, per decode step of ``--profile-rows`` sessions.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

from common import (
    Row,
    console,
    model_path,
    print_rows,
    save_json,
    serve_bench,
    spawned,
)

SERVERS = ("butter", "mlx_lm")


def convert(folder: Path) -> Path:
    from butter_backend_mlx.checkpoint import gguf_to_folder

    if not (folder / "config.json").is_file():
        gguf_to_folder(model_path(), folder)
    return folder


def command(name: str, folder: Path, port: int, parallel: int) -> list[str]:
    if name == "butter":
        return [sys.executable, "-m", "butter", "serve", "--backend", "mlx", "--model",
                str(folder), "--port", str(port), "--parallel", str(parallel),
                "--log-level", "warning"]
    return [sys.executable, "-m", "mlx_lm.server", "--model", str(folder), "--port", str(port),
            "--decode-concurrency", str(parallel), "--prompt-concurrency", str(parallel),
            "--log-level", "WARNING"]


@contextlib.contextmanager
def running(name: str, folder: Path, parallel: int, logs: Path):
    with spawned(name, lambda port: command(name, folder, port, parallel), logs) as (root, _, _):
        yield f"{root}/v1"


async def measure(url: str, folder: Path, level: int, args, seed: int | None) -> dict:
    config = serve_bench.BenchConfig(model=str(folder), url=url, concurrency=(level,),
                                     max_tokens=args.max_tokens, waves=args.waves, seed=seed)
    warm = serve_bench.BenchConfig(model=str(folder), url=url, concurrency=(1,), max_tokens=4,
                                   waves=1, seed=seed)
    await serve_bench.run_bench(warm)
    report = await serve_bench.run_bench(config)
    serve_bench.print_report(report, console)
    return report.to_dict()["levels"][0] | {"ok": report.ok}


def run(args) -> int:
    folder = convert(args.folder)
    logs = Path(tempfile.mkdtemp(prefix="butter-mlx-bench-"))
    results: dict[tuple[str, str, int], dict] = {}
    for seeded in (False, True):
        for index, level in enumerate(args.levels):
            order = SERVERS if (index + seeded) % 2 == 0 else SERVERS[::-1]
            for name in order:
                with running(name, folder, args.parallel, logs) as url:
                    results[(name, "seed" if seeded else "no seed", level)] = asyncio.run(
                        measure(url, folder, level, args, 0 if seeded else None))
    rows = []
    for seeded in ("no seed", "seed"):
        for level in args.levels:
            butter, peer = (results[(name, seeded, level)]["completion_tok_s"]
                            for name in SERVERS)
            rows.append(Row(f"completion tok/s @{level}, {seeded}", butter, peer))
    print_rows(f"MLX: butter vs mlx_lm.server, {args.max_tokens} tokens/request, "
               f"{args.waves} waves/level (logs in {logs})", rows, peer="mlx_lm.server")
    save_json(args.json, rows, {"results": {" / ".join(map(str, k)): v
                                            for k, v in results.items()}})
    return 0 if all(r["ok"] for r in results.values()) else 1


def profile(args) -> int:
    """Seconds per decode step in butter's MLX runtime: model call, sampling, detokenizing."""
    from butter.backend import KVSpec, SamplingParams, Work
    from butter.engine.text import Detokenizer
    from butter.library import Model

    with Model.load(str(convert(args.folder)), backend="mlx") as model:
        runtime = model.loaded.create_runtime(kv=KVSpec(), capacity=4096,
                                              n_sessions=args.profile_rows, max_batch=512,
                                              options={})
        runtime_module = sys.modules[type(runtime).__module__]
        samplers = [runtime.new_sampler(SamplingParams(temperature=0.7, top_p=0.9, seed=s))
                    for s in range(args.profile_rows)]
        prompt = model.encode("<|im_start|>user\nTell me a story.<|im_end|>\n"
                              "<|im_start|>assistant\n")
        last = [runtime.step([Work(s, prompt, samplers[s])])[0]
                for s in range(args.profile_rows)]
        detoks = [Detokenizer() for _ in samplers]
        timings = {"step (model call + sampling)": 0.0, "sampling": 0.0, "detokenizing": 0.0}
        sample = runtime_module.MLXSampler.sample

        def timed_sample(self, logits):
            began = time.perf_counter()
            try:
                return sample(self, logits)
            finally:
                timings["sampling"] += time.perf_counter() - began

        runtime_module.MLXSampler.sample = timed_sample
        for _ in range(args.profile_steps):
            began = time.perf_counter()
            last = runtime.step([Work(s, (last[s],), samplers[s])
                                 for s in range(args.profile_rows)])
            timings["step (model call + sampling)"] += time.perf_counter() - began
            began = time.perf_counter()
            for detok, token in zip(detoks, last):
                detok.feed(model.loaded.token_piece(token))
            timings["detokenizing"] += time.perf_counter() - began
        runtime_module.MLXSampler.sample = sample
        runtime.close()
    steps = args.profile_steps
    console.print(f"MLX decode, {args.profile_rows} rows, {steps} steps, per step:")
    model_call = timings["step (model call + sampling)"] - timings["sampling"]
    for label, seconds in (("model call", model_call), ("sampling", timings["sampling"]),
                           ("detokenizing", timings["detokenizing"])):
        console.print(f"  {label:<14}{seconds / steps * 1000:8.2f} ms")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--levels", type=serve_bench.parse_levels, default=[1, 4, 8])
    parser.add_argument("--waves", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--folder", type=Path,
                        default=Path(os.environ.get("TMPDIR", "/tmp")) / "smollm2-mlx-bench")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-rows", type=int, default=4)
    parser.add_argument("--profile-steps", type=int, default=16)
    args = parser.parse_args()
    return profile(args) if args.profile else run(args)


if __name__ == "__main__":
    raise SystemExit(main())
