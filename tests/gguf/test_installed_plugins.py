"""The plugins installed with butter, on the shipped model."""

from butter.plugins import build_plugins


def test_builtins_and_installed_back_ends_register(model_path):
    plugins = build_plugins()
    assert "gguf" in plugins.backends
    assert "raw" in plugins.kv_codecs
    assert {f.name for f in plugins.tool_formats} >= {"hermes", "qwen3_coder"}
    resolved = plugins.resolve("smollm2")
    assert resolved.path == model_path and resolved.format == "gguf"
    assert plugins.backend_for(resolved).name == "gguf"
    assert not plugins.failures
    assert plugins.backends["mlx"].unavailable() is None  # mlx[cpu] on this platform
