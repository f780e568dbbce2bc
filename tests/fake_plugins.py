"""Installs throw-away plugin distributions (dist-info + module) on sys.path, as pip would, for registry tests."""

from __future__ import annotations

import textwrap
from pathlib import Path


def install_plugin(root: Path, dist: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
    """Writes ``modules`` (name -> source) and a ``dist``-0.1.dist-info declaring ``entry_points`` in the group
    ``deepinfer`` under ``root`` (which the caller puts on sys.path)."""
    info = root / f"{dist}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = "\n".join(f"{name} = {target}" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[deepinfer]\n{lines}\n")
    for name, source in modules.items():
        (root / f"{name}.py").write_text(source)


def backend_module(
    name: str, *, device_type: str = "cpu", available: bool = True, aliases: tuple = (), impls: str = "[]"
) -> str:
    return textwrap.dedent(f"""
        import deepinfer
        from deepinfer import BackendSpec, OpImpl

        @deepinfer.hookimpl
        def deepinfer_backend():
            return BackendSpec(name={name!r}, device_type={device_type!r}, aliases={aliases!r},
                               probe=lambda: ({available!r}, "probe says {"yes" if available else "no device here"}"))

        @deepinfer.hookimpl
        def deepinfer_op_impls():
            return {impls}
        """)
