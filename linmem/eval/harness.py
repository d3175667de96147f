"""lm-evaluation-harness on linmem models: an ``lm_eval`` model class and ``run_harness``.

:class:`LinmemLM` answers the three kinds of request of lm-eval (``loglikelihood``,
``loglikelihood_rolling``, ``generate_until``) with a :class:`~linmem.models.LinmemForCausalLM` and
a :class:`~linmem.data.codec.Codec`, so byte-level models (no Hugging Face tokenizer) run any task
too. Scoring is batched: requests sorted by length, right-padded (a causal model's logits at a
position do not depend on later tokens, so padding needs no mask), and only the continuation's
positions go through the output layer. Generation is greedy and batched with the model's decoding
cache (:func:`~linmem.eval.inference.greedy_generate`). Importing this module registers the class
under the name ``linmem``: ``simple_evaluate(model="linmem", model_args="run_dir=runs/x")``.

lm-eval is an optional dependency: ``pip install 'linmem[eval]'``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
from torch import nn

try:
    from lm_eval import simple_evaluate
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError("the lm-eval bridge needs the optional package lm-eval: pip install 'linmem[eval]' "
                      "(or pip install 'lm-eval>=0.4.9')") from error

from ..data.codec import Codec
from .inference import IGNORE_INDEX, greedy_generate, inference_mode, model_device, next_token_scores
from .runs import open_run

PathLike = Union[str, Path]


class HarnessError(ValueError):
    """A request, setting or run the lm-eval bridge cannot serve."""


@register_model("linmem")
class LinmemLM(TemplateLM):
    """lm-eval's view of a linmem model: scores and greedy continuations of text.

    Args:
        model: the causal LM (moved to ``device`` when given).
        codec: its tokenizer (:func:`~linmem.data.codec.byte_codec` for byte-level models).
        batch_size: requests per forward pass.
        max_length: longest token window the model reads; longer inputs keep their last tokens
            (rolling loglikelihood slides windows of this length).
        max_gen_toks: new tokens per generation unless a task sets ``max_gen_toks``
            (default: 256 or half of ``max_length``, whichever is fewer).

    Example:
        >>> from linmem.models import LinmemConfig, LinmemForCausalLM
        >>> from linmem.data.codec import byte_codec
        >>> lm = LinmemLM(LinmemForCausalLM(LinmemConfig(vocab_size=256, hidden_size=16, num_heads=2,
        ...                                              layer_pattern="L")), byte_codec(), max_length=64)
        >>> logprob, greedy = lm._loglikelihood_tokens([(("a", "b"), [97], [98])], disable_tqdm=True)[0]
        >>> logprob < 0
        True
    """

    def __init__(self, model: nn.Module, codec: Codec, *, batch_size: int = 8, max_length: int = 2048,
                 max_gen_toks: Optional[int] = None, device: Optional[str] = None) -> None:
        super().__init__()
        if max_gen_toks is None:
            max_gen_toks = min(256, max_length // 2) if isinstance(max_length, int) else 256
        if not isinstance(codec, Codec):
            raise TypeError(f"codec must be a linmem.data.codec.Codec, got {type(codec).__name__}")
        for name, value in (("batch_size", batch_size), ("max_length", max_length), ("max_gen_toks", max_gen_toks)):
            if not isinstance(value, int) or value < 1:
                raise HarnessError(f"{name} must be a positive int, got {value!r}")
        if max_gen_toks >= max_length:
            raise HarnessError(f"max_gen_toks ({max_gen_toks}) must be below max_length ({max_length})")
        if device is not None:
            model.to(device)
        vocab = model.get_output_embeddings().weight.shape[0]
        if codec.vocab_size > vocab:
            raise HarnessError(f"the codec has {codec.vocab_size} tokens but the model only {vocab}")
        self.model, self.codec = model.eval(), codec
        self.batch_size, self.max_length, self.max_gen_toks = batch_size, max_length, max_gen_toks
        self._device = model_device(model)

    @classmethod
    def from_run(cls, run_dir: PathLike, **kwargs: Any) -> "LinmemLM":
        """The model and tokenizer of a run directory; ``max_length`` defaults to its training length.

        Example:
            >>> lm = LinmemLM.from_run("runs/text-hybrid-tiny", batch_size=16)  # doctest: +SKIP
        """
        run = open_run(run_dir, device=kwargs.pop("device", None))
        kwargs.setdefault("max_length", run.train_length)
        return cls(run.model, run.codec, **kwargs)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: Optional[dict] = None) -> "LinmemLM":
        """``run_dir=DIR[,batch_size=N,max_length=N,max_gen_toks=N,device=D]`` (lm-eval's ``--model_args``)."""
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: Optional[dict] = None) -> "LinmemLM":
        """``arg_dict``: run_dir (required), batch_size, max_length, max_gen_toks, device; lm-eval's own
        settings in ``additional_config`` (batch_size, device) win, the ones this model has no use for
        (max_batch_size) are left out."""
        known = {"run_dir", "batch_size", "max_length", "max_gen_toks", "device"}
        unknown = sorted(set(arg_dict) - known)
        if unknown:
            raise HarnessError(f"unknown model_args {unknown} of the linmem model; valid: {', '.join(sorted(known))}")
        args = {**arg_dict, **{k: v for k, v in (additional_config or {}).items() if v is not None and k in known}}
        if "run_dir" not in args:
            raise HarnessError(f"model_args of the linmem model need run_dir=<a run directory>; got {sorted(args)}")
        run_dir = args.pop("run_dir")
        kwargs: dict[str, Any] = {}
        for name in ("batch_size", "max_length", "max_gen_toks"):
            if name in args:
                try:
                    kwargs[name] = int(args[name])
                except (TypeError, ValueError) as err:
                    raise HarnessError(f"{name} must be a whole number for the linmem model, "
                                       f"got {args[name]!r}") from err
        if "device" in args:
            kwargs["device"] = str(args["device"])
        return cls.from_run(run_dir, **kwargs)

    @property
    def eot_token_id(self) -> int:
        return self.codec.prefix_token_id

    @property
    def tokenizer_name(self) -> str:
        return self.codec.name

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs: Any) -> list[int]:
        return self.codec.encode(string)

    def tok_decode(self, tokens: Sequence[int], **kwargs: Any) -> str:
        return self.codec.decode(tokens)

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """``requests``: ``(cache_key, context_ids, continuation_ids)``; returns, per request,
        ``(log p(continuation | context), whether greedy decoding gives the continuation)``."""
        from tqdm.auto import tqdm

        rows = []
        for _, context, continuation in requests:
            if not continuation or not context:
                raise HarnessError("a loglikelihood request needs context tokens (lm-eval gives the prefix token for "
                                   "an empty context) and continuation tokens; "
                                   f"got {len(context)} and {len(continuation)}")
            if len(continuation) > self.max_length:
                raise HarnessError(f"a continuation of {len(continuation)} tokens does not fit in max_length = "
                                   f"{self.max_length}")
            inputs = (list(context) + list(continuation))[-(self.max_length + 1):-1]
            rows.append((inputs, list(continuation)))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        answers: list[Optional[tuple[float, bool]]] = [None] * len(rows)
        bar = tqdm(total=len(rows), desc="loglikelihood", disable=disable_tqdm, dynamic_ncols=True)
        with inference_mode(self.model):
            for start in range(0, len(order), self.batch_size):
                batch = order[start:start + self.batch_size]
                width = len(rows[batch[0]][0])
                ids = torch.zeros(len(batch), width, dtype=torch.long)
                targets = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
                for r, i in enumerate(batch):
                    inputs, continuation = rows[i]
                    m, n = len(inputs), len(continuation)
                    ids[r, :m] = torch.tensor(inputs)
                    targets[r, m - n:m] = torch.tensor(continuation)  # position t predicts token t + 1
                logprob, greedy = next_token_scores(self.model, ids, targets)
                scored = (targets != IGNORE_INDEX).to(greedy.device)
                for r, i in enumerate(batch):
                    answer = (float(logprob[r].sum()), bool(greedy[r][scored[r]].all()))
                    answers[i] = answer
                    if requests[i][0] is not None:
                        self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
                bar.update(len(batch))
        bar.close()
        return answers  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole texts, in disjoint windows of ``max_length`` tokens (each token scored once)."""
        windows, owners = [], []
        for index, request in enumerate(requests):
            (text,) = request.args
            pieces = get_rolling_token_windows(token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                                               max_seq_len=self.max_length, context_len=1)
            for context, continuation in map(make_disjoint_window, pieces):
                windows.append((None, context, continuation))
                owners.append(index)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, scores):
            totals[owner] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut before the first stop string (``until``) of each request."""
        from tqdm.auto import tqdm

        eos_text = self.codec.decode([self.codec.eos_token_id]) if self.codec.eos_token_id is not None else None
        settings = []
        for request in requests:
            context, gen_kwargs = request.args
            gen_kwargs = dict(gen_kwargs or {})
            if gen_kwargs.get("do_sample") and float(gen_kwargs.get("temperature", 1.0)) > 0:
                raise HarnessError(f"the linmem model generates greedily only; the task asks for sampling: "
                                   f"{gen_kwargs}")
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            if eos_text is not None and eos_text not in until:
                until.append(eos_text)
            budget = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
            if not 1 <= budget < self.max_length:
                raise HarnessError(f"max_gen_toks must lie in [1, max_length = {self.max_length}), got {budget}")
            prompt = (self.tok_encode(context) or [self.prefix_token_id])[-(self.max_length - budget):]
            settings.append((prompt, until, budget))
        answers: list[str] = [""] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for i, (_, until, budget) in enumerate(settings):
            groups.setdefault((tuple(until), budget), []).append(i)
        bar = tqdm(total=len(requests), desc="generate_until", disable=disable_tqdm, dynamic_ncols=True)
        with inference_mode(self.model):
            for (until, budget), members in groups.items():
                members.sort(key=lambda i: -len(settings[i][0]))

                def stop(ids: list[int], until: tuple = until) -> bool:
                    text = self.codec.decode(ids)
                    return any(s in text for s in until)

                for start in range(0, len(members), self.batch_size):
                    batch = members[start:start + self.batch_size]
                    outputs = greedy_generate(self.model, [settings[i][0] for i in batch], budget, stop=stop)
                    for i, out in zip(batch, outputs):
                        text = self.codec.decode(out)
                        for s in until:
                            text = text.split(s, 1)[0]
                        answers[i] = text
                        self.cache_hook.add_partial("generate_until", requests[i].args, text)
                    bar.update(len(batch))
        bar.close()
        return answers


