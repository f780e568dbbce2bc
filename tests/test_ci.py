"""CI runs what the README tells a new user to run, and that is enough: ``.ci/run`` makes a fresh venv and runs
exactly the README's Quick start install commands and its test command, nothing else; and the suite itself needs
nothing those commands do not set up (it collects without Triton, where the ``[test]`` extra installs none)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _commands(block: str) -> list[str]:
    """The command lines of a shell snippet, without comments and blank lines."""
    lines = (re.sub(r"\s+#.*$|^#.*$", "", ln).strip() for ln in block.splitlines())
    return [ln for ln in lines if ln]


def readme_quick_start() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    return _commands(block)


def ci_commands() -> list[str]:
    """The commands of ``.ci/run`` once its fresh venv is active."""
    script = (ROOT / ".ci" / "run").read_text()
    before, activated = script.split("source .ci-venv/bin/activate\n", 1)
    assert "python3 -m venv .ci-venv" in before, "CI must start from a fresh venv"
    return _commands(activated)


def test_ci_runs_exactly_the_readme_install_and_test_commands():
    quick = readme_quick_start()
    install = [c for c in quick if c.startswith("pip install")]
    test = [c for c in quick if "pytest" in c]
    assert install == ["pip install torch==2.13.0", 'pip install -e ".[test]"'] and test == [
        "python -m pytest -q -n 2 --dist loadfile"
    ]
    assert ci_commands() == [*install, *test]
    tests_section = (ROOT / "README.md").read_text().split("\n## Tests", 1)[1]
    assert test[0] in _commands("\n".join(re.findall(r"```bash\n(.*?)```", tests_section, flags=re.S)))


def test_the_suite_collects_without_triton():
    """``import triton`` blocked as if it were not installed (``sys.modules['triton'] = None``): every test file
    still imports; those that need Triton skip with the reason shown."""
    code = (
        "import sys\n"
        "sys.modules['triton'] = None\n"
        "import pytest\n"
        "sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', 'tests']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "error" not in out.stdout.splitlines()[-1], out.stdout[-2000:]
