"""The reference of every config key, generated from the config dataclasses (``docs/config.md``).

Each key's type comes from its annotation, its default from the dataclass and its meaning from the
field's declaration (:func:`linmem.settings.setting`), so the reference cannot drift from the code;
a test fails when ``docs/config.md`` differs from :func:`config_reference`. Rewrite it with::

    python -m linmem.train.config_reference docs/config.md

Example:
    >>> rows = config_rows()
    >>> next(r for r in rows if r.key == "schedule.steps").default
    '1000'
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from ..settings import meaning
from .config import TrainConfig, type_name

INTRO = """\
# Config keys

Every key of a training config: its type, its default and what it does. A config starts from these
defaults, then a YAML file (`--config my.yaml`, nested as `section: {key: value}`) or a shipped recipe
(`--recipe NAME`, `linmem/recipes/`), then `section.key=value` overrides on the command line, e.g.

```bash
linmem train data.task=text data.text.paths=[my.txt] schedule.steps=200 run.out_dir=runs/mine
```

A list is written in brackets (`data.text.paths=[a.txt, docs/]`), `null` unsets an optional key,
`model.options.<field>=value` sets any other field of `LinmemConfig` and `model.options.<section>.<key>=value`
a mixer option (`model.options.mixer.window=64`, `model.options.moe.num_experts=4`; the sections are in
docs/mixers.md). Unknown keys and values outside their range are refused by name before anything runs.
This page is generated from the config dataclasses (`linmem/train/config.py`, the `data` section
`linmem/data/config.py`) by
`python -m linmem.train.config_reference docs/config.md`; do not edit it by hand.
"""


@dataclass(frozen=True)
class KeyRow:
    """One config key as the reference lists it."""

    key: str  # section.key, e.g. data.text.paths
    type: str  # e.g. "list[str]", "int or null"
    default: str  # as it would be written in YAML, e.g. "[]", "null", "0.02"
    meaning: str  # the field's one-line meaning


def _yaml_value(value: Any) -> str:
    """A default as it is written in YAML or on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value) if value != "" else '""'


def _rows(cls: type, prefix: str) -> list[KeyRow]:
    hints = typing.get_type_hints(cls)
    defaults = cls()
    rows = []
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            rows += _rows(hint, f"{prefix}{field.name}.")
            continue
        rows.append(KeyRow(prefix + field.name, type_name(hint), _yaml_value(getattr(defaults, field.name)),
                           meaning(field)))
    return rows


def config_rows() -> list[KeyRow]:
    """Every key of :class:`~linmem.train.config.TrainConfig`, in declaration order."""
    return _rows(TrainConfig, "")


def _sections(cls: type = TrainConfig, prefix: str = "") -> list[tuple[str, str, type]]:
    """(name, meaning, class) of every section and nested section, depth first."""
    found = []
    for field in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[field.name]
        if dataclasses.is_dataclass(hint):
            found.append((prefix + field.name, meaning(field), hint))
            found += _sections(hint, f"{prefix}{field.name}.")
    return found


def section_lines() -> list[str]:
    """One line per top-level section: its name and meaning (``linmem train --help`` lists them).

    Example:
        >>> section_lines()[0].split()[0]
        'model'
    """
    top = [(name, doc) for name, doc, _ in _sections() if "." not in name]
    width = max(len(name) for name, _ in top)
    return [f"{name:<{width}}  {doc}" for name, doc in top]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def config_reference() -> str:
    """The Markdown of ``docs/config.md``: one table per section (key, type, default, meaning)."""
    rows = config_rows()
    parts = [INTRO.rstrip()]
    for name, doc, _ in _sections():
        mine = [r for r in rows if r.key.rsplit(".", 1)[0] == name]
        if not mine:
            continue
        table = [f"| `{r.key}` | {_cell(r.type)} | `{r.default}` | {_cell(r.meaning)} |" for r in mine]
        parts.append("\n".join([f"## {name}\n\n{doc[0].upper()}{doc[1:]}.\n", "| key | type | default | meaning |",
                                 "|---|---|---|---|", *table]))
    return "\n\n".join(parts) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m linmem.train.config_reference PATH``: write the reference to PATH."""
    parser = argparse.ArgumentParser(prog="python -m linmem.train.config_reference", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="where to write it (docs/config.md)")
    path = Path(parser.parse_args(argv).path)
    path.write_text(config_reference())
    print(f"wrote {path} ({len(config_rows())} keys)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
