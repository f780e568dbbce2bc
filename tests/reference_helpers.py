"""What the reference tests share: fixtures that run every op on the reference backend with a fresh, printed seed
(import ``g_fixture`` and ``on_reference_fixture``: pytest finds them under the names ``g`` and ``on_reference``).

Each run draws new data; ``DEEPINFER_TEST_SEED=<n>`` replays a run (the seed is printed with a failure).
"""

from __future__ import annotations

import os
import random
import zlib

import pytest
import torch

import deepinfer

U32 = 2.0**-24  # fp32 unit roundoff
BASE_SEED = int(os.environ.get("DEEPINFER_TEST_SEED", random.SystemRandom().randrange(2**31)))


@pytest.fixture(autouse=True, name="on_reference")
def on_reference_fixture():
    """Every op call in a test module that imports this fixture runs the reference backend."""
    with deepinfer.use("reference"):
        yield


@pytest.fixture(name="g")
def g_fixture(request) -> torch.Generator:
    """A generator seeded per test from the run's seed (printed, so a failure can be replayed)."""
    print(f"DEEPINFER_TEST_SEED={BASE_SEED}")
    return torch.Generator().manual_seed(BASE_SEED + zlib.crc32(request.node.name.encode()))


def randn(g: torch.Generator, *shape: int, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype)
