"""Log-probabilities on the wire: where each token's entry goes in a stream, and the
legacy ``text_offset`` of each token, whatever way the text was cut into chunks."""

import json

from butter.chat.recovery import ContentDelta
from butter.generation import Logprob, LogprobsDelta, TokenChoice
from butter.wire.openai import ChunkWriter, chat_choice, text_choice


def entry(token: str, logprob: float = -0.5) -> Logprob:
    chosen = TokenChoice(token, token.encode(), logprob)
    return Logprob(chosen, (chosen, TokenChoice("x", b"x", logprob - 1)))


def writer(*, text: bool) -> ChunkWriter:
    return ChunkWriter(completion_id="c", model="m", created=0, text=text)


def test_legacy_offsets_count_the_text_sent_before_each_token():
    out = writer(text=True)
    chunks = [out.delta(LogprobsDelta((entry("Par"), entry("is")))),
              out.delta(ContentDelta("Par")),
              out.delta(ContentDelta("is")),  # no tokens of its own: sent from the template
              out.delta(LogprobsDelta((entry(" is"),))),
              out.delta(ContentDelta(" is")),
              out.delta(LogprobsDelta((entry(" the"),))),
              out.closing("length")]  # a token no text carried goes with the last chunk
    choices = [json.loads(c)["choices"][0] for c in chunks if c is not None]
    assert "".join(c["text"] for c in choices) == "Paris is"
    logprobs = [c["logprobs"] for c in choices]
    assert logprobs[0] == {"tokens": ["Par", "is"], "token_logprobs": [-0.5, -0.5],
                           "top_logprobs": [{"Par": -0.5, "x": -1.5}, {"is": -0.5, "x": -1.5}],
                           "text_offset": [0, 3]}
    assert logprobs[1] is None
    assert logprobs[2]["text_offset"] == [5] and logprobs[3]["text_offset"] == [8]
    assert choices[3]["finish_reason"] == "length"


def test_chat_chunks_carry_their_tokens_in_openai_shape():
    out = writer(text=False)
    assert out.delta(LogprobsDelta((entry("Hi"),))) is None
    choice = json.loads(out.delta(ContentDelta("Hi")))["choices"][0]
    assert choice["delta"] == {"content": "Hi"}
    assert choice["logprobs"] == {"content": [
        {"token": "Hi", "logprob": -0.5, "bytes": [72, 105],
         "top_logprobs": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105]},
                          {"token": "x", "logprob": -1.5, "bytes": [120]}]}],
        "refusal": None}
    assert json.loads(out.delta(ContentDelta("!")))["choices"][0]["logprobs"] is None


def test_whole_choices_have_logprobs_only_when_asked():
    plain = chat_choice(index=0, content="Hi", reasoning="", calls=[], finish_reason="stop")
    assert plain["logprobs"] is None
    asked = chat_choice(index=0, content="", reasoning="", calls=[], finish_reason="stop",
                        logprobs=[])
    assert asked["logprobs"] == {"content": [], "refusal": None}
    legacy = text_choice(index=0, text="ab", finish_reason="stop",
                         logprobs=[entry("a"), entry("b")])["logprobs"]
    assert legacy["tokens"] == ["a", "b"] and legacy["text_offset"] == [0, 1]
