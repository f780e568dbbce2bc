"""Which backend runs the ops.

Resolution order, first hit wins, cached per process:
1. ``deepinfer.use(name)`` (also a context manager);
2. the environment variable ``DEEPINFER_ACCELERATOR=<name>``;
3. the build-time default recorded by ``DEEPINFER_ACCELERATOR=<name> pip install .``;
4. auto-detection: the one available hardware backend; the built-in ``reference`` if there is none; an error if
   there are several.
"""

from __future__ import annotations

import os

from . import registry
from .errors import BackendError
from .records import BackendSpec

_explicit: list[str] = []  # stack of names given to use()
_cached: tuple[BackendSpec, str] | None = None


def clear_cache() -> None:
    global _cached
    _cached = None


def build_default() -> str | None:
    """The backend recorded at build time, if the install was built with ``DEEPINFER_ACCELERATOR``."""
    try:
        from ._build_config import DEFAULT_ACCELERATOR
    except ImportError:
        return None
    return DEFAULT_ACCELERATOR


def describe_backends() -> str:
    """One line per installed backend with its availability, for error messages."""
    reg = registry.get()
    lines = []
    for name in reg.backends:
        ok, reason = reg.probe(name)
        lines.append(f"  {name}: {'available' if ok else 'unavailable'} ({reason})")
    for name, err in reg.failures.items():
        lines.append(f"  {name}: plugin failed to load ({err})")
    for name in reg.skipped:
        lines.append(f"  {name}: not loaded (not in DEEPINFER_PLUGINS)")
    return "\n".join(lines)


def _require(name: str, how: str) -> BackendSpec:
    reg = registry.get()
    spec = reg.lookup(name)
    if spec is None:
        if name in reg.failures:
            why = f"its plugin failed to load: {reg.failures[name]}"
        elif name in reg.skipped:
            why = "its plugin is installed but not listed in DEEPINFER_PLUGINS"
        else:
            why = "it is not installed"
        raise BackendError(
            f"backend {name!r} ({how}) cannot be used: {why}.\nInstalled backends:\n{describe_backends()}"
        )
    ok, reason = reg.probe(spec.name)
    if not ok:
        raise BackendError(
            f"backend {spec.name!r} ({how}) is not available: {reason}.\nInstalled backends:\n{describe_backends()}"
        )
    return spec


def require(name: str, source: str | None = None) -> BackendSpec:
    """The backend called or aliased ``name``, checked to be installed and available here; otherwise a
    ``BackendError`` that says why and lists the installed backends. ``source`` says in that message where the name
    came from (``--backend NAME``, ``LLM(backend=...)``; default ``deepinfer.use(NAME)``)."""
    return _require(name, f"chosen by {source or f'deepinfer.use({name!r})'}")


def _auto_detect() -> tuple[BackendSpec, str]:
    reg = registry.get()
    hardware = sorted(n for n, s in reg.backends.items() if s.device_type != "cpu" and reg.probe(n)[0])
    if len(hardware) == 1:
        return reg.backends[hardware[0]], "auto-detected: the only available hardware backend"
    if not hardware:
        return reg.backends["reference"], "auto-detected: no hardware backend is available"
    raise BackendError(
        f"several hardware backends are available: {hardware}; choose one with DEEPINFER_ACCELERATOR=<name> or "
        f"deepinfer.use(name).\nInstalled backends:\n{describe_backends()}"
    )


def resolve() -> tuple[BackendSpec, str]:
    """The selected backend and how it was chosen."""
    global _cached
    if _explicit:
        return _require(_explicit[-1], f"chosen by deepinfer.use({_explicit[-1]!r})"), (
            f"deepinfer.use({_explicit[-1]!r})"
        )
    if _cached is None:
        env = os.environ.get("DEEPINFER_ACCELERATOR", "").strip()
        default = build_default()
        if env:
            _cached = _require(env, f"DEEPINFER_ACCELERATOR={env}"), f"DEEPINFER_ACCELERATOR={env}"
        elif default:
            _cached = _require(default, "build-time default"), f"build-time default ({default})"
        else:
            _cached = _auto_detect()
    return _cached


def current_backend() -> BackendSpec:
    """The backend the ops dispatch to now."""
    return resolve()[0]


def available_backends() -> list[str]:
    """Names of the installed backends whose probe says they can run here (always includes ``reference``)."""
    reg = registry.get()
    return [n for n in reg.backends if reg.probe(n)[0]]


class use:
    """Selects a backend by name or alias for this process; as a context manager, only for the ``with`` block.

    Raises ``BackendError`` naming the reason if it is not installed or not available here; ``source`` says in that
    message where the name came from (as ``require``).
    """

    def __init__(self, name: str, *, source: str | None = None):
        spec = require(name, source)
        self.spec = spec
        self._depth = len(_explicit)
        _explicit.append(spec.name)

    def __enter__(self) -> BackendSpec:
        return self.spec

    def __exit__(self, *exc) -> None:
        del _explicit[self._depth :]

    def __repr__(self) -> str:
        return f"deepinfer.use({self.spec.name!r})"
