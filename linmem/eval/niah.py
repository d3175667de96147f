"""Needle in a haystack: RULER's retrieval tasks, offline, over local text.

Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language Models?"
(arXiv 2404.06654). A prompt hides needles, sentences ``One of the special magic numbers for
<key> is: <value>.``, in a haystack and ends by asking for the values of one or more keys; the
model continues the prompt greedily. The eight tasks, as RULER defines them:

    task                haystack   key     value    keys  values/key  queried keys
    niah_single_1       noise      word    number   1     1           1
    niah_single_2       text       word    number   1     1           1
    niah_single_3       text       word    uuid     1     1           1
    niah_multikey_1     text       word    number   4     1           1
    niah_multikey_2     needles    word    number   1     1           1
    niah_multikey_3     needles    uuid    uuid     1     1           1
    niah_multivalue     text       word    number   1     4           1
    niah_multiquery     text       word    number   4     1           4

``noise`` repeats one plain sentence, ``text`` is consecutive lines of local text (by default the
Python standard library's sources), ``needles`` is made of distractor needles with other keys. Keys
are adjective-noun words (``quiet-harbor``) or UUIDs, numbers have 7 digits. ``length`` counts the
prompt's tokens plus ``max_new_tokens`` (as RULER does): the haystack is the longest that fits.
``depth`` (percent) is where the first queried needle sits in the haystack; the other needles sit
at uniformly random depths.

Scoring is RULER's ``string_match_all``: the fraction of the needed values that appear
(case-insensitively) in the output. The output is the greedy continuation up to ``max_new_tokens``
tokens; with ``stop_at_newline`` (default) it ends at the first line break after the answer began,
which only saves time: every value is asked for on that one line.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import numpy as np
from torch import nn

from ..data.sources import stdlib_corpus
from .inference import greedy_generate, inference_mode

Encode = Callable[[str], list[int]]
Decode = Callable[[Sequence[int]], str]

NOISE_SENTENCE = "The river is wide. The hills are quiet. The road goes on and on. Nothing happens here."
ADJECTIVES = (
    "amber", "ancient", "bitter", "bold", "brave", "bright", "broken", "calm", "clever", "cold", "crimson", "curious",
    "dark", "distant", "dusty", "eager", "early", "empty", "faint", "fierce", "gentle", "golden", "grand", "green",
    "hidden", "hollow", "humble", "icy", "jolly", "kind", "late", "lazy", "little", "lively", "lonely", "loud",
    "lucky", "misty", "noble", "odd", "pale", "patient", "polite", "proud", "purple", "quick", "quiet", "rapid",
    "rare", "restless", "rough", "rusty", "sharp", "shy", "silent", "silver", "sleepy", "slow", "smooth", "soft",
    "steady", "swift", "tender", "wild",
)
NOUNS = (
    "anchor", "apple", "arrow", "badge", "basket", "beacon", "bell", "bridge", "candle", "canyon", "castle", "cedar",
    "cloud", "comet", "compass", "coral", "crown", "desert", "engine", "falcon", "feather", "forest", "fountain",
    "garden", "glacier", "harbor", "hammer", "island", "jacket", "kettle", "ladder", "lantern", "meadow", "mirror",
    "mountain", "needle", "oak", "ocean", "orchard", "otter", "palace", "pebble", "pencil", "planet", "pocket",
    "quarry", "rabbit", "river", "saddle", "shadow", "signal", "spring", "statue", "thunder", "tiger", "tower",
    "trumpet", "valley", "violin", "wagon", "whistle", "window", "winter", "zephyr",
)
#: The default grid of ``linmem eval --suite niah`` by device type: (evenly spaced depths, prompts per
#: (task, length, depth)). RULER's 10 x 10 on a GPU (2,400 prompts over 8 tasks and 3 lengths); on a CPU
#: 3 x 2 (144 prompts), which a small model answers in minutes.
NIAH_DEFAULTS = {"cuda": (10, 10), "cpu": (3, 2)}
KINDS = ("words", "numbers", "uuids")
HAYSTACKS = ("noise", "text", "needles")


class NiahError(ValueError):
    """A needle-in-a-haystack setting that cannot be built or scored."""


@dataclass(frozen=True)
class NiahTask:
    """One of RULER's retrieval tasks."""

    haystack: str  # noise, text or needles
    key_kind: str  # words or uuids (or numbers)
    value_kind: str  # numbers or uuids (or words)
    num_keys: int = 1  # keys with needles in the prompt
    num_values: int = 1  # needles (values) per key
    num_queries: int = 1  # keys asked for; their values are all needed

    def __post_init__(self) -> None:
        if self.haystack not in HAYSTACKS:
            raise NiahError(f"haystack must be one of {HAYSTACKS}, got {self.haystack!r}")
        for name in ("key_kind", "value_kind"):
            if getattr(self, name) not in KINDS:
                raise NiahError(f"{name} must be one of {KINDS}, got {getattr(self, name)!r}")
        if not 1 <= self.num_queries <= self.num_keys or self.num_values < 1:
            raise NiahError(f"need 1 <= num_queries <= num_keys and num_values >= 1; got {self}")


