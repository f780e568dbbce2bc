"""The conformance suite as pytest tests (registered through the ``pytest11`` entry point).

    pytest --pyargs deepinfer.conformance --deepinfer-backend NAME [--deepinfer-shapes full] [--deepinfer-seed N]

Each case and each bad input is one test; a case the backend leaves to the reference is skipped with that reason
(it is not a pass). Without ``--deepinfer-backend`` the selected backend is checked. A backend that is not installed
or not available here is one usage error before any test runs, with the reason ``deepinfer conformance`` gives.
"""

from __future__ import annotations

import os

import pytest


def pytest_addoption(parser) -> None:
    group = parser.getgroup("deepinfer", "deepinfer conformance")
    group.addoption("--deepinfer-backend", default=None, help="backend to check (default: the selected one)")
    group.addoption("--deepinfer-shapes", default="small", choices=("small", "full"), help="shape grid")
    group.addoption("--deepinfer-seed", type=int, default=None, help="random seed (default: fresh, printed)")
    group.addoption("--deepinfer-device", default=None, help="torch device for the inputs (default: the backend's)")


def pytest_configure(config) -> None:
    name = config.getoption("deepinfer_backend", None)
    if name:
        from ..errors import BackendError
        from ..selection import require

        try:
            require(name, f"--deepinfer-backend {name}")
        except BackendError as e:
            raise pytest.UsageError(str(e)) from None


def pytest_generate_tests(metafunc) -> None:
    from .runner import all_bad_inputs, all_cases

    if "deepinfer_case" in metafunc.fixturenames:
        cases = all_cases(metafunc.config.getoption("deepinfer_shapes"))
        metafunc.parametrize("deepinfer_case", cases, ids=[f"{c.op}[{c.name}]" for c in cases])
    if "deepinfer_bad_input" in metafunc.fixturenames:
        bad = all_bad_inputs()
        metafunc.parametrize("deepinfer_bad_input", bad, ids=[f"{b.op}[{b.name}]" for b in bad])


@pytest.fixture(scope="session")
def deepinfer_backend(pytestconfig) -> str:
    from ..selection import current_backend

    return pytestconfig.getoption("deepinfer_backend") or current_backend().name


@pytest.fixture(scope="session")
def deepinfer_seed(pytestconfig) -> int:
    seed = pytestconfig.getoption("deepinfer_seed")
    return int.from_bytes(os.urandom(4), "little") if seed is None else seed


@pytest.fixture(scope="session")
def deepinfer_device(pytestconfig) -> str | None:
    return pytestconfig.getoption("deepinfer_device")


def pytest_report_header(config) -> str | None:
    backend = config.getoption("deepinfer_backend")
    return f"deepinfer conformance: backend={backend}" if backend else None
