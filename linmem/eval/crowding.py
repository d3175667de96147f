"""Random-key crowding: recall loss against the number of stored pairs per key dimension.

``n`` pairs with random unit keys in ``R^d`` and Gaussian values (``E |v|^2 = 1``) are written one
after another; then every stored key is queried against the final memory (``o_i = M^T k_i``, no
scale). The loss is the normalised squared error ``mean_i |o_i - v_i|^2 / mean_i |v_i|^2``. No
training: the three memories of :mod:`linmem.eval.collision`, the filters as written with fixed noise
(prior ``p``, observation noise ``r``, no decay, no process noise).

Reference curves: linear attention's cross-talk has the closed form ``(n - 1) / d`` (each of the
other n - 1 keys leaks ``(k_i . k_j)^2``, of mean 1/d); the Bayesian memory is ridge regression on
the stored pairs, whose noise-free limit (``r -> 0``) is least squares: zero loss up to ``n = d``
and ``1 - d / n`` beyond (the targets are random, so only a d-dimensional share of them fits).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from ..ops import bayes_filter, linear_recurrence
from .collision import MEMORIES
from .tables import write_table


def stored_pairs(trials: int, n: int, d: int, value_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [trials, n, 1, d] (unit norm) and values [trials, n, 1, value_dim] (N(0, 1 / value_dim)), fp64."""
    gen = torch.Generator().manual_seed(seed)
    keys = F.normalize(torch.randn(trials, n, 1, d, generator=gen, dtype=torch.float64), dim=-1)
    values = torch.randn(trials, n, 1, value_dim, generator=gen, dtype=torch.float64) / value_dim ** 0.5
    return keys, values


def final_memory(keys: torch.Tensor, values: torch.Tensor, memory: str, prior: float, obs_noise: float) -> torch.Tensor:
    """The memory's mean [trials, 1, d, V] after writing every pair in order."""
    B, n = keys.shape[:2]
    zeros = keys.new_zeros(B, n, 1)
    if memory == "bayes":
        _, _, (M, _) = bayes_filter(keys, keys, values, log_decay=zeros, obs_noise=zeros + obs_noise, prior=prior,
                                    output_final_state=True, backend="reference")
        return M
    if memory == "delta":
        beta = zeros + prior / (prior + obs_noise)  # the covariance-reset filter with unit keys
        _, M = linear_recurrence(keys, keys, values, beta=beta, output_final_state=True, backend="reference")
        return M
    if memory == "linear":
        _, M = linear_recurrence(keys, keys, values, output_final_state=True, backend="reference")
        return M
    raise ValueError(f"unknown memory {memory!r}; valid: {', '.join(MEMORIES)}")


def recall_loss(keys: torch.Tensor, values: torch.Tensor, M: torch.Tensor) -> float:
    """Normalised squared error of the read-outs ``M^T k_i`` at every stored key."""
    readout = torch.einsum("bnhk,bhkv->bnhv", keys, M)
    return float((readout - values).pow(2).sum(-1).mean() / values.pow(2).sum(-1).mean())


def crowding_study(
    out_dir: Path,
    *,
    key_dims: Sequence[int] = (16, 32, 64),
    ratios: Sequence[float] = (0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0),
    value_dim: int = 16,
    trials: int = 8,
    prior: float = 1.0,
    obs_noise: float = 0.1,
    seed: int = 0,
) -> list[dict]:
    """Run the study: for each key dim d and ratio n / d, store n pairs ``trials`` times and measure each
    memory's loss; write ``crowding`` (.csv, .md) and ``crowding.png`` under ``out_dir``; return the rows.

    Example:
        >>> import tempfile
        >>> rows = crowding_study(Path(tempfile.mkdtemp()), key_dims=(8,), ratios=(0.5, 2.0), trials=2)
        >>> [(r["n"], r["memory"]) for r in rows][:3]
        [(4, 'bayes'), (4, 'delta'), (4, 'linear')]
    """
    rows = []
    for d in key_dims:
        for ratio in ratios:
            n = max(1, round(ratio * d))
            keys, values = stored_pairs(trials, n, d, value_dim, seed=seed + 1000 * d + n)
            for memory in MEMORIES:
                loss = recall_loss(keys, values, final_memory(keys, values, memory, prior, obs_noise))
                rows.append(dict(d=d, n=n, n_over_d=n / d, memory=memory, loss=loss,
                                 linear_closed_form=(n - 1) / d, least_squares_limit=max(0.0, 1.0 - d / n)))
    out_dir = Path(out_dir)
    write_table(rows, out_dir / "crowding")
    _plot(rows, out_dir / "crowding.png", prior, obs_noise)
    return rows


def _plot(rows: list[dict], out: Path, prior: float, obs_noise: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    colors = dict(zip(MEMORIES, ("tab:blue", "tab:orange", "tab:green")))
    dims = sorted({r["d"] for r in rows})
    styles = dict(zip(dims, ("-", "--", ":", "-.")))
    for memory in MEMORIES:
        for d in dims:
            mine = [r for r in rows if r["memory"] == memory and r["d"] == d]
            ax.plot([r["n_over_d"] for r in mine], [r["loss"] for r in mine], styles.get(d, "-"), marker="o", ms=3,
                    color=colors[memory], label=f"{memory}, d = {d}")
    grid = sorted({r["n_over_d"] for r in rows})
    ax.plot(grid, [max(0.0, 1 - 1 / x) for x in grid], color="black", lw=1, label="least squares limit")
    ax.set(xlabel="stored pairs per key dimension n / d", ylabel="recall loss (normalised MSE)", yscale="log",
           title=f"random-key crowding (p = {prior}, r = {obs_noise})", ylim=(1e-4, None))
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
