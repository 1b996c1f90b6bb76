"""Models from the Hugging Face hub: which files an id names, and fetching them.

Resolution (``butter.resolvers``) never downloads; this module is what does, called by
``butter serve --model`` and ``butter pull`` (with a rich progress bar) and by the server
when ``--allow-downloads`` lets a request name a repository not cached yet.

Everything goes through ``huggingface_hub``'s own client into the standard cache, so
``HF_HOME``, ``HF_HUB_CACHE``, ``HF_ENDPOINT``, ``HF_TOKEN`` and ``HF_HUB_OFFLINE`` mean
what they mean to every other tool. ``huggingface_hub`` is imported inside the functions
that need it: parsing an id and choosing a file are pure and cheap.

Ids, as llama-server's ``-hf`` and Ollama's ``hf.co/…`` spell them:

- ``owner/repo``: an HF / MLX checkpoint (config, safetensors, tokenizer), or for a
  repository of GGUF files the one llama-server picks (``Q4_K_M``, else ``Q8_0``, else
  the first);
- ``owner/repo:QUANT``: the one ``.gguf`` whose name carries that quant (any case);
- ``owner/repo/path/file.gguf``: that file.
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path, PurePosixPath

import attrs

from butter.errors import ButterError, ModelDownloadError, ModelLoadError, ModelNotFoundError

log = logging.getLogger("butter.hub")

# mlx-lm's own download patterns (mlx_lm.utils.DEFAULT_ALLOW_PATTERNS) without "*.py":
# butter runs no code from a repository.
SERVING_PATTERNS = ("*.json", "model*.safetensors", "tokenizer.model", "*.tiktoken",
                    "tiktoken.model", "*.txt", "*.jsonl", "*.jinja")
WEIGHT_PATTERN = "model*.safetensors"
# llama-server's choice without a quant (the pinned llama.cpp's common/download.cpp).
DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")
# Files in GGUF repositories that are not a language model (llama.cpp skips them too).
_NOT_MODEL = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
_QUANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_LISTED = 12  # files named in an error before "…"


@attrs.frozen
class HubId:
    """A model id naming a hub repository, and optionally one GGUF in it."""

    text: str
    repo_id: str
    quant: str | None = None
    filename: str | None = None

    @property
    def is_gguf(self) -> bool:
        """The id itself asks for a GGUF file (a quant or a file name)."""
        return self.quant is not None or self.filename is not None


def parse_hub_id(text: str) -> HubId | None:
    """``text`` as a hub id, or ``None`` when it cannot be one (paths, aliases)."""
    if not text or text != text.strip() or text.startswith(("/", ".", "~")) or "\\" in text:
        return None
    base, quant = text, None
    if ":" in text:
        base, _, quant = text.rpartition(":")
        if not _QUANT.match(quant):
            return None
    parts = base.split("/")
    if len(parts) < 2 or not all(_valid_name(part) for part in parts[:2]):
        return None
    filename = "/".join(parts[2:]) or None
    if filename is not None:
        if quant is not None or not filename.lower().endswith(".gguf"):
            return None
        if any(part in ("", ".", "..") for part in parts[2:]):
            return None
    return HubId(text=text, repo_id="/".join(parts[:2]), quant=quant, filename=filename)


def _valid_name(part: str) -> bool:
    # The hub's own rule (huggingface_hub.utils.validate_repo_id), without importing it.
    return bool(_NAME.match(part)) and "--" not in part and ".." not in part \
        and not part.endswith((".", "-"))


# ---- which files an id names --------------------------------------------------------

def model_ggufs(paths: Iterable[str]) -> list[str]:
    """The GGUF language models among ``paths``: projectors, imatrix files and the later
    parts of split files left out (a split model is named by its first part)."""
    chosen = []
    for path in sorted(paths):
        name = PurePosixPath(path).name.lower()
        if not name.endswith(".gguf") or any(word in name for word in _NOT_MODEL):
            continue
        split = _SPLIT.search(name)
        if split is not None and int(split.group(1)) != 1:
            continue
        chosen.append(path)
    return chosen


def choose_gguf(hub_id: HubId, paths: Iterable[str]) -> str:
    """The GGUF ``hub_id`` names among ``paths``: :class:`ModelNotFoundError` when none
    does, :class:`ModelLoadError` when several do; each lists what ``paths`` hold."""
    paths = list(paths)
    repo = f"The repository {hub_id.repo_id}"
    if hub_id.filename is not None:
        if hub_id.filename in paths:
            return hub_id.filename
        raise ModelNotFoundError(hub_id.text, f"{repo} has no file {hub_id.filename}; "
                                 f"{_has(paths)}.")
    models = model_ggufs(paths)
    if hub_id.quant is not None:
        hits = _with_quant(models, hub_id.quant)
        if len(hits) == 1:
            return hits[0]
        if hits:
            raise ModelLoadError(hub_id.text, f"{len(hits)} files carry {hub_id.quant}: "
                                 f"{', '.join(hits)}; name one as owner/repo/FILE.gguf")
        raise ModelNotFoundError(hub_id.text, f"{repo}: no .gguf file carries "
                                 f"{hub_id.quant}; {_has(paths)}.")
    for quant in DEFAULT_QUANTS:
        hits = _with_quant(models, quant)
        if hits:
            return hits[0]
    if models:
        return models[0]
    raise ModelNotFoundError(hub_id.text, f"{repo} has no .gguf model; {_has(paths)}.")


def _with_quant(paths: Sequence[str], quant: str) -> list[str]:
    # llama.cpp's rule (QUANT followed by "." or "-", any case), not inside a longer name.
    pattern = re.compile(rf"(?<![A-Za-z0-9]){re.escape(quant)}[.-]", re.IGNORECASE)
    return [path for path in paths if pattern.search(path)]


def split_parts(chosen: str, paths: Iterable[str]) -> list[str]:
    """Every part of a split GGUF (``…-00001-of-00003.gguf``), or just ``chosen``."""
    split = _SPLIT.search(chosen)
    if split is None:
        return [chosen]
    stem, count = chosen[:split.start()], split.group(2)
    return sorted(p for p in paths if (m := _SPLIT.search(p)) is not None
                  and p[:m.start()] == stem and m.group(2) == count)


def _has(paths: Sequence[str]) -> str:
    ggufs = [p for p in paths if p.lower().endswith(".gguf")]
    shown = ggufs or list(paths)
    if not shown:
        return "the repository is empty"
    kind = ".gguf files" if ggufs else "files"
    more = f", … ({len(shown) - _LISTED} more)" if len(shown) > _LISTED else ""
    return f"its {kind}: {', '.join(sorted(shown)[:_LISTED])}{more}"


@attrs.frozen
class RemoteFile:
    path: str
    size: int


def files_to_fetch(hub_id: HubId, listing: Sequence[RemoteFile]) -> list[RemoteFile]:
    """What serving ``hub_id`` needs from a repository, in download order.

    The file resolution looks for comes last (``config.json``, the first part of a split
    GGUF), and each file appears in the cache only when whole: a download cut off leaves
    no snapshot that resolves, so the next run downloads the rest instead of serving half.
    """
    by_path = {f.path: f for f in listing}
    paths = list(by_path)
    ggufs = model_ggufs(paths)
    if hub_id.is_gguf or ggufs:
        chosen = choose_gguf(hub_id, paths)
        return [by_path[p] for p in reversed(split_parts(chosen, paths))]
    has_weights = any(fnmatch.fnmatch(p, WEIGHT_PATTERN) for p in paths)
    if "config.json" not in by_path or not has_weights:
        raise ModelLoadError(hub_id.text, "the repository holds no weights butter can load "
                             f"(no .gguf, no config.json with {WEIGHT_PATTERN}); {_has(paths)}")
    wanted = [p for p in paths if any(fnmatch.fnmatch(p, pattern) for pattern in SERVING_PATTERNS)]
    wanted.sort(key=lambda p: (p == "config.json", p))
    return [by_path[p] for p in wanted]


# ---- downloading --------------------------------------------------------------------

class ByteSink:
    """Where a download reports its bytes: ``start`` once, ``advance`` per chunk."""

    def start(self, hub_id: HubId, files: int, total: int) -> None:
        """``files`` files of ``total`` bytes are about to download."""

    def advance(self, n: int) -> None:
        """``n`` more bytes are on disk (negative when a server ignored a resume)."""

    def done(self) -> None:
        """The download ended, whole or not."""


class RichSink(ByteSink):
    """One rich progress bar: bytes, rate and time left (the CLI's)."""

    def __init__(self, console) -> None:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                  DownloadColumn(), TransferSpeedColumn(),
                                  TimeRemainingColumn(), console=console)
        self._task = None

    def start(self, hub_id: HubId, files: int, total: int) -> None:
        noun = "file" if files == 1 else "files"
        self._task = self._progress.add_task(f"{hub_id.text} ({files} {noun})", total=total)

    def advance(self, n: int) -> None:
        if not self._progress.live.is_started:  # from the first byte: a refusal draws no bar
            self._progress.start()
        self._progress.advance(self._task, n)

    def done(self) -> None:
        if self._progress.live.is_started:
            self._progress.stop()