NIAH_TASKS: dict[str, NiahTask] = {
    "niah_single_1": NiahTask("noise", "words", "numbers"),
    "niah_single_2": NiahTask("text", "words", "numbers"),
    "niah_single_3": NiahTask("text", "words", "uuids"),
    "niah_multikey_1": NiahTask("text", "words", "numbers", num_keys=4),
    "niah_multikey_2": NiahTask("needles", "words", "numbers"),
    "niah_multikey_3": NiahTask("needles", "uuids", "uuids"),
    "niah_multivalue": NiahTask("text", "words", "numbers", num_values=4),
    "niah_multiquery": NiahTask("text", "words", "numbers", num_keys=4, num_queries=4),
}


def string_match_all(prediction: str, answers: Sequence[str]) -> float:
    """RULER's score of one output: the fraction of ``answers`` found in ``prediction`` (case-insensitive).

    Example:
        >>> string_match_all("The numbers are 1234567 and 7654321.", ["1234567", "1111111"])
        0.5
    """
    if not answers:
        raise NiahError("answers must not be empty")
    text = prediction.lower()
    return sum(answer.lower() in text for answer in answers) / len(answers)


def _draw(kind: str, rng: np.random.Generator) -> str:
    if kind == "numbers":
        return str(int(rng.integers(10 ** 6, 10 ** 7)))
    if kind == "uuids":
        return str(uuid.UUID(int=int.from_bytes(rng.bytes(16), "big"), version=4))
    return f"{ADJECTIVES[rng.integers(len(ADJECTIVES))]}-{NOUNS[rng.integers(len(NOUNS))]}"


def _distinct(kind: str, count: int, rng: np.random.Generator, avoid: set[str]) -> list[str]:
    """``count`` distinct draws of ``kind`` that are not in ``avoid``."""
    found: list[str] = []
    while len(found) < count:
        item = _draw(kind, rng)
        if item not in avoid and item not in found:
            found.append(item)
    return found


def _plural(kind: str, many: bool) -> str:
    return kind if many else kind[:-1]


def _needle(kind: str, key: str, value: str) -> str:
    return f"One of the special magic {kind} for {key} is: {value}."


