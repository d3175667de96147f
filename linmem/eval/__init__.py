"""Evaluation: needle in a haystack, per-position loss, the lm-eval bridge and the suites of a run
(MQAR recall among them; the MQAR examples come from :mod:`linmem.data.mqar`).

Names load on first use (importing ``linmem.eval`` pulls in neither torch nor lm-eval), so the
command line builds its parser at once.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "niah": ("NIAH_TASKS", "NiahResult", "build_prompt", "plot_niah", "run_niah", "string_match_all"),
    "position_loss": ("PositionCurve", "extrapolation_rows", "plot_position_loss", "position_loss",
                      "write_position_loss"),
    "runs": ("EvalRun", "open_run"),
    "suites": ("SUITES", "EvalOptions", "evaluate_run", "format_summary"),
    "command": ("add_eval_arguments", "run_eval_command"),
    "harness": ("LinmemLM", "run_harness"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'linmem.eval' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
