"""Backend selection: use(), the environment, the build-time default, auto-detection, and their errors."""

from __future__ import annotations

import warnings

import pytest
import torch
from fake_plugins import backend_module

import deepinfer
from deepinfer import ops, registry, selection
from deepinfer.errors import BackendError, FallbackWarning, NotSupportedError


def test_reference_is_built_in_and_always_available():
    assert "reference" in deepinfer.available_backends()
    with deepinfer.use("cpu") as spec:  # alias
        assert spec.name == "reference"
        assert deepinfer.current_backend().name == "reference"


def test_use_as_context_manager_restores_previous(plugins):
    plugins("fake_a", {"fake_a": "fake_a"}, {"fake_a": backend_module("fake_a")})
    assert deepinfer.current_backend().name == "reference"
    with deepinfer.use("fake_a"):
        assert deepinfer.current_backend().name == "fake_a"
        with deepinfer.use("reference"):
            assert deepinfer.current_backend().name == "reference"
        assert deepinfer.current_backend().name == "fake_a"
    assert deepinfer.current_backend().name == "reference"


def test_unknown_backend_error_lists_installed_and_available(plugins):
    plugins("fake_off", {"fake_off": "fake_off"}, {"fake_off": backend_module("fake_off", available=False)})
    with pytest.raises(BackendError) as e:
        deepinfer.use("nope")
    msg = str(e.value)
    assert "'nope'" in msg and "not installed" in msg
    assert "reference: available" in msg and "fake_off: unavailable (probe says no device here)" in msg


def test_unavailable_backend_error_names_the_reason(plugins):
    plugins(
        "fake_off",
        {"fake_off": "fake_off"},
        {"fake_off": backend_module("fake_off", device_type="cuda", available=False)},
    )
    with pytest.raises(BackendError, match="not available: probe says no device here"):
        deepinfer.use("fake_off")


def test_environment_variable_selects_and_errors(plugins, monkeypatch):
    plugins("fake_a", {"fake_a": "fake_a"}, {"fake_a": backend_module("fake_a", aliases=("fa",))})
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "fa")
    selection.clear_cache()
    spec, how = selection.resolve()
    assert spec.name == "fake_a" and how == "DEEPINFER_ACCELERATOR=fa"
    with deepinfer.use("reference"):  # use() wins over the environment
        assert deepinfer.current_backend().name == "reference"
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "missing")
    selection.clear_cache()
    with pytest.raises(BackendError, match="DEEPINFER_ACCELERATOR=missing"):
        deepinfer.current_backend()


def test_build_time_default_applies_after_the_environment(plugins, monkeypatch):
    plugins("fake_a", {"fake_a": "fake_a"}, {"fake_a": backend_module("fake_a")})
    monkeypatch.setattr(selection, "build_default", lambda: "fake_a")
    selection.clear_cache()
    assert selection.resolve() == (registry.get().backends["fake_a"], "build-time default (fake_a)")
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "reference")
    selection.clear_cache()
    assert deepinfer.current_backend().name == "reference"


def test_auto_detect_one_none_or_several_hardware_backends(plugins):
    assert selection.resolve()[1] == "auto-detected: no hardware backend is available"
    plugins("fake_gpu", {"fake_gpu": "fake_gpu"}, {"fake_gpu": backend_module("fake_gpu", device_type="cuda")})
    assert selection.resolve() == (
        registry.get().backends["fake_gpu"],
        "auto-detected: the only available hardware backend",
    )
    plugins("fake_npu", {"fake_npu": "fake_npu"}, {"fake_npu": backend_module("fake_npu", device_type="npu")})
    with pytest.raises(BackendError, match=r"several hardware backends are available: \['fake_gpu', 'fake_npu'\]"):
        selection.resolve()


def test_cpu_plugins_are_never_auto_detected(plugins):
    plugins("fake_a", {"fake_a": "fake_a"}, {"fake_a": backend_module("fake_a", device_type="cpu")})
    assert deepinfer.current_backend().name == "reference"


