"""Whether the ascend backend can run here, on which chip generation, and with which capabilities.

The chip generation is turned into capability flags in this one place (``capabilities``); op implementations ask
for capabilities (``has("fp8_e4m3")``), never for chip names. Ascend 950 (950PR / 950DT) has every capability;
A2 / A3 run the bf16 paths; an unknown chip gets the bf16 set.

``probe()`` imports torch_npu (which needs CANN's libraries) and asks whether an NPU exists; it creates no device
context. The chip name is read at the first op call, when initialising the device is expected, unless
``DEEPINFER_ASCEND_SOC`` names it.

Test-double seam: when the importable ``torch_npu`` is the test double (``torch_npu.TEST_DOUBLE``), the backend's
device type is ``cpu`` (the double computes on the CPU), its collectives run over ``gloo`` instead of ``hccl``, and
the probe says so; this is the only place that distinction is made.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import sys
import warnings
import weakref
from types import ModuleType

from deepinfer import Decline

EMULATED = "torch_npu test double (emulated, not hardware)"
SOC_ENV = "DEEPINFER_ASCEND_SOC"

#: DeepSeek Sparse Attention: ``dsa`` = npu_lightning_indexer and npu_sparse_flash_attention exist (their docs list
#: 950, A3 and A2); the rest are where the generations' documented envelopes differ: ``dsa_fp32_weights`` (the
#: indexer takes fp32 weights; the 950 docs exclude them), ``dsa_indexer_any_heads`` (any query head count up to 64;
#: the 950 takes 8, 16, 24, 32 or 64), ``dsa_sfa_any_heads`` (sparse attention takes 1..128 heads; A2/A3 powers of
#: two only).
DSA_950 = frozenset({"dsa", "dsa_sfa_any_heads"})
DSA_A2_A3 = frozenset({"dsa", "dsa_fp32_weights", "dsa_indexer_any_heads"})

GENERATION_CAPS = {
    "950": frozenset({"bf16", "fp8_e4m3", "fp8_block_gemm", "mxfp8", "kv_fp8_ds_mla", "ep_mc2"}) | DSA_950,
    "A3": frozenset({"bf16", "nz_grouped_weight", "ep_mc2"}) | DSA_A2_A3,
    "A2": frozenset({"bf16", "nz_grouped_weight"}) | DSA_A2_A3,
    "unknown": frozenset({"bf16"}),
}
#: What the backend can do on the chip it targets; shown before the chip is known.
TARGET_CAPS = GENERATION_CAPS["950"]


def _import_quietly() -> ModuleType:
    """Imports torch_npu with Python-level stderr output and warnings captured (a missing CANN must not spill a
    traceback into ``deepinfer info``); exceptions propagate to the caller."""
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        import torch_npu

    return torch_npu


def torch_npu() -> ModuleType:
    """The torch_npu module (real or test double), imported on first use."""
    module = sys.modules.get("torch_npu")
    return module if module is not None else _import_quietly()


def emulated() -> bool:
    """True when the importable torch_npu is the test double."""
    try:
        return bool(getattr(torch_npu(), "TEST_DOUBLE", False))
    except Exception:
        return False


def device_type() -> str:
    """The torch device type the backend's tensors live on: ``npu``, or ``cpu`` under the test double."""
    return "cpu" if emulated() else "npu"


def collective_backend() -> str:
    """The ``torch.distributed`` backend of the communicator the MC2 expert all-to-all runs on: ``hccl``, or
    ``gloo`` under the test double (which exchanges over Gloo between processes on the CPU)."""
    return "gloo" if emulated() else "hccl"


def double_on_path() -> bool:
    """Whether the importable torch_npu is the test double, found without importing a real torch_npu: an already
    imported module answers itself; otherwise the module's source is checked for the double's marker line."""
    module = sys.modules.get("torch_npu")
    if module is not None:
        return bool(getattr(module, "TEST_DOUBLE", False))
    spec = importlib.util.find_spec("torch_npu")
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return False
    try:
        with open(spec.origin, encoding="utf-8") as f:
            return "\nTEST_DOUBLE = True\n" in f.read()
    except OSError:
        return False


