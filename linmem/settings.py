"""Fields of the config dataclasses that carry their one-line meaning.

Every field of a config section is declared with :func:`setting` (a value) or :func:`section`
(a nested section), so that its meaning is data the program can read: the config reference
(``docs/config.md``, :mod:`linmem.train.config_reference`) and ``linmem train --help`` are
generated from it and cannot drift from the code. Nothing here imports torch.

Example:
    >>> from dataclasses import dataclass, fields
    >>> @dataclass
    ... class Example:
    ...     steps: int = setting(10, "optimiser steps")
    ...     sizes: list[int] = setting([1, 2], "a mutable default is copied for every instance")
    >>> [meaning(f) for f in fields(Example)]
    ['optimiser steps', 'a mutable default is copied for every instance']
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

_DOC = "doc"


def setting(default: Any, doc: str) -> Any:
    """A dataclass field with ``default`` (lists and dicts are copied for each instance) and its meaning ``doc``."""
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata={_DOC: doc})
    return dataclasses.field(default=default, metadata={_DOC: doc})


def section(cls: type, doc: str) -> Any:
    """A nested config section: a fresh ``cls()`` for each instance, with its meaning ``doc``."""
    return dataclasses.field(default_factory=cls, metadata={_DOC: doc})


def meaning(field: dataclasses.Field) -> str:
    """The one-line meaning a field was declared with ("" if it has none)."""
    return field.metadata.get(_DOC, "")
