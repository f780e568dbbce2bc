"""Build script.

``DEEPINFER_ACCELERATOR=<name> pip install .`` ships the core, the model and only the named backend, adds that
backend's vendor dependency, and records the name as the installed default (``deepinfer/_build_config.py``).
Without the variable every in-tree backend is shipped and no default is recorded.
"""

import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

# In-tree backends: name -> (import package, source folder, vendor requirements, build-time aliases).
BACKENDS = {
    "cuda_sm100": ("deepinfer_cuda_sm100", "backends/cuda_sm100", ["triton>=3.0"], ("cuda", "nvidia")),
    "ascend": ("deepinfer_ascend", "backends/ascend", ["torch-npu"], ("npu",)),
}
NO_BACKEND = ("reference", "cpu")  # ship the core and model only; the default is the built-in reference

CORE_PACKAGES = {
    "deepinfer": "core",
    "deepinfer.ops": "core/ops",
    "deepinfer.reference": "core/reference",
    "deepinfer.conformance": "core/conformance",
    "deepinfer.model": "model",
}


def chosen_accelerator() -> str | None:
    raw = os.environ.get("DEEPINFER_ACCELERATOR", "").strip()
    if not raw:
        return None
    if raw in NO_BACKEND:
        return "reference"
    for name, (*_, aliases) in BACKENDS.items():
        if raw == name or raw in aliases:
            return name
    known = sorted([*BACKENDS, *NO_BACKEND, *(a for *_, al in BACKENDS.values() for a in al)])
    raise SystemExit(f"DEEPINFER_ACCELERATOR={raw!r} is not a backend this source tree can build; known: {known}")


ACCELERATOR = chosen_accelerator()
shipped = {n: b for n, b in BACKENDS.items() if ACCELERATOR in (None, n)}

package_dir = dict(CORE_PACKAGES)
entry_points = {
    "console_scripts": ["deepinfer = deepinfer.cli:main"],
    "pytest11": ["deepinfer = deepinfer.conformance.pytest_plugin"],
    "deepinfer": [],
}
install_requires = [
    "torch>=2.6",
    "pluggy>=1.3",
    "safetensors>=0.4",
    "numpy",
    "rich>=13",
    "tokenizers>=0.15",
    "llguidance>=1.0",  # structured output's grammar engine
]
for name, (package, folder, requires, _) in shipped.items():
    package_dir[package] = folder
    entry_points["deepinfer"].append(f"{name} = {package}.plugin")
    if name == ACCELERATOR:
        install_requires += requires


class BuildWithDefault(build_py):
    """Writes the build-time default backend into the built package."""

    def run(self):
        super().run()
        target = Path(self.build_lib, "deepinfer", "_build_config.py")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(
            "# Written by setup.py at build time.\n"
            f"DEFAULT_ACCELERATOR = {ACCELERATOR!r}\n"
            f"SHIPPED_BACKENDS = {tuple(shipped)!r}\n"
        )


setup(
    packages=list(package_dir),
    package_dir=package_dir,
    package_data={"deepinfer.model": ["*.json", "checkpoints/*/*.md", "checkpoints/*/*.json", "checkpoints/*/*/*"]},
    install_requires=install_requires,
    extras_require={
        "cuda": ["triton>=3.0", "cupy-cuda12x"],
        "ascend": ["torch-npu"],
        # deepinfer serve: the OpenAI-compatible server
        "serve": ["fastapi>=0.110", "uvicorn>=0.29", "jinja2>=3.1", "prometheus-client>=0.20"],
        # triton (Linux): the NVIDIA kernels run through its CPU interpreter in the tests. The example plugin of
        # tests/plugins is made visible to the tests by tests/conftest.py, not installed.
        "test": [
            "pytest>=7",
            "pytest-xdist>=3",  # the suite on two processes (the README's test command)
            "hypothesis>=6",
            "transformers>=5.24",
            "ruff",
            "setuptools>=69",
            "wheel",
            "triton>=3.0; sys_platform == 'linux'",
            # the server's tests: its dependencies, and the official client that drives it
            "fastapi>=0.110",
            "uvicorn>=0.29",
            "jinja2>=3.1",
            "prometheus-client>=0.20",
            "openai>=1.0",
        ],
    },
    entry_points=entry_points,
    cmdclass={"build_py": BuildWithDefault},
)
