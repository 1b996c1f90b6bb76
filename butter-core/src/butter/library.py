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
from typing import Any, Iterator, Sequence

import attrs

from butter.backend import LoadedModel, ModelInfo
from butter.chat.answer import AnswerReader
from butter.chat.guard import TextGuard
from butter.chat.prompt import PromptPlan, build_prompt
from butter.chat.recovery import ContentDelta, ReasoningDelta, StreamParser, ToolCall
from butter.chat.request import DEFAULT_TEMPERATURE, ChatRequest, parse_messages, parse_tools
from butter.chat.template import ChatTemplate
from butter.engine.events import Failed, Finished, SyncChannel, TextDelta, Usage
from butter.engine.records import GenerationParams, Request
from butter.engine.scheduler import Engine, EngineConfig
from butter.errors import ButterError, EngineStoppedError, ModelLoadError
from butter.plugins import Plugins, build_plugins
from butter.resolve import ResolvedModel


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


class Model:
    """A loaded checkpoint and the engine that runs it."""

    def __init__(self, loaded: LoadedModel, *, model_id: str, resolved: ResolvedModel,
                 backend_name: str, plugins: Plugins) -> None:
        self.loaded = loaded
        self.model_id = model_id
        self.resolved = resolved
        self.backend_name = backend_name
        self.info: ModelInfo = loaded.info
        self.loaded_at = int(time.time())
        self.template = ChatTemplate(self.info.chat_template, bos_token=self.info.bos_token,
                                     eos_token=self.info.eos_token)
        self.tool_formats = tuple(plugins.tool_formats) or None
        self.guard = TextGuard(self.info.control_tokens)
        self._engine: Engine | None = None
        self._lock = threading.Lock()
        # Request threads tokenizing right now; close() waits for them before freeing.
        self._users = 0
        self._closing = False
        self._users_changed = threading.Condition()

    @classmethod
    def load(cls, model_id: str, *, backend: str | None = None, threads: int | None = None,
             plugins: Plugins | None = None) -> "Model":
        """Resolve ``model_id`` (path, alias or cached hub id) and load it."""
        plugins = plugins or default_plugins()
        resolved = check_loadable(model_id, plugins=plugins)
        chosen = plugins.backend_for(resolved, backend)
        loaded = chosen.load(resolved, threads=threads)
        return cls(loaded, model_id=model_id, resolved=resolved, backend_name=chosen.name,
                   plugins=plugins)

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
            self.start_engine(EngineConfig(parallel=1, capacity=min(self.info.n_ctx_train, 8192)))
        return self._engine

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
        """Generate a whole answer. Options: max_tokens, temperature, top_p, seed, stop, tools."""
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

    def _reader(self, messages_or_prompt, options: dict[str, Any],
                params: GenerationParams) -> tuple[str, AnswerReader]:
        """The prompt text and how to read the answer: raw completion or chat."""
        if isinstance(messages_or_prompt, str) and not options.get("chat", False):
            plan = PromptPlan(text=messages_or_prompt, parse_tools=False, think_open=False)
            return plan.text, AnswerReader(StreamParser(parse_think=False), plan)
        messages = ([{"role": "user", "content": messages_or_prompt}]
                    if isinstance(messages_or_prompt, str) else messages_or_prompt)
        chat = ChatRequest(messages=parse_messages(list(messages)), params=params,
                           tools=parse_tools(options.get("tools")))
        plan = build_prompt(chat, self.template, guard=self.guard)
        return plan.text, AnswerReader.for_plan(plan, tools=chat.tools, formats=self.tool_formats)

    def _stream(self, messages_or_prompt, options: dict[str, Any],
                calls: list[ToolCall]) -> Iterator[StreamChunk]:
        stop = options.get("stop") or ()
        params = GenerationParams(
            max_tokens=options.get("max_tokens"),
            temperature=float(options.get("temperature", DEFAULT_TEMPERATURE)),
            top_p=float(options.get("top_p", 1.0)),
            seed=options.get("seed"),
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
        )
        prompt, reader = self._reader(messages_or_prompt, options, params)
        channel = SyncChannel()
        request = Request(self.encode(prompt), params, channel)
        engine = self.engine
        engine.submit(request)
        finished = False
        try:
            yield from _chunks(reader.start())
            while True:
                event = channel.get()
                if isinstance(event, TextDelta):
                    yield from _chunks(reader.feed(event.text))
                elif isinstance(event, Finished):
                    finished = True
                    yield from _chunks(reader.finish())
                    calls.extend(reader.tool_calls)
                    reason = "tool_calls" if reader.tool_calls else event.reason
                    yield StreamChunk(finish_reason=reason, usage=event.usage)
                    return
                elif isinstance(event, Failed):
                    finished = True
                    raise event.error
        finally:
            if not finished:
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

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _chunks(deltas) -> Iterator[StreamChunk]:
    for delta in deltas:
        if isinstance(delta, ContentDelta) and delta.text:
            yield StreamChunk(text=delta.text)
        elif isinstance(delta, ReasoningDelta) and delta.text:
            yield StreamChunk(reasoning=delta.text)


def check_loadable(model_id: str, *, plugins: Plugins | None = None) -> ResolvedModel:
    """Resolve ``model_id`` and refuse what can never load, before touching a resident model."""
    plugins = plugins or default_plugins()
    resolved = plugins.resolve(model_id)
    if resolved.format == "empty":
        raise ModelLoadError(model_id, f"{resolved.path} holds no model weights "
                             "(no .gguf file, no config.json with .safetensors).")
    backend = plugins.backend_for(resolved)
    precheck = getattr(backend, "precheck", None)
    if precheck is not None:
        precheck(resolved)
    return resolved


def load_model(model_id: str, **options: Any) -> Model:
    """The default loader of ``ResidentServeBackend``: ``Model.load`` with a precheck."""
    return Model.load(model_id, **options)


load_model.precheck = check_loadable  # type: ignore[attr-defined]
