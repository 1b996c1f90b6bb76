"""The plugin system: hooks, entry points loaded one by one, failures reported."""

import importlib.metadata
import subprocess
import sys

from butter import hookspecs
from butter.plugins import build_plugins
from butter.resolve import ResolvedModel


class _ThirdParty:
    @hookspecs.hookimpl
    def resolve_model(self, model_id):
        if model_id == "my-alias":
            return ResolvedModel(model_id=model_id, path=__import__("pathlib").Path("/x.gguf"),
                                 format="gguf")
        return None

    @hookspecs.hookimpl
    def register_kv_codecs(self, register):
        register("fancy", object())


def test_a_third_party_plugin_adds_a_resolver_and_a_codec():
    plugins = build_plugins(extra=(_ThirdParty(),))
    assert plugins.resolve("my-alias").path.name == "x.gguf"
    assert "fancy" in plugins.kv_codecs


def test_a_broken_entry_point_is_reported_not_fatal(monkeypatch):
    real = importlib.metadata.entry_points

    def entry_points(**kwargs):
        found = list(real(**kwargs))
        if kwargs.get("group") == "butter":
            found.append(importlib.metadata.EntryPoint(
                name="broken", value="butter_no_such_module", group="butter"))
        return found

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    plugins = build_plugins()
    assert "gguf" in plugins.backends
    assert [f.name for f in plugins.failures] == ["broken"]
    assert "ModuleNotFoundError" in plugins.failures[0].reason


def test_import_butter_needs_neither_llama_cpp_nor_mlx():
    code = (
        "import sys; sys.modules['llama_cpp'] = None; sys.modules['mlx'] = None\n"
        "import butter, butter.plugins\n"
        "from butter import Model, ButterServeBackend, ServeServer, ResidentServeBackend\n"
        "p = butter.plugins.build_plugins(); assert 'gguf' in p.backends\n"
        "print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "ok", result.stderr
