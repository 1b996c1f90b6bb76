"""The in-process library API: load a model, generate, or serve it over HTTP.

>>> model = Model.load("smollm2")
>>> model.generate([{"role": "user", "content": "Hi"}], max_tokens=16).text

``ButterServeBackend``, ``ResidentServeBackend`` (``butter.serving``) and
``ServeServer`` (``butter.http.server``) wrap a model for the HTTP surface;
``butter serve`` is built from the same pieces.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from butter.backend import (
    Backend,
    CheckpointFacts,
    KVSpec,
    LoadedModel,
    ModelInfo,
    PromptTail,
    check_options,
)
from butter.chat.answer import Answer, AnswerReader
from butter.chat.grammar import grammar_for
from butter.chat.guard import TextGuard
from butter.chat.prompt import PromptPlan, build_prompt
from butter.chat.recovery import ContentDelta, ReasoningDelta, StreamParser, ToolCall
from butter.chat.request import ChatRequest, parse_messages, parse_tools
from butter.chat.template import ChatTemplate
from butter.engine.constraint import Constraint, Grammars
from butter.engine.events import SyncChannel
from butter.engine.planner import PREFILL_CHUNK
from butter.engine.promptcache import DEFAULT_MIB, MIB
from butter.engine.records import Request
from butter.engine.scheduler import Engine, EngineConfig
from butter.errors import (
    ButterError,
    EngineStoppedError,
    InvalidRequestError,
    ModelLoadError,
    ModelNotFoundError,
)
from butter.generation import GenerationParams, Usage
from butter.hub import HubId, download, parse_hub_id
from butter.plugins import Plugins, build_plugins
from butter.resolve import ResolvedModel
from butter.wire.fields import generation_params

GENERATE_OPTIONS = frozenset({"max_tokens", "temperature", "top_p", "seed", "stop", "tools",
                              "chat", "ignore_eos", "min_tokens", "top_k", "frequency_penalty",
                              "presence_penalty", "repetition_penalty", "logit_bias", "min_p",
                              "speculation"})
# A final message longer than this many characters is never looked for in its prompt: no
# back end reads a tail that long otherwise (the GGUF one, under 40 tokens).
TAIL_CHARS = 2048


@functools.lru_cache(maxsize=1)
def default_plugins() -> Plugins:
    """The plugins installed in this environment (built once, on first use)."""
    return build_plugins()


@attrs.frozen
class GenerationResult:
    text: str
    finish_reason: str
    usage: Usage
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()


@attrs.frozen
class StreamChunk:
    text: str = ""
    reasoning: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None


@attrs.frozen
class Prepared:
    """A request made ready for the engine: prompt tokens, answer reader, grammar."""

    tokens: list[int]
    reader: AnswerReader
    constraint: Constraint | None = None
    tail: PromptTail | None = None  # a chat prompt's final message (``Work.tail``)


class Model:
    """A loaded checkpoint and the engine that runs it."""

    def __init__(self, loaded: LoadedModel, *, model_id: str, resolved: ResolvedModel,
                 backend: Backend, plugins: Plugins) -> None:
        self.loaded = loaded
        self.model_id = model_id
        self.resolved = resolved
        self.backend = backend  # the back end that loaded it: its settings, its layout
        self.info: ModelInfo = loaded.info
        self.loaded_at = int(time.time())
        self.template = ChatTemplate(self.info.chat_template, bos_token=self.info.bos_token,
                                     eos_token=self.info.eos_token)
        self.tool_formats = tuple(plugins.tool_formats) or None
        self.guard = TextGuard(self.info.control_tokens)
        self.grammars = Grammars(loaded)
        self._engine: Engine | None = None
        self._lock = threading.Lock()
        # Request threads tokenizing right now; close() waits for them before freeing.
        self._users = 0
        self._closing = False
        self._users_changed = threading.Condition()

    @classmethod
    def load(cls, model_id: str, *, backend: str | None = None, threads: int | None = None,
             plugins: Plugins | None = None) -> Model:
        """Resolve ``model_id`` (any path, alias or hub id), check it and load it. A hub
        id not cached yet is downloaded first, as ``butter serve --model`` does."""
        loader = ModelLoader(backend=backend, threads=threads, allow_any_path=True,
                             plugins=plugins)
        target = loader.download_target(model_id, trusted=True)
        if target is not None:
            download(target)
        return loader.load(loader.check(loader.find(model_id)))

    # ---- engine ------------------------------------------------------------------

    def start_engine(self, config: EngineConfig) -> Engine:
        """Run this model with ``config`` (replacing an idle engine with another config)."""
        with self._lock:
            if self._engine is not None:
                if self._engine.config == config:
                    return self._engine
                self._engine.stop()
            self._engine = Engine(self.loaded, config, name=self.model_id)
            self._engine.start()
            return self._engine

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self.start_engine(self.engine_config(capacity=min(self.info.n_ctx_train, 8192)))
        return self._engine

    @property
    def backend_name(self) -> str:
        return self.backend.name

    def engine_config(self, *, parallel: int = 1, capacity: int | None = None,
                      prefill_chunk: int = PREFILL_CHUNK, kv: KVSpec | None = None,
                      options: Mapping[str, object] | None = None,
                      speculation: str = "ngram", cache_ram: int = DEFAULT_MIB) -> EngineConfig:
        """The engine settings for this model (``butter serve``'s flags); ``options`` are
        its back end's own settings (``Backend.options``), refused with a 400 if it does
        not declare one or a value cannot work."""
        options = check_options(self.backend, options or {})
        layout = self.backend.session_layout(options, parallel)
        return EngineConfig(parallel=parallel, capacity=capacity or self.info.n_ctx_train,
                            prefill_chunk=prefill_chunk, n_sessions=layout.n_sessions,
                            kv=kv or KVSpec(), options=options, speculation=speculation,
                            prompt_cache_bytes=cache_ram * MIB)

    @property
    def key(self) -> str:
        """The checkpoint's identity: ids that resolve to the same key are one model."""
        return self.resolved.key

    def prepare(self, request: ChatRequest, *, default_thinking: bool | None = None,
                default_effort: str | None = None) -> Prepared:
        """Render ``request`` with the checkpoint's template, tokenize it (client text
        stays text), compile its grammar and make the reader of its answer. Runs on the
        caller's thread."""
        self.check_params(request.params)
        completion = request.raw_prompt is not None or request.prompt_tokens is not None
        if completion:  # no template, no tool markup
            plan = PromptPlan(text=request.raw_prompt or "", parse_tools=False,
                              think_open=False)
            reader = AnswerReader(StreamParser(parse_think=False), plan)
        else:
            plan = build_prompt(request, self.template, default_thinking=default_thinking,
                                default_effort=default_effort, guard=self.guard)
            reader = AnswerReader.for_plan(plan, tools=request.tools, formats=self.tool_formats)
        spec = grammar_for(request, plan)
        if request.prompt_tokens is not None:
            tokens = self._checked_ids(request.prompt_tokens)
        elif request.suffix is not None:
            tokens = self._infill(request.raw_prompt or "", request.suffix)
        else:
            tokens = self.encode(plan.text)
        tail = None if completion else self._tail(plan, tokens)
        return Prepared(tokens, reader, self.grammars.compile(spec) if spec else None, tail)

    def _tail(self, plan: PromptPlan, tokens: list[int]) -> PromptTail | None:
        """Where the final message of a chat prompt of ``tokens`` starts: after the text
        it shares with the rendering of every message before it, where the prompt's tokens
        end with that final text's own (they split there: a template's special token).
        None when they do not, or the final text runs past ``TAIL_CHARS``: only the final
        text is tokenized again, never a long system prompt."""
        history, text = plan.history, plan.text
        if history is None:
            return None
        low, high = 0, min(len(history), len(text))  # text starts with history[:low]
        while low < high:
            middle = (low + high + 1) // 2
            if text.startswith(history[:middle]):
                low = middle
            else:
                high = middle - 1
        if len(text) - low > TAIL_CHARS:
            return None
        with self._in_use():
            final = self.guard.encode(text[low:], self._tokenize, add_special=False)
        start = len(tokens) - len(final)
        if start < 0 or tokens[start:] != final:
            return None
        return PromptTail(start, len(tokens))

    def _checked_ids(self, ids: Sequence[int]) -> list[int]:
        n_vocab = self.info.n_vocab
        if n_vocab and max(ids) >= n_vocab:
            raise InvalidRequestError(f"`prompt` holds token {max(ids)}; this model's "
                                      f"vocabulary has {n_vocab}.", param="prompt")
        return list(ids)

    def _infill(self, prefix: str, suffix: str) -> list[int]:
        """Fill in the middle, prefix-suffix-middle as llama-server's /infill lays it out:
        ``[BOS] <FIM_PRE> prefix <FIM_SUF> suffix <FIM_MID>``; client text stays text."""
        fim = self.info.fim_tokens
        if fim is None:
            raise InvalidRequestError("`suffix` needs fill-in-the-middle tokens, which this "
                                      "model's vocabulary does not have.", param="suffix")
        pre, suf, mid = fim
        with self._in_use():
            head = self._tokenize("", add_special=True, parse_special=False) \
                if self.info.add_bos else []
            return [*head, pre, *self._tokenize(prefix, False, False),
                    suf, *self._tokenize(suffix, False, False), mid]

    def check_params(self, params: GenerationParams) -> None:
        """Refuse what only the checkpoint can judge: token ids past its vocabulary."""
        n_vocab = self.info.n_vocab
        for token, _ in params.logit_bias:
            if n_vocab and token >= n_vocab:
                raise InvalidRequestError(f"`logit_bias` names token {token}; this model's "
                                          f"vocabulary has {n_vocab}.", param="logit_bias")

    def adds_bos(self, prompt: str) -> bool:
        info = self.info
        return info.add_bos and not (info.bos_token and prompt.startswith(info.bos_token))

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a prompt built with ``guard`` (client text stays text).

        Runs on the caller's thread, never the engine's: a 10 MB prompt stalls no stream.
        """
        with self._in_use():
            return self.guard.encode(prompt, self._tokenize, add_special=self.adds_bos(prompt))

    def _tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return self.loaded.tokenize(text, add_special=add_special, parse_special=parse_special)

    @contextlib.contextmanager
    def _in_use(self) -> Iterator[None]:
        with self._users_changed:
            if self._closing:
                raise EngineStoppedError("The model is being unloaded.")
            self._users += 1
        try:
            yield
        finally:
            with self._users_changed:
                self._users -= 1
                self._users_changed.notify_all()

    # ---- generation --------------------------------------------------------------

    def generate(self, messages_or_prompt: str | Sequence[dict[str, Any]], **options: Any
                 ) -> GenerationResult:
        """Generate a whole answer. Options: max_tokens, temperature, top_p, seed, stop, tools,
        ignore_eos, min_tokens, and chat=True to treat a string as a user message."""
        parts: list[str] = []
        reasoning: list[str] = []
        calls: list[ToolCall] = []
        chunk = StreamChunk()
        for chunk in self._stream(messages_or_prompt, options, calls):
            parts.append(chunk.text)
            reasoning.append(chunk.reasoning)
        return GenerationResult(
            text="".join(parts), finish_reason=chunk.finish_reason or "stop", usage=chunk.usage,
            reasoning="".join(reasoning) or None, tool_calls=tuple(calls),
        )

    def generate_stream(self, messages_or_prompt: str | Sequence[dict[str, Any]],
                        **options: Any) -> Iterator[StreamChunk]:
        """Yield :class:`StreamChunk` objects as text arrives; the last has the finish reason."""
        return self._stream(messages_or_prompt, options, [])

    def _prompt(self, messages_or_prompt, options: dict[str, Any],
                params: GenerationParams) -> Prepared:
        """The prompt's tokens and how to read the answer: raw completion or chat."""
        if isinstance(messages_or_prompt, str) and not options.get("chat", False):
            return self.prepare(ChatRequest(messages=[], params=params,
                                            raw_prompt=messages_or_prompt))
        messages = ([{"role": "user", "content": messages_or_prompt}]
                    if isinstance(messages_or_prompt, str) else messages_or_prompt)
        chat = ChatRequest(messages=parse_messages(list(messages)), params=params,
                           tools=parse_tools(options.get("tools")))
        return self.prepare(chat)

    def _stream(self, messages_or_prompt, options: dict[str, Any],
                calls: list[ToolCall]) -> Iterator[StreamChunk]:
        unknown = set(options) - GENERATE_OPTIONS
        if unknown:  # an option the library would not honour is an error, not a no-op
            raise TypeError(f"generate() got unknown options {sorted(unknown)}")
        # The parameter builder HTTP uses: the same defaults and the same range checks.
        bias = options.get("logit_bias")
        body = dict(options, logit_bias={str(t): b for t, b in bias.items()}) \
            if isinstance(bias, dict) else options
        params = generation_params(body, max_tokens_keys=("max_tokens",), stop_key="stop")
        self.check_params(params)
        prepared = self._prompt(messages_or_prompt, options, params)
        answer = Answer(prepared.reader)
        channel = SyncChannel()
        request = Request(prepared.tokens, params, channel, prepared.constraint,
                          tail=prepared.tail)
        engine = self.engine
        engine.submit(request)
        try:
            yield from _chunks(answer.start())
            while not answer.done:
                yield from _chunks(answer.on(channel.get()))
            calls.extend(answer.tool_calls)
            yield StreamChunk(finish_reason=answer.finish_reason, usage=answer.usage)
        finally:
            if not answer.done:
                engine.cancel(request)

    # ---- lifetime ----------------------------------------------------------------

    def close(self, error: ButterError | None = None) -> None:
        """Stop the engine (ending its requests with ``error``) and free the checkpoint now."""
        with self._users_changed:
            self._closing = True
            self._users_changed.wait_for(lambda: self._users == 0)
        with self._lock:
            if self._engine is not None:
                self._engine.stop(error)
                self._engine = None
            if self.loaded is not None:
                self.loaded.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _chunks(deltas) -> Iterator[StreamChunk]:
    for delta in deltas:
        if isinstance(delta, ContentDelta) and delta.text:
            yield StreamChunk(text=delta.text)
        elif isinstance(delta, ReasoningDelta) and delta.text:
            yield StreamChunk(reasoning=delta.text)


@attrs.frozen
class CheckedModel:
    """A resolved checkpoint its back end's pre-check passed: ready to load."""

    resolved: ResolvedModel
    backend: Backend
    facts: CheckpointFacts

    @property
    def model_id(self) -> str:
        """The served id: a path's stem, never the path (``ResolvedModel.served_id``)."""
        return self.resolved.served_id


class ModelLoader:
    """Finds, checks and loads model ids: ``butter serve``'s loader, and swaps'.

    What a request may name (``find``): ids butter knows by name (aliases, hub ids in
    the local cache, ids a resolver plugin knows) and files and folders under
    ``models_dirs``; with ``allow_any_path``, any path. ``trusted=True`` (the operator's
    own ``--model``) allows any path too. Anything else is
    :class:`ModelNotFoundError`, whether it exists or not, so an id reveals nothing
    about the disk.

    ``find`` never downloads. ``download_target`` says which hub id to fetch first
    (``butter.hub``): one not cached yet, named by the operator (``trusted``) or, with
    ``allow_downloads``, by a request.
    """

    def __init__(self, *, backend: str | None = None, threads: int | None = None,
                 models_dirs: Sequence[str | Path] = (), allow_any_path: bool = False,
                 allow_downloads: bool = False, plugins: Plugins | None = None,
                 factory: Callable[[str], Model] | None = None) -> None:
        self.factory = factory  # a loader callable (``lambda id: Model.load(id)``), if any
        self.backend = backend
        self.threads = threads
        self.models_dirs = tuple(Path(d).expanduser().resolve() for d in models_dirs)
        self.allow_any_path = allow_any_path
        self.allow_downloads = allow_downloads
        self.plugins = plugins or default_plugins()

    def find(self, model_id: str, *, trusted: bool = False) -> ResolvedModel:
        """Resolve an id a client may name; raise :class:`ModelNotFoundError` otherwise."""
        free = trusted or self.allow_any_path
        if not free:
            for directory in self.models_dirs:
                candidate = _inside(directory, model_id)
                if candidate is not None:
                    found = self.plugins.resolve(str(candidate))
                    # A name under --models-dir is a name: it is served as given.
                    return attrs.evolve(found, model_id=model_id, named_path=False)
        resolved = self.plugins.resolve(model_id)
        if resolved.named_path and not free and not self._in_models_dir(resolved.path):
            raise ModelNotFoundError(model_id)
        return resolved

    def download_target(self, model_id: str, *, trusted: bool = False) -> HubId | None:
        """The hub id to download before ``find`` can answer ``model_id``, if any.

        ``None`` when it resolves already (a snapshot with weights), when it cannot be a
        hub id, or when this caller may not download (a request without
        ``allow_downloads``). Touches only the disk.
        """
        if not (trusted or self.allow_downloads):
            return None
        hub_id = parse_hub_id(model_id)
        if hub_id is None:
            return None
        try:
            resolved = self.find(model_id, trusted=trusted)
        except ModelNotFoundError:
            return hub_id
        # A snapshot without weights is one a cut-off download left: fetch the rest.
        return hub_id if resolved.format == "empty" and not resolved.named_path else None

    def _in_models_dir(self, path: Path) -> bool:
        try:
            real = path.resolve()
        except (OSError, RuntimeError):
            return False
        return any(real.is_relative_to(directory) for directory in self.models_dirs)

    def check(self, resolved: ResolvedModel) -> CheckedModel:
        """Refuse what can never load, before a resident model is touched."""
        if resolved.format == "empty":
            raise ModelLoadError(resolved.model_id, "it holds no model weights (no .gguf "
                                 "file, no config.json with .safetensors)")
        backend = self.plugins.backend_for(resolved, self.backend)
        return CheckedModel(resolved=resolved, backend=backend,
                            facts=backend.precheck(resolved))

    def load(self, checked: CheckedModel) -> Model:
        if self.factory is not None:
            return self.factory(checked.model_id)
        loaded = checked.backend.load(checked.resolved, threads=self.threads)
        return Model(loaded, model_id=checked.model_id, resolved=checked.resolved,
                     backend=checked.backend, plugins=self.plugins)


def _inside(directory: Path, name: str) -> Path | None:
    """``directory / name`` if ``name`` is a plain relative name that exists there."""
    if not name or "\0" in name or name.startswith(("/", "~", "\\")):
        return None
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts:
        return None
    candidate = directory / relative
    try:
        return candidate if candidate.exists() else None
    except OSError:
        return None
