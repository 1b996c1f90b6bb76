"""A test folder that needs an optional package skips, file by file, when it is absent.

``pytest.importorskip`` in a folder's conftest fails the run instead when the folder is
named on the command line (pytest loads that conftest before collecting), so the
folder's conftest asks for :func:`skip_without` as its module hook: each test file then
becomes one skipped item naming what is missing, and is never imported.
"""

from __future__ import annotations

import importlib.util

import pytest


class _Skipped(pytest.Item):
    def __init__(self, *, reason: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.reason = reason

    def runtest(self) -> None:
        pytest.skip(self.reason)

    def reportinfo(self):
        return self.path, None, self.name


class _AbsentModule(pytest.File):
    reason = ""

    def collect(self):
        yield _Skipped.from_parent(self, name=self.path.name, reason=self.reason)


def skip_without(*modules: str, reason: str):
    """A ``pytest_pycollect_makemodule`` hook: None (collect as usual) when every module
    in ``modules`` can be imported, else a stand-in whose one item skips with ``reason``."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]

    def pytest_pycollect_makemodule(module_path, parent):
        if not missing:
            return None
        module = _AbsentModule.from_parent(parent, path=module_path)
        module.reason = f"{reason} ({', '.join(missing)} cannot be imported)"
        return module

    return pytest_pycollect_makemodule
