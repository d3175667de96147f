"""What a run shows while it trains, and its token rates.

On a terminal (stdout and stderr both) with ``run.progress`` on, a progress bar shows the loss and
the tokens per second of the last logging window; otherwise (a log file, ``run.progress=false``) a
plain line is printed every ``run.log_every`` steps. Validation results are printed when they are
computed, under the bar or as plain lines. Only rank 0 speaks.

Example:
    >>> console = Console(start=0, total=2, main=True, bar=False)
    >>> console.logged(1, {"loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tok_s": 1234.0})
    step 1/2: loss 2.5000, lr 1.00e-03, grad_norm 0.500, tok_s 1,234
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Iterator, Mapping


def on_terminal() -> bool:
    """Whether stdout and stderr (where the bar draws) are both terminals."""
    return sys.stdout.isatty() and sys.stderr.isatty()


class TokenRate:
    """Tokens per second over the last logging window (time inside :meth:`paused`, such as evaluating
    and saving, left out) and since this process started training (everything counted).

    Example:
        >>> rate = TokenRate(tokens=0)
        >>> rate.window(tokens=100) > 0
        True
    """

    def __init__(self, tokens: int) -> None:
        now = time.perf_counter()
        self.start, self.start_tokens = now, tokens
        self.mark, self.mark_tokens, self.excluded = now, tokens, 0.0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside is not part of the current window."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.excluded += time.perf_counter() - began

    def window(self, tokens: int) -> float:
        """Tokens per second since the previous call (or the start); begins the next window."""
        now = time.perf_counter()
        rate = (tokens - self.mark_tokens) / max(now - self.mark - self.excluded, 1e-9)
        self.mark, self.mark_tokens, self.excluded = now, tokens, 0.0
        return rate

    def cumulative(self, tokens: int) -> float:
        """Tokens per second since training started in this process, every pause included."""
        return (tokens - self.start_tokens) / max(time.perf_counter() - self.start, 1e-9)


def _line(step: int, total: int, values: Mapping[str, float], names: tuple[str, ...]) -> str:
    shown = {"loss": "{:.4f}", "lr": "{:.2e}", "grad_norm": "{:.3f}", "tok_s": "{:,.0f}", "skipped_steps": "{:d}"}
    parts = [f"{name} {shown.get(name, '{:.4f}').format(values[name])}" for name in names if name in values]
    return f"step {step}/{total}: " + ", ".join(parts)


class Console:
    """The progress bar, or plain lines, of one training run (see the module docstring)."""

    LOGGED = ("loss", "lr", "grad_norm", "tok_s")  # the metrics of a plain line

    def __init__(self, start: int, total: int, *, main: bool, bar: bool) -> None:
        from tqdm.auto import tqdm

        self.main, self.total, self.bar_on, self.rate = main, total, main and bar, None
        self.bar = tqdm(total=total, initial=start, disable=not self.bar_on, desc="train", unit="step",
                        dynamic_ncols=True)

    def step(self, loss: float) -> None:
        """One optimiser step done: the bar moves and shows its loss (and the last window's rate)."""
        self.bar.update(1)
        rate = {} if self.rate is None else {"tok_s": f"{self.rate:,.0f}"}
        self.bar.set_postfix(loss=f"{loss:.4f}", **rate)

    def logged(self, step: int, values: Mapping[str, float]) -> None:
        """A logging step's metrics: the bar's rate, or a plain line."""
        self.rate = values.get("tok_s", self.rate)
        if self.main and not self.bar_on:
            skipped = ("skipped_steps",) if values.get("skipped_steps") else ()
            print(_line(step, self.total, values, self.LOGGED + skipped), flush=True)

    def evaluated(self, step: int, metrics: Mapping[str, float]) -> None:
        """Validation results, printed as they are computed."""
        if self.main and metrics:
            self.write(_line(step, self.total, metrics, tuple(metrics)))

    def write(self, text: str) -> None:
        """A line above the bar (or a plain line); rank 0 only."""
        if self.bar_on:
            self.bar.write(text)
        elif self.main:
            print(text, flush=True)

    def close(self) -> None:
        self.bar.close()
