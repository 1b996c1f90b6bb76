"""Building the plugin manager: built-ins first, then each entry point on its own.

A plugin that fails to import or register is recorded with its reason and skipped;
it never takes the CLI or the server down.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from typing import TYPE_CHECKING

import attrs
import pluggy

from butter import hookspecs
from butter.errors import BackendUnavailableError, ModelNotFoundError
from butter.known import (
    KNOWN_BACKENDS,
    KNOWN_CODEC_FAMILIES,
    KnownPlugin,
    missing_backend,
    missing_codec,
)
from butter.kvcodec import InvalidCodecError

if TYPE_CHECKING:
    from butter.backend import Backend
    from butter.chat.recovery import ToolFormat
    from butter.kvcodec import KVCodec
    from butter.resolve import ResolvedModel

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = hookspecs.PROJECT

# Built-in plugins register through the same hooks as third-party ones.
DEFAULT_PLUGINS = ("butter.resolvers", "butter.chat.toolformats", "butter.kvcodec")


@attrs.frozen
class PluginFailure:
    name: str
    reason: str


@attrs.define
class Plugins:
    """What the plugin system found: back ends, codecs, tool formats, failures."""

    manager: pluggy.PluginManager
    backends: dict[str, Backend] = attrs.field(factory=dict)
    kv_codecs: dict[str, KVCodec] = attrs.field(factory=dict)
    tool_formats: list[ToolFormat] = attrs.field(factory=list)
    failures: list[PluginFailure] = attrs.field(factory=list)

    def resolve(self, model_id: str) -> ResolvedModel:
        """Resolve ``model_id`` or raise :class:`ModelNotFoundError`."""
        resolved = self.manager.hook.resolve_model(model_id=model_id)
        if resolved is None:
            raise ModelNotFoundError(model_id)
        return resolved

    def backend_for(self, resolved: ResolvedModel, preferred: str | None = None) -> Backend:
        """The back end that loads ``resolved``: ``preferred`` if given, else the first able one."""
        if preferred is not None:
            backend = self.backends.get(preferred)
            if backend is None:
                raise BackendUnavailableError(self.unknown_backend(preferred) + ".")
            reason = backend.unavailable()
            if reason is not None:
                raise BackendUnavailableError(f"Back end {preferred!r} is unavailable: {reason}.")
            if not backend.can_load(resolved):
                raise BackendUnavailableError(
                    f"Back end {preferred!r} cannot load a {resolved.format} checkpoint."
                )
            return backend
        for backend in sorted(self.backends.values(), key=lambda b: b.priority):
            if backend.can_load(resolved):
                return backend
        raise BackendUnavailableError(
            f"No installed back end can load a {resolved.format} checkpoint "
            "(install butter-core[gguf] or butter-core[mlx])."
        )

    def unknown_backend(self, name: str) -> str:
        """Why back end ``name`` is not here: the package that brings it, or what is."""
        missing = missing_backend(name)
        if missing is not None:
            return f"back end {missing.hint(name)}"
        known = ", ".join(sorted(self.backends)) or "none"
        return f"no back end named {name!r} (known: {known})"

    def missing(self) -> list[KnownPlugin]:
        """First-party back ends and codec families that are known but not installed."""
        absent = [known for known in KNOWN_BACKENDS if known.name not in self.backends]
        if "affine8" not in self.kv_codecs:
            absent.extend(KNOWN_CODEC_FAMILIES)
        return absent

    def kv_codec(self, name: str) -> KVCodec:
        """The codec ``name`` names: a registered one or a recipe a family parses.

        Raise :class:`~butter.kvcodec.InvalidCodecError` with a reason otherwise."""
        codec = self.kv_codecs.get(name)
        if codec is None:
            try:
                codec = self.manager.hook.parse_kv_codec(name=name)
            except InvalidCodecError:
                raise
            except Exception as exc:  # a broken recipe parser refuses, it does not crash
                raise InvalidCodecError(f"a codec plugin failed on {name!r}: {exc}") from None
        if codec is None:
            missing = missing_codec(name)
            if missing is not None:
                raise InvalidCodecError(missing.hint(name))
            known = ", ".join(sorted(self.kv_codecs)) or "none"
            raise InvalidCodecError(f"unknown codec {name!r} (known: {known}, or a recipe "
                                    "such as aura4v2)")
        return codec

    def resolver_names(self) -> list[str]:
        return [
            self.manager.get_name(impl.plugin) or repr(impl.plugin)
            for impl in self.manager.hook.resolve_model.get_hookimpls()
        ]


def build_plugins(*, load_entry_points: bool = True, extra: tuple[object, ...] = ()) -> Plugins:
    """Build a fresh plugin manager and collect what its plugins register."""
    manager = pluggy.PluginManager(hookspecs.PROJECT)
    manager.add_hookspecs(hookspecs)
    plugins = Plugins(manager=manager)
    for module_name in DEFAULT_PLUGINS:
        _register_module(plugins, module_name, module_name)
    if load_entry_points:
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if entry_point.value in DEFAULT_PLUGINS:
                continue
            _register_module(plugins, entry_point.name, entry_point.value)
    for index, plugin in enumerate(extra):
        manager.register(plugin, name=f"extra-{index}")
    manager.check_pending()
    _collect(plugins)
    return plugins


def _register_module(plugins: Plugins, name: str, module_name: str) -> None:
    try:
        module = importlib.import_module(module_name)
        if plugins.manager.is_registered(module):
            return
        plugins.manager.register(module, name=name)
    except Exception as exc:  # a broken plugin is reported, never fatal
        log.warning("plugin %s failed to load: %s", name, exc)
        plugins.failures.append(PluginFailure(name=name, reason=f"{type(exc).__name__}: {exc}"))


def _collect(plugins: Plugins) -> None:
    hook = plugins.manager.hook
    _call_registration(plugins, hook.register_backends, _add_backend(plugins))
    _call_registration(plugins, hook.register_kv_codecs, plugins.kv_codecs.__setitem__)
    _call_registration(plugins, hook.register_tool_formats, plugins.tool_formats.append)


def _add_backend(plugins: Plugins):
    def register(backend: Backend) -> None:
        plugins.backends[backend.name] = backend

    return register


def _call_registration(plugins: Plugins, hook_caller, register) -> None:
    # Call each implementation on its own so one failing plugin does not hide the others.
    for impl in hook_caller.get_hookimpls():
        try:
            impl.function(register=register)
        except Exception as exc:
            name = plugins.manager.get_name(impl.plugin) or repr(impl.plugin)
            log.warning("plugin %s failed in %s: %s", name, hook_caller.name, exc)
            plugins.failures.append(PluginFailure(name=name, reason=f"{type(exc).__name__}: {exc}"))
