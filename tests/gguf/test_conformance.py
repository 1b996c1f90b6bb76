"""The back-end conformance suite (``butter.testing``) on the GGUF back end and SmolLM2."""

from __future__ import annotations

import pytest
from support.smollm2 import SMOLLM2

from butter.library import Model, default_plugins
from butter.testing import BackendConformance


class TestGGUF(BackendConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def loaded(cls):
        plugins = default_plugins()
        model = plugins.backends["gguf"].load(plugins.resolve("smollm2"), threads=2)
        yield model
        model.close()

    @pytest.fixture(scope="class")
    @classmethod
    def open_model(cls):
        return lambda: Model.load("smollm2", backend="gguf")

    @pytest.fixture(scope="class")
    @classmethod
    def model_facts(cls):
        return SMOLLM2
