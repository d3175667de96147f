"""The controlled collision study: what the covariance of the Bayesian memory buys.

Two unit keys overlap by ``rho = k_A . k_B``; their values are orthonormal (``v_B = e_1``,
``v_A = e_2``). Key B is written ``boosts`` times, then key A is written ``floods`` times, then B is
queried (``o = M^T k_B``, no scale). The read-out is ``c_B v_B + c_A v_A``, and the probability of
recalling B among the two stored values is the softmax ``p_B = 1 / (1 + exp(-(c_B - c_A)))``.

Three memories, no training, the filters as written (no decay):

* ``bayes``: :func:`linmem.ops.bayes_filter` with prior ``p``, observation noise ``r`` (and optional
  process noise ``Q``);
* ``delta``: the same filter with its covariance reset, i.e. the delta rule with
  ``beta = p / (p + r)``;
* ``linear``: linear attention, the additive recurrence ``M += k v^T``.

Closed forms (derived in ``docs/bayes.md``; ``lambda = r / p``, ``s^2 = 1 - rho^2``):

* ``bayes`` with ``Q = 0`` is ridge regression: ``(c_B, c_A) = [1, rho] (lambda I + N G)^-1 N`` with
  ``N = diag(boosts, floods)`` and ``G = [[1, rho], [rho, 1]]``. As the boosts grow, ``c -> (1, 0)``
  whatever the flood: ``p_B -> (1 + e^-1)^-1 = 0.731`` (the boost asymptote); for an endless flood,
  ``c_B = n s^2 / (lambda + n s^2)`` and ``c_A = rho (1 - c_B)``.
* ``delta``: ``c_B = (1 - (1 - beta)^boosts) (1 - rho^2 f)``, ``c_A = rho f``, ``f = 1 - (1 - beta)^floods``:
  the flood overwrites B's share along A, so ``p_B`` falls below 1/2 once ``1 - rho^2 < rho``.
* ``linear``: ``c_B = boosts``, ``c_A = rho floods``: the flood drowns B.
* With process noise ``Q`` the gain of a flooded key settles at the steady state of the scalar
  Riccati recursion ``x = a^2 x r / (x + r) + Q``, gain ``x / (x + r)``: for ``a = 1``, ``Q = r`` it is
  ``(sqrt(5) - 1) / 2 = 0.618``. The filter reports it through its variance: after writing k (unit),
  ``var(k) - r = k^T P k = gain * r``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import torch

from ..ops import bayes_filter, linear_recurrence
from .tables import write_table

MEMORIES = ("bayes", "delta", "linear")
#: the recall probability of a memory that returns v_B exactly: softmax over {v_A, v_B} of (1, 0)
BOOST_ASYMPTOTE = 1.0 / (1.0 + math.exp(-1.0))
F64 = torch.float64


@dataclass(frozen=True)
class CollisionSetting:
    """One collision experiment."""

    rho: float = 0.5  # overlap k_A . k_B of the two unit keys, in [0, 1)
    boosts: int = 16  # writes of (k_B, v_B), first
    floods: int = 256  # writes of (k_A, v_A), after the boosts
    prior: float = 1.0  # p: the Bayesian memory's prior variance (and the delta rule's beta = p / (p + r))
    obs_noise: float = 1.0  # r: observation-noise variance
    process_noise: float = 0.0  # Q per step, Bayesian memory only

    def __post_init__(self):
        if not 0 <= self.rho < 1:
            raise ValueError(f"CollisionSetting: rho must be in [0, 1), got {self.rho}")
        if self.boosts < 0 or self.floods < 0 or self.boosts + self.floods == 0:
            raise ValueError(f"CollisionSetting: boosts, floods must be >= 0 and not both 0, got "
                             f"{self.boosts}, {self.floods}")
        if self.prior <= 0 or self.obs_noise <= 0 or self.process_noise < 0:
            raise ValueError(f"CollisionSetting: need prior > 0, obs_noise > 0, process_noise >= 0; got "
                             f"{self.prior}, {self.obs_noise}, {self.process_noise}")


def recall_probability(c_B: float, c_A: float) -> float:
    """Softmax probability of v_B among {v_A, v_B} for the read-out ``c_B v_B + c_A v_A`` (orthonormal values).

    Example:
        >>> round(recall_probability(1.0, 0.0), 4)
        0.7311
    """
    return 1.0 / (1.0 + math.exp(-(c_B - c_A)))


def _keys(rho: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([1.0, 0.0], dtype=F64), torch.tensor([rho, math.sqrt(1.0 - rho * rho)], dtype=F64)


def _stream(setting: CollisionSetting, query: torch.Tensor) -> dict:
    """q (``query`` at every token), k, v: [1, T, 1, 2] of the boosts then the floods; the gates [1, T, 1]."""
    k_B, k_A = _keys(setting.rho)
    v_B, v_A = torch.eye(2, dtype=F64)
    n, m = setting.boosts, setting.floods
    k = torch.cat([k_B.expand(n, 2), k_A.expand(m, 2)])[None, :, None]
    v = torch.cat([v_B.expand(n, 2), v_A.expand(m, 2)])[None, :, None]
    gate = lambda x: torch.full((1, n + m, 1), float(x), dtype=F64)  # noqa: E731
    return dict(q=query.expand(1, n + m, 1, 2), k=k, v=v, zero=gate(0.0), r=gate(setting.obs_noise),
                Q=gate(setting.process_noise))


def measured_readout(setting: CollisionSetting, memory: str) -> tuple[float, float]:
    """(c_B, c_A): the memory's read-out at k_B after the boosts and the floods, run through the ops."""
    s = _stream(setting, _keys(setting.rho)[0])
    if memory == "bayes":
        o, _, _ = bayes_filter(s["q"], s["k"], s["v"], log_decay=s["zero"], obs_noise=s["r"],
                               process_noise=s["Q"] if setting.process_noise else None, prior=setting.prior,
                               scale=1.0, backend="reference")
    elif memory == "delta":
        beta = torch.full_like(s["zero"], setting.prior / (setting.prior + setting.obs_noise))
        o, _ = linear_recurrence(s["q"], s["k"], s["v"], beta=beta, scale=1.0, backend="reference")
    elif memory == "linear":
        o, _ = linear_recurrence(s["q"], s["k"], s["v"], scale=1.0, backend="reference")
    else:
        raise ValueError(f"unknown memory {memory!r}; valid: {', '.join(MEMORIES)}")
    c_B, c_A = o[0, -1, 0].tolist()
    return c_B, c_A


