"""``deepinfer generate``: the README's first command works on a CPU with no download (the embedded model), the
random-weight test checkpoint is the same bytes on every machine, and the model is never imported unless asked
for."""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import subprocess
import sys

import pytest
from model_helpers import one_thread  # noqa: F401 (autouse fixture)

from deepinfer import InputError, cli
from deepinfer.model import LLM, RequestError, SamplingParams
from deepinfer.model import cli as model_cli
from deepinfer.model.embedded import checkpoint_dir
from deepinfer.model.tiny import TINY_CONFIG, write_checkpoint

# sha256 of the random test checkpoint's model.safetensors: its weights come from a fixed seed of NumPy's frozen
# RandomState stream, so this holds on every machine (a change here changes every test that uses it).
TINY_WEIGHTS_SHA256 = "9fa30cd2984bc96138fa21fb4eb16c1f88318e6629352912e2229750c2248687"


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tiny_checkpoint_is_deterministic(tmp_path):
    a, b = write_checkpoint(tmp_path / "a"), write_checkpoint(tmp_path / "b")
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert json.loads((a / "config.json").read_text()) == TINY_CONFIG
    assert sha256(a / "model.safetensors") == TINY_WEIGHTS_SHA256


def test_llm_with_no_path_runs_the_embedded_model():
    llm = LLM(progress=False)
    assert llm.path == checkpoint_dir("bf16")
    out = llm.generate("def fibonacci(n):", SamplingParams(max_tokens=8, temperature=0))[0]
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].text.strip()


