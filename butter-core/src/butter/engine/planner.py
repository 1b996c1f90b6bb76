"""What one engine step feeds: a pure policy over the live requests.

The engine thread calls :meth:`Planner.tick` once per step with the active requests; it
returns the step's work and touches nothing else (no runtime, no clock, no threads), so
the policy is tested step by step (``tests/core/test_planner.py``).

The rules:

- Every decoding request feeds its last token (one row each), and the tokens ``draft``
  proposes after it while the step has room (speculation: the runtime verifies them).
- Prefill chunks end at multiples of ``prefill_chunk`` (absolute positions), whatever else
  runs: a prompt is cut the same way alone or batched, so its cache is computed the same
  way.
- The prompt with the fewest tokens left goes first (ties: the earlier request). Tokens
  leave only when the whole step is done, so a step that ends some prompt (its first
  token) takes no chunk of a longer one: short requests beside a long one wait for their
  own prompts only. Prompts that arrive together so end one after another, as in
  llama-server and vLLM, instead of all near the end (which sharing every step round by
  round gave): eight 1,100-token prompts got their median first token about 10% later
  than llama-server's that way.
- Nothing starves. A prompt that waited ``patience`` steps in a row goes first, before
  shorter ones; when decoding rows fill the step, prefill still advances by at least one
  chunk (cut to half the step at most) and the decoding rows that did not fit go first in
  the next step, so no decoding row waits twice in a row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from butter.backend import Work
from butter.engine.records import Phase, Request

# The default prefill chunk: llama-server's micro-batch. Eight prompts at once then go
# one chunk per step, each prompt's chunks back to back, and a lone prompt in as many
# passes as llama-server's: against 256, the median lane of eight 1,185-token prompts
# got its first token 10% sooner (bench/long_prompt.py, 0.878 against 0.975 of
# llama-server's TTFT). A decoding request beside a prompt being read waits one chunk
# per step: up to twice as long as with 256, a quarter of llama-server's 2,048-token
# batch.
PREFILL_CHUNK = 512


@attrs.frozen
class Planned:
    """One request's part of a step."""

    request: Request
    work: Work


@attrs.define
class Planner:
    """The step policy; its only state is who waited in the previous step."""

    max_batch: int  # tokens one step may feed across sessions (the runtime's)
    prefill_chunk: int  # prefill chunks end at multiples of it
    mask: Callable[[Request], object | None] = lambda request: None
    # Up to ``limit`` drafted tokens to verify after a decoding request's last token.
    draft: Callable[[Request, int], tuple[int, ...]] = lambda request, limit: ()
    # Steps in a row a prompt may wait for shorter ones before it goes first.
    patience: int = 64
    _waited: set[int] = attrs.field(factory=set)  # request ids that waited last step
    _waits: dict[int, int] = attrs.field(factory=dict)  # prompts' waits in a row

    def tick(self, active: Sequence[Request]) -> list[Planned]:
        """The work of the next step for ``active`` (in their order)."""
        decoding = [r for r in active if r.phase is Phase.DECODE]
        prefilling = [r for r in active if r.phase is Phase.PREFILL]
        prefilling.sort(key=lambda r: (self._waits.get(r.id, 0) < self.patience,
                                       len(r.prompt_tokens) - r.next_prefill, r.id))
        size = max(1, min(self.prefill_chunk, self.max_batch))
        # Room kept for one chunk when decoding rows would take the whole step.
        reserve = min(self._chunk(prefilling[0], size), max(1, self.max_batch // 2)) \
            if prefilling and len(decoding) + 1 > self.max_batch else 0
        room = self.max_batch - reserve
        # Decoding rows that waited go first (stable: otherwise in the order they came).
        by_wait = sorted(decoding, key=lambda r: r.id not in self._waited)
        held = {r.id for r in by_wait[room:]}
        # Rows drafts may take: never the room the next prefill chunk needs.
        spare = room - len(decoding) - (self._chunk(prefilling[0], size) if prefilling else 0)
        plan = []
        for r in decoding:
            if r.id in held:
                continue
            draft = self.draft(r, spare) if spare > 0 else ()
            spare -= len(draft)
            plan.append(Planned(r, Work(r.session.seq_id, (r.last_token, *draft), r.sampler,
                                        self.mask(r), draft)))
        waited = set(held)
        budget = self.max_batch - sum(len(p.work.tokens) for p in plan)
        planned = ending = False
        for request in prefilling:
            start = request.next_prefill
            end = start + self._chunk(request, size)
            last = end == len(request.prompt_tokens)
            # A chunk too big for what is left waits, unless none has been planned (a
            # back end whose steps are small takes what fits).
            waits = budget <= 0 or (end - start > budget and planned) \
                or (ending and not last and request.id not in self._waited)
            if waits:
                waited.add(request.id)
                continue
            end = min(end, start + budget)
            last = end == len(request.prompt_tokens)
            budget -= end - start
            planned = True
            ending = ending or last
            plan.append(Planned(request, Work(request.session.seq_id,
                                              request.prompt_tokens[start:end],
                                              request.sampler if last else None,
                                              self.mask(request) if last else None,
                                              prompt_left=len(request.prompt_tokens) - end,
                                              tail=request.tail)))
        self._waited = waited
        self._waits = {r.id: self._waits.get(r.id, 0) + 1 for r in prefilling
                       if r.id in waited}
        return plan

    @staticmethod
    def _chunk(request: Request, size: int) -> int:
        """Tokens from ``request``'s next prefill position to its chunk's end."""
        start = request.next_prefill
        return min((start // size + 1) * size, len(request.prompt_tokens)) - start