def closed_form_readout(setting: CollisionSetting, memory: str) -> tuple[float, float]:
    """(c_B, c_A) from the closed forms of the module docstring (``bayes`` needs ``process_noise = 0``)."""
    rho, n, m = setting.rho, setting.boosts, setting.floods
    if memory == "bayes":
        if setting.process_noise:
            raise ValueError("closed_form_readout: the Bayesian closed form is for process_noise = 0")
        lam = setting.obs_noise / setting.prior
        G = torch.tensor([[1.0, rho], [rho, 1.0]], dtype=F64)
        N = torch.diag(torch.tensor([float(n), float(m)], dtype=F64))
        c = torch.tensor([1.0, rho], dtype=F64) @ torch.linalg.solve(lam * torch.eye(2, dtype=F64) + N @ G, N)
        return c[0].item(), c[1].item()
    if memory == "delta":
        beta = setting.prior / (setting.prior + setting.obs_noise)
        f = 1.0 - (1.0 - beta) ** m
        return (1.0 - (1.0 - beta) ** n) * (1.0 - rho * rho * f), rho * f
    if memory == "linear":
        return float(n), rho * m
    raise ValueError(f"unknown memory {memory!r}; valid: {', '.join(MEMORIES)}")


def riccati_gain(obs_noise: float, process_noise: float, decay: float = 1.0) -> float:
    """Steady-state gain of a key (unit norm) written at every step: the fixed point x of
    ``x = decay^2 x r / (x + r) + Q``, gain ``x / (x + r)``.

    Example:
        >>> round(riccati_gain(1.0, 1.0), 4)  # Q = r, no decay: the golden ratio's inverse
        0.618
    """
    r, Q, a2 = obs_noise, process_noise, decay * decay
    b = r - a2 * r - Q
    x = (-b + math.sqrt(b * b + 4.0 * Q * r)) / 2.0
    return x / (x + r)


def measured_gains(setting: CollisionSetting) -> list[float]:
    """Gain of each flood write of A (from the prior, no boosts), read from the filter's variance at k_A:
    ``(var - r) / r``."""
    flood = replace(setting, boosts=0)
    s = _stream(flood, _keys(setting.rho)[1])
    _, var, _ = bayes_filter(s["q"], s["k"], s["v"], log_decay=s["zero"], obs_noise=s["r"], process_noise=s["Q"],
                             prior=setting.prior, scale=1.0, return_variance=True, backend="reference")
    return ((var[0, :, 0] - setting.obs_noise) / setting.obs_noise).tolist()