class LogSink(ByteSink):
    """Progress as log lines, at most one per ``every`` seconds (the server's)."""

    def __init__(self, every: float = 5.0) -> None:
        self._every = every
        self._lock = threading.Lock()

    def start(self, hub_id: HubId, files: int, total: int) -> None:
        self._id, self._total, self._bytes = hub_id.text, total, 0
        self._began = self._last = time.monotonic()
        log.info("downloading %s: %d files, %s", self._id, files, _size(total))

    def advance(self, n: int) -> None:
        with self._lock:
            self._bytes += n
            now = time.monotonic()
            if now - self._last < self._every:
                return
            self._last = now
        log.info("downloading %s: %s of %s", self._id, _size(self._bytes), _size(self._total))

    def done(self) -> None:
        seconds = max(time.monotonic() - self._began, 1e-6)
        log.info("downloaded %s: %s in %.1f s", self._id, _size(self._bytes), seconds)


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def tqdm_class_for(sink: ByteSink) -> type:
    """A ``tqdm_class`` for ``hf_hub_download`` that feeds ``sink``.

    huggingface_hub accepts any class that mimics tqdm; one with ``update_transfer`` is
    treated as an aggregating bar (as its own ``snapshot_download`` aggregates files), so
    plain HTTP and Xet downloads both report bytes on disk through ``update`` alone.
    """

    class Bar:
        def __init__(self, *args, initial: int = 0, total: int | None = None, **kwargs) -> None:
            self.n, self.total = initial, total
            if initial:
                sink.advance(initial)

        def update(self, n: int | float | None = 1) -> None:
            if n:
                self.n += int(n)
                sink.advance(int(n))

        def update_transfer(self, n: int | float | None = 1) -> None:
            """Network bytes (fewer than disk bytes with Xet's dedup): the bar counts disk."""

        def set_postfix_str(self, *args, **kwargs) -> None:
            """The rate is the progress display's own."""

        set_transfer_postfix_str = set_postfix_str

        def refresh(self, *args, **kwargs) -> None: ...

        def close(self) -> None: ...

        def __enter__(self) -> Bar:
            return self

        def __exit__(self, *exc_info) -> None: ...

    return Bar