def test_readme_first_command_runs_with_no_download():
    env = dict(os.environ)
    env.pop("DEEPINFER_ACCELERATOR", None)
    run = subprocess.run(
        [sys.executable, "-m", "deepinfer.cli", "generate", "--prompt", "def fibonacci(n):", "--max-tokens", "16"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "def fibonacci(n):" in run.stdout and "16 generated tokens" in run.stdout and "tokens/s" in run.stdout


def test_generate_batch_file_token_ids_and_sampling(tmp_path, capsys):
    batch = tmp_path / "prompts.txt"
    batch.write_text("\n".join(["[256, 72, 105]", *[f"prompt number {i}" for i in range(9)], ""]))
    argv = ["generate", "--batch", str(batch), "--max-tokens", "4", "--temperature", "0.7", "--seed", "5"]
    assert cli.main(argv) == 0
    first = capsys.readouterr().out
    assert "10 request(s)" in first and "prompt number 8" in first and "[256, 72, 105]" in first
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.split("\n")[:10] == first.split("\n")[:10], "same seed, same text"


@pytest.mark.parametrize("text", ["", "\n  \n\n"])
def test_a_batch_file_without_prompts_is_an_error_not_the_default_prompt(tmp_path, capsys, text):
    batch = tmp_path / "prompts.txt"
    batch.write_text(text)
    assert model_cli.read_prompts(argparse.Namespace(prompt=["x = 1"], batch=str(batch))) == ["x = 1"]
    assert cli.main(["generate", "--batch", str(batch), "--max-tokens", "1"]) == 2
    out = capsys.readouterr().out
    (line,) = [ln for ln in out.splitlines() if ln.strip()]
    assert line.startswith("error: --batch") and "no prompt" in line, line
    assert "France" not in out


def test_text_prompts_without_a_tokenizer_name_the_flag_for_token_ids(tmp_path, capsys):
    path = write_checkpoint(tmp_path / "no_tokenizer")
    (path / "tokenizer.json").unlink()
    assert cli.main(["generate", "--model", str(path), "--prompt", "[1, 2, 3]", "--max-tokens", "1"]) == 2
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    assert line.startswith("error: text prompts need a tokenizer.json") and "--batch" in line, line
    batch = tmp_path / "ids.txt"
    batch.write_text("[1, 2, 3]\n")
    assert cli.main(["generate", "--model", str(path), "--batch", str(batch), "--max-tokens", "1"]) == 0
    assert "[1, 2, 3] -> [" in capsys.readouterr().out


def test_fp8_cache_for_a_latent_not_in_groups_of_128_names_the_flag(tmp_path, capsys):
    from model_helpers import small_checkpoint

    path = small_checkpoint(tmp_path / "rank32")  # kv_lora_rank 32
    with pytest.raises(InputError, match=r"LLM: argument 'kv_format': expected bf16 .*kv_lora_rank.*\(32,"):
        LLM(path, "reference", kv_format="fp8_ds_mla", progress=False)
    for command in ("generate", "serve"):  # refused before the server starts
        assert cli.main([command, "--model", str(path), "--kv-format", "fp8_ds_mla"]) == 2
        out = capsys.readouterr().out
        assert "Traceback" not in out
        (line,) = [ln for ln in out.splitlines() if ln.strip()]
        assert line.startswith("error: argument --kv-format: expected bf16") and "multiple of 128" in line, line


def test_generate_reports_a_bad_checkpoint(tmp_path, capsys):
    assert cli.main(["generate", "--model", str(tmp_path / "nowhere")]) == 2
    assert "config.json: not found" in capsys.readouterr().out


@pytest.mark.parametrize("code", ["import deepinfer", "import deepinfer.cli as c; c.main(['info'])"])
def test_the_model_is_not_imported_unless_asked(code):
    probe = f"{code}\nimport sys\nassert 'deepinfer.model' not in sys.modules, 'deepinfer.model was imported'"
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny"))


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """``deepinfer ARGV`` in this process: its exit status and everything it printed."""
    try:
        status = cli.main(argv)
    except SystemExit as e:  # argparse's own errors and --help
        status = e.code
    out = capsys.readouterr()
    return status, out.out + out.err


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["generate", "--max-num-seqs", "0"], "--max-num-seqs"),
        (["generate", "--max-tokens", "0"], "--max-tokens"),
        (["generate", "--temperature", "nan"], "--temperature"),
        (["generate", "--temperature", "-1"], "--temperature"),
        (["generate", "--top-p", "2"], "--top-p"),
        (["generate", "--top-k", "-2"], "--top-k"),
        (["generate", "--seed", "x"], "--seed"),
        (["generate", "--ep", "0"], "--ep"),
        (["generate", "--dist-timeout", "0"], "--dist-timeout"),
        (["generate", "--max-model-len", "1"], "--max-model-len"),
        (["generate", "--max-model-len", "100000"], "--max-model-len"),  # above the model's positions
        (["generate", "--dtype", "float16"], "--dtype"),
        (["generate", "--eplb-window-size", "0"], "--eplb-window-size"),
        (["generate", "--eplb-rebalance-layers-per-chunk", "0"], "--eplb-rebalance-layers-per-chunk"),
        (["generate", "--enable-eplb", "--num-redundant-experts", "3"], "--num-redundant-experts"),  # no --ep
        (["conformance", "--backend", "reference", "--ops", "gemm,bogus"], "--ops"),
        (["conformance"], "--backend"),
        (["conformance", "--backend", "reference", "--ops", "rms_norm", "--seed", str(2**63)], "--seed"),
        (["bench", "--quick", "--ops", "bogus"], "--ops"),
        (["info", "--ops", "--backend", "bogus"], "--backend"),
        # a device torch cannot parse or allocate on, refused before any case runs
        (["conformance", "--backend", "reference", "--ops", "rms_norm", "--device", "bogus"], "--device"),
        (["bench", "--quick", "--ops", "rms_norm", "--device", "bogus"], "--device"),
        (["info", "--ops", "--shapes", "small", "--only", "rms_norm", "--device", "bogus"], "--device"),
        # an output file that cannot be written, refused before the run rather than a traceback after it
        (["conformance", "--backend", "reference", "--report", "/nonexistent-dir/report.json"], "--report"),
        (["conformance", "--backend", "reference", "--report", "."], "--report"),  # a directory
        (["bench", "--quick", "--json", "/nonexistent-dir/bench.json"], "--json"),
        (["bench", "--quick", "--results", "/nonexistent-dir/RESULTS.md"], "--results"),
        # an empty list of ops names none (a shell variable left empty), not all of them
        (["conformance", "--backend", "reference", "--ops", ""], "--ops"),
        (["bench", "--quick", "--ops", ""], "--ops"),
        (["info", "--ops", "--shapes", "small", "--only", ""], "--only"),
        # a flag that would be ignored without the one it refines
        (["info", "--shapes", "small"], "--shapes"),
        (["info", "--ops", "--only", "rms_norm"], "--only"),
        (["info", "--ops", "--device", "cpu"], "--device"),
    ],
)
def test_every_bad_flag_is_a_one_line_error(argv, flag, tiny, capsys):
    if argv[0] == "generate":
        argv = [*argv, "--model", str(tiny)]
    status, out = run_cli(argv, capsys)
    assert status == 2, out
    assert "Traceback" not in out
    (line,) = [ln for ln in out.splitlines() if ln.strip()]
    assert line.startswith("error: ") and flag in line, line
    assert any(word in line for word in ("expected", "invalid", "required")), line  # the last two: argparse's


