"""A finished (or checkpointed) run directory, loaded back for evaluation and generation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from ..models import LinmemForCausalLM
from .config import TrainConfig, apply_overrides, load_config
from .tasks import Task, build_task
from .trainer import resolve_device


@dataclass
class Run:
    config: TrainConfig
    model: LinmemForCausalLM
    task: Task
    device: torch.device

    @torch.no_grad()
    def generate(self, prompt: str, *, max_new_tokens: int = 200, temperature: float = 0.8, seed: int = 0) -> str:
        """Continue ``prompt`` (text tasks): greedy when temperature == 0, else sampled."""
        ids = self.task.encode(prompt) or [self.task.encode("\n")[0]]
        torch.manual_seed(seed)
        out = self.model.generate(
            torch.tensor([ids], device=self.device), max_new_tokens=max_new_tokens,
            do_sample=temperature > 0, temperature=temperature if temperature > 0 else None, top_k=None,
            pad_token_id=0,
        )
        return self.task.decode(out[0].tolist())


def load_run(run_dir: Path, overrides: Sequence[str] = ()) -> Run:
    """Config (run_dir/config.yaml), data and the latest weights (run_dir/model) of a run."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").exists() or not (run_dir / "model").exists():
        raise FileNotFoundError(f"{run_dir} is not a linmem run directory (needs config.yaml and model/)")
    config = apply_overrides(load_config(str(run_dir / "config.yaml")), overrides).validate()
    device = resolve_device(config.run.device)
    model = LinmemForCausalLM.from_pretrained(run_dir / "model").to(device).eval()
    return Run(config=config, model=model, task=build_task(config.data), device=device)