@dataclass
class _Draft:
    """Every random choice of one prompt; ``render(n)`` lays it out over n haystack units."""

    task: NiahTask
    keys: list[str]
    values: list[list[str]]  # per key
    queries: list[int]  # indices of the queried keys
    depth: float  # percent, of the first queried needle
    other_depths: list[float]  # fractions in [0, 1], of the other needles
    text_start: int  # first line of a text haystack
    seed: int  # of the distractor needles of a needles haystack

    @property
    def answers(self) -> list[str]:
        return [value for q in self.queries for value in self.values[q]]

    def render(self, units: int, lines: Sequence[str]) -> str:
        task = self.task
        if task.haystack == "noise":
            haystack = [NOISE_SENTENCE] * units
        elif task.haystack == "text":
            haystack = [lines[(self.text_start + i) % len(lines)] for i in range(units)]
        else:
            rng = np.random.default_rng(self.seed)
            taken = set(self.keys)
            haystack = [_needle(task.value_kind, _distinct(task.key_kind, 1, rng, taken)[0],
                                _draw(task.value_kind, rng)) for _ in range(units)]
        needles = [(q, v) for q in self.queries for v in self.values[q]]
        needles += [(k, v) for k in range(len(self.keys)) if k not in self.queries for v in self.values[k]]
        spots = [round(self.depth / 100 * units)] + [round(f * units) for f in self.other_depths]
        placed = sorted(zip(spots, range(len(needles))))
        for offset, (spot, index) in enumerate(placed):
            k, v = needles[index]
            haystack.insert(spot + offset, _needle(task.value_kind, self.keys[k], v))
        many = len(self.answers) > 1
        kind = _plural(task.value_kind, many)
        query = [self.keys[q] for q in self.queries]
        query_text = query[0] if len(query) == 1 else ", ".join(query[:-1]) + ", and " + query[-1]
        verb, them = ("are", "them") if many else ("is", "it")
        header = (f"{'Some' if many else 'A'} special magic {kind} {verb} hidden in the text below. "
                  f"Remember {them}: you will be asked for {them} afterwards.\n")
        question = (f"\nWhat {verb} the special magic {kind} for {query_text} mentioned in the text above? "
                    f"The special magic {kind} for {query_text} {verb}:")
        return header + "\n".join(haystack) + question


def _draft(task: NiahTask, depth: float, rng: np.random.Generator, num_lines: int) -> _Draft:
    keys = _distinct(task.key_kind, task.num_keys, rng, set())
    values = [_distinct(task.value_kind, task.num_values, rng, set(keys)) for _ in keys]
    others = task.num_keys * task.num_values - 1
    return _Draft(task=task, keys=keys, values=values, queries=list(range(task.num_queries)), depth=depth,
                  other_depths=rng.random(others).tolist(), text_start=int(rng.integers(max(num_lines, 1))),
                  seed=int(rng.integers(2 ** 32)))


@dataclass
class NiahPrompt:
    """A prompt that fits its length, its answers, and the tokens it takes."""

    task: str
    length: int  # prompt tokens + max_new_tokens <= length
    depth: float  # percent
    text: str
    answers: list[str]
    ids: list[int]


def build_prompt(
    task: str, length: int, depth: float, encode: Encode, *, max_new_tokens: int,
    rng: np.random.Generator, lines: Sequence[str] = (),
) -> NiahPrompt:
    """The prompt of ``task`` with the longest haystack such that its tokens + ``max_new_tokens`` <= ``length``.

    ``lines``: the text haystack's lines (needed by tasks whose haystack is ``text``). Binary search
    over the number of haystack units (sentences, lines or distractor needles).

    Example:
        >>> p = build_prompt("niah_single_1", 400, 50.0, lambda s: list(s.encode()), max_new_tokens=16,
        ...                  rng=np.random.default_rng(0))
        >>> len(p.ids) + 16 <= 400, p.answers[0] in p.text
        (True, True)
    """
    if task not in NIAH_TASKS:
        raise NiahError(f"unknown task {task!r}; valid: {', '.join(NIAH_TASKS)}")
    spec = NIAH_TASKS[task]
    if spec.haystack == "text" and not lines:
        raise NiahError(f"task {task} hides its needles in text: pass the haystack's lines")
    if not 0 <= depth <= 100:
        raise NiahError(f"depth must be a percentage in [0, 100], got {depth}")
    draft = _draft(spec, depth, rng, len(lines))
    budget = length - max_new_tokens

    def tokens(units: int) -> list[int]:
        return encode(draft.render(units, lines))

    if len(tokens(0)) > budget:
        raise NiahError(f"{task}: length {length} leaves {budget} prompt tokens after max_new_tokens = "
                        f"{max_new_tokens}, fewer than the {len(tokens(0))} of the prompt without a haystack")
    low, high = 0, 1
    while len(tokens(high)) <= budget:  # grow until too long
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if len(tokens(mid)) <= budget else (low, mid)
    return NiahPrompt(task=task, length=length, depth=depth, text=draft.render(low, lines), answers=draft.answers,
                      ids=tokens(low))


