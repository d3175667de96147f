"""The Python examples of docs/liger.md run as they are."""

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "liger.md"


def test_liger_doc_python_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert blocks, "docs/liger.md must hold a runnable python example"
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), {"__name__": "liger_doc"})
