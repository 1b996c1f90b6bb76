"""The Serve config files of docs/scale-out.md, as users deploy them.

``docs/serve.yaml`` runs through Serve's own ``serve run`` (which validates it with
``ServeDeploySchema``), with only what this 2-core machine needs changed: one replica of
one thread, and Serve's proxy on a free loopback port. The page quotes each file whole.
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import free_port

from butter.cli.main import build_parser
from butter.ray.launch import options_argv

DOCS = Path(__file__).resolve().parents[2] / "docs"
CONFIGS = ("serve.yaml", "serve-models.yaml")


def load(name: str) -> dict:
    from ray.serve.schema import ServeDeploySchema

    text = (DOCS / name).read_text()
    ServeDeploySchema.model_validate(yaml.safe_load(text))  # what `serve deploy` checks
    return yaml.safe_load(text)


@pytest.mark.parametrize("name", CONFIGS)
def test_the_page_quotes_each_config_file_whole(name):
    page = (DOCS / "scale-out.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", page, flags=re.DOTALL)
    assert (DOCS / name).read_text() in blocks, f"docs/scale-out.md does not quote {name}"


def test_the_multi_model_example_is_two_models_with_every_flag_known():
    (application,) = load("serve-models.yaml")["applications"]
    args = build_parser().parse_args(options_argv(application["args"]))
    assert args.models == ["smollm2", "Qwen/Qwen3-0.6B-GGUF:Q8_0"]
    assert args.model == "smollm2" and args.replicas == 4 and args.threads == 2


@pytest.mark.ray
@pytest.mark.slow
def test_serve_run_deploys_the_config_file_and_it_answers(tmp_path):
    config = load("serve.yaml")
    port = free_port()
    config["http_options"].update(host="127.0.0.1", port=port)  # loopback, a free port
    (application,) = config["applications"]
    application["args"].update(replicas=1, threads=1)  # the 2-core machine's sizes
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    log = tmp_path / "serve-run.log"
    serve = Path(sys.executable).with_name("serve")
    with open(log, "wb") as output:
        # --address local: a private Ray for this run, never a cluster someone else runs.
        process = subprocess.Popen([str(serve), "run", "--address", "local", str(path)],
                                   stdout=output, stderr=subprocess.STDOUT, cwd=tmp_path)
    root = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert process.poll() is None, log.read_text(errors="replace")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{root}/health", timeout=2).text == "ok":
                    break
            assert time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(1)
        asked = {"model": "smollm2", "max_tokens": 8, "temperature": 0,
                 "messages": [{"role": "user", "content": "Name the capital city of France."}]}
        refused = httpx.post(f"{root}/v1/chat/completions", json=asked, timeout=60)
        assert refused.status_code == 401  # the file's api_key holds
        answer = httpx.post(f"{root}/v1/chat/completions", json=asked, timeout=120, headers={
            "Authorization": f"Bearer {application['args']['api_key']}",
            "Host": "butter.example"})  # the file's host: 0.0.0.0 lets any Host in
        assert answer.status_code == 200, answer.text
        assert "Paris" in answer.json()["choices"][0]["message"]["content"]
        card = httpx.get(f"{root}/v1/models", timeout=10, headers={
            "Authorization": f"Bearer {application['args']['api_key']}"}).json()["data"][0]
        assert card["butter"]["parallel"] == application["args"]["parallel"]
        assert card["butter"]["threads"] == 1 and card["butter"]["replicas"] == 1
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