def haystack_lines(texts: Sequence[str]) -> list[str]:
    """The lines of ``texts``, in order, without blank ones: the units of a ``text`` haystack.

    Example:
        >>> haystack_lines(["a\\n\\nb", "c"])
        ['a', 'b', 'c']
    """
    lines = [line for text in texts for line in text.splitlines() if line.strip()]
    if not lines:
        raise NiahError("the haystack texts hold no non-blank line")
    return lines


@dataclass
class NiahCell:
    """Accuracy of one (task, length, depth)."""

    task: str
    length: int
    depth: float
    accuracy: float  # mean string_match_all over the samples
    samples: int


@dataclass
class NiahResult:
    """Every cell's accuracy, the settings, and one example output per (task, length)."""

    cells: list[NiahCell]
    settings: dict
    examples: list[dict] = field(default_factory=list)

    def accuracy(self, task: str, length: Optional[int] = None) -> float:
        """Mean accuracy of ``task`` over its depths (and lengths, unless ``length`` is given)."""
        picked = [c.accuracy for c in self.cells if c.task == task and (length is None or c.length == length)]
        if not picked:
            raise NiahError(f"no cell of task {task!r}" + (f" at length {length}" if length is not None else ""))
        return float(np.mean(picked))

    def summary_rows(self) -> list[dict]:
        """One row per (task, length): the accuracy over depths."""
        pairs = dict.fromkeys((c.task, c.length) for c in self.cells)
        return [{"task": task, "length": length, "accuracy": self.accuracy(task, length)} for task, length in pairs]

    def to_json(self) -> dict:
        return {"settings": self.settings, "cells": [asdict(c) for c in self.cells], "summary": self.summary_rows(),
                "examples": self.examples}

    def write(self, path: Union[str, Path]) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path


def depth_grid(depths: Union[int, Sequence[float]]) -> list[float]:
    """``depths`` as percentages: an int n gives n evenly spaced depths from 0 to 100.

    Example:
        >>> depth_grid(5)
        [0.0, 25.0, 50.0, 75.0, 100.0]
    """
    if isinstance(depths, int):
        if depths < 1:
            raise NiahError(f"depths must be >= 1 (or a list of percentages), got {depths}")
        return [float(d) for d in np.round(np.linspace(0, 100, depths), 1)] if depths > 1 else [50.0]
    grid = [float(d) for d in depths]
    if not grid or any(not 0 <= d <= 100 for d in grid):
        raise NiahError(f"depths must be percentages in [0, 100], got {grid}")
    return grid


