"""The back-end conformance suite (``butter.testing``) on the fake runtime's toy model."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from fakes.runtime import CONTROL_TOKENS, ToyModel

from butter.backend import BackendLimits, SessionLayout
from butter.library import Model
from butter.plugins import build_plugins
from butter.resolve import ResolvedModel
from butter.testing import BackendConformance, ModelFacts

ROOT = Path(__file__).parents[2]


class ToyBackend:
    """Just enough of a back end for :class:`~butter.library.Model` to run a toy model."""

    name = "toy"
    priority = 100
    options = ()
    limits = BackendLimits()
    takes_threads = False
    kv_windows = False
    decode_paths = frozenset({"compressed"})

    def session_layout(self, options, parallel: int) -> SessionLayout:
        return SessionLayout()


def open_toy() -> Model:
    # A step takes a few milliseconds, as a real one does: a request closed after its
    # first token is still running when its model closes.
    return Model(ToyModel(delay=0.005), model_id="toy",
                 resolved=ResolvedModel("toy", Path("toy"), "toy"), backend=ToyBackend(),
                 plugins=build_plugins(load_entry_points=False))


class TestToyModel(BackendConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def loaded(cls):
        return ToyModel()

    @pytest.fixture(scope="class")
    @classmethod
    def open_model(cls):
        return open_toy

    @pytest.fixture(scope="class")
    @classmethod
    def model_facts(cls):
        return ModelFacts(n_ctx_train=4096, eos_token="<|end|>",
                          control_tokens={text: 256 + i for i, text in enumerate(CONTROL_TOKENS)})


def test_butter_runs_without_pytest():
    """The suite ships in the wheel, but only ``import butter.testing`` imports pytest,
    and pytest is an extra (``butter-core[testing]``), never a runtime dependency."""
    code = ("import sys, butter, butter.library, butter.serving, butter.cli.main\n"
            "assert 'pytest' not in sys.modules and '_pytest' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
    project = tomllib.loads((ROOT / "butter-core" / "pyproject.toml").read_text())["project"]
    assert not any(r.startswith("pytest") for r in project["dependencies"])
    assert any(r.startswith("pytest") for r in project["optional-dependencies"]["testing"])
