"""Run the README's install-and-serve commands as a new user would, and ask one question.

The commands are read from README.md itself (the first ```bash block under a heading), so
the check follows the README and nothing keeps a second copy. Each runs verbatim, with
``--port N`` added so that it serves on a free port, in order, in one fresh copy of the
checkout (the first makes its fresh venv; the MLX line adds to it, as the README says),
until ``/health`` answers; then one chat question must be answered with the right city.
Standard library only: it runs before anything is installed.

    python3 .ci/readme_commands.py "Set up" "The MLX back end"
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUESTION = "Name the capital city of France."
ANSWER = "Paris"
START_SECONDS = 40 * 60  # a first install builds llama-cpp-python (~8 min on 2 cores)
ANSWER_SECONDS = 10 * 60  # MLX on a CPU with the reference BLAS is slow


def first_command(readme: str, heading: str) -> str:
    """The first ```bash block under ``## heading``, as one command line."""
    section = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", readme, re.M | re.S)
    if section is None:
        raise SystemExit(f"README.md has no section '## {heading}'")
    block = re.search(r"^```bash\n(.*?)^```", section[1], re.M | re.S)
    if block is None:
        raise SystemExit(f"README.md's '## {heading}' has no ```bash block")
    lines = [line for line in block[1].splitlines() if line.strip()]
    if len(lines) != 1 or "butter serve" not in lines[0]:
        raise SystemExit(f"'## {heading}': expected one command ending in butter serve, "
                         f"got {lines!r}")
    return lines[0]


def fresh_copy(destination: Path) -> None:
    """The checkout's files as a clone has them: tracked and untracked-not-ignored."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def get(url: str, timeout: float) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def ask(port: int) -> str:
    body = json.dumps({"model": "smollm2", "temperature": 0, "max_tokens": 24,
                       "messages": [{"role": "user", "content": QUESTION}]}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                     data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=ANSWER_SECONDS) as reply:
        return json.load(reply)["choices"][0]["message"]["content"]


def run(heading: str, folder: Path) -> None:
    command = first_command((ROOT / "README.md").read_text(), heading)
    port = free_port()
    log_path = folder / f"serve-{re.sub(r'[^a-z]+', '-', heading.lower()).strip('-')}.log"
    print(f"[{heading}] {command} --port {port}", flush=True)
    started = time.monotonic()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(["bash", "-c", f"{command} --port {port}"], cwd=folder,
                                   stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    try:
        while True:
            if process.poll() is not None:
                fail(heading, f"exited with status {process.returncode} before serving", log_path)
            if time.monotonic() - started > START_SECONDS:
                fail(heading, f"not serving after {START_SECONDS} s", log_path)
            try:
                status, _ = get(f"http://127.0.0.1:{port}/health", timeout=5)
            except OSError:
                status = None
            if status == 200:
                break
            time.sleep(2)
        print(f"[{heading}] serving after {time.monotonic() - started:.0f} s", flush=True)
        answer = ask(port)
        print(f"[{heading}] {QUESTION!r} -> {answer!r}", flush=True)
        if ANSWER not in answer:
            fail(heading, f"the answer does not name {ANSWER}", log_path)
    finally:
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(process.pid, signal.SIGKILL)


def fail(heading: str, reason: str, log_path: Path) -> None:
    tail = log_path.read_text(errors="replace")[-4000:]
    raise SystemExit(f"[{heading}] the README's command failed: {reason}\n{tail}")


def main(headings: list[str]) -> None:
    with tempfile.TemporaryDirectory(prefix="butter-readme-") as work:
        fresh_copy(Path(work))
        for heading in headings:
            run(heading, Path(work))
    print("README commands: all served and answered", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["Set up"])
