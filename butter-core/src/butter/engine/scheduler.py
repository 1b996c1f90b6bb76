"""The engine thread: admission, sessions, fused batches, cancellation.

One thread owns the runtime (the back end's native context). Other threads talk to
it only through :meth:`Engine.submit`, :meth:`Engine.cancel` and
:meth:`Engine.stop`; it answers through each request's channel. Prompts arrive as
token ids: rendering and tokenizing run on the requesting threads.

Each loop iteration is one bounded work unit: it drops cancelled requests, admits
waiting ones in FIFO order, then runs one model pass of what the planner
(``engine/planner.py``) chose: the next token of every decoding session and prefill
chunks of sessions still reading their prompts.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import random
import threading
import time

import attrs

from butter.backend import (
    ForkKind,
    KVSpec,
    LoadedModel,
    Runtime,
    SamplingParams,
    StepFailedError,
    TokenLogprob,
    TruncateKind,
    Work,
)
from butter.engine.admission import Admission
from butter.engine.events import Admitted, Failed, Finished, Outbox, TextDelta
from butter.engine.metrics import Gauges, Metrics
from butter.engine.planner import PREFILL_CHUNK, Planner
from butter.engine.promptcache import DEFAULT_MIB, MIB, MIN_GAIN, PromptCache, Saved
from butter.engine.records import Phase, Request, Session
from butter.engine.speculation import Drafter
from butter.engine.text import StopMatcher
from butter.errors import ButterError, EngineStoppedError, InternalError, InvalidRequestError
from butter.generation import Logprob, TokenChoice, Usage

log = logging.getLogger("butter.engine")



@attrs.frozen
class EngineConfig:
    parallel: int = 1
    capacity: int = 8192  # KV cells shared by every session
    # 0: parallel + 2. Idle sessions keep their KV for prefix reuse, but every cell held
    # widens the unified cache each pass attends over, so only a couple are kept.
    n_sessions: int = 0
    max_batch: int = 512  # tokens one step may feed across sessions
    prefill_chunk: int = PREFILL_CHUNK  # prefill chunks end at multiples of it
    kv: KVSpec = KVSpec()
    # ``ngram``: requests draft from their own context (prompt lookup) where the runtime
    # verifies exactly; ``mtp``: from the checkpoint's own multi-token-prediction head
    # (``ModelInfo.draft_head``); ``none``: never (``--speculation``).
    speculation: str = "ngram"
    # Host memory for session caches another prompt displaced (``--cache-ram``, MiB;
    # 0: none), where the runtime saves them (``KVFacts.saves``).
    prompt_cache_bytes: int = DEFAULT_MIB * MIB
    # The back end's own settings (``Backend.options``), checked, passed through.
    options: dict = attrs.field(factory=dict)

    @property
    def sessions(self) -> int:
        return self.n_sessions or self.parallel + 2


@attrs.frozen
class _Submit:
    request: Request


@attrs.frozen
class _Stop:
    error: ButterError


_WAKE = object()


class Engine:
    """Runs every request of one loaded model on one thread."""

    def __init__(self, model: LoadedModel, config: EngineConfig, *, name: str = "engine") -> None:
        if config.speculation == "mtp" and not model.info.draft_head:
            raise InvalidRequestError("Speculation 'mtp' drafts with the checkpoint's own "
                                      "multi-token-prediction head; this model has none "
                                      "that its back end runs.")
        self.model = model
        self.config = config
        self.metrics = Metrics()
        self.fused = model.info.fusable
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox = Outbox()  # engine thread only
        self._waiting: collections.deque[Request] = collections.deque()
        self._active: list[Request] = []
        self._sessions: list[Session] = []
        self._runtime: Runtime | None = None
        self._admission: Admission | None = None
        self._planner: Planner | None = None
        self._prompt_cache: PromptCache | None = None
        self._pass_seconds = 0.0  # this step's time inside the runtime (engine thread)
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        # Set when the thread ended without being asked to: the server must not live on.
        self.died = False
        self._thread = threading.Thread(target=self._run, name=f"butter-{name}", daemon=True)

    # ---- called from other threads -------------------------------------------------

    def start(self) -> None:
        """Create the runtime on the engine thread; raise its error if that fails."""
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            raise self._start_error

    @property
    def capacity(self) -> int:
        return self._admission.capacity if self._admission else self.config.capacity

    @property
    def runtime_facts(self) -> dict[str, object]:
        """What the back end settled (micro-batch rows...), for the model card."""
        if self._runtime is None:
            return {}
        cache = self._prompt_cache
        return {**self._runtime.describe(),
                "prompt_cache_mib": cache.budget // MIB if cache is not None else 0}

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs (False before start and after stop or death)."""
        return self._thread.is_alive()

    def submit(self, request: Request) -> None:
        if not self._thread.is_alive():
            request.channel.emit(Failed(EngineStoppedError("The engine is not running.")))
            return
        self._inbox.put(_Submit(request))

    def cancel(self, request: Request) -> None:
        request.cancelled = True
        self._inbox.put(_WAKE)

    def stop(self, error: ButterError | None = None, *, timeout: float = 30.0) -> None:
        """End every request with ``error``, free the runtime and join the thread."""
        if not self._thread.is_alive():
            return
        self._inbox.put(_Stop(error or EngineStoppedError("The server is shutting down.")))
        self._thread.join(timeout)

    # ---- the engine thread ----------------------------------------------------------

    def _run(self) -> None:
        try:
            self._runtime = self.model.create_runtime(
                kv=self.config.kv,
                capacity=self.config.capacity,
                n_sessions=self.config.sessions,
                # Room for a whole prefill chunk next to every decoding row.
                max_batch=max(self.config.max_batch,
                              self.config.prefill_chunk + self.config.sessions),
                options=self.config.options,
            )
            self._sessions = [Session(seq_id=i) for i in range(self._runtime.n_sessions)]
            self._admission = Admission(self._runtime.kv, self.config.parallel,
                                        self._runtime.reachable)
            self._planner = Planner(max_batch=self._runtime.max_batch,
                                    prefill_chunk=self.config.prefill_chunk, mask=self._mask,
                                    draft=self._draft)
            if self._runtime.kv.saves and self.config.prompt_cache_bytes > 0:
                self._prompt_cache = PromptCache(self.config.prompt_cache_bytes)
            elif self.config.prompt_cache_bytes > 0:
                log.info("no prompt cache in host memory: this model's cache cannot be "
                         "saved and loaded back (a KV window, a shared KV layout, or "
                         "an MTP draft head on MLX)")
            self.metrics.sessions_total = len(self._sessions)
            self.metrics.kv_capacity_cells = self._admission.capacity
            self.metrics.kv_budget_bytes = self._runtime.kv.budget_bytes
            self.metrics.kv_token_bytes = self._runtime.kv.token_bytes
            self.metrics.engine_alive = 1
        except BaseException as exc:  # surfaced by start()
            self._start_error = exc
            self._ready.set()
            return
        self._ready.set()
        stop: _Stop | None = None
        try:
            while stop is None:
                # Sleep only when there is nothing to run and nobody to admit.
                stop = self._drain_inbox(block=not self._active and not self._waiting)
                if stop is not None:
                    break
                started = time.perf_counter()
                decoded = False
                try:
                    self._reap_cancelled()
                    self._admit()
                    if self._active:
                        decoded = self._step()
                except Exception:  # a bug must not take the engine down with it
                    log.exception("engine step failed; failing the active requests")
                    self._fail(list(self._active))
                self._update_gauges()
                self._outbox.flush()
                if decoded:
                    self.metrics.decode_step_seconds += time.perf_counter() - started
        except BaseException:  # nothing may end this loop but a stop: this is a death
            log.critical("the engine thread died", exc_info=True)
        finally:
            self.metrics.engine_alive = 0
            self.died = stop is None
            self._shutdown(stop.error if stop else InternalError())
            self._outbox.flush()

    def _drain_inbox(self, *, block: bool) -> _Stop | None:
        try:
            message = self._inbox.get() if block else self._inbox.get_nowait()
        except queue.Empty:
            return None
        while True:
            if isinstance(message, _Stop):
                return message
            self._handle(message)
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return None

    def _handle(self, message: object) -> None:
        if isinstance(message, _Submit):
            self._accept(message.request)

    def _accept(self, request: Request) -> None:
        # The prompt arrives tokenized: per-request text work never runs on this thread.
        try:
            request.prompt_tokens = list(request.prompt)
            if not request.prompt_tokens:
                raise InvalidRequestError("The prompt is empty.", param="messages")
            request.max_tokens = self._admission.plan(request)
        except Exception as exc:  # one request's problem is never the engine's
            error = exc if isinstance(exc, ButterError) else InternalError()
            if not isinstance(exc, ButterError):
                log.exception("accepting a request failed")
            self.metrics.requests_rejected += 1
            request.phase = Phase.DONE
            self._outbox.put(request.channel, Failed(error))
            return
        request.reservation = len(request.prompt_tokens) + request.max_tokens
        self.metrics.requests_total += 1
        self.metrics.prompt_tokens += len(request.prompt_tokens)
        self._outbox.put(request.channel, Admitted(prompt_tokens=len(request.prompt_tokens)))
        self._waiting.append(request)

    def _reap_cancelled(self) -> None:
        if any(r.cancelled for r in self._waiting):
            for request in [r for r in self._waiting if r.cancelled]:
                self._waiting.remove(request)
                self.metrics.cancellations["queued"] += 1
                request.phase = Phase.DONE
                self._outbox.put(request.channel, Finished("cancelled", self._usage(request)))
        for request in [r for r in self._active if r.cancelled]:
            self.metrics.cancellations[request.phase.value] += 1
            self._finish(request, "cancelled")

    def _admit(self) -> None:
        admission = self._admission
        while self._waiting and len(self._active) < self.config.parallel:
            request = self._waiting[0]
            if self._twin_prefilling(request):
                return  # n choices: the rest fork the first's prompt once it is read
            idle = [s for s in self._sessions if s.idle]
            session, reuse = admission.pick_session(idle, request.prompt_tokens, request.tail)
            evict = admission.make_room(request, session, self._active, idle)
            if evict is None:
                if not self._active:  # cannot happen after plan(); never spin on it
                    self._waiting.popleft()
                    error = InternalError("No session could hold it.")
                    self._outbox.put(request.channel, Failed(error))
                    continue
                return  # the head waits for capacity; FIFO keeps everyone behind it
            for victim in evict:
                self._save(victim, keep=0)
                self._runtime.truncate(victim.seq_id, 0)
                victim.tokens.clear()
            self._waiting.popleft()
            try:
                self._install(request, session, reuse)
            except Exception:  # a native call failed: this request fails, not the engine
                log.exception("installing a request failed")
                self._fail([request])

    def _install(self, request: Request, session: Session, reuse: int) -> None:
        session.request = request  # leased first: _fail can release it from here on
        request.session = session
        self.metrics.latency.request_queue_time.observe(time.monotonic() - request.submitted_at)
        if len(session.tokens) > reuse:
            self._save(session, keep=reuse)
            if not self._runtime.truncate(session.seq_id, reuse):
                self._runtime.truncate(session.seq_id, 0)
                reuse = 0
            del session.tokens[reuse:]
        reuse = self._take_prefix(request, session, reuse)
        request.cached_tokens = reuse
        request.next_prefill = reuse
        request.phase = Phase.PREFILL
        params = request.params
        seed = params.seed if params.seed is not None else random.getrandbits(31)
        request.sampling = SamplingParams(
            temperature=params.temperature, top_p=params.top_p, seed=seed, top_k=params.top_k,
            frequency_penalty=params.frequency_penalty,
            presence_penalty=params.presence_penalty,
            repetition_penalty=params.repetition_penalty, logit_bias=params.logit_bias,
            min_p=params.min_p, logprobs=params.logprobs)
        request.sampler = self._runtime.new_sampler(request.sampling)
        request.stops = StopMatcher(params.stop)
        if self._speculates(request):
            request.drafter = Drafter(max_draft=self._runtime.max_draft)
            request.drafter.extend(request.prompt_tokens)
        self.metrics.cached_tokens += reuse
        self._active.append(request)

    def _twin_prefilling(self, request: Request) -> bool:
        """Whether a running request is still reading this very prompt (another choice of
        the same completion): waiting for it turns this prefill into a fork."""
        if self._runtime.kv.fork is ForkKind.NONE:
            return False
        return any(other.phase is Phase.PREFILL and other.prompt_tokens == request.prompt_tokens
                   for other in self._active)

    def _take_prefix(self, request: Request, session: Session, reuse: int) -> int:
        """Take a longer cached prefix of the prompt than the ``reuse`` tokens ``session``
        holds: another session's, busy or idle (a fork), or a saved one (a load), whichever
        holds more; the new reuse.

        Concurrent requests with one system prompt then prefill it once, and a
        conversation that lost its session reads only its new turn. How much a fork
        costs is the runtime's business (GGUF aliases cells; MLX copies them); a load
        must gain ``MIN_GAIN`` tokens over the better of the other two, and only one of
        them is made (a fork's copy may land after a load, over it). A fork that fails
        leaves the leased session with what it had; a load that fails empties it.
        """
        others = [s for s in self._sessions if s is not session and s.tokens] \
            if self._runtime.kv.fork is not ForkKind.NONE else []
        tail = request.tail
        source, forked = self._admission.best_source(others, request.prompt_tokens,
                                                     better_than=reuse, tail=tail)
        cache = self._prompt_cache
        if cache is not None:
            entry, shared = cache.best(
                request.prompt_tokens, better_than=max(reuse, forked) + MIN_GAIN,
                reach=lambda data, keep: self._runtime.restorable(data, keep, tail))
            if entry is not None:
                return self._load(session, entry, shared)
        if source is None or not self._runtime.fork(source.seq_id, session.seq_id, forked):
            return reuse
        session.tokens[:] = source.tokens[:forked]
        return forked

    def _save(self, session: Session, *, keep: int) -> None:
        """Copy ``session``'s cache to the prompt cache before it drops all but ``keep``
        tokens, when that is most of it and no saved entry holds it already."""
        cache, tokens = self._prompt_cache, session.tokens
        if cache is None or keep * 2 >= len(tokens) or cache.covers(tokens):
            return
        data = self._runtime.save(session.seq_id, len(tokens))
        if data is not None:
            cache.keep(tokens, data, self._runtime.kv.cost(len(tokens)))
            self.metrics.prompt_cache_saves += 1

    def _load(self, session: Session, entry: Saved, shared: int) -> int:
        """Load a saved cache into ``session``, cut to the ``shared`` tokens the prompt
        starts with; the new reuse (0 if the runtime could not)."""
        seq_id = session.seq_id
        if not (self._runtime.restore(seq_id, entry.data, len(entry.tokens))
                and self._runtime.truncate(seq_id, shared)):
            self._runtime.truncate(seq_id, 0)
            session.tokens.clear()
            return 0
        session.tokens[:] = entry.tokens[:shared]
        self.metrics.prompt_cache_hits += 1
        self.metrics.prompt_cache_tokens += shared
        return shared

    def _speculates(self, request: Request) -> bool:
        """Whether ``request`` drafts: the server and the request allow it, the runtime
        verifies drafts and can drop rejected positions, and each draw depends on nothing
        a draft would have to guess (a grammar's state; logprobs are per draw)."""
        kv = self._runtime.kv
        if not request.params.speculation or kv.window is not None \
                or request.constraint is not None or request.params.logprobs is not None:
            return False
        if self.config.speculation == "mtp":  # the runtime rolls its own state back
            return self.model.info.draft_head
        return self.config.speculation == "ngram" and self._runtime.max_draft > 0 \
            and kv.truncate is TruncateKind.ANYWHERE

    def _draft(self, request: Request, limit: int) -> tuple[int, ...]:
        """The tokens ``request`` drafts after its last one (at most ``limit``): never more
        than its answer may still take, nor than the runtime verifies exactly there."""
        drafter = request.drafter
        if drafter is None:
            return ()
        # Plain decoding feeds at most max_tokens - 1 answer tokens: so do verifies.
        limit = min(limit, request.max_tokens - len(request.generated) - 1)
        if self.config.speculation == "mtp":
            if drafter.paused or limit <= 0:
                return ()
            draft = self._runtime.propose(request.session.seq_id, request.last_token)[:limit]
            return draft[:self._runtime.draft_room(request.session.seq_id, len(draft))]
        # The drafter weighs the draft it can send: the room the runtime verifies in too.
        limit = self._runtime.draft_room(request.session.seq_id, max(limit, 0))
        lanes = sum(1 for r in self._active if r.phase is Phase.DECODE)
        return drafter.propose(limit, lanes)

    # ---- one model pass ------------------------------------------------------------

    @staticmethod
    def _mask(request: Request):
        """The tokens ``request``'s grammar allows next (None: any): it stays in the batch."""
        return request.constraint.mask() if request.constraint is not None else None

    def _step(self) -> bool:
        """Run the next step's plan; whether it decoded (a decoding request's row in it)."""
        plan = [(planned.request, planned.work) for planned in self._planner.tick(self._active)]
        if not plan:
            return False
        decoding = any(request.phase is Phase.DECODE for request, _ in plan)
        # While it runs, /metrics tells a step that takes long (a CPU other processes
        # crowd) from requests nobody works on: the gauges are the last iteration's.
        self.metrics.step_started = time.monotonic()
        self._pass_seconds = 0.0
        try:
            if self.fused:
                self._run_work(plan)
            else:  # independent bounded sessions: one model pass each
                for item in plan:
                    self._run_work([item])
        finally:
            self.metrics.step_started = None
        if decoding:
            self.metrics.decode_steps += 1
            self.metrics.decode_pass_seconds += self._pass_seconds
        return decoding

    def _run_work(self, plan: list[tuple[Request, Work]]) -> None:
        """One step of ``plan``; a failing step is retried in halves, as llama-server
        does, so only the request that cannot run fails."""
        self.metrics.model_passes += 1
        started = time.perf_counter()
        try:
            tokens = self._runtime.step([work for _, work in plan])
        except StepFailedError as exc:
            self._pass_seconds += time.perf_counter() - started
            if len(plan) == 1:
                log.error("model pass failed: %s", exc)
                self._fail([plan[0][0]])
                return
            log.warning("model pass of %d sessions failed (%s); retrying in halves",
                        len(plan), exc)
            half = len(plan) // 2
            self._run_work(plan[:half])
            self._run_work(plan[half:])
            return
        self._pass_seconds += time.perf_counter() - started
        for (request, work), token in zip(plan, tokens):
            if work.draft:
                self._verified(request, work, token)
                continue
            request.session.tokens.extend(work.tokens)
            if request.phase is Phase.PREFILL:
                request.next_prefill += len(work.tokens)
                self.metrics.prefill_chunks += 1
                self.metrics.prefill_tokens += len(work.tokens)
            if token is not None:
                last = request.sampler.last
                if last is not None and request.params.logprobs is not None:
                    request.logprobs.append(self._logprob(last))
                self._on_token(request, token)

    def _verified(self, request: Request, work: Work, draws: tuple[int, ...]) -> None:
        """Take a verify's draws: the accepted drafts, then the draw that ended them. The
        runtime kept the last token and the accepted drafts in the cache."""
        accepted = len(draws) - 1
        request.session.tokens.extend(work.tokens[:1 + accepted])
        request.drafter.verified(len(work.draft), accepted)
        rejected = len(work.draft) - accepted
        request.rejected_tokens += rejected
        metrics = self.metrics
        metrics.draft_verifies += 1
        metrics.draft_tokens += len(work.draft)
        metrics.draft_accepted_tokens += accepted
        for index, token in enumerate(draws):
            if request.phase is Phase.DONE:  # it ended (stop, length): the rest is no answer
                break
            if index < accepted:
                request.accepted_tokens += 1
            self._on_token(request, token)

    def _fail(self, requests: list[Request]) -> None:
        """End ``requests`` with an internal error and drop their (now unknown) KV."""
        for request in requests:
            with contextlib.suppress(Exception):
                self._runtime.truncate(request.session.seq_id, 0)
            request.session.tokens.clear()
            self.metrics.requests_failed += 1
            self._release(request)
            self._outbox.put(request.channel, Failed(InternalError()))

    def _on_token(self, request: Request, token: int) -> None:
        now = time.monotonic()
        latency = self.metrics.latency
        if request.generated:
            latency.time_per_output_token.observe(now - request.last_token_at)
        else:
            latency.time_to_first_token.observe(now - request.submitted_at)
        request.last_token_at = now
        request.generated.append(token)
        request.last_token = token
        if request.drafter is not None:
            request.drafter.extend([token])
        request.phase = Phase.DECODE
        self.metrics.generated_tokens += 1
        params = request.params
        count = len(request.generated)
        if self.model.is_end_of_generation(token) and not params.ignore_eos:
            if count > params.min_tokens:
                request.logprobs.clear()  # the end token is no text: OpenAI lists none
                self._finish(request, "stop")
                return
        piece = self.model.token_piece(token)
        if request.constraint is not None:
            request.constraint.advance(token, piece.decode("utf-8", errors="replace"))
        text = request.detokenizer.feed(piece)
        if text:
            safe, hit = request.stops.feed(text)
            if safe:
                self._emit_text(request, safe)
            if hit:
                self._finish(request, "stop", flush=False, stop_sequence=request.stops.matched)
                return
        if count >= request.max_tokens:
            self._finish(request, "length")

    def _finish(self, request: Request, reason: str, *, flush: bool = True,
                stop_sequence: str | None = None) -> None:
        if flush and reason != "cancelled":
            tail = request.detokenizer.flush()
            safe, _ = request.stops.feed(tail) if tail else ("", False)
            safe += request.stops.flush()
            if safe or request.logprobs:
                self._emit_text(request, safe)
        self._release(request)
        if reason != "cancelled":
            self.metrics.latency.e2e_request_latency.observe(time.monotonic()
                                                             - request.submitted_at)
        self._outbox.put(request.channel, Finished(reason, self._usage(request), stop_sequence))

    def _emit_text(self, request: Request, text: str) -> None:
        logprobs = tuple(request.logprobs)
        request.logprobs.clear()
        self._outbox.put(request.channel, TextDelta(text, logprobs))

    def _logprob(self, drawn: TokenLogprob) -> Logprob:
        return Logprob(self._choice(drawn.token, drawn.logprob),
                       tuple(self._choice(token, logprob) for token, logprob in drawn.top))

    def _choice(self, token: int, logprob: float) -> TokenChoice:
        piece = self.model.token_piece(token)
        return TokenChoice(piece.decode("utf-8", errors="replace"), piece, logprob)

    def _release(self, request: Request) -> None:
        if request.sampler is not None:
            request.sampler.close()
            request.sampler = None
        if request.session is not None:
            request.session.request = None
            request.session.last_used = time.monotonic()
        if request in self._active:
            self._active.remove(request)
        request.phase = Phase.DONE

    @staticmethod
    def _usage(request: Request) -> Usage:
        return Usage(
            prompt_tokens=len(request.prompt_tokens),
            completion_tokens=len(request.generated),
            cached_tokens=request.cached_tokens,
            accepted_prediction_tokens=request.accepted_tokens,
            rejected_prediction_tokens=request.rejected_tokens,
        )

    def _update_gauges(self) -> None:
        # One new record, published by one assignment: a scrape on another thread reads
        # either the last iteration's gauges or these, never some of each.
        bytes_of = self._admission.kv.cost if self._admission is not None else lambda n: 0
        cache = self._prompt_cache
        self.metrics.gauges = Gauges(
            active_requests=len(self._active),
            queued_requests=len(self._waiting),
            sessions_busy=sum(1 for s in self._sessions if not s.idle),
            kv_reserved_cells=sum(r.reservation for r in self._active),
            kv_used_cells=sum(len(s.tokens) for s in self._sessions),
            # bytes as the codec stores them, windows capped
            kv_reserved_bytes=sum(bytes_of(r.reservation) for r in self._active),
            kv_used_bytes=sum(bytes_of(len(s.tokens)) for s in self._sessions),
            prompt_cache_bytes=cache.bytes if cache is not None else 0,
            prompt_cache_entries=len(cache) if cache is not None else 0)

    def _shutdown(self, error: ButterError) -> None:
        for request in list(self._waiting) + list(self._active):
            self._release(request)
            self._outbox.put(request.channel, Failed(error))
        self._waiting.clear()
        self._drain_inbox_on_stop(error)
        for session in self._sessions:
            session.tokens.clear()
        if self._runtime is not None:
            self._runtime.close()
            self._runtime = None
        self._update_gauges()

    def _drain_inbox_on_stop(self, error: ButterError) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, _Submit):
                self._outbox.put(message.request.channel, Failed(error))