def download(hub_id: HubId, *, sink: ByteSink | None = None) -> Path:
    """Fetch what serving ``hub_id`` needs into the HF cache; the local file or folder.

    Files already in the cache are not fetched again, and a connection cut off mid-file
    resumes where it stopped (huggingface_hub asks for the rest with a ``Range``). Every
    failure is a :class:`~butter.errors.ButterError` whose message is one line naming the id.
    """
    from huggingface_hub import constants

    sink = sink or ByteSink()
    if constants.is_offline_mode():
        raise ModelDownloadError(hub_id.text, "it is not in the local cache, and "
                                 "HF_HUB_OFFLINE is set")
    try:
        return _download(hub_id, sink)
    except ButterError:
        raise
    except Exception as error:
        raise explain(hub_id, error) from None


def _download(hub_id: HubId, sink: ByteSink) -> Path:
    from huggingface_hub import HfApi, RepoFile, hf_hub_download, try_to_load_from_cache

    api = HfApi()
    revision = api.resolve_revision(hub_id.repo_id)  # pins every file to one commit
    listing = [RemoteFile(entry.path, entry.size or 0)
               for entry in api.list_repo_tree(hub_id.repo_id, revision=revision.resolved,
                                               recursive=True)
               if isinstance(entry, RepoFile)]
    files = files_to_fetch(hub_id, listing)
    missing = [f for f in files if not isinstance(
        try_to_load_from_cache(hub_id.repo_id, f.path, revision=revision.resolved), str)]
    bar = tqdm_class_for(sink)
    sink.start(hub_id, len(missing), sum(f.size for f in missing))
    try:
        for remote in files:
            local = hf_hub_download(hub_id.repo_id, remote.path, revision=revision,
                                    tqdm_class=bar)
    finally:
        sink.done()
    snapshot = Path(local).parents[len(PurePosixPath(remote.path).parts) - 1]
    last = files[-1].path
    return snapshot / last if last.lower().endswith(".gguf") else snapshot


