"""Test support that ships with butter: the back-end conformance suite.

A back end's package runs :class:`BackendConformance` against its own runtime::

    from butter.testing import BackendConformance, ModelFacts

    class TestMyBackend(BackendConformance):
        @pytest.fixture(scope="class")
        @classmethod
        def loaded(cls): ...          # a LoadedModel (yield it, then close it)

        @pytest.fixture(scope="class")
        @classmethod
        def open_model(cls): ...      # a callable returning a new, unstarted butter Model

        @pytest.fixture(scope="class")
        @classmethod
        def model_facts(cls):
            return ModelFacts(n_ctx_train=..., eos_token=...)

Importing this package imports pytest (``pip install butter-core[testing]``);
``import butter`` never does.
"""

from butter.testing.conformance import BackendConformance, ModelFacts

__all__ = ["BackendConformance", "ModelFacts"]
