"""Every Python example of ``docs/*.md`` runs as it is written (the README's: ``tests/test_readme.py``).

An example that cannot run here (it needs a GPU, torchrun's ranks, or a trained run) says so and why in
an HTML comment on the line before its fence, which readers of the rendered page do not see::

    <!-- not run: needs torchrun's ranks and CUDA -->
    ```python
    ...
    ```

Such an example is compiled but not run; every other one must run without an error, each in a fresh
namespace, in a temporary working directory (for the files it writes). Tracebacks carry the page's line
numbers.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
NOT_RUN = "<!-- not run:"
EXAMPLE = re.compile(r"^(?:<!-- not run: (?P<reason>.*?) -->\n)?```python\n(?P<code>.*?)^```$", re.S | re.M)


def examples(text: str) -> list[tuple[int, str, Optional[str]]]:
    """The ``python`` examples of a page: (line of their first code line, code, the reason not to run or None).

    Example:
        >>> examples("a\\n```python\\nx = 1\\n```\\n<!-- not run: GPU -->\\n```python\\ny\\n```\\n")
        [(3, 'x = 1\\n', None), (7, 'y\\n', 'GPU')]
    """
    return [(text.count("\n", 0, m.start("code")) + 1, m.group("code"), m.group("reason"))
            for m in EXAMPLE.finditer(text)]


PAGES = [page for page in sorted(DOCS.glob("*.md")) if examples(page.read_text())]


@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_doc_examples_run(page: Path, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    for line, code, reason in examples(page.read_text()):
        compiled = compile("\n" * (line - 1) + code, str(page), "exec")
        if reason is None:
            exec(compiled, {"__name__": f"docs.{page.stem}"})


def test_every_python_fence_and_mark_is_an_example() -> None:
    """A ```py / ```python3 fence or a "not run" mark that is not on an example's line would hide it."""
    assert PAGES, "docs/ holds no python example"
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        found = examples(text)
        fences = re.findall(r"^```py\w*", text, re.M)
        assert all(f == "```python" for f in fences), f"{page.name}: fence {set(fences)}; write ```python"
        assert len(found) == len(fences), f"{page.name}: a ```python block without its closing fence"
        marks = sum(reason is not None for _, _, reason in found)
        assert text.count(NOT_RUN) == marks, f"{page.name}: a '{NOT_RUN}' mark that is not right before a ```python"
        assert all(reason is None or reason.strip() for _, _, reason in found), f"{page.name}: a mark with no reason"
