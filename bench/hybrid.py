"""A hybrid model (the tiny random-weight Qwen3.5) on butter and its back end's own server.

    python bench/hybrid.py [--model FILE.gguf] [--lanes 1 4 8] [--tokens 64] [--json out.json]
    python bench/hybrid.py --backend mlx [--model FOLDER] ...   # against mlx_lm.server
    python bench/hybrid.py [--backend mlx] --peer butter ...    # A/A: butter against itself

Without ``--model`` it builds the tiny Qwen3.5 the tests use (``tests/support/tiny_qwen35.py``;
needs the pinned sdist through ``BUTTER_LLAMA_SDIST``): the F16 GGUF for ``--backend gguf``,
the HF folder for ``--backend mlx``. Each server is started alone, never two at once, and
which side goes first alternates from one block to the next. GGUF: the same threads, slots
and KV room, llama-server with its defaults (``--ctx-checkpoints`` 32 per slot in the
pinned source). MLX: ``butter serve --backend mlx`` (MLX takes no ``--threads``) against
``mlx_lm.server --decode-concurrency N --prompt-concurrency N`` with its default prompt
cache. ``--peer butter`` runs the same butter command as both sides, for the noise. Two
figures:

- **tool rounds**: a five-round tool conversation, each round resending every message.
  butter runs it with ``tool_choice: required`` (a random-weight model calls a tool only
  under a grammar); llama-server gets the very same message lists, round by round, so
  both read the same prompts. Each round's ``cached_tokens`` is printed for both.
- **tokens/s at N lanes**: N requests at once, each drawing ``--tokens`` tokens
  (``ignore_eos``, temperature 0.7, seed per lane); generated tokens over wall time.
  With ``--backend mlx`` no seed is sent: mlx_lm.server serves seeded requests one at a
  time, and it has no ``ignore_eos`` (it ignores the field), so the figure counts the
  tokens each server reports generating.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
from common import (
    REPO,
    Row,
    add_common_arguments,
    console,
    log_dir,
    print_rows,
    save_json,
    spawned,
)

sys.path.insert(0, str(REPO / "tests"))
from support.conversations import TOOLS, tool_rounds  # noqa: E402

MODEL_ID = "tiny"
SLOT_CONTEXT = 4096


def tiny_model(backend: str) -> Path:
    from support.tiny_qwen35 import build_gguf, build_hf_folder

    scratch = Path(tempfile.mkdtemp(prefix="tiny-qwen35-"))
    if backend == "mlx":
        return build_hf_folder(scratch / "Qwen3.5-tiny")
    return build_gguf(scratch / "Qwen3.5-tiny.gguf")


def butter_command(args, parallel: int):
    def command(port: int) -> list[str]:
        backend = (["--backend", "mlx"] if args.backend == "mlx"
                   else ["--threads", str(args.threads)])  # MLX refuses --threads
        return [sys.executable, "-m", "butter", "serve", "--model", str(args.model),
                "--port", str(port), "--parallel", str(parallel),
                "--max-context", str(parallel * SLOT_CONTEXT),
                *backend, *args.butter_args.split()]
    return command


def peer_command(args, parallel: int):
    if args.peer == "butter":
        return butter_command(args, parallel)

    def command(port: int) -> list[str]:
        if args.backend == "mlx":
            return [sys.executable, "-m", "mlx_lm.server", "--model", str(args.model),
                    "--host", "127.0.0.1", "--port", str(port),
                    "--decode-concurrency", str(parallel),
                    "--prompt-concurrency", str(parallel)]
        return [str(args.llama_server), "-m", str(args.model), "-a", MODEL_ID, "--jinja",
                "--host", "127.0.0.1", "--port", str(port), "-np", str(parallel),
                "-c", str(parallel * SLOT_CONTEXT), "-t", str(args.threads)]
    return command


def served_model(url: str, args) -> str:
    """The model name to send. mlx_lm.server's /v1/models scans the HF cache and, when
    there is none, sends its 200 headers and then dies with an empty body; it gets the
    folder exactly as its --model was given (its name for the loaded model)."""
    response = httpx.get(f"{url}/models")
    try:
        return response.json()["data"][-1]["id"]
    except ValueError:
        if args.backend != "mlx":
            raise
        return str(args.model)


def replay(url: str, model: str, transcript: list[list[dict]]) -> list[tuple[int, int]]:
    """Send each round's recorded messages; (prompt, cached) per round."""
    usage = []
    with httpx.Client(timeout=600) as client:
        for messages in transcript:
            response = client.post(f"{url}/chat/completions", json={
                "model": model, "messages": messages, "tools": TOOLS,
                "max_tokens": 40, "temperature": 0.0})
            response.raise_for_status()
            body = response.json()["usage"]
            usage.append((body["prompt_tokens"],
                          (body.get("prompt_tokens_details") or {}).get("cached_tokens", 0)))
    return usage


