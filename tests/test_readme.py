"""The README's examples are themselves tests, and its quick start has exactly two commands."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_python_examples_run():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "the README must hold a python example"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {"__name__": "readme"})


def test_quick_start_has_two_commands_and_ci_runs_the_second():
    out = subprocess.run([sys.executable, str(ROOT / ".ci" / "readme_command.py"), "test"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert "pytest" in out
    assert "readme_command.py test" in (ROOT / ".ci" / "run").read_text()
