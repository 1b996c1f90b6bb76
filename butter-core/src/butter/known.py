"""First-party plugins that may not be installed, and the package that brings each.

``butter plugins`` lists them, and a flag that names one (``--backend mlx``,
``--kv-cache affine8``) says which package to install instead of only "unknown".
"""

from __future__ import annotations

import re

import attrs


@attrs.frozen
class KnownPlugin:
    kind: str  # "backend" or "kv-codec"
    name: str  # a back end's name, or a codec family's names (affine8, affine4, aura…)
    package: str
    install: str  # what to run, from a butter checkout

    def hint(self, name: str) -> str:
        """One line: what brings ``name`` (a back end, or one codec of the family)."""
        return f"{name!r} needs {self.package}: {self.install}"


KNOWN_BACKENDS = (
    KnownPlugin("backend", "gguf", "butter-backend-gguf",
                'pip install "./butter-core[gguf]" ./butter-backend-gguf'),
    KnownPlugin("backend", "mlx", "butter-backend-mlx",
                'pip install "./butter-core[mlx]" ./butter-backend-mlx'),
)
KNOWN_CODEC_FAMILIES = (
    KnownPlugin("kv-codec", "affine8, affine4, aura, auraNvM", "butter-kvcodecs",
                "pip install ./butter-kvcodecs"),
)
_KVCODECS_NAMES = re.compile(r"affine\d+|aura(\d+v\d+)?")


def missing_backend(name: str) -> KnownPlugin | None:
    """The first-party package that would bring back end ``name``."""
    return next((known for known in KNOWN_BACKENDS if known.name == name), None)


def missing_codec(name: str) -> KnownPlugin | None:
    """The first-party package that would bring codec ``name``."""
    return KNOWN_CODEC_FAMILIES[0] if _KVCODECS_NAMES.fullmatch(name) else None
