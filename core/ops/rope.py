"""Rotary position embedding: the ``rope`` op and the tables it reads (plain and YaRN, built in core)."""

from __future__ import annotations

import math

import torch

from ..dispatch import call
from ..validation import FLOAT_DTYPES, Check, value_checks_enabled


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, base: float, scaling: dict) -> torch.Tensor:
    factor = float(scaling["factor"])
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers does, to avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: keep the original frequency, 0: interpolate it by `factor`
    return inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate


def _finite(value, *, positive: bool) -> bool:
    """A finite int or float (and > 0 with ``positive``); bools are not numbers here."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False
    return finite and (value > 0 or not positive)


def _check_yarn(c: Check, scaling: dict, base: float) -> None:
    """The YaRN fields ``rope_cos_sin_cache`` reads, each usable: ``factor`` and
    ``original_max_position_embeddings`` present, and no field that makes the table NaN, infinite or negative."""
    factor = scaling.get("factor")
    if not _finite(factor, positive=True):
        raise c.fail("scaling", "yarn 'factor' a finite number > 0", repr(factor))
    original = scaling.get("original_max_position_embeddings")
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise c.fail("scaling", "yarn 'original_max_position_embeddings' an int >= 1", repr(original))
    for name in ("beta_fast", "beta_slow"):  # 0 (falsy) reads as the default, as transformers does
        value = scaling.get(name)
        if value is not None and not (_finite(value, positive=True) or value == 0):
            raise c.fail("scaling", f"yarn {name!r} None, 0 (the default) or a finite number > 0", repr(value))
    for name in ("mscale", "mscale_all_dim"):
        value = scaling.get(name)
        if value is not None and not _finite(value, positive=False):
            raise c.fail("scaling", f"yarn {name!r} None or a finite number", repr(value))
    value = scaling.get("attention_factor")
    if value is not None and not (_finite(value, positive=True) or value == 0):
        raise c.fail("scaling", "yarn 'attention_factor' None, 0 (computed) or a finite number > 0", repr(value))
    if base == 1:
        raise c.fail("base", "a base other than 1 under yarn (its ramp divides by log(base))", repr(base))


def rope_cos_sin_cache(
    rotary_dim: int, max_position: int, base: float = 10000.0, scaling: dict | None = None
) -> torch.Tensor:
    """The ``[max_position, rotary_dim]`` fp32 table ``rope`` reads: ``cos`` of each position times each frequency
    in the first half, ``sin`` in the second.

    scaling: None, or a Hugging Face ``rope_scaling`` / ``rope_parameters`` dict of type ``yarn`` (``factor``,
    ``original_max_position_embeddings``, optional ``beta_fast`` 32, ``beta_slow`` 1, ``mscale``,
    ``mscale_all_dim``, ``attention_factor``, ``truncate`` True): frequencies blended between interpolated and
    original by YaRN's ramp, cos/sin times the attention factor, as transformers computes them.

    rotary_dim: an even int >= 2; max_position: an int >= 1; base: a finite number > 0 (and not 1 under YaRN).
    ``InputError`` otherwise, for a scaling that is not a dict, for a scaling type other than ``default`` or
    ``yarn``, and under YaRN for a missing or non-finite ``factor`` (or one <= 0), an
    ``original_max_position_embeddings`` that is not an int >= 1, or a non-finite optional field (``beta_fast`` and
    ``beta_slow`` and ``attention_factor`` also >= 0, 0 reading as the default).
    """
    c = Check("rope_cos_sin_cache")
    c.positive_int("rotary_dim", rotary_dim, minimum=2)
    if rotary_dim % 2:
        raise c.fail("rotary_dim", "an even int", repr(rotary_dim))
    c.positive_int("max_position", max_position)
    c.positive_number("base", base)
    if scaling is not None and not isinstance(scaling, dict):
        raise c.fail("scaling", "None or a dict", type(scaling).__name__)
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    attention_factor = 1.0
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "yarn":
        _check_yarn(c, scaling, base)
        inv_freq = _yarn_inv_freq(inv_freq, rotary_dim, base, scaling)
        factor, mscale, mscale_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = scaling.get("attention_factor") or (
            _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
            if mscale and mscale_all
            else _yarn_mscale(factor)
        )
    elif kind != "default":
        raise c.fail("scaling", "rope_type 'default' or 'yarn'", repr(kind))
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return (torch.cat([angles.cos(), angles.sin()], dim=1) * attention_factor).float()


def mla_softmax_scale(qk_head_dim: int, scaling: dict | None = None) -> float:
    """DeepSeek MLA's softmax scale: ``qk_head_dim ** -0.5``, times ``mscale**2`` under YaRN with ``mscale_all_dim``."""
    scale = qk_head_dim**-0.5
    if scaling and scaling.get("rope_type", scaling.get("type")) == "yarn" and scaling.get("mscale_all_dim"):
        m = _yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
        scale *= m * m
    return scale


def rope(
    x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, interleaved: bool = True
) -> torch.Tensor:
    """Rotates ``x [T, H, D]`` by the angles of ``positions [T]`` (int32) from ``cos_sin_cache [P, D]`` fp32.

    ``interleaved=True`` (DeepSeek): channel pairs ``(2i, 2i+1)`` rotate by frequency ``i`` and stay in place;
    ``False`` (GPT-NeoX): pairs ``(i, i + D/2)``. Computed in fp32, returned in x's dtype as a new tensor.
    Positions must lie in ``[0, P)``.
    """
    c = Check("rope")
    c.tensor("x", x, dtypes=FLOAT_DTYPES, ndim=3)
    if x.shape[2] % 2:
        raise c.fail("x", "an even rotary dim", f"shape {list(x.shape)}")
    c.index("positions", positions, length=x.shape[0])
    c.tensor("cos_sin_cache", cos_sin_cache, dtypes=(torch.float32,), shape=(None, x.shape[2]))
    if not isinstance(interleaved, bool):
        raise c.fail("interleaved", "a bool", repr(interleaved))
    c.same_device(x=x, positions=positions, cos_sin_cache=cos_sin_cache)
    if value_checks_enabled(positions):
        c.values_in_range("positions", positions, 0, cos_sin_cache.shape[0] - 1, what="positions")
    return call("rope", x=x, positions=positions, cos_sin_cache=cos_sin_cache, interleaved=interleaved)
