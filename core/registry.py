"""Loads backend plugins through pluggy and keeps their records.

The built-in ``reference`` backend is always registered. Third-party and in-tree backends are entry points of the
``deepinfer`` group; ``DEEPINFER_PLUGINS=a,b`` limits which of them load. A plugin that fails to import, raises
in a hook, returns bad records or reuses a taken name is kept out and listed in ``Registry.failures`` with its
error: it never breaks the core unless it is chosen explicitly.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field
from importlib.metadata import entry_points

import pluggy

from . import hookspecs
from .errors import PluginError
from .records import DEVICE_TYPES, BackendSpec, OpImpl

ENTRY_POINT_GROUP = "deepinfer"


@dataclass
class Registry:
    """backends: name -> spec; plugin_of: backend name -> plugin (entry-point) name; impls: (backend, op) ->
    implementations, highest priority first; failures: plugin name -> error text; skipped: entry points left out
    by ``DEEPINFER_PLUGINS``."""

    backends: dict[str, BackendSpec] = field(default_factory=dict)
    plugin_of: dict[str, str] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    impls: dict[tuple[str, str], list[OpImpl]] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    _probes: dict[str, tuple[bool, str]] = field(default_factory=dict)

    def lookup(self, name: str) -> BackendSpec | None:
        """The backend called ``name`` or aliased so, if registered."""
        return self.backends.get(self.aliases.get(name, name))

    def probe(self, name: str) -> tuple[bool, str]:
        """The backend's probe result, computed once per process (a raising probe means unavailable)."""
        if name not in self._probes:
            try:
                ok, reason = self.backends[name].probe()
                self._probes[name] = (bool(ok), str(reason))
            except Exception as e:  # a broken probe must not break the core
                self._probes[name] = (False, f"probe raised {type(e).__name__}: {e}")
        return self._probes[name]

    def impls_for(self, backend: str, op: str) -> list[OpImpl]:
        return self.impls.get((backend, op), [])


def _error_text(e: BaseException) -> str:
    last = traceback.extract_tb(e.__traceback__)[-1:] if e.__traceback__ else []
    frozen = last and last[0].filename.startswith("<")
    where = f" (at {last[0].filename.rsplit('/', 1)[-1]}:{last[0].lineno})" if last and not frozen else ""
    return f"{type(e).__name__}: {e}{where}"


def _plugin_allow_list() -> set[str] | None:
    raw = os.environ.get("DEEPINFER_PLUGINS")
    if raw is None:
        return None
    return {p.strip() for p in raw.split(",") if p.strip()}


def _check_spec(spec) -> None:
    if not isinstance(spec, BackendSpec):
        raise PluginError(f"deepinfer_backend returned {type(spec).__name__}, expected BackendSpec")
    if not spec.name or not isinstance(spec.name, str):
        raise PluginError(f"backend name must be a non-empty string, got {spec.name!r}")
    if spec.device_type not in DEVICE_TYPES:
        raise PluginError(f"backend {spec.name!r}: device_type {spec.device_type!r} is not one of {DEVICE_TYPES}")
    if not callable(spec.probe):
        raise PluginError(f"backend {spec.name!r}: probe is not callable")


def _check_impl(impl, backends: set[str], known_ops: set[str]) -> None:
    if not isinstance(impl, OpImpl):
        raise PluginError(f"deepinfer_op_impls returned a {type(impl).__name__}, expected OpImpl")
    if impl.op not in known_ops:
        raise PluginError(f"implementation of unknown op {impl.op!r}; known ops: {sorted(known_ops)}")
    if impl.backend not in backends:
        raise PluginError(f"implementation of {impl.op!r} names backend {impl.backend!r}, not one this plugin provides")
    if not callable(impl.fn) or (impl.supports is not None and not callable(impl.supports)):
        raise PluginError(f"implementation of {impl.op!r} by {impl.provider!r}: fn and supports must be callable")


def _load_plugin_records(pm: pluggy.PluginManager, name: str, plugin) -> tuple[list[BackendSpec], list[OpImpl]]:
    specs, impls = [], []
    for hook_impl in pm.hook.deepinfer_backend.get_hookimpls():
        if hook_impl.plugin is plugin:
            spec = hook_impl.function()
            _check_spec(spec)
            specs.append(spec)
    for hook_impl in pm.hook.deepinfer_op_impls.get_hookimpls():
        if hook_impl.plugin is plugin:
            impls.extend(hook_impl.function() or [])
    if not specs:
        raise PluginError("the plugin provides no deepinfer_backend hook")
    return specs, impls


def _add_plugin(reg: Registry, pm: pluggy.PluginManager, name: str, plugin, known_ops: set[str]) -> None:
    specs, impls = _load_plugin_records(pm, name, plugin)
    new_names: dict[str, str] = {}
    for spec in specs:
        for n in (spec.name, *spec.aliases):
            taken = reg.aliases.get(n) or (n if n in reg.backends else None) or new_names.get(n)
            if taken is not None:
                owner = reg.plugin_of.get(taken, name)
                raise PluginError(f"backend name or alias {n!r} is already taken by plugin {owner!r}")
            new_names[n] = spec.name
    table: dict[tuple[str, str], list[OpImpl]] = {}
    for impl in impls:
        _check_impl(impl, {s.name for s in specs}, known_ops)
        key = (impl.backend, impl.op)
        if any(i.provider == impl.provider for i in table.get(key, [])):
            raise PluginError(
                f"duplicate implementation of {impl.op!r} by provider {impl.provider!r} in {impl.backend!r}"
            )
        table.setdefault(key, []).append(impl)
    for spec in specs:
        reg.backends[spec.name] = spec
        reg.plugin_of[spec.name] = name
        reg.aliases.update({a: spec.name for a in spec.aliases})
    for key, lst in table.items():
        reg.impls[key] = sorted(lst, key=lambda i: -i.priority)


def load() -> Registry:
    """Builds a fresh registry from the built-in reference and the installed entry points."""
    from . import reference
    from .ops import OP_NAMES

    known_ops = set(OP_NAMES)
    reg = Registry()
    pm = pluggy.PluginManager("deepinfer")
    pm.add_hookspecs(hookspecs)
    pm.register(reference, name="reference")
    _add_plugin(reg, pm, "reference", reference, known_ops)

    allow = _plugin_allow_list()
    seen: set[str] = set()
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in seen:
            reg.failures[ep.name] = f"two installed distributions declare the entry point {ep.name!r}"
            continue
        seen.add(ep.name)
        if allow is not None and ep.name not in allow:
            reg.skipped.append(ep.name)
            continue
        try:
            plugin = ep.load()
            pm.register(plugin, name=ep.name)
        except Exception as e:
            reg.failures[ep.name] = _error_text(e)
            continue
        try:
            pm.check_pending()
            _add_plugin(reg, pm, ep.name, plugin, known_ops)
        except Exception as e:
            pm.unregister(plugin)
            reg.failures[ep.name] = _error_text(e)
    return reg


_REGISTRY: Registry | None = None


def get() -> Registry:
    """The process's registry (loaded on first use)."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = load()
    return _REGISTRY


def reload() -> Registry:
    """Forgets the loaded plugins, the backend selection cache and the remembered implementation choices, then
    loads again (for tests and tools)."""
    global _REGISTRY
    from . import dispatch, selection

    _REGISTRY = None
    selection.clear_cache()
    dispatch.clear_choice_cache()
    return get()