def test_broken_plugin_is_listed_not_fatal(plugins):
    plugins("fake_broken", {"fake_broken": "fake_broken"}, {"fake_broken": "raise ImportError('libvendor.so missing')"})
    reg = registry.get()
    assert "libvendor.so missing" in reg.failures["fake_broken"]
    assert deepinfer.current_backend().name == "reference"
    with pytest.raises(BackendError, match=r"its plugin failed to load: ImportError: libvendor\.so missing"):
        deepinfer.use("fake_broken")


def test_raising_probe_means_unavailable(plugins):
    source = backend_module("fake_p").replace('probe=lambda: (True, "probe says yes")', "probe=lambda: 1 / 0")
    plugins("fake_p", {"fake_p": "fake_p"}, {"fake_p": source})
    ok, reason = registry.get().probe("fake_p")
    assert not ok and "ZeroDivisionError" in reason


def test_duplicate_backend_name_is_a_plugin_error(plugins):
    plugins("fake_dup", {"fake_dup": "fake_dup"}, {"fake_dup": backend_module("reference")})
    assert "already taken by plugin 'reference'" in registry.get().failures["fake_dup"]
    assert registry.get().plugin_of["reference"] == "reference"


def test_duplicate_op_provider_is_a_plugin_error(plugins):
    impl = "OpImpl('rms_norm', 'fake_d', 'torch', lambda **kw: None)"
    plugins("fake_d", {"fake_d": "fake_d"}, {"fake_d": backend_module("fake_d", impls=f"[{impl}, {impl}]")})
    assert "duplicate implementation of 'rms_norm' by provider 'torch'" in registry.get().failures["fake_d"]


def test_unknown_op_and_foreign_backend_are_plugin_errors(plugins):
    plugins(
        "fake_u",
        {"fake_u": "fake_u"},
        {"fake_u": backend_module("fake_u", impls="[OpImpl('matmul', 'fake_u', 't', print)]")},
    )
    assert "unknown op 'matmul'" in registry.get().failures["fake_u"]
    plugins(
        "fake_v",
        {"fake_v": "fake_v"},
        {"fake_v": backend_module("fake_v", impls="[OpImpl('gemm', 'reference', 't', print)]")},
    )
    assert "not one this plugin provides" in registry.get().failures["fake_v"]


def test_misspelled_hook_is_caught_by_check_pending(plugins):
    source = backend_module("fake_h") + "\n@deepinfer.hookimpl\ndef deepinfer_op_impl():\n    return []\n"
    plugins("fake_h", {"fake_h": "fake_h"}, {"fake_h": source})
    assert "deepinfer_op_impl" in registry.get().failures["fake_h"]


def test_plugin_allow_list(plugins, monkeypatch):
    plugins("fake_a", {"fake_a": "fake_a"}, {"fake_a": backend_module("fake_a")})
    plugins("fake_b", {"fake_b": "fake_b"}, {"fake_b": backend_module("fake_b")})
    monkeypatch.setenv("DEEPINFER_PLUGINS", "fake_b")
    reg = registry.reload()
    assert "fake_b" in reg.backends and "fake_a" not in reg.backends and "fake_a" in reg.skipped
    with pytest.raises(BackendError, match="not listed in DEEPINFER_PLUGINS"):
        deepinfer.use("fake_a")


def _supports_small(x, w, eps, residual):
    return x.shape[0] < 4


RMS_IMPL = "[OpImpl('rms_norm', 'fake_r', 'half', lambda x, w, eps, residual: (x * 0.5, x), supports=_small)]"
RMS_SOURCE = backend_module("fake_r", impls=RMS_IMPL) + (
    "\ndef _small(x, w, eps, residual):\n    return x.shape[0] < 4\n"
)


