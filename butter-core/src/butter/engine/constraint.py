"""Constrained decoding with llguidance: a grammar turned into a token mask per step.

llguidance is the grammar engine llama.cpp and vLLM embed: it compiles JSON Schema,
Lark grammars and regexes against a tokenizer and computes each step's allowed-token
bitmask in tens of microseconds, with no schema-to-grammar converter of our own.

:class:`Grammars` holds one loaded model's llguidance tokenizer (built once, on first
use, off the engine thread) and compiles a :class:`GrammarSpec` into a
:class:`Constraint`: one request's matcher. The engine thread then asks the constraint
for a mask before each draw of that request (it rides in the fused batch as
``Work.mask``) and feeds it every drawn token.

A *lazy* constraint (``tool_choice: auto``) leaves the model free until its text holds
a trigger (the tool-call open tag); from there, the trigger's own text included, the
call is constrained, as llama.cpp's lazy grammars do, and once the call closes the model
is free again. A trigger can wait for another text first (``armed_by``): a call opened
inside a think block is thinking, so under a template that opened one the trigger counts
only after ``</think>``.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import attrs
import llguidance
import numpy as np

from butter.errors import InvalidRequestError

if TYPE_CHECKING:
    from butter.backend import LoadedModel

# Compact JSON, as json.dumps writes it: free whitespace lets a small model pad forever.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@attrs.frozen
class GrammarSpec:
    """What a request constrains: an llguidance grammar (JSON), from the start or lazily
    from the first of the ``triggers`` in the model's text (the grammar starts with it)."""

    grammar: str
    triggers: tuple[str, ...] = ()
    armed_by: str | None = None  # the trigger counts only after this text
    what: str = "response_format"  # the field a compile error names


def json_schema_grammar(schema: dict) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_STYLE)


class _Vocabulary:
    """A loaded model's vocabulary as llguidance's tokenizer wrapper wants it."""

    def __init__(self, model: LoadedModel) -> None:
        n_vocab = model.info.n_vocab
        self.tokens = [model.token_piece(token) for token in range(n_vocab)]
        ends = [token for token in range(n_vocab) if model.is_end_of_generation(token)]
        self.eos_token_id = ends[0] if ends else n_vocab - 1
        self.end_tokens = ends or [self.eos_token_id]
        self.bos_token_id = None
        self.special_token_ids = []
        self._model = model

    def __call__(self, text: str) -> list[int]:
        return self._model.tokenize(text, add_special=False, parse_special=False)


class Grammars:
    """llguidance for one loaded model."""

    def __init__(self, model: LoadedModel) -> None:
        self._model = model
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                vocabulary = _Vocabulary(self._model)
                self._tokenizer = llguidance.LLTokenizer(
                    llguidance.TokenizerWrapper(vocabulary), n_vocab=len(vocabulary.tokens),
                    eos_token=vocabulary.end_tokens)
            return self._tokenizer

    def compile(self, spec: GrammarSpec) -> Constraint:
        """The request's constraint; a grammar llguidance refuses is a 400 naming why."""
        tokenizer = self.tokenizer()
        matcher = llguidance.LLMatcher(tokenizer, spec.grammar, log_level=0)
        if matcher.is_error():
            reason = matcher.get_error().strip().splitlines()[0][:300]
            raise InvalidRequestError(f"`{spec.what}` cannot be enforced: {reason}",
                                      param=spec.what)
        return Constraint(matcher, tokenizer, triggers=spec.triggers, armed_by=spec.armed_by)


class Constraint:
    """One request's matcher; after construction only the engine thread touches it."""

    def __init__(self, matcher: llguidance.LLMatcher, tokenizer: llguidance.LLTokenizer, *,
                 triggers: tuple[str, ...] = (), armed_by: str | None = None) -> None:
        self._matcher = matcher
        self._tokenizer = tokenizer
        self._triggers = triggers
        self._armed_by = armed_by  # None once it has been seen
        self.active = not triggers
        self._seen = ""  # free text since the last call, while waiting for the trigger
        self._mask = np.zeros((tokenizer.vocab_size + 31) // 32, dtype=np.int32)
        self.failed = False

    def mask(self) -> np.ndarray | None:
        """The tokens the next draw may pick, or None while the model is free."""
        if not self.active:
            return None
        matcher = self._matcher
        matcher.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        if matcher.is_error() or not self._mask.any():
            self._give_up()
            return None
        return self._mask

    def advance(self, token: int, text: str) -> None:
        """Take the drawn ``token`` (whose text, once decoded, is ``text``)."""
        if self.active:
            if not self._matcher.consume_token(token):
                self._give_up()
            elif self._triggers and self._matcher.is_stopped():
                self._matcher.reset()  # the call closed: the model is free again
                self.active = False
            return
        if not self._triggers or self.failed:
            return
        self._seen = (self._seen + text)[-4096:]
        if self._armed_by is not None:
            at = self._seen.find(self._armed_by)
            if at < 0:
                return
            self._seen = self._seen[at + len(self._armed_by):]
            self._armed_by = None
        found = [at for trigger in self._triggers if (at := self._seen.find(trigger)) >= 0]
        if not found:
            return
        call = self._seen[min(found):]
        self._seen = ""
        tokens = self._tokenizer.tokenize_str(call)
        if self._matcher.consume_tokens(tokens):
            self.active = True
        else:
            self._matcher.reset()

    def _give_up(self) -> None:
        """The grammar has nowhere to go (it should not happen): let the model be."""
        self.active = False
        self.failed = True
