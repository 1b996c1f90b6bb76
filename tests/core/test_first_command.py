"""What the README's first command installs (core and the GGUF back end, no codecs, no
MLX) is enough to serve the default, and names the package for anything else.

CI runs the command itself (`.ci/readme_commands.py`); these tests hide the other
first-party packages' entry points to check the same rules on the dev install."""

import importlib.metadata
import inspect
import os
import subprocess
import sys

import pytest

from butter.plugins import build_plugins


def _without_kvcodecs_and_mlx(real):
    def entry_points(**kwargs):
        found = real(**kwargs)
        if kwargs.get("group") == "butter":
            return [e for e in found if e.name not in ("kvcodecs", "mlx")]
        return found

    return entry_points


# The same in a subprocess: `butter` as a user of the first command has it.
ONLY_CORE_AND_GGUF = (
    "import importlib.metadata, sys\n"
    + inspect.getsource(_without_kvcodecs_and_mlx)
    + "importlib.metadata.entry_points = "
      "_without_kvcodecs_and_mlx(importlib.metadata.entry_points)\n"
      "from butter.cli.main import main\n"
      "sys.exit(main(sys.argv[1:]))\n")


@pytest.fixture
def only_core_and_gguf(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        _without_kvcodecs_and_mlx(importlib.metadata.entry_points))


def butter(*args):
    return subprocess.run([sys.executable, "-c", ONLY_CORE_AND_GGUF, *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "400"})


def test_core_alone_serves_the_default_codec(only_core_and_gguf):
    plugins = build_plugins()
    assert plugins.kv_codec("raw").raw
    assert "affine8" not in plugins.kv_codecs
    assert {known.package for known in plugins.missing()} == {"butter-backend-mlx",
                                                              "butter-kvcodecs"}


@pytest.mark.parametrize("codec", ["affine8", "affine4", "aura", "aura4v2"])
def test_a_codec_named_but_not_installed_names_its_package(only_core_and_gguf, codec):
    result = butter("serve", "--model", "smollm2", "--kv-cache", codec)
    assert result.returncode == 2
    assert result.stderr.strip() == (f"butter serve: error: --kv-cache: {codec!r} needs "
                                      "butter-kvcodecs: pip install ./butter-kvcodecs")


def test_a_back_end_named_but_not_installed_names_its_package():
    result = butter("serve", "--model", "smollm2", "--backend", "mlx")
    assert result.returncode == 2
    assert "'mlx' needs butter-backend-mlx: pip install" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_plugins_lists_what_is_known_but_not_installed():
    result = butter("plugins")
    assert result.returncode == 0, result.stderr
    assert "not installed: butter-backend-mlx" in result.stdout
    assert "not installed: butter-kvcodecs" in result.stdout
    assert "raw" in result.stdout
