"""The conformance suite can fail: planted bugs in a third-party plugin are reported case by case, a correct plugin
passes, and the CLI and pytest forms report the same verdicts. The example plugins are found through their entry
points, exactly as an outside vendor's would be: installed with ``pip install tests/plugins/deepinfer_example``, or
(without that) through the ``*.dist-info`` that ``tests/conftest.py`` writes for them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest

from deepinfer import registry
from deepinfer.conformance import run_conformance
from deepinfer.conformance.runner import all_cases


def _by_check(report, op: str, check: str) -> dict[str, str]:
    return {r.case: r.status for r in report.results if r.op == op and r.check == check}


def test_example_plugins_are_installed_through_entry_points():
    reg = registry.get()
    assert reg.plugin_of.get("example_cpu") == "example_cpu"
    assert reg.plugin_of.get("example_buggy") == "example_buggy"


def test_reference_passes_every_check():
    report = run_conformance("reference", seed=11)
    assert not report.failed, report.failed
    checks = {r.check for r in report.results}
    assert checks == {"accuracy", "strided", "determinism", "batch_invariance", "bad_input"}
    assert sum(r.check == "bad_input" for r in report.results) >= 50


def test_correct_plugin_passes_and_serves_its_ops():
    report = run_conformance("example_cpu", seed=12)
    assert not report.failed, report.failed
    served = {r.op for r in report.results if r.check == "accuracy" and r.impl.startswith("example_cpu/")}
    assert served == {"gemm", "rms_norm", "mla_decode", "silu_and_mul"}
    invariant = _by_check(report, "silu_and_mul", "batch_invariance")
    assert invariant and set(invariant.values()) == {"pass"}


def test_planted_bugs_fail_case_by_case():
    report = run_conformance("example_buggy", seed=13, only_ops=["mla_decode", "gemm", "rms_norm"])

    # Off-by-one causal limit: every decode case with rows reads one position too many.
    mla = _by_check(report, "mla_decode", "accuracy")
    assert len(mla) == len([c for c in all_cases("small") if c.op == "mla_decode"])
    for case, status in mla.items():
        assert status == "pass" if " B=0 " in case else status in ("fail", "error"), (case, status)

    # Wrong scale: only FP8 x FP8 products whose weight has more than one 128-row block go wrong.
    gemm = _by_check(report, "gemm", "accuracy")
    for case, status in gemm.items():
        n = int(re.search(r"N=(\d+)", case).group(1))
        fp8_both = case.split()[3] == "fp8"
        expected = "fail" if fp8_both and n > 128 else ("pass" if fp8_both else "fallback")
        assert status == expected, (case, status)
    assert "fail" in gemm.values() and "pass" in gemm.values()

    # Batch-dependent reduction: accurate everywhere, but not invariant once a batch takes the "fast path".
    assert set(_by_check(report, "rms_norm", "accuracy").values()) == {"pass"}
    invariance = _by_check(report, "rms_norm", "batch_invariance")
    for case, status in invariance.items():
        tokens = int(re.search(r"T=(\d+)", case).group(1))
        assert status == ("fail" if tokens >= 8 else "pass"), (case, status)
    assert "fail" in invariance.values()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepinfer.cli", *args], capture_output=True, text=True)


def test_cli_exit_codes_and_json_report(tmp_path):
    bad = _cli("conformance", "--backend", "example_buggy", "--ops", "rms_norm", "--report", str(tmp_path / "b.json"))
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "FAILED example_buggy" in bad.stdout
    body = json.loads((tmp_path / "b.json").read_text())
    assert body["passed"] is False and body["backend"] == "example_buggy"
    assert any(r["check"] == "batch_invariance" and r["status"] == "fail" for r in body["results"])

    good = _cli("conformance", "--backend", "example_cpu", "--ops", "rms_norm,gemm", "--seed", "5")
    assert good.returncode == 0, good.stdout + good.stderr
    assert "PASSED example_cpu" in good.stdout and "(seed 5)" in good.stdout

    missing = _cli("conformance", "--backend", "nope")
    assert missing.returncode == 2
    assert "not installed" in missing.stdout and "example_cpu: available" in missing.stdout


def test_info_lists_backends_and_op_resolution():
    out = _cli("info", "--ops", "--backend", "example_cpu")
    assert out.returncode == 0, out.stderr
    assert "Selected backend: reference" in out.stdout
    assert re.search(r"gemm\s+│\s+torch-blocked", out.stdout)
    assert "reference (fallback)" in out.stdout


@pytest.mark.slow
def test_pytest_plugin_form_reports_the_same_failures():
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--pyargs",
        "deepinfer.conformance",
        "--deepinfer-backend",
        "example_buggy",
        "-k",
        "rms_norm",
        "--deepinfer-seed",
        "3",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 1, out.stdout
    assert re.search(r"2 failed, \d+ passed", out.stdout), out.stdout
    assert re.search(r"row \d+ alone differs", out.stdout)


SPLIT_PROVIDERS = textwrap.dedent("""
    import deepinfer
    from deepinfer import BackendSpec, OpImpl
    from deepinfer.reference import norm

    def five_percent_off(**kw):
        y, h = norm.rms_norm(**kw)
        return y * 1.05, h

    @deepinfer.hookimpl
    def deepinfer_backend():
        return BackendSpec(name="fake_split", device_type="cpu", probe=lambda: (True, "yes"))

    @deepinfer.hookimpl
    def deepinfer_op_impls():
        return [
            OpImpl("rms_norm", "fake_split", "fast", norm.rms_norm, batch_invariant=False, priority=1),
            OpImpl("rms_norm", "fake_split", "fixed", five_percent_off, batch_invariant=True),
        ]
    """)


def test_a_wrong_batch_invariant_implementation_fails_its_accuracy(plugins):
    """The default mode runs a correct provider; batch-invariant mode runs another one, deterministic and invariant
    but 5% off: only its own accuracy check can catch it."""
    plugins("fake_split", {"fake_split": "fake_split"}, {"fake_split": SPLIT_PROVIDERS})
    report = run_conformance("fake_split", seed=14, only_ops=["rms_norm"])
    checks = [r for r in report.results if r.check == "accuracy"]
    default = [r for r in checks if r.impl == "fake_split/fast"]
    invariant = [r for r in checks if r.impl == "fake_split/fixed"]
    assert default and {r.status for r in default} == {"pass"}
    empty = [r for r in invariant if r.case.startswith("T=0 ") or " H=0 " in r.case]  # nothing to be off
    assert empty and {r.status for r in empty} == {"pass"}
    assert {r.status for r in invariant if r not in empty} == {"fail"}
    assert all(r.detail.startswith("batch-invariant mode") for r in invariant)
    assert {r.status for r in report.results if r.check == "batch_invariance"} == {"pass"}


def test_pytest_form_with_an_unknown_backend_is_one_usage_error():
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "deepinfer.conformance"]
    out = subprocess.run([*cmd, "--deepinfer-backend", "bogus"], capture_output=True, text=True)
    assert out.returncode == pytest.ExitCode.USAGE_ERROR, out.stdout + out.stderr
    assert "backend 'bogus' (chosen by --deepinfer-backend bogus) cannot be used: it is not installed" in out.stderr
    assert "reference: available" in out.stderr
    assert "failed" not in out.stdout and "AttributeError" not in out.stdout + out.stderr


def test_planted_sparse_attention_bugs_fail_where_they_show():
    report = run_conformance("example_buggy", seed=14, only_ops=["indexer_topk", "sparse_mla"])

    # Ties to the higher position: random scores have no ties and pass within the tolerance of the score gap; the
    # integer-valued cases, full of exact ties, fail.
    topk = _by_check(report, "indexer_topk", "accuracy")
    assert topk and all(s == ("fail" if "exact ties" in c else "pass") for c, s in topk.items()), topk

    # A -1 ending the row: every case with queries shuffles some rows' -1 entries in among their slots, and fails.
    sparse = _by_check(report, "sparse_mla", "accuracy")
    assert sparse and all(s == ("pass" if " T=0 " in c else "fail") for c, s in sparse.items()), sparse


def test_a_planted_bitmask_bug_fails_every_case():
    report = run_conformance("example_buggy", seed=15, only_ops=["apply_token_bitmask"])
    accuracy = _by_check(report, "apply_token_bitmask", "accuracy")
    # rows with every token or none allowed read the same either way; the random rows do not
    assert accuracy and all(s == ("pass" if c.startswith("B=0 ") else "fail") for c, s in accuracy.items()), accuracy


def test_planted_stride_bug_fails_only_on_non_contiguous_inputs():
    """``slot_mapping`` read as if contiguous: right on every case as drawn, wrong on the same slots in a strided
    view wherever there are two tokens or more (the cache must stay contiguous: its contract says so)."""
    report = run_conformance("example_buggy", seed=15, only_ops=["write_kv_cache"])
    assert set(_by_check(report, "write_kv_cache", "accuracy").values()) == {"pass"}
    strided = _by_check(report, "write_kv_cache", "strided")
    assert len(strided) == len([c for c in all_cases("small") if c.op == "write_kv_cache"])
    for case, status in strided.items():
        tokens = int(re.search(r"T=(\d+)", case).group(1))
        assert status == ("fail" if tokens >= 2 else "pass"), (case, status)
    assert "fail" in strided.values()