def run_niah(
    model: nn.Module,
    encode: Encode,
    decode: Decode,
    *,
    tasks: Sequence[str] = tuple(NIAH_TASKS),
    lengths: Sequence[int] = (1024, 2048, 4096),
    depths: Union[int, Sequence[float]] = 10,
    samples: int = 10,
    max_new_tokens: int = 128,
    device: Optional[str] = None,
    seed: int = 0,
    haystack: Optional[Sequence[str]] = None,
    batch_size: int = 8,
    stop_at_newline: bool = True,
    eos_token_id: Optional[int] = None,
    progress: bool = True,
) -> NiahResult:
    """Accuracy of ``model`` on RULER's needle tasks per (task, length, depth), ``samples`` prompts each.

    ``encode``/``decode`` turn text into the model's token ids and back (``lambda s: list(s.encode())``
    and ``lambda ids: bytes(ids).decode(errors="replace")`` for a byte-level model).
    ``haystack``: texts whose lines make the ``text`` haystack (default: the Python standard
    library's sources). ``device`` moves the model there first. Generation stops at
    ``max_new_tokens``, at ``eos_token_id``, or (``stop_at_newline``) at a line break after the
    answer began. The prompts of a cell are the same for every model (they depend on ``seed``
    and the tokenizer only).

    Example:
        >>> result = run_niah(model, codec.encode, codec.decode, tasks=["niah_single_2"],
        ...                   lengths=[1024], depths=5, samples=4)  # doctest: +SKIP
        >>> result.accuracy("niah_single_2")  # doctest: +SKIP
        0.85
    """
    unknown = [t for t in tasks if t not in NIAH_TASKS]
    if unknown or not tasks:
        raise NiahError(f"tasks must be a non-empty list of {', '.join(NIAH_TASKS)}; got {list(tasks)}")
    if not lengths or any(int(n) < 1 for n in lengths):
        raise NiahError(f"lengths must be positive token counts, got {list(lengths)}")
    if samples < 1 or batch_size < 1 or max_new_tokens < 1:
        raise NiahError(f"samples, batch_size and max_new_tokens must be >= 1; got {samples}, {batch_size}, "
                        f"{max_new_tokens}")
    grid = depth_grid(depths)
    if device is not None:
        model.to(device)
    needs_text = any(NIAH_TASKS[t].haystack == "text" for t in tasks)
    lines: list[str] = []
    if needs_text:
        if haystack is None:
            haystack = stdlib_corpus()
        lines = haystack_lines(haystack)
    from tqdm.auto import tqdm

    order = list(NIAH_TASKS)
    cells, examples = [], []
    bar = tqdm(total=len(tasks) * len(lengths) * len(grid) * samples, desc="niah", unit="prompt",
               disable=not progress, dynamic_ncols=True)

    def stop(ids: list[int]) -> bool:
        if eos_token_id is not None and ids[-1] == eos_token_id:
            return True
        return stop_at_newline and "\n" in decode(ids).lstrip()

    with inference_mode(model):
        for task in tasks:
            for length in lengths:
                prompts = [build_prompt(task, int(length), depth, encode, max_new_tokens=max_new_tokens, lines=lines,
                                        rng=np.random.default_rng([seed, order.index(task), int(length), d, s]))
                           for d, depth in enumerate(grid) for s in range(samples)]
                scores = {}
                by_size = sorted(range(len(prompts)), key=lambda i: len(prompts[i].ids))
                for start in range(0, len(by_size), batch_size):
                    batch = by_size[start:start + batch_size]
                    outputs = greedy_generate(model, [prompts[i].ids for i in batch], max_new_tokens, stop=stop)
                    for i, out in zip(batch, outputs):
                        text = decode(out)
                        if stop_at_newline:
                            head = len(text) - len(text.lstrip())
                            text = text[:head] + text[head:].split("\n", 1)[0]
                        scores[i] = (string_match_all(text, prompts[i].answers), text)
                    bar.update(len(batch))
                for d, depth in enumerate(grid):
                    mine = [scores[d * samples + s][0] for s in range(samples)]
                    cells.append(NiahCell(task=task, length=int(length), depth=depth, accuracy=float(np.mean(mine)),
                                          samples=samples))
                examples.append({"task": task, "length": int(length), "depth": grid[0], "answers": prompts[0].answers,
                                 "output": scores[0][1], "prompt_tokens": len(prompts[0].ids)})
    bar.close()
    settings = {"tasks": list(tasks), "lengths": [int(n) for n in lengths], "depths": grid, "samples": samples,
                "max_new_tokens": max_new_tokens, "seed": seed, "stop_at_newline": stop_at_newline}
    return NiahResult(cells=cells, settings=settings, examples=examples)


def plot_niah(result: NiahResult, out_dir: Union[str, Path]) -> list[Path]:
    """One heat map per task (depth down, length across, accuracy as colour and number): ``<task>.png``
    (e.g. ``niah_single_1.png``).

    Example:
        >>> paths = plot_niah(result, "runs/x/eval")  # doctest: +SKIP
    """
    from .plots import plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lengths, depths = result.settings["lengths"], result.settings["depths"]
    paths = []
    for task in result.settings["tasks"]:
        grid = np.full((len(depths), len(lengths)), np.nan)
        for c in result.cells:
            if c.task == task:
                grid[depths.index(c.depth), lengths.index(c.length)] = c.accuracy
        fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 2.5, 0.35 * len(depths) + 1.8))
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for (row, col), value in np.ndenumerate(grid):
            ax.text(col, row, f"{value:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set(xlabel="context length (tokens)", ylabel="needle depth (%)",
               title=f"{task}: {result.accuracy(task):.2f}")
        fig.colorbar(image, ax=ax, label="accuracy")
        fig.tight_layout()
        path = out_dir / f"{task}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths
