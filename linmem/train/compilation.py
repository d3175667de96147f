"""Compiled training steps: where ``torch.compile`` keeps its caches, and what the console says while it compiles
(CUDA-graph steps: :mod:`linmem.train.graphs`).

Compilation is regional: each block of the stack is compiled on its own (:func:`~linmem.distributed.apply_compile`),
so blocks of one kind share their compiled code and compile time does not grow with depth. It happens during the
first step, which would otherwise look like a hang: :class:`CompileProgress` prints a line as each graph starts and
ends, and the total goes to ``metrics.jsonl`` as ``compile_s``.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional

logger = logging.getLogger("linmem.train")

__all__ = ["use_compile_cache", "CompileProgress"]


def use_compile_cache(folder: Optional[str]) -> Optional[Path]:
    """Point inductor's and Triton's caches at ``folder`` (created if needed), so that a later run naming the same
    folder reuses the compiled graphs and kernels of the same model; None keeps torch's default
    (``/tmp/torchinductor_$USER``, Triton's ``~/.triton/cache``). Call before anything compiles. Returns the folder."""
    if folder is None:
        return None
    path = Path(folder).expanduser().resolve()
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"run.compile_cache={folder!r} is a file, not a folder")
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    os.environ["TRITON_CACHE_DIR"] = str(path / "triton")
    return path


class CompileProgress:
    """While active, a console line as each ``torch.compile`` graph (dynamo's forward graphs and, on torch >= 2.8,
    the lazily compiled backward graphs) starts and ends; ``seconds`` and ``graphs`` count them.

    Example:
        >>> with CompileProgress(print) as progress:  # doctest: +SKIP
        ...     loss = compiled_model(ids, labels=ids).loss; loss.backward()
        >>> progress.seconds, progress.graphs  # doctest: +SKIP
    """

    def __init__(self, say: Callable[[str], Any]) -> None:
        self.say = say
        self.seconds = 0.0
        self.graphs = 0
        self._started: Optional[float] = None

    def _start(self, *args: Any) -> None:  # torch < 2.8 passes nothing, later torch a CallbackArgs
        self._started = time.perf_counter()
        self.graphs += 1
        self.say(f"compiling graph {self.graphs}{_trigger(args)} ...")

    def _end(self, *args: Any) -> None:
        if self._started is None:
            return
        took = time.perf_counter() - self._started
        self.seconds += took
        self._started = None
        self.say(f"compiled graph {self.graphs}{_trigger(args)} in {took:.1f} s ({self.seconds:.1f} s so far)")

    def __enter__(self) -> "CompileProgress":
        from torch._dynamo.callback import callback_handler

        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)
        return self

    def __exit__(self, *exc: Any) -> None:
        from torch._dynamo.callback import callback_handler

        callback_handler.remove_start_callback(self._start)
        callback_handler.remove_end_callback(self._end)


def _trigger(args: tuple) -> str:
    """" (backward)" for a lazily compiled backward graph, else "" (as far as the torch version says)."""
    trigger = getattr(args[0], "callback_trigger", None) if args else None
    return " (backward)" if trigger is not None and "BACKWARD" in getattr(trigger, "name", "") else ""