def run_harness(
    run_dir: Optional[PathLike],
    tasks: Sequence[str],
    include_path: Optional[PathLike] = None,
    limit: Optional[Union[int, float]] = None,
    batch_size: int = 8,
    *,
    num_fewshot: Optional[int] = None,
    max_length: Optional[int] = None,
    device: Optional[str] = None,
    bootstrap_iters: int = 100000,
    include_defaults: bool = True,
    lm: Optional[LinmemLM] = None,
) -> dict:
    """Run lm-eval ``tasks`` on a run directory's model; returns lm-eval's results (JSON-ready parts).

    ``include_path``: a folder of local task YAMLs (lm-eval's ``--include_path``); ``limit``:
    examples per task (an int, or a fraction when < 1). ``include_defaults=False`` indexes only
    ``include_path``, not lm-eval's thousands of built-in tasks (much faster to start).
    ``bootstrap_iters``: lm-eval's resamples for the standard errors of aggregate metrics
    (0: none). ``lm``: an already built model object
    (then ``run_dir``, ``batch_size``, ``max_length`` and ``device`` are not used). Returns
    ``{"results": {task: {metric: value}}, "versions", "n-shot", "n-samples", "configs"}``.

    Example:
        >>> out = run_harness("runs/text-hybrid-tiny", ["my_task"], include_path="tasks/")  # doctest: +SKIP
        >>> out["results"]["my_task"]["acc,none"]  # doctest: +SKIP
        0.6
    """
    if isinstance(tasks, str) or not tasks:
        raise HarnessError(f"tasks must be a non-empty list of task names, got {tasks!r}")
    if include_path is not None and not Path(include_path).is_dir():
        raise FileNotFoundError(f"include_path {include_path} is not a folder of task YAMLs")
    if lm is None:
        kwargs: dict[str, Any] = {"batch_size": batch_size, "device": device}
        if max_length is not None:
            kwargs["max_length"] = max_length
        lm = LinmemLM.from_run(run_dir, **kwargs)
    if not include_defaults and include_path is None:
        raise HarnessError("include_defaults=False leaves no task to run: pass include_path")
    manager = TaskManager(include_path=str(include_path) if include_path is not None else None,
                          include_defaults=include_defaults)
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        raise HarnessError(f"lm-eval knows no task {unknown}" +
                           ("" if include_path else "; pass include_path=<folder of task YAMLs> for local tasks"))
    out = simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit, task_manager=manager,
                          bootstrap_iters=bootstrap_iters, log_samples=False)
    keep = ("results", "groups", "versions", "n-shot", "n-samples", "configs", "higher_is_better")
    return json.loads(json.dumps({k: out[k] for k in keep if k in out}, default=str))