def explain(hub_id: HubId, error: BaseException) -> ButterError:
    """A huggingface_hub failure as one line naming the id (never the library's text)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint = constants.ENDPOINT
    name = hub_id.text
    status = getattr(getattr(error, "response", None), "status_code", None)
    token = "HF_TOKEN is set" if _has_token() else "no HF_TOKEN is set"
    if isinstance(error, GatedRepoError) or (isinstance(error, HfHubHTTPError)
                                             and status in (401, 403)
                                             and not isinstance(error, RepositoryNotFoundError)):
        return ModelDownloadError(name, f"{endpoint} refused access to the gated repository "
                                  f"{hub_id.repo_id} ({status}; {token}: accept its terms on "
                                  "the hub with a token that may read it)")
    if isinstance(error, RepositoryNotFoundError):
        return ModelNotFoundError(name, f"{endpoint} has no repository {hub_id.repo_id} "
                                  f"({status}; {token}; a private one needs a token that "
                                  "may read it).")
    if isinstance(error, RevisionNotFoundError):
        return ModelNotFoundError(name, f"The repository {hub_id.repo_id} has no main branch.")
    network = _network_cause(error)
    if network is not None:
        return ModelDownloadError(name, f"cannot reach {endpoint} ({network})")
    if isinstance(error, HfHubHTTPError):
        return ModelDownloadError(name, f"{endpoint} answered {status}")
    text = str(error).strip().splitlines()
    return ModelDownloadError(name, f"{type(error).__name__}: {text[0] if text else ''}")


def _has_token() -> bool:
    from huggingface_hub import get_token

    return bool(get_token())


def _network_cause(error: BaseException) -> str | None:
    """The transport failure behind ``error`` (connection refused, timeout), if any."""
    try:
        import httpx2  # huggingface_hub's HTTP client
    except ImportError:
        return None

    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, httpx2.TransportError):
            cause = error.__context__ or error.__cause__
            detail = str(cause if isinstance(cause, OSError) else error).strip()
            return (detail.splitlines() or [type(error).__name__])[0]
        error = error.__cause__ or error.__context__
    return None


# ---- request-driven downloads ---------------------------------------------------------

class SharedDownloads:
    """Downloads a server runs for requests: one per id, on a worker thread.

    Requests naming the same id wait for the same download; a client that goes away does
    not cancel it (others may wait for it). A failed download is forgotten, so the next
    request tries again.
    """

    def __init__(self, fetch: Callable[[HubId], Path] | None = None) -> None:
        self._fetch = fetch or (lambda hub_id: download(hub_id, sink=LogSink()))
        self._running: dict[str, asyncio.Future[Path]] = {}
        self.started = 0

    async def fetch(self, hub_id: HubId) -> Path:
        future = self._running.get(hub_id.text)
        if future is None:
            self.started += 1
            future = asyncio.ensure_future(asyncio.to_thread(self._fetch, hub_id))
            self._running[hub_id.text] = future
            future.add_done_callback(lambda _f, key=hub_id.text: self._running.pop(key, None))
        return await asyncio.shield(future)
