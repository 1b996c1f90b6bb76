"""The back-end conformance suite (``butter.testing``) on the MLX back end and SmolLM2
(the shipped GGUF through ``mx.load``; ``loaded`` is this folder's fixture)."""

from __future__ import annotations

import pytest
from support.smollm2 import SMOLLM2

from butter.library import Model
from butter.testing import BackendConformance

pytestmark = pytest.mark.slow  # MLX on a CPU: seconds per request


class TestMLX(BackendConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def open_model(cls):
        return lambda: Model.load("smollm2", backend="mlx")

    @pytest.fixture(scope="class")
    @classmethod
    def model_facts(cls):
        return SMOLLM2
