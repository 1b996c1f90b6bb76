"""Download speed from a loopback hub against ``cp`` of the same file, with an A/A run.

Serves the shipped SmolLM2 GGUF (98 MB) from the test suite's loopback hub
(``tests/support/fakehub.py``, plain HTTP, no Xet), in a process of its own so client and
server do not share an interpreter lock, and times, interleaved, ``--runs`` times each:

* **hub**: ``butter.hub.download("lab/smollm2-gguf:Q4_1")`` into an empty HF cache
  (huggingface_hub's own client: revision, listing, HEAD, GET, blob moved into place),
  in this process, so no interpreter start is counted;
* **curl**: ``curl`` fetching the same file from the same hub: the server's share (the
  hub is a Python ``http.server``, not the real hub's CDN), so hub / curl is what
  huggingface_hub's client and the cache cost on top;
* **socket**: the floor of the loopback itself: the file sent with ``sendfile`` over a
  loopback TCP connection and written to disk by a ``recv`` loop, no HTTP;
* **cp**: ``cp`` of the same file into a fresh folder of the same disk;
* **cp (A/A)**: ``cp`` again, timed the same way: the ratio cp / cp is the noise of the
  machine, the yardstick for the hub / cp ratio.

The source stays in the page cache after the first read, for every contender. Prints
the median seconds and MB/s of each and the ratios (above 1: slower than ``cp``).

    .venv/bin/python bench/download.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import REPO, console, model_path
from rich.table import Table

REPO_ID = "lab/smollm2-gguf"
FILE = "SmolLM2-135M-Instruct-Q4_1.gguf"
# The loopback hub is test support, not shipped: its own process, serving until stdin ends.
SERVE = f"""
import sys
sys.path.insert(0, {str(REPO / "tests")!r})
from pathlib import Path
from support.fakehub import FakeHub
hub = FakeHub({{{REPO_ID!r}: {{{FILE!r}: Path(sys.argv[1])}}}})
print(hub.url, flush=True)
sys.stdin.read()
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    source = model_path()
    size = source.stat().st_size
    hub = subprocess.Popen([sys.executable, "-c", SERVE, str(source)], text=True,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    url = hub.stdout.readline().strip()
    work = Path(tempfile.mkdtemp(prefix="butter-download-"))
    # huggingface_hub reads its settings at import: set them first.
    os.environ.update(HF_ENDPOINT=url, HF_HOME=str(work / "hf-home"),
                      HF_HUB_DISABLE_TELEMETRY="1")
    os.environ.pop("HF_HUB_OFFLINE", None)
    from butter.hub import download, parse_hub_id

    hub_id = parse_hub_id(f"{REPO_ID}:Q4_1")
    cache = work / "hf-home" / "hub"

    def fetch() -> None:
        shutil.rmtree(cache, ignore_errors=True)
        path = download(hub_id)
        assert path.stat().st_size == size

    def copy(name: str):
        def run() -> None:
            target = work / name
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir()
            subprocess.run(["cp", str(source), str(target / FILE)], check=True)
        return run

    file_url = f"{url}/{REPO_ID}/resolve/main/{FILE}"
    contenders = {"hub": fetch}
    if shutil.which("curl"):
        contenders["curl"] = lambda: subprocess.run(
            ["curl", "-sf", "-o", str(work / "curl.bin"), file_url], check=True)
    contenders.update({"socket": lambda: over_socket(source, work / "socket.bin"),
                       "cp": copy("cp-a"), "cp (A/A)": copy("cp-b")})
    for run in contenders.values():  # warm-up: page cache, imports, connections
        run()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.runs):
        for name, run in contenders.items():
            began = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - began)
    hub.stdin.close()
    hub.wait(10)
    shutil.rmtree(work, ignore_errors=True)

    median = {name: statistics.median(values) for name, values in times.items()}
    table = Table(title=f"{FILE} ({size / 1e6:.1f} MB), median of {args.runs} runs")
    for column in ("contender", "seconds", "MB/s", "runs (s)"):
        table.add_column(column, justify="right")
    for name, values in times.items():
        table.add_row(name, f"{median[name]:.3f}", f"{size / 1e6 / median[name]:.0f}",
                      " ".join(f"{v:.3f}" for v in values))
    console.print(table)
    ratios = "   ".join(f"{name} / cp: {median[name] / median['cp']:.2f}"
                       for name in contenders if name not in ("cp", "cp (A/A)"))
    console.print(f"{ratios}   "
                  f"A/A cp (A/A) / cp: {median['cp (A/A)'] / median['cp']:.2f}")
    return 0


def over_socket(source: Path, target: Path) -> None:
    """``source`` through a loopback TCP connection into ``target`` (sendfile, recv)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        def send() -> None:
            connection, _ = server.accept()
            with connection, source.open("rb") as body:
                connection.sendfile(body)

        sender = threading.Thread(target=send)
        sender.start()
        with socket.create_connection(server.getsockname()) as client, \
                target.open("wb") as out:
            while block := client.recv(1 << 20):
                out.write(block)
        sender.join()


if __name__ == "__main__":
    sys.exit(main())
