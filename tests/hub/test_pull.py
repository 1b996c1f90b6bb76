"""``butter pull`` against the loopback hub: progress, resume, what is taken, failures."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
from conftest import free_port
from support.hubtest import GATED_REPO, GATED_TOKEN, GGUF_FILE, GGUF_REPO, butter


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fetched(hub, repo: str) -> list[str]:
    """The files of ``repo`` the hub sent, in order (API calls left out)."""
    return [e.path for e in hub.log if e.method == "GET" and e.repo == repo
            and not e.path.startswith("api/")]


def test_pull_shows_bytes_rate_and_time_left_then_serves_from_the_cache(hub, hf_env,
                                                                       model_path):
    hub.rate = 40e6  # about 2.5 s for the 98 MB file: the bar redraws while it runs
    terminal = dict(hf_env, TTY_COMPATIBLE="1", TTY_INTERACTIVE="1", COLUMNS="120",
                    NO_COLOR="1")
    done = butter("pull", f"{GGUF_REPO}:q4_1", env=terminal)
    assert done.returncode == 0, done.stderr
    local = Path(done.stdout.strip())
    assert local.name == GGUF_FILE and sha256(local) == sha256(model_path)
    assert str(local).startswith(hf_env["HF_HOME"])  # the standard cache, under HF_HOME
    frames = [f for f in re.split(r"[\r\n]", done.stderr) if GGUF_REPO in f]
    # A frame mid-way: bytes so far of the total, a rate, and a time left that is not 0.
    middle = [f for f in frames if re.search(r"\b\d+\.\d/98\.4 MB\b", f)
              and not f.count("98.4/98.4")]
    assert middle, done.stderr
    assert any(re.search(r"\d+(\.\d)? MB/s", f) and re.search(r"0:00:0[1-9]", f)
               for f in middle), middle
    assert "98.4/98.4 MB" in frames[-1]
    # Nothing fetched the README, and the id resolves offline from now on.
    assert fetched(hub, GGUF_REPO) == [GGUF_FILE]
    offline = butter("pull", f"{GGUF_REPO}:Q4_1", env=dict(hf_env, HF_HUB_OFFLINE="1"))
    assert offline.returncode == 0 and Path(offline.stdout.strip()) == local
    assert "in the cache already" in offline.stderr


def test_a_download_cut_off_mid_file_resumes_where_it_stopped(hub, hf_env, model_path):
    hub.cut_once(GGUF_REPO, GGUF_FILE, after=30_000_000)
    quiet = dict(hf_env, HF_HUB_DISABLE_PROGRESS_BARS="1")  # it means what it always means
    done = butter("pull", f"{GGUF_REPO}/{GGUF_FILE}", env=quiet)
    assert done.returncode == 0, done.stderr
    assert "MB/s" not in done.stderr
    gets = hub.gets(GGUF_REPO, GGUF_FILE)
    assert len(gets) == 2 and gets[0].range is None
    # The second request asks for the rest only (huggingface_hub writes 10 MiB blocks).
    start = int(re.fullmatch(r"bytes=(\d+)-", gets[1].range).group(1))
    assert 10_000_000 < start <= 30_000_000 and gets[1].status == 206
    assert sha256(Path(done.stdout.strip())) == sha256(model_path)


def test_mlx_repository_takes_only_what_serving_needs(hub, hf_env, mlx_repo):
    done = butter("pull", mlx_repo, env=hf_env)
    assert done.returncode == 0, done.stderr
    folder = Path(done.stdout.strip())
    taken = sorted(p.name for p in folder.rglob("*") if p.is_file())
    assert taken == ["config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]
    # config.json last: a download cut off before it leaves nothing that resolves.
    assert fetched(hub, mlx_repo)[-1] == "config.json"
    offline = butter("pull", mlx_repo, env=dict(hf_env, HF_HUB_OFFLINE="1"))
    assert offline.returncode == 0 and Path(offline.stdout.strip()) == folder


def test_an_interrupted_pull_keeps_finished_files_and_serves_nothing_half_done(
        hub, hf_env, mlx_repo):
    hub.broken.add((mlx_repo, "config.json"))
    try:
        failed = butter("pull", mlx_repo, env=hf_env)
    finally:
        hub.broken.clear()
    assert failed.returncode == 1 and "answered 500" in failed.stderr
    offline = butter("pull", mlx_repo, env=dict(hf_env, HF_HUB_OFFLINE="1"))
    assert offline.returncode == 1  # weights without their config.json do not resolve
    hub.log.clear()
    done = butter("pull", mlx_repo, env=hf_env)
    assert done.returncode == 0, done.stderr
    assert fetched(hub, mlx_repo) == ["config.json"]  # the finished files were kept
    assert (Path(done.stdout.strip()) / "model.safetensors").is_file()


def test_gguf_choice_follows_llama_server(hub, hf_env):
    """No quant: Q4_K_M as llama-server's -hf; a quant picks the one file carrying it."""
    done = butter("pull", "lab/many-ggufs", env=hf_env)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).name == "m-Q4_K_M.gguf"
    done = butter("pull", "lab/many-ggufs:q8_0", env=hf_env)  # the projector does not count
    assert Path(done.stdout.strip()).name == "m-Q8_0.gguf"


