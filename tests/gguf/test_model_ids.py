"""What a model id may name, and what its errors reveal: swaps are not a disk probe."""

import concurrent.futures
import json
import shutil
from pathlib import Path

import httpx
import pytest
from helpers import stream_lines

from butter.resolve import ResolvedModel
from butter.resolvers import resolve_model

QUESTION = [{"role": "user", "content": "Name the capital city of France."}]


def chat(server, model, **extra):
    return httpx.post(f"{server.base_url}/chat/completions", timeout=120, json={
        "model": model, "messages": QUESTION, "max_tokens": 8, "temperature": 0, **extra})


@pytest.fixture
def models_dir(tmp_path, model_path):
    directory = tmp_path / "models"
    directory.mkdir()
    shutil.copyfile(model_path, directory / "copy.gguf")
    (directory / "folder").mkdir()
    shutil.copyfile(model_path, directory / "folder" / "inner.gguf")
    data = model_path.read_bytes()
    (directory / "short-by-one.gguf").write_bytes(data[:-1])
    return directory


def test_a_request_cannot_probe_or_load_arbitrary_paths(start_server, tmp_path, model_path):
    server = start_server()
    outside = tmp_path / "outside.gguf"
    shutil.copyfile(model_path, outside)
    ids = [str(outside), str(tmp_path), "/tmp", "~", "~/", "/etc/passwd", "/no/such/file",
           "/root", "x" * 5000, "/" + "y" * 300, "a\u0000b", "../" * 20 + "etc/passwd"]
    bodies = []
    for model_id in ids:
        response = chat(server, model_id)
        assert response.status_code == 404, (model_id, response.text)
        error = response.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        bodies.append(error["message"].replace(model_id, "<id>"))
    # An existing file, a directory and nothing at all read the same: the id reveals nothing.
    assert len(set(bodies)) == 1, set(bodies)
    assert str(Path.home()) not in json.dumps(bodies)
    assert "swap requested" not in server.log_text()
    assert chat(server, "smollm2").status_code == 200


def test_the_models_card_shows_no_paths(server, model_path):
    text = httpx.get(f"{server.base_url}/models").text
    assert str(model_path.parent) not in text and '"path"' not in text


def test_models_dir_names_are_swappable_and_nothing_else(start_server, models_dir, tmp_path):
    server = start_server("--models-dir", str(models_dir))
    for model_id in ("copy.gguf", "folder", str(models_dir / "copy.gguf")):
        response = chat(server, model_id)
        assert response.status_code == 200, (model_id, response.text)
        served = response.json()["model"]
        assert served == model_id if "/" not in model_id else served == "copy"  # no path
    for model_id in ("../outside.gguf", "folder/../../x", str(tmp_path), "/tmp"):
        assert chat(server, model_id).status_code == 404, model_id
    assert chat(server, "smollm2").status_code == 200


def test_allow_any_path_restores_path_swaps(start_server, tmp_path, model_path):
    copy = tmp_path / "any.gguf"
    shutil.copyfile(model_path, copy)
    server = start_server("--allow-any-path")
    assert chat(server, str(copy)).status_code == 200


def test_a_file_short_by_one_byte_is_refused_and_aborts_nothing(start_server, models_dir):
    server = start_server("--models-dir", str(models_dir), "--parallel", "2")
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Tell a story."}],
            "max_tokens": 64, "ignore_eos": True, "stream": True}
    lines: list[str] = []

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(stream_lines, server, body, lines)
        while len(lines) < 3:
            assert not running.done()
        refused = chat(server, "short-by-one.gguf")
        running.result(timeout=120)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "model_load_failed"
    assert error["message"].startswith("Could not load model `short-by-one.gguf`")
    assert str(models_dir) not in error["message"]
    assert not any(ch.isdigit() for ch in error["message"].split(":", 1)[1])  # no sizes
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][len("data: "):])
    assert "error" not in last
    assert "swap done" not in server.log_text()


def test_with_no_swap_an_unreadable_id_is_404_not_500(start_server):
    server = start_server("--no-swap")
    for model_id in ("/" + "n" * 300 + "/model.gguf", "bad\u0000id", "/proc/1/root/x"):
        response = chat(server, model_id)
        assert response.status_code == 404, (model_id, response.text)
    assert "Traceback" not in server.log_text()


def test_the_resolver_treats_a_path_it_may_not_read_as_unknown(monkeypatch):
    def denied(self):
        raise PermissionError(13, "Permission denied")

    assert isinstance(resolve_model("smollm2"), ResolvedModel)
    monkeypatch.setattr(Path, "is_file", denied)
    assert resolve_model("/root/secret/model.gguf") is None


def test_models_lists_a_path_by_its_stem_and_requests_naming_the_path_reach_it(
        start_server, tmp_path, model_path):
    served = tmp_path / "secret-dir" / "mine.gguf"
    served.parent.mkdir()
    shutil.copyfile(model_path, served)
    server = start_server(model=str(served))
    listing = httpx.get(f"{server.base_url}/models").json()
    assert [card["id"] for card in listing["data"]] == ["mine"]
    assert "secret-dir" not in json.dumps(listing)
    for model_id in ("mine", str(served)):
        response = chat(server, model_id)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == "mine"
    assert "swap requested" not in server.log_text()


def test_alias_names_the_served_model(start_server):
    server = start_server("--alias", "house-model")
    assert httpx.get(f"{server.base_url}/models").json()["data"][0]["id"] == "house-model"
    for model_id in ("house-model", "smollm2"):
        response = chat(server, model_id)
        assert response.status_code == 200, response.text
    assert "swap requested" not in server.log_text()
