"""Typed run configuration: model, data, optimiser, schedule and run sections.

A config comes from defaults, a YAML file or a named recipe (``linmem/recipes/<name>.yaml``,
shipped with the package), then ``key.sub=value`` overrides from the command line; it is
validated before anything runs and printed with the run.

Example:
    >>> cfg = load_config(overrides=["model.memory=gla", "schedule.steps=10"])
    >>> cfg.model.memory, cfg.schedule.steps
    ('gla', 10)
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import inspect
import types
import typing
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from ..data.config import VAL_FRACTION, DataSection
from ..distributed.config import ParallelConfig
from ..settings import section, setting

#: The named recipes, shipped inside the package (found in a source checkout and an installed wheel alike).
RECIPES = importlib.resources.files("linmem") / "recipes"

#: Keys that may differ from a run directory's saved config when the run resumes: how long to train
#: (the warm-up and cosine schedule are recomputed for the new total), how often to log / evaluate / save, where and
#: how to run, over how many ranks (checkpoints reshard). ``schedule.grad_accum`` may change only with
#: the number of data-parallel ranks, so that an optimiser step keeps its micro-batches (the trainer
#: compares ``dp * grad_accum`` with the checkpoint's). Any other difference is refused, since the
#: checkpoint would not match the new config.
RESUMABLE_KEYS = (
    "schedule.steps", "schedule.warmup_steps", "run.log_every", "run.eval_every", "run.save_every", "run.progress",
    "run.keep_checkpoints", "run.tensorboard", "run.device", "run.compile", "run.compile_cache", "run.cuda_graph",
    "run.resume",
    "run.out_dir",
    "parallel.dp", "parallel.sp", "parallel.ep", "parallel.tp", "parallel.fsdp", "parallel.blocks_per_unit",
    "parallel.activation_checkpointing",
    "parallel.timeout_minutes", "schedule.grad_accum",
)


#: The longest default warm-up (``schedule.warmup_steps`` unset: a tenth of the steps, at most this).
MAX_DEFAULT_WARMUP = 50


class ConfigError(ValueError):
    """A config key, value or combination that cannot run."""


@dataclass
class ModelSection:
    recipe: Optional[str] = setting(None, "a named model recipe (linmem.models.MODEL_RECIPES); then only `options` "
                                          "apply")
    hidden_size: int = setting(64, "model width D")
    num_heads: int = setting(2, "heads of every mixer")
    layer_pattern: str = setting("LL", "one letter per layer: L memory, N attention")
    memory: str = setting("gated_deltanet", "mixer of L layers (gla, mamba2, deltanet, gated_deltanet, mom, bayes, "
                                            "...)")
    attention: str = setting("softmax", "mixer of N layers: softmax, swa, fox")
    options: dict[str, Any] = setting({}, "any other LinmemConfig field or section key, e.g. "
                                           "model.options.mlp=moe, model.options.mixer.window=64")
    pretrained: Optional[str] = setting(None, "a saved LinmemForCausalLM folder to start from (then only `options` "
                                              "apply)")


@dataclass
class OptimSection:
    lr: float = setting(3e-3, "peak learning rate")
    weight_decay: float = setting(0.1, "AdamW decay of matrices (not of norms, biases, embeddings)")
    beta1: float = setting(0.9, "AdamW beta1")
    beta2: float = setting(0.95, "AdamW beta2")
    eps: float = setting(1e-8, "AdamW epsilon")
    grad_clip: float = setting(1.0, "max global grad norm (0 = off)")


@dataclass
class ScheduleSection:
    steps: int = setting(1000, "optimiser steps")
    warmup_steps: Optional[int] = setting(None, "linear warm-up steps; null: a tenth of schedule.steps, at most "
                                                f"{MAX_DEFAULT_WARMUP}")
    min_lr_ratio: float = setting(0.1, "cosine decays to lr * min_lr_ratio")
    grad_accum: int = setting(1, "micro-batches per optimiser step")

    @property
    def warmup(self) -> int:
        """The warm-up steps this schedule uses: ``warmup_steps``, or by default min(steps // 10, 50).

        Example:
            >>> ScheduleSection(steps=40).warmup, ScheduleSection(steps=5000).warmup
            (4, 50)
        """
        if self.warmup_steps is not None:
            return self.warmup_steps
        return min(self.steps // 10, MAX_DEFAULT_WARMUP)


@dataclass
class RunSection:
    out_dir: str = setting("runs/default", "checkpoints, metrics, model/ and evaluations")
    seed: int = setting(0, "model init and every other RNG")
    device: str = setting("auto", "auto, cpu, cuda, cuda:1")
    dtype: str = setting("auto", "auto (bf16 autocast on GPU, fp32 on CPU), bf16, fp32")
    compile: bool = setting(False, "torch.compile each block on its own (regional compilation)")
    compile_cache: Optional[str] = setting(None, "folder for torch.compile's caches (inductor, Triton), reused by "
                                           "later runs naming it; null: torch's defaults")
    cuda_graph: Optional[bool] = setting(None, "replay each micro-step's forward and backward from a CUDA graph, one "
                                               "per batch shape; null: on CUDA on one process unless a layer "
                                               "reads on the host (MoE, MoM, Titans' momentum)")
    log_every: int = setting(10, "steps between metric lines (and console lines when the progress bar is off)")
    eval_every: int = setting(0, "steps between evaluations (0 = only at the end)")
    save_every: int = setting(500, "steps between checkpoints (0 = only at the end)")
    keep_checkpoints: int = setting(2, "newest checkpoints kept")
    resume: bool = setting(True, "continue from the newest valid checkpoint in out_dir")
    progress: bool = setting(True, "progress bar on a terminal (else a plain line every log_every steps)")
    tensorboard: bool = setting(True, "also write TensorBoard events (when tensorboard is installed)")


@dataclass
class LoraSection:
    rank: int = setting(0, "LoRA rank r; 0: no LoRA, every parameter trains")
    alpha: float = setting(16.0, "the adapters' update is alpha / r * B A")
    dropout: float = setting(0.0, "dropout on the adapters' input")
    targets: list[str] = setting(["q_proj", "k_proj", "v_proj"], "modules given adapters")
    train_modules: list[str] = setting(["gate_proj", "feature_map"], "modules trained in full, if present")


@dataclass
class TrainConfig:
    model: ModelSection = section(ModelSection, "the model: a recipe, a layer pattern and mixers, or a saved folder")
    data: DataSection = section(DataSection, "what the model learns: MQAR, text or instruction data")
    optim: OptimSection = section(OptimSection, "AdamW")
    schedule: ScheduleSection = section(ScheduleSection, "steps, linear warm-up, cosine decay, accumulation")
    run: RunSection = section(RunSection, "where and how: output folder, device, logging, checkpoints")
    parallel: ParallelConfig = section(ParallelConfig, "ranks under torchrun (dp * sp * tp processes; 1 on one "
                                                       "process)")
    lora: LoraSection = section(LoraSection, "LoRA fine-tuning of a saved model (model.pretrained)")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def validate(self) -> "TrainConfig":
        """Check values and combinations; returns self. Model names are checked by LinmemConfig."""
        checks = [
            (self.data.task in ("mqar", "text", "instruct"),
             f"data.task must be 'mqar', 'text' or 'instruct', got {self.data.task!r}"),
            (self.data.task != "instruct" or (self.data.instruct.path is not None
                                              and self.data.instruct.tokenizer is not None),
             "data.task=instruct needs data.instruct.path (a JSON/JSONL file) and data.instruct.tokenizer (a folder)"),
            (self.data.instruct.max_tokens >= 2, "data.instruct.max_tokens must be >= 2"),
            (0 <= self.data.instruct.val_fraction < 1, "data.instruct.val_fraction must lie in [0, 1)"),
            (self.model.pretrained is None or self.model.recipe is None,
             "model.pretrained loads a saved model with its own config: unset model.recipe"),
            (self.lora.rank >= 0, "lora.rank must be >= 0 (0: no LoRA)"),
            (self.lora.alpha > 0, "lora.alpha must be > 0"),
            (0 <= self.lora.dropout < 1, "lora.dropout must lie in [0, 1)"),
            (self.lora.rank == 0 or bool(self.lora.targets), "lora.targets must name at least one module"),
            (self.lora.rank == 0 or self.model.pretrained is not None,
             "lora.rank > 0 adapts a trained model: set model.pretrained (e.g. a folder written by linmem linearize)"),
            (self.data.batch_size >= 1, "data.batch_size must be >= 1"),
            (self.data.tokens_per_batch >= 2, "data.tokens_per_batch must be >= 2"),
            (self.optim.lr > 0, "optim.lr must be > 0"),
            (0 <= self.optim.grad_clip, "optim.grad_clip must be >= 0"),
            (self.schedule.steps >= 1, "schedule.steps must be >= 1"),
            (0 <= self.schedule.warmup, "schedule.warmup_steps must be >= 0"),
            (0 <= self.schedule.min_lr_ratio <= 1, "schedule.min_lr_ratio must be in [0, 1]"),
            (self.schedule.grad_accum >= 1, "schedule.grad_accum must be >= 1"),
            (self.schedule.warmup <= self.schedule.steps,
             f"schedule.warmup_steps ({self.schedule.warmup}) must be <= schedule.steps "
             f"({self.schedule.steps}): the learning rate would never reach optim.lr"),
            (self.run.dtype in ("auto", "bf16", "fp32"),
             f"run.dtype must be auto, bf16 or fp32, got {self.run.dtype!r}"),
            (self.run.keep_checkpoints >= 1, "run.keep_checkpoints must be >= 1"),
            (self.run.log_every >= 1, f"run.log_every must be >= 1, got {self.run.log_every}"),
            (self.run.eval_every >= 0, f"run.eval_every must be >= 0 (0: only at the end), got {self.run.eval_every}"),
            (self.run.save_every >= 0, f"run.save_every must be >= 0 (0: only at the end), got {self.run.save_every}"),
            (0 <= self.run.seed < 2**32, f"run.seed must lie in [0, 2**32), got {self.run.seed}"),
            (0 <= self.data.seed < 2**32, f"data.seed must lie in [0, 2**32), got {self.data.seed}"),
            (self.optim.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {self.optim.weight_decay}"),
            (0 <= self.optim.beta1 < 1 and 0 <= self.optim.beta2 < 1,
             f"optim.beta1 and optim.beta2 must lie in [0, 1), got {self.optim.beta1} and {self.optim.beta2}"),
            (self.optim.eps > 0, f"optim.eps must be > 0, got {self.optim.eps}"),
            (all(len(s) == 2 for s in self.data.mqar.settings + self.data.mqar.eval_settings),
             "data.mqar.settings entries must be [seq_len, num_kv_pairs]"),
            (bool(self.data.mqar.settings), "data.mqar.settings must not be empty"),
            (self.data.mqar.variant in ("base", "shared", "update", "block"),
             f"data.mqar.variant must be base, shared, update or block, got {self.data.mqar.variant!r}"),
            (0 < self.data.mqar.update_fraction <= 1, "data.mqar.update_fraction must lie in (0, 1]"),
            (self.data.mqar.num_blocks >= 1, "data.mqar.num_blocks must be >= 1"),
            (self.data.text.dataset is None or self.data.text.tokenizer is not None,
             "data.text.dataset needs data.text.tokenizer (a local tokenizer folder)"),
            (self.data.text.errors in ("replace", "strict"),
             f"data.text.errors must be replace or strict, got {self.data.text.errors!r}"),
            (self.data.text.prepared is None or not (self.data.text.paths or self.data.text.dataset
                                                     or self.data.text.tokenizer or self.data.text.max_files),
             "data.text.prepared replaces data.text.paths, dataset, tokenizer and max_files "
             "(the prepared folder records them): unset those"),
            (self.data.text.prepared is None or self.data.text.val_fraction == VAL_FRACTION,
             f"data.text.val_fraction={self.data.text.val_fraction:g} does not apply to data.text.prepared: the "
             "folder was split when it was prepared (linmem data prepare --val-fraction); unset it"),
            (0 <= self.data.text.val_fraction < 1, "data.text.val_fraction must lie in [0, 1)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        _check_model_options(self.model)
        self.parallel.validate()  # its own values; against the processes launched: linmem.train.trainer.check_launch
        return self


def check_processes(config: TrainConfig, world: int) -> None:
    """What the config alone decides about a launch on ``world`` processes (no torch needed): the
    ``parallel`` layout must have ``world`` ranks (on one process: 1; anything else says to launch
    with torchrun), and a saved model is fine-tuned on one process.

    Example:
        >>> check_processes(load_config(overrides=["parallel.dp=2"]), 2)
    """
    if world > 1 and (config.lora.rank or config.model.pretrained is not None):
        raise ConfigError(f"WORLD_SIZE={world}: fine-tuning a saved model (model.pretrained, lora.rank) runs on one "
                          "process; launch it without torchrun")
    config.parallel.validate(world)


def _model_fields() -> list[str]:
    """The keyword arguments of LinmemConfig that ``model.options`` may set."""
    from ..models import LinmemConfig

    parameters = inspect.signature(LinmemConfig.__init__).parameters.values()
    return [p.name for p in parameters if p.name not in ("self", "vocab_size") and p.kind is p.POSITIONAL_OR_KEYWORD]


def _check_model_options(model: "ModelSection") -> None:
    """Refuse options that LinmemConfig does not know (with a close match, or the section of a mixer option
    given flat) or that the section sets itself."""
    if not model.options:
        return  # nothing to check: LinmemConfig (and torch with it) is not loaded
    from ..models.config import SECTIONS, section_fields

    valid = _model_fields()
    for key, value in model.options.items():
        if key == "vocab_size":
            raise ConfigError("model.options.vocab_size is set by the task (MQAR vocabulary, tokenizer or bytes)")
        if key not in valid:
            raise ConfigError(f"unknown key 'model.options.{key}'{_section_hint(key) or _did_you_mean(key, valid)}; "
                              f"valid: {', '.join(valid)}")
        if model.recipe is None and key in _SECTION_FIELDS:
            raise ConfigError(f"model.options.{key} duplicates model.{key}: set model.{key} instead")
        if key in SECTIONS:
            keys = list(section_fields(key))
            if not isinstance(value, dict):
                raise ConfigError(f"model.options.{key} must be a mapping of {key} options ({', '.join(keys)}), "
                                  f"got {value!r}")
            for inner in value:
                if inner not in keys:
                    raise ConfigError(f"unknown key 'model.options.{key}.{inner}'{_did_you_mean(inner, keys)}; "
                                      f"valid: {', '.join(keys)}")


def _section_hint(key: str) -> str:
    """For a mixer option given flat (``window``, ``num_experts``), where it goes now; else ''."""
    from ..models.config import FLAT_FIELDS

    if key not in FLAT_FIELDS:
        return ""
    return f" (a mixer option: set {' or '.join(f'model.options.{s}.{k}' for s, k in FLAT_FIELDS[key])})"


_SECTION_FIELDS = ("hidden_size", "num_heads", "layer_pattern", "memory", "attention")


def _did_you_mean(key: str, valid: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _unknown_key(where: str, key: str, valid: Sequence[str]) -> ConfigError:
    """The error for ``where + key`` not being a field: a close match, and for model fields of
    LinmemConfig a pointer to ``model.options``."""
    if where == "model." and key in _model_fields():
        return ConfigError(f"unknown key 'model.{key}': {key} is a LinmemConfig field, set it as model.options.{key}")
    if where == "model." and _section_hint(key):
        return ConfigError(f"unknown key 'model.{key}'{_section_hint(key)}")
    return ConfigError(f"unknown key '{where}{key}'{_did_you_mean(key, valid)}; valid: {', '.join(valid)}")


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1} (lists stay values)."""
    if not isinstance(data, dict):
        return {prefix[:-1]: data}
    flat: dict[str, Any] = {}
    for key, value in data.items():
        flat.update(_flatten(value, f"{prefix}{key}."))
    return flat


def config_differences(saved: dict[str, Any], config: TrainConfig) -> list[str]:
    """Keys whose value in ``config`` differs from the ``saved`` config dict (a run directory's
    config.yaml), other than :data:`RESUMABLE_KEYS`, as ``"key (saved X, now Y)"`` strings. A key
    the saved config lacks (written before the key existed) counts as its default."""
    old = {**_flatten(yaml.safe_load(TrainConfig().to_yaml())), **_flatten(saved)}
    new = _flatten(yaml.safe_load(config.to_yaml()))  # the same YAML round trip the saved one went through
    missing = "<unset>"
    return [f"{key} (saved {old.get(key, missing)!r}, now {new.get(key, missing)!r})"
            for key in sorted(set(old) | set(new))
            if key not in RESUMABLE_KEYS and old.get(key, missing) != new.get(key, missing)]


def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _from_dict(cls: type, data: dict[str, Any], where: str) -> Any:
    """Build dataclass ``cls`` from a dict, refusing unknown keys with the valid ones."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'} must be a mapping, got {type(data).__name__}")
    hints = _type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise _unknown_key(where, unknown[0], names)
    values = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            values[name] = _from_dict(hint, value, f"{where}{name}.")
        else:
            values[name] = _check_type(value, hint, where + name)
    return cls(**values)


def type_name(hint: Any) -> str:
    """A field's type as the config reference writes it: ``int``, ``list[str]``, ``str or null``.

    Example:
        >>> type_name(Optional[int]), type_name(list[list[int]]), type_name(dict[str, Any])
        ('int or null', 'list[list[int]]', 'dict[str, Any]')
    """
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else type_name(a) for a in args)
    if args:
        return f"{typing.get_origin(hint).__name__}[{', '.join(type_name(a) for a in args)}]"
    return "Any" if hint is Any else hint.__name__


def _check_type(value: Any, hint: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _check_type(value, inner[0], key)
    if hint is Any:
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    expected = origin or hint
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        brackets = f": write a list in brackets, e.g. {key}=[{value}]" if expected is list else ""
        raise ConfigError(f"{key} must be {type_name(hint)}, got {value!r}{brackets}")
    return value


def _parse_override(text: str, hint: Any, key: str) -> Any:
    """Turn the right-hand side of ``key=value`` into a value of the field's type."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # Optional[X]
        if text.lower() in ("none", "null"):
            return None
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    target = typing.get_origin(hint) or hint
    try:
        if target is bool:
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(text)
            return text.lower() in ("true", "1", "yes")
        if target in (int, float, str):
            return target(text)
        return _check_type(yaml.safe_load(text), hint, key)
    except ConfigError:
        raise
    except (ValueError, yaml.YAMLError) as err:
        raise ConfigError(f"{key}={text!r}: cannot read a {type_name(hint)}") from err


def apply_overrides(config: TrainConfig, overrides: Sequence[str]) -> TrainConfig:
    """Apply ``section.key=value`` (or ``model.options.<field>=value``, ``model.options.<section>.<key>=value``)
    overrides in place."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        path, text = item.split("=", 1)
        parts = path.split(".")
        target = config
        for depth, part in enumerate(parts[:-1]):
            if isinstance(target, dict):
                target = target.setdefault(part, {})
                continue
            valid = [f.name for f in dataclasses.fields(target)] if dataclasses.is_dataclass(target) else []
            if part not in valid:
                raise _unknown_key("".join(p + "." for p in parts[:depth]), part, valid)
            target = getattr(target, part)
        leaf = parts[-1]
        if isinstance(target, dict):  # model options: YAML-typed values, names checked by validate()
            target[leaf] = yaml.safe_load(text)
            continue
        valid = [f.name for f in dataclasses.fields(target)] if dataclasses.is_dataclass(target) else []
        if leaf not in valid:
            raise _unknown_key("".join(p + "." for p in parts[:-1]), leaf, valid)
        setattr(target, leaf, _parse_override(text, _type_hints(type(target))[leaf], path))
    return config


def recipe_names() -> list[str]:
    """Names of the shipped recipes (``linmem/recipes/*.yaml``), sorted."""
    return sorted(entry.name[:-len(".yaml")] for entry in RECIPES.iterdir() if entry.name.endswith(".yaml"))


def recipe_text(name: str) -> str:
    """The YAML of recipe ``name``; unknown names are refused with the list of recipes."""
    entry = RECIPES / f"{name}.yaml"
    if not entry.is_file():
        raise ConfigError(f"unknown recipe {name!r}{_did_you_mean(name, recipe_names())}; "
                          f"valid: {', '.join(recipe_names())}")
    return entry.read_text()


def load_config(path: Optional[str] = None, *, recipe: Optional[str] = None,
                overrides: Sequence[str] = ()) -> TrainConfig:
    """Defaults <- YAML file or recipe <- overrides; validated."""
    if path is not None and recipe is not None:
        raise ConfigError("give a config file or a recipe, not both")
    if path is not None:
        data, source = read_config_file(path), str(path)
    else:
        source = f"recipe {recipe}"
        data = _parse_yaml(recipe_text(recipe), source) if recipe is not None else {}
    try:
        config = _from_dict(TrainConfig, data, "")
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from err
    return apply_overrides(config, overrides).validate()


def read_config_file(path: typing.Union[str, Path]) -> dict[str, Any]:
    """The mapping of sections in the YAML file ``path`` (a config file or a run's config.yaml); a file
    that is missing, not UTF-8, not YAML or not a mapping is a ConfigError naming it. Mixer options that a file
    written before the config's sections holds flat in ``model.options`` (``window``, ``mom_top_k``) come in their
    sections (:func:`linmem.models.config.nest_flat_fields`), so that old runs evaluate and resume.

    Example:
        >>> read_config_file("runs/gdn/config.yaml")["schedule"]["steps"]  # doctest: +SKIP
        2000
    """
    if not Path(path).is_file():
        raise ConfigError(f"config file {path} {'is a folder' if Path(path).is_dir() else 'not found'}")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path} is not a YAML text file (byte {err.start} is not UTF-8)") from err
    return _nest_model_options(_parse_yaml(text, str(path)))


def _nest_model_options(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with the flat mixer options of its ``model.options`` moved into their sections."""
    model = data.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("options"), dict) or not model["options"]:
        return data  # nothing to move: LinmemConfig (and torch with it) is not loaded
    from ..models.config import nest_flat_fields

    return {**data, "model": {**model, "options": nest_flat_fields(model["options"])}}


def _parse_yaml(text: str, source: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(" ".join(f"{source} is not valid YAML ({where}{problem})".split())) from err
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source} must hold a mapping of sections (model, data, ...), got a "
                          f"{type(data).__name__}")
    return data