FAILURES = [
    # (id, extra environment, what the one line says)
    ("lab/missing", {}, r"has no repository lab/missing \(404"),
    (GATED_REPO, {}, r"refused access to the gated repository .*\(401; no HF_TOKEN"),
    (GATED_REPO, {"HF_TOKEN": "hf_wrong"}, r"refused access .*\(403; HF_TOKEN is set"),
    ("lab/not-cached", {"HF_HUB_OFFLINE": "1"}, r"not in the local cache, and HF_HUB_OFFLINE"),
    ("lab/not-cached", {"HF_ENDPOINT": "http://127.0.0.1:9"},
     r"cannot reach http://127\.0\.0\.1:9 \(.*Connection refused"),
    ("lab/no-weights", {}, r"no weights butter can load .* README\.md, pytorch_model\.bin"),
    ("lab/many-ggufs:Q4_1", {}, r"2 files carry Q4_1: m-Q4_1\.gguf, m-instruct-Q4_1\.gguf"),
    ("lab/many-ggufs:Q5_K_M", {}, r"no \.gguf file carries Q5_K_M; its \.gguf files: m-Q4_1"),
    (f"{GGUF_REPO}/other.gguf", {}, r"has no file other\.gguf"),
]


@pytest.mark.parametrize(("model_id", "extra", "says"), FAILURES,
                         ids=[f"{m}{'+' + '+'.join(e) if e else ''}" for m, e, _ in FAILURES])
def test_failures_are_one_line_naming_the_id(hf_env, model_id, extra, says):
    done = butter("pull", model_id, env=dict(hf_env, **extra))
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"`{model_id}`" in lines[0] and re.search(says, lines[0]), lines[0]
    assert done.stdout == ""


def test_a_token_the_gated_repository_accepts_downloads_it(hf_env):
    done = butter("pull", f"{GATED_REPO}:Q4_1", env=dict(hf_env, HF_TOKEN=GATED_TOKEN))
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).name == GGUF_FILE


def test_pull_refuses_what_is_not_a_hub_id(hf_env):
    done = butter("pull", "smollm2", env=hf_env)
    assert done.returncode == 2 and "is not a Hugging Face id" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_serve_fails_the_same_way_before_loading_anything(hf_env):
    done = butter("serve", "--model", "lab/missing", "--port", str(free_port()), env=hf_env)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"butter: error: The model `lab/missing` does not exist or is not available here. "
        f"{hf_env['HF_ENDPOINT']} has no repository lab/missing (404; no HF_TOKEN is set; "
        "a private one needs a token that may read it)."]


def test_allow_downloads_with_no_swap_is_a_usage_error(hf_env):
    done = butter("serve", "--model", "smollm2", "--allow-downloads", "--no-swap",
                  "--port", str(free_port()), env=hf_env)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "butter serve: error: --allow-downloads: a request cannot swap in what it pulls "
        "with --no-swap"]