async def lanes_rate(url: str, model: str, lanes: int, tokens: int, seeded: bool) -> float:
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(lane: int) -> int:
            body = {"model": model, "max_tokens": tokens, "ignore_eos": True,
                    "temperature": 0.7,
                    "messages": [{"role": "user", "content": f"Lane {lane}: tell a long story."}]}
            if seeded:
                body["seed"] = lane
            response = await client.post(f"{url}/chat/completions", json=body)
            response.raise_for_status()
            return response.json()["usage"]["completion_tokens"]

        await one(99)  # warm-up
        start = time.monotonic()
        counts = await asyncio.gather(*(one(lane) for lane in range(lanes)))
        return sum(counts) / (time.monotonic() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_arguments(parser)
    parser.add_argument("--model", type=Path,
                        help="a hybrid GGUF, or an HF folder with --backend mlx "
                             "(default: the tiny Qwen3.5)")
    parser.add_argument("--lanes", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--backend", choices=("gguf", "mlx"), default="gguf",
                        help="butter's back end; the peer is llama-server or mlx_lm.server")
    parser.add_argument("--peer", choices=("native", "butter"), default="native",
                        help="native: the back end's own server; butter: A/A, for the noise")
    args = parser.parse_args()
    args.model = args.model or tiny_model(args.backend)
    logs = log_dir(args)
    sides = [args.only] if args.only else ["butter", "peer"]
    commands = {"butter": butter_command, "peer": peer_command}
    peer_name = ("butter (A/A)" if args.peer == "butter"
                 else "mlx_lm.server" if args.backend == "mlx" else "llama-server")
    details: dict[str, object] = {"model": str(args.model), "backend": args.backend,
                                  "peer": peer_name, "load_1min": os.getloadavg()[0]}
    transcript: list[list[dict]] = []
    rounds: dict[str, list[tuple[int, int]]] = {}
    for side in sides:
        with spawned(side, commands[side](args, 2), logs) as (root, _, _):
            url = f"{root}/v1"
            model = served_model(url, args)
            if not transcript:
                rounds[side] = tool_rounds(url, model, record=transcript)
            else:
                rounds[side] = replay(url, model, transcript)
    details["tool_rounds"] = rounds
    console.print(json.dumps(rounds))
    rows = []
    for n, _ in enumerate(transcript):
        got = {side: rounds[side][n] for side in rounds}
        rows.append(Row(f"round {n + 1} cached_tokens (prompt "
                        f"{'/'.join(str(got[s][0]) for s in got)})",
                        got.get("butter", (0, None))[1], got.get("peer", (0, None))[1]))
    rates: dict[str, dict[int, float]] = {side: {} for side in sides}
    seeded = args.backend != "mlx"
    for index, lanes in enumerate(args.lanes):
        # Alternate who goes first (peer first on odd blocks) so drift in the shared
        # machine's load does not always land on the same side.
        for side in sides if index % 2 == 0 else sides[::-1]:
            with spawned(side, commands[side](args, lanes), logs) as (root, _, _):
                url = f"{root}/v1"
                rates[side][lanes] = asyncio.run(
                    lanes_rate(url, served_model(url, args), lanes, args.tokens, seeded))
        rows.append(Row(f"tok/s at {lanes} lanes", rates.get("butter", {}).get(lanes),
                        rates.get("peer", {}).get(lanes)))
    details["tokens_per_s"] = rates
    details["load_1min_end"] = os.getloadavg()[0]
    print_rows(f"tiny Qwen3.5 (hybrid) {args.backend.upper()}: butter vs {peer_name} "
               f"(load {details['load_1min']:.1f} -> {details['load_1min_end']:.1f})",
               rows, peer=peer_name)
    save_json(args.json, rows, details)


if __name__ == "__main__":
    main()
