"""`butter serve --backend mlx` through the official SDKs, and swaps between back ends."""

import json

import anthropic
import httpx
import openai
import pytest

pytestmark = pytest.mark.slow  # MLX on a CPU: seconds per request

QUESTION = [{"role": "user", "content": "Name the capital city of France."}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def test_every_route_answers_through_the_sdks(mlx_server):
    card = mlx_server.models()[0]
    assert card["butter"]["backend"] == "mlx" and card["butter"]["fused_batching"]
    client = openai.OpenAI(base_url=mlx_server.base_url, api_key="-", max_retries=0,
                           timeout=300)
    reply = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=8,
                                           temperature=0)
    assert "Paris" in reply.choices[0].message.content
    streamed = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=8,
                                              temperature=0, stream=True,
                                              stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        reply.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the prefix was reused

    claude = anthropic.Anthropic(base_url=mlx_server.root, api_key="-", max_retries=0,
                                 timeout=300)
    with claude.messages.stream(model="smollm2", max_tokens=8, messages=QUESTION,
                                extra_body={"temperature": 0}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert "Paris" in text and final.stop_reason in ("end_turn", "max_tokens")
    legacy = client.completions.create(model="smollm2", prompt="The capital of France is",
                                       max_tokens=4, temperature=0, logprobs=2)
    assert legacy.choices[0].text and client.models.retrieve("smollm2").id == "smollm2"
    logprobs = legacy.choices[0].logprobs  # greedy: the drawn token tops the raw model's
    assert "".join(logprobs.tokens) == legacy.choices[0].text
    assert all(max(top, key=top.get) == token and top[token] == logprob <= 0
               for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs,
                                              logprobs.top_logprobs))
    counted = claude.messages.count_tokens(model="smollm2", messages=QUESTION)
    usage = final.usage  # Anthropic counts cache reads apart from input tokens
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens


def test_a_tool_call_comes_back_structured(mlx_server):
    client = openai.OpenAI(base_url=mlx_server.base_url, api_key="-", max_retries=0,
                           timeout=300)
    reply = client.chat.completions.create(
        model="smollm2", temperature=0, max_tokens=40, tools=TOOLS,
        messages=[{"role": "system", "content": "You copy text exactly."},
                  {"role": "user", "content": "Repeat the following text exactly, with "
                                              "nothing before or after it:\n" + CALL}])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert "<tool_call>" not in (choice.message.content or "")


def test_swaps_between_an_mlx_folder_and_a_gguf_both_ways(start_server, mlx_folder):
    server = start_server(model=str(mlx_folder))
    assert server.models()[0]["butter"]["backend"] == "mlx"
    client = openai.OpenAI(base_url=server.base_url, api_key="-", max_retries=0, timeout=300)
    for model, backend in (("smollm2", "gguf"), (str(mlx_folder), "mlx"), ("smollm2", "gguf")):
        reply = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8,
                                               temperature=0)
        served = model if model == "smollm2" else mlx_folder.name  # a path: its name
        assert reply.model == served and "Paris" in reply.choices[0].message.content
        assert server.models()[0]["butter"]["backend"] == backend
    assert httpx.get(f"{server.root}/health").text == "ok"


@pytest.mark.parametrize("flag", [("--threads", "2"), ("--ubatch-size", "64")])
def test_gguf_only_flags_are_refused_for_mlx_before_loading(flag):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "butter", "serve", "--model", "smollm2",
                             "--backend", "mlx", *flag], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and flag[0] in result.stderr
    assert result.stderr.strip().count("\n") == 0


def test_a_displaced_prompt_loads_back_from_host_memory_on_mlx(start_server):
    """Three sessions (one active, two spare): a new prompt takes the session that
    shares the most with it (the template's first tokens), so two other prompts later the
    first one's caches are gone from every session, and come back from the prompt cache."""
    import openai
    from helpers import notes

    server = start_server("--backend", "mlx", "--parallel", "1")
    client = openai.OpenAI(base_url=server.base_url, api_key="-", max_retries=0, timeout=180)

    def ask(system: str):
        return client.chat.completions.create(
            model="smollm2", max_tokens=16, temperature=0,
            messages=[{"role": "system", "content": system},
                      {"role": "user", "content": "Which lamp stays on?"}])

    keeper = "You are a lighthouse keeper. " + notes(20, "lamps")
    first = ask(keeper)
    for topic in ("rivers", "hills"):
        ask(f"You answer in one word about {topic}. " + notes(20, topic))
    again = ask(keeper)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert again.choices[0].message.content == first.choices[0].message.content
    metrics = server.metrics()
    assert metrics["butter_prompt_cache_hits_total"] >= 1
    assert server.models()[0]["butter"]["prompt_cache_mib"] == 8192
