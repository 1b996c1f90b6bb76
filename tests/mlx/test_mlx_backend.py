"""The MLX back end on the shipped SmolLM2: GGUF via mx.load, an MLX folder, a hybrid."""

import struct

import pytest

from butter.errors import ModelLoadError
from butter.library import Model, default_plugins
from butter.resolve import ResolvedModel

pytestmark = pytest.mark.slow  # MLX on a CPU: seconds per request

QUESTIONS = [
    [{"role": "user", "content": "Name the capital city of France."}],
    [{"role": "user", "content": "What is 2 plus 2?"}],
    [{"role": "system", "content": "Answer in one word."},
     {"role": "user", "content": "What colour is the sky?"}],
]


# llama.cpp multiplies Q4_1 weights by 8-bit-quantized activations, MLX in float16: the
# first tokens agree, a later near-tie may not (SmolLM2's 8th token of the third answer).
FIRST = 6


@pytest.fixture(scope="module")
def gguf_answers():
    """llama.cpp's answers from its plain pass: the prompt fed as one unpadded batch.

    The default per-session layout pads short prompt chunks to ggml's tiled flash attention,
    which sums in another order; the third answer's 4th token is a near-tie between the two
    llama.cpp paths ("a" plain, "often" tiled), so the reference is the plain one."""
    with Model.load("smollm2", backend="gguf") as model:
        model.start_engine(model.engine_config(capacity=8192, options={"kv_layout": "shared"}))
        return [model.generate(q, max_tokens=FIRST, temperature=0, ignore_eos=True).text
                for q in QUESTIONS]


def test_greedy_answers_agree_with_llama_cpp(gguf_answers):
    with Model.load("smollm2", backend="mlx") as model:
        assert model.backend_name == "mlx"
        answers = [model.generate(q, max_tokens=FIRST, temperature=0, ignore_eos=True).text
                   for q in QUESTIONS]
    assert answers == gguf_answers


def test_the_tokenizer_rebuilt_from_gguf_matches_llama_cpp():
    texts = ["Hello world! 12345 numbers, café ünïcödé 🙂  spaces\n\n\tnewlines",
             "<|im_start|>user\nHi<|im_end|>\n", "def f(x):\n    return x**2  # 3.14"]
    with Model.load("smollm2", backend="gguf") as gguf, \
            Model.load("smollm2", backend="mlx") as mlx:
        for text in texts:
            for special in (True, False):
                assert mlx.loaded.tokenize(text, add_special=True, parse_special=special) == \
                    gguf.loaded.tokenize(text, add_special=True, parse_special=special), text
        ids = gguf.loaded.tokenize(texts[0], add_special=False, parse_special=False)
        assert [mlx.loaded.token_piece(t) for t in ids] == \
            [gguf.loaded.token_piece(t) for t in ids]


def test_an_mlx_folder_loads_through_mlx_lm_and_answers_the_same(mlx_folder, gguf_answers):
    resolved = default_plugins().resolve(str(mlx_folder))
    assert resolved.format == "hf"
    with Model.load(str(mlx_folder)) as model:  # a folder goes to MLX on its own
        assert model.backend_name == "mlx"
        answer = model.generate(QUESTIONS[0], max_tokens=FIRST, temperature=0, ignore_eos=True)
    assert answer.text == gguf_answers[0]


def _tiny_gguf(path, tensor_type: int, elements: int, nbytes: int) -> None:
    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()

    meta = (string("general.architecture") + struct.pack("<I", 8) + string("llama")
            + string("tokenizer.ggml.model") + struct.pack("<I", 8) + string("gpt2"))
    table = string("w") + struct.pack("<I", 1) + struct.pack("<q", elements) \
        + struct.pack("<IQ", tensor_type, 0)
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, 2) + meta + table
    head += b"\0" * (-len(head) % 32)
    path.write_bytes(head + b"\0" * nbytes)


def test_other_gguf_quant_types_are_refused_with_a_reason(tmp_path):
    backend = default_plugins().backends["mlx"]
    kquant = tmp_path / "q4k.gguf"
    _tiny_gguf(kquant, 12, 256, 144)  # one Q4_K block
    with pytest.raises(ModelLoadError, match="Q4_0, Q4_1 and Q8_0"):
        backend.precheck(ResolvedModel(model_id="q4k", path=kquant, format="gguf"))
    plain = tmp_path / "q8.gguf"
    _tiny_gguf(plain, 8, 32, 34)  # one Q8_0 block passes the structural check
    assert backend.precheck(ResolvedModel(model_id="q8", path=plain, format="gguf"))


def test_a_recurrent_hybrid_resumes_from_a_state_snapshot(hybrid_folder):
    with Model.load(str(hybrid_folder)) as model:
        info = model.info
        assert not info.can_rewind and info.fusable
        first = model.generate(QUESTIONS[0], max_tokens=6, temperature=0, ignore_eos=True)
        other = model.generate(QUESTIONS[1], max_tokens=6, temperature=0, ignore_eos=True)
        # The same question again shares all but its last prompt token: the state cannot be
        # cut back there, but a snapshot 4 tokens before the prompt's end resumes it.
        again = model.generate(QUESTIONS[0], max_tokens=6, temperature=0, ignore_eos=True)
        assert again.text == first.text
        assert other.usage.cached_tokens < first.usage.prompt_tokens - 4 \
            == again.usage.cached_tokens
        runtime = model.engine._runtime
        assert runtime.kv.fork.value == "copy" and runtime.kv.truncate.value == "snapshots"


def test_a_cached_hub_id_loads_the_folder(tmp_path, monkeypatch, mlx_folder):
    repo = tmp_path / "hub" / "models--butter--smollm2-mlx"
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for item in mlx_folder.iterdir():
        (snapshot / item.name).symlink_to(item)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with Model.load("butter/smollm2-mlx") as model:
        assert model.backend_name == "mlx"
        assert model.generate(QUESTIONS[0], max_tokens=3, temperature=0).text


def test_the_platform_picks_mlx_on_apple_silicon_and_gguf_elsewhere(monkeypatch):
    import butter_backend_mlx.plugin as plugin

    plugins = default_plugins()
    resolved = plugins.resolve("smollm2")
    assert plugins.backend_for(resolved).name == "gguf"
    monkeypatch.setattr(plugin, "apple_silicon", lambda: True)
    assert plugins.backend_for(resolved).name == "mlx"
    assert plugins.backend_for(resolved, "gguf").name == "gguf"  # --backend overrides


def test_plugins_say_why_mlx_is_unavailable():
    import subprocess
    import sys

    code = ("import sys; sys.modules['mlx'] = None\n"
            "from butter.cli.main import main; main(['plugins'])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={"COLUMNS": "200", "PATH": "/usr/bin"})
    assert "unavailable: mlx not installed" in result.stdout, result.stdout + result.stderr
