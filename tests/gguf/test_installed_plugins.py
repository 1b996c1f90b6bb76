"""The plugins installed with butter, on the shipped model."""

import importlib.util
import platform

from butter.plugins import build_plugins


def installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def test_builtins_and_installed_back_ends_register(model_path):
    plugins = build_plugins()
    assert "gguf" in plugins.backends
    assert "raw" in plugins.kv_codecs
    assert {f.name for f in plugins.tool_formats} >= {"hermes", "qwen3_coder"}
    resolved = plugins.resolve("smollm2")
    assert resolved.path == model_path and resolved.format == "gguf"
    assert plugins.backends["gguf"].unavailable() is None
    assert not plugins.failures
    # MLX is optional: asserted only as far as it is installed here.
    if not installed("butter_backend_mlx"):
        assert "mlx" not in plugins.backends
        assert "mlx" in {known.name for known in plugins.missing()}
    elif installed("mlx"):
        assert plugins.backends["mlx"].unavailable() is None  # mlx[cpu] on this platform
    else:
        assert plugins.backends["mlx"].unavailable()  # says what is missing
    # GGUF loads the shipped file by default, except on Apple Silicon with MLX there.
    mlx_default = installed("mlx") and installed("butter_backend_mlx") \
        and platform.system() == "Darwin" and platform.machine() == "arm64"
    assert plugins.backend_for(resolved).name == ("mlx" if mlx_default else "gguf")