def declared_device_type() -> str:
    """The BackendSpec's device type: ``cpu`` under the test double (so it is never auto-detected as hardware and
    conformance inputs are made on the CPU), else ``npu``."""
    return "cpu" if double_on_path() else "npu"


def on_device(*tensors) -> bool:
    """All given tensors (None skipped; QTensors by their data) are on the backend's device."""
    want = device_type()
    return all(t.device.type == want for t in tensors if t is not None)


def placed(**tensors) -> bool | Decline:
    """True where every tensor argument given (None skipped, a QTensor by its data) is on the backend's device;
    else a ``Decline`` naming the first that is not, for a ``supports`` to return."""
    want = device_type()
    for name, t in tensors.items():
        if t is not None and t.device.type != want:
            return Decline(f"{name} is on {t.device.type}, expected {want}")
    return True


def capable(*needed: str) -> bool | Decline:
    """True where the chip at hand has every capability named; else a ``Decline`` naming the first it lacks."""
    for capability in needed:
        if not has(capability):
            return Decline(f"this chip ({soc_name()}) lacks the {capability} capability")
    return True


def supports_on_device(*names: str):
    """A ``supports`` predicate for plain-torch implementations: the named arguments are on the backend's device."""

    def supports(**kwargs) -> bool | Decline:
        return placed(**{n: kwargs[n] for n in names})

    return supports


def probe() -> tuple[bool, str]:
    """Available when torch_npu imports and reports an NPU; otherwise why not."""
    if importlib.util.find_spec("torch_npu") is None:
        return False, "torch_npu is not installed (pip install 'deepinfer[ascend]')"
    try:
        module = torch_npu()
    except Exception as e:  # CANN libraries missing or mismatched: say so, never crash deepinfer
        return (
            False,
            f"torch_npu is not importable (are CANN's libraries installed and sourced?): {type(e).__name__}: {e}",
        )
    if getattr(module, "TEST_DOUBLE", False):
        return True, f"{EMULATED}: computes on the CPU, emulating {module.npu.get_device_name(0)}"
    try:
        count = module.npu.device_count() if module.npu.is_available() else 0
    except Exception as e:
        return False, f"torch_npu imports but the driver query failed: {type(e).__name__}: {e}"
    if not count:
        return False, "torch_npu imports but finds no NPU"
    return True, f"torch_npu {getattr(module, '__version__', '?')}, {count} NPU(s)"


def generation(soc: str) -> str:
    """Chip generation from an SoC name: ``950`` (Ascend950PR/DT, Ascend910_95*), ``A3`` (Ascend910_93*),
    ``A2`` (Ascend910B*), else ``unknown``."""
    name = soc.replace(" ", "")
    if name.startswith("Ascend950") or name.startswith("Ascend910_95"):
        return "950"
    if name.startswith("Ascend910_93"):
        return "A3"
    if name.startswith("Ascend910B"):
        return "A2"
    return "unknown"


_soc_cache: weakref.WeakKeyDictionary[ModuleType, str] = weakref.WeakKeyDictionary()


def soc_name() -> str:
    """The SoC name: ``DEEPINFER_ASCEND_SOC`` if set, else what torch_npu reports for device 0 (cached per
    torch_npu module; reading it may initialise the device, so this runs at op time, not at probe time)."""
    if os.environ.get(SOC_ENV):
        return os.environ[SOC_ENV]
    module = torch_npu()
    if module not in _soc_cache:
        try:
            _soc_cache[module] = str(module.npu.get_device_name(0))
        except Exception:
            _soc_cache[module] = "unknown"
    return _soc_cache[module]


def capabilities() -> frozenset[str]:
    """The capability flags of the chip at hand."""
    return GENERATION_CAPS[generation(soc_name())]


def has(capability: str) -> bool:
    return capability in capabilities()


def declared_capabilities() -> frozenset[str]:
    """Capabilities for the BackendSpec, computed without touching a device: the named or emulated chip's when
    that is known cheaply, else the target's (Ascend 950); ops still check ``has()`` at run time."""
    if os.environ.get(SOC_ENV) or double_on_path():
        return capabilities()
    return TARGET_CAPS