def test_supports_predicate_and_one_time_fallback_warning(plugins):
    plugins("fake_r", {"fake_r": "fake_r"}, {"fake_r": RMS_SOURCE})
    x, w = torch.randn(2, 8), torch.ones(8)
    with deepinfer.use("fake_r"):
        y, _ = ops.rms_norm(x, w, 1e-6)
        assert torch.equal(y, x * 0.5)  # the plugin ran
        big = torch.randn(6, 8)
        with pytest.warns(FallbackWarning, match="rms_norm: backend 'fake_r' has no implementation"):
            y, _ = ops.rms_norm(big, w, 1e-6)
        ref = big / big.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
        torch.testing.assert_close(y, ref)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ops.rms_norm(big, w, 1e-6)  # second time: no warning


def test_strict_mode_refuses_the_fallback(plugins, monkeypatch):
    plugins("fake_r", {"fake_r": "fake_r"}, {"fake_r": RMS_SOURCE})
    monkeypatch.setenv("DEEPINFER_STRICT", "1")
    with deepinfer.use("fake_r"), pytest.raises(NotSupportedError, match="DEEPINFER_STRICT=1"):
        ops.rms_norm(torch.randn(6, 8), torch.ones(8), 1e-6)


def test_batch_invariant_mode_uses_only_declared_implementations(plugins):
    plugins("fake_r", {"fake_r": "fake_r"}, {"fake_r": RMS_SOURCE})
    x, w = torch.randn(2, 8), torch.ones(8)
    with deepinfer.use("fake_r"), deepinfer.batch_invariant(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        y, _ = ops.rms_norm(x, w, 1e-6)
    assert not torch.equal(y, x * 0.5)  # the undeclared plugin implementation was skipped


@pytest.mark.parametrize(
    ("argv", "source"),
    [
        (["generate", "--backend", "bogus"], "--backend bogus"),
        (["bench", "--quick", "--backend", "bogus"], "--backend bogus"),
        (["conformance", "--backend", "bogus"], "--backend bogus"),
    ],
)
def test_cli_backend_errors_name_the_flag(argv, source, capsys):
    from deepinfer.cli import main

    assert main(argv) == 2
    out = capsys.readouterr().out
    assert f"error: backend 'bogus' (chosen by {source}) cannot be used: it is not installed" in out
    assert "deepinfer.use" not in out


def test_llm_backend_error_names_the_argument(tmp_path, plugins):
    from deepinfer.model import LLM

    module = backend_module("fake_off", device_type="cuda", available=False, aliases=("off",))
    plugins("fake_off", {"fake_off": "fake_off"}, {"fake_off": module})
    with pytest.raises(BackendError) as e:
        LLM(tmp_path, backend="off")  # an alias of a backend that cannot run here, as "npu" without torch_npu
    msg = str(e.value)
    assert msg.startswith("backend 'fake_off' (chosen by LLM(backend='off')) is not available: probe says no device")
    assert "deepinfer.use" not in msg
    with pytest.raises(BackendError, match=r"\(chosen by deepinfer.use\('bogus'\)\) cannot be used"):
        deepinfer.use("bogus")


WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # import triton fails as if it were not installed
import deepinfer_cuda_sm100.plugin  # the plugin module itself needs no triton
from deepinfer.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_cuda_sm100_without_triton_says_so_and_keeps_its_aliases():
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEEPINFER_", "TRITON_"))}
    run = lambda *args, **extra: subprocess.run(
        [sys.executable, "-c", WITHOUT_TRITON, *args], capture_output=True, text=True, env={**env, **extra}
    )
    info = run("info")
    assert info.returncode == 0, info.stderr
    row = next(line for line in info.stdout.splitlines() if "cuda_sm100" in line)
    assert "cuda, nvidia" in row and "triton is not installed (pip install 'deepinfer[cuda]')" in row, info.stdout
    assert "plugin failed to load" not in info.stdout
    chosen = run("info", DEEPINFER_ACCELERATOR="cuda")
    assert "backend 'cuda_sm100' (DEEPINFER_ACCELERATOR=cuda) is not available: triton is not installed" in " ".join(
        chosen.stdout.split()
    ), chosen.stdout