def _row(sweep: str, setting: CollisionSetting, memory: str) -> dict:
    c_B, c_A = measured_readout(setting, memory)
    closed = None if (memory == "bayes" and setting.process_noise) else closed_form_readout(setting, memory)
    return dict(sweep=sweep, memory=memory, rho=setting.rho, boosts=setting.boosts, floods=setting.floods,
                c_B=c_B, c_A=c_A, p_B=recall_probability(c_B, c_A),
                p_B_closed_form=recall_probability(*closed) if closed else float("nan"))


def collision_study(
    out_dir: Path,
    *,
    setting: CollisionSetting = CollisionSetting(),
    boosts: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 1024),
    rhos: Sequence[float] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95),
    gain_steps: int = 32,
    gain_process_noise: float = 1.0,
) -> dict:
    """Run the study; write ``collision_boosts``, ``collision_overlap``, ``collision_gain`` (.csv, .md) and
    ``collision.png`` under ``out_dir``. Returns a summary: the boost asymptote (closed form and the Bayesian
    memory's recall at the most boosts), the Riccati gain (closed form and the last measured flood gain).

    The boost sweep varies ``setting.boosts``, the overlap sweep ``setting.rho``; the gain run floods key A
    ``gain_steps`` times with ``process_noise = gain_process_noise``.

    Example:
        >>> import tempfile
        >>> summary = collision_study(Path(tempfile.mkdtemp()), boosts=(1, 64), rhos=(0.0, 0.9), gain_steps=16)
        >>> round(summary["riccati_gain_measured"], 4), round(summary["riccati_gain_closed_form"], 4)
        (0.618, 0.618)
    """
    out_dir = Path(out_dir)
    by_boosts = [_row("boosts", replace(setting, boosts=n), m) for n in boosts for m in MEMORIES]
    by_overlap = [_row("overlap", replace(setting, rho=rho), m) for rho in rhos for m in MEMORIES]
    gain_setting = replace(setting, floods=gain_steps, process_noise=gain_process_noise)
    gains = measured_gains(gain_setting)
    closed_gain = riccati_gain(setting.obs_noise, gain_process_noise)
    by_step = [dict(step=t + 1, gain=g, gain_closed_form_steady=closed_gain) for t, g in enumerate(gains)]
    write_table(by_boosts, out_dir / "collision_boosts")
    write_table(by_overlap, out_dir / "collision_overlap")
    write_table(by_step, out_dir / "collision_gain")
    _plot(by_boosts, by_overlap, by_step, setting, out_dir / "collision.png")
    most = max(boosts)
    return dict(
        boost_asymptote=BOOST_ASYMPTOTE,
        bayes_recall_at_most_boosts=next(r["p_B"] for r in by_boosts if r["memory"] == "bayes" and r["boosts"] == most),
        most_boosts=most,
        riccati_gain_closed_form=closed_gain,
        riccati_gain_measured=gains[-1],
    )


def _plot(by_boosts: list[dict], by_overlap: list[dict], by_step: list[dict], setting: CollisionSetting,
          out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_b, ax_o, ax_g) = plt.subplots(1, 3, figsize=(14, 4))
    for memory in MEMORIES:
        rows = [r for r in by_boosts if r["memory"] == memory]
        ax_b.plot([r["boosts"] for r in rows], [r["p_B"] for r in rows], marker="o", label=memory)
        rows = [r for r in by_overlap if r["memory"] == memory]
        ax_o.plot([r["rho"] for r in rows], [r["p_B"] for r in rows], marker="o", label=memory)
    for ax in (ax_b, ax_o):
        ax.axhline(BOOST_ASYMPTOTE, color="gray", ls="--", lw=1, label="(1 + e^-1)^-1")
        ax.set(ylabel="p(recall B)", ylim=(0, 1))
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    ax_b.set(xscale="log", xlabel="boosts of B", title=f"rho = {setting.rho}, {setting.floods} floods of A")
    ax_o.set(xlabel="overlap rho", title=f"{setting.boosts} boosts, {setting.floods} floods")
    ax_g.plot([r["step"] for r in by_step], [r["gain"] for r in by_step], marker=".", label="measured")
    ax_g.axhline(by_step[0]["gain_closed_form_steady"], color="gray", ls="--", lw=1, label="Riccati steady state")
    ax_g.set(xlabel="flood step", ylabel="gain along k_A", title="gain under process noise", ylim=(0, 1))
    ax_g.legend(fontsize=8)
    ax_g.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