def test_generate_passes_the_eplb_flags_to_the_llm(tiny, capsys, monkeypatch):
    got = {}

    def fake_llm(*args, **kw):
        got.update(kw)
        raise InputError("LLM", "model", "a stand-in", "stopped")

    monkeypatch.setattr(model_cli, "LLM", fake_llm)
    argv = ["generate", "--model", str(tiny), "--enable-eplb", "--eplb-window-size", "7"]
    status, _ = run_cli([*argv, "--eplb-step-interval", "11", "--eplb-rebalance-layers-per-chunk", "3"], capsys)
    assert status != 0
    assert (got["enable_eplb"], got["eplb_window_size"], got["eplb_step_interval"]) == (True, 7, 11)
    assert got["eplb_rebalance_layers_per_chunk"] == 3 and got["num_redundant_experts"] == 0


def test_help_lists_every_subcommand_and_describes_every_flag(capsys):
    status, out = run_cli(["--help"], capsys)
    assert status == 0 and "``" not in out
    parser = cli.build_parser()
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(subparsers.choices) == {"info", "conformance", "bench", "generate", "serve"}
    for name, sub in subparsers.choices.items():
        assert name in out
        assert sub.description and "``" not in sub.description, name
        for action in sub._actions:
            assert action.help and "``" not in action.help, (name, action.option_strings)
        status, text = run_cli([name, "--help"], capsys)  # renders (a bare % in a help text would raise)
        assert status == 0 and sub.description.split()[0] in text, name


def test_generate_prints_finish_reasons_and_says_when_the_context_capped_it(tiny, capsys, monkeypatch):
    base = ["generate", "--model", str(tiny), "--prompt", "Hello"]  # 6 tokens with BOS
    status, out = run_cli([*base, "--max-tokens", "3"], capsys)
    assert status == 0, out
    assert "[finish reason: length, 3 tokens]" in out and "note:" not in out
    status, out = run_cli([*base, "--max-tokens", "100", "--max-model-len", "16"], capsys)
    assert status == 0, out
    assert "[finish reason: length at the context length, 10 tokens]" in out
    assert "note: 1 request(s) stopped at the context length (16 tokens, prompt included) before --max-tokens 100" in (
        " ".join(out.split())
    )
    monkeypatch.setattr(model_cli, "LLM", functools.partial(LLM, num_blocks=1, block_size=16))  # 16 tokens of cache
    status, out = run_cli([*base, "--max-tokens", "100"], capsys)
    assert status == 0, out
    assert "at the cache's capacity" in out and "note: 1 request(s) stopped at the cache's capacity before" in out


def test_max_model_len_above_the_model_is_an_error(tiny):
    positions = json.loads((tiny / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(InputError) as e:
        LLM(tiny, progress=False, max_model_len=positions + 1)
    assert (
        e.value.arg == "max_model_len" and str(positions) in e.value.expected and e.value.actual == str(positions + 1)
    )
    assert LLM(tiny, progress=False, max_model_len=positions).max_model_len == positions
    with pytest.raises(InputError, match="argument 'max_num_seqs': expected an int >= 1, got 0"):
        LLM(tiny, progress=False, max_num_seqs=0)


def test_generate_takes_a_dict_of_sampling_fields(tiny):
    llm = LLM(tiny, progress=False)
    prompt = [256, 72, 105]
    want = llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0))[0].outputs[0].token_ids
    assert llm.generate(prompt, {"max_tokens": 4, "temperature": 0})[0].outputs[0].token_ids == want
    per_prompt = llm.generate([prompt, prompt], [{"max_tokens": 4, "temperature": 0}, {"max_tokens": 2}])
    assert per_prompt[0].outputs[0].token_ids == want and len(per_prompt[1].outputs[0].token_ids) == 2
    with pytest.raises(RequestError, match=r"unknown field\(s\) \['max_token'\]; the fields are max_tokens"):
        llm.generate(prompt, {"max_token": 4})


def test_ctrl_c_during_generate_is_one_line_and_exit_status_130(tiny, capsys, monkeypatch):
    """A ``KeyboardInterrupt`` a few steps into generation (as Ctrl-C raises it): one line, no traceback, 130."""
    from deepinfer.model.engine import LLMEngine

    step, steps = LLMEngine.step, []

    def interrupted(self):
        steps.append(self)
        if len(steps) == 3:
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", interrupted)
    status, out = run_cli(["generate", "--model", str(tiny), "--prompt", "Hello", "--max-tokens", "20"], capsys)
    assert status == 130, out
    assert "Traceback" not in out
    (line,) = [ln for ln in out.splitlines() if ln.strip()]
    assert "interrupted" in line, line
    assert not steps[-1].has_unfinished() and steps[-1].allocator.num_free == steps[-1].allocator.num_blocks
