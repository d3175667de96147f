"""Turn a trained Gated DeltaNet model into a Bayesian-memory model over the same weights (Memory by Design's
distillation, arXiv 2605.31163: Bayesian layers started from a pretrained Gated DeltaNet, then fine-tuned).

Every memory layer ``gated_deltanet`` becomes ``bayes`` (:mod:`linmem.layers.bayes`), which is Gated DeltaNet's
projections around a Kalman filter; everything else (embeddings, norms, feed-forwards, attention layers of a
hybrid, ``lm_head``) is copied as it is. Per memory layer::

    q_proj, k_proj, v_proj, b_proj, a_proj, A_log, dt_bias,
    g_proj, o_norm, o_proj                                  -> the same names, copied exactly
    q_conv, k_conv, v_conv (weight, bias)                   -> convs.q, convs.k, convs.v
    (none)                                                  -> obs_noise_raw, process_noise_raw: see below

**What maps.** The decay has the same form in both layers (Mamba-2's ``log a = -exp(A_log) softplus(W_a x +
dt_bias)``), so ``a_proj``, ``A_log`` and ``dt_bias`` carry it over exactly. The Bayesian layer's prior is fixed
to ``p = 1`` (its unit) and its observation noise is ``r_t = r_h exp(-b_t)`` with Gated DeltaNet's ``b_t = W_b
x_t``. With its covariance reset to ``p I`` at every step the filter is the gated delta rule with
``beta_t = p / (p |k|^2 + r_t)``; for unit keys that is ``sigmoid(b_t - log(r_h / p))``, Gated DeltaNet's
``sigmoid(b_t)`` for every ``b_t`` exactly when ``r_h = p = 1``: so ``obs_noise_raw = softplus^-1(1)``.
The process noise ``Q_t = q_h (1 - a_t^2)`` has no counterpart; ``q_h = 1`` keeps a direction nothing has written
at the prior (``P^- = a^2 I + (1 - a^2) I = I``), so every write into a fresh direction is Gated DeltaNet's
write exactly, and a head whose decay is near 0 (``P^- ~ q_h I``) stays near Gated DeltaNet throughout.

**What does not map.** The covariance itself: after a write, the Bayesian layer's gain along the written
direction is smaller than ``beta`` (``P`` shrinks there) and its writes are steered by ``P``, so the converted
model's outputs differ from the source's wherever a head writes twice into overlapping directions within its
memory's horizon; this is the change the conversion is for. Two details of the parameterisation differ as well:
``b_t`` is clamped to +-10 in the Bayesian layer (``beta`` within 5e-5 of 0 or 1 beyond it), and Gated DeltaNet
normalises keys as ``x / sqrt(|x|^2 + 1e-6)``, the Bayesian layer as ``x / max(|x|, 1e-12)``. With the filter
run with ``reset=True`` the converted model equals the source to fp32 rounding wherever no ``|b_t|`` passes the
clamp (``tests/linearize/test_bayes_conversion.py``).

Example:
    >>> from linmem.models import LinmemConfig, LinmemForCausalLM
    >>> source = LinmemForCausalLM(LinmemConfig(vocab_size=64, hidden_size=32, num_heads=2, layer_pattern="LN"))
    >>> model, record = gated_deltanet_to_bayes(source)
    >>> model.config.memory, len(record.initialised)
    ('bayes', 2)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..layers.base import check_choice
from ..layers.bayes import LAYER_BACKENDS, SOFTPLUS_INV_ONE
from ..models import LinmemConfig, LinmemForCausalLM

#: Gated DeltaNet's spelling of a parameter -> the Bayesian layer's, inside a memory layer's ``mixer.``
RENAMED = {"q_conv.": "convs.q.", "k_conv.": "convs.k.", "v_conv.": "convs.v."}
#: the Bayesian layer's parameters without a counterpart -> their raw start (softplus^-1 of r_h = 1, q_h = 1)
BAYES_ONLY = {"obs_noise_raw": SOFTPLUS_INV_ONE, "process_noise_raw": SOFTPLUS_INV_ONE}


@dataclass
class BayesConversion:
    """What :func:`gated_deltanet_to_bayes` did: the names copied and those it initialised."""

    copied: dict[str, str] = field(default_factory=dict)  # converted model's name -> the source's
    initialised: dict[str, float] = field(default_factory=dict)  # converted name -> raw value (no counterpart)


def _source_name(name: str) -> str:
    """The source's name of a converted model's parameter (the convolutions renamed back)."""
    for old, new in RENAMED.items():
        if f".mixer.{new}" in name:
            return name.replace(f".mixer.{new}", f".mixer.{old}")
    return name


def gated_deltanet_to_bayes(
    model: LinmemForCausalLM, *, backend: str = "auto"
) -> tuple[LinmemForCausalLM, BayesConversion]:
    """A model whose memory layers are Bayesian, started from ``model``'s Gated DeltaNet weights (see the module
    docstring for the mapping). Returns ``(converted, record)``; ``model`` is left as it is.

    The converted model has ``model``'s config with ``memory="bayes"`` and ``recurrence_backend=backend`` (one
    of the Bayesian layer's: ``auto``, ``reference``, ``triton``), sits on ``model``'s device in its dtype, and
    is in ``model``'s train/eval mode. Raises ``ValueError`` naming ``memory`` when ``model``'s memory layers are
    not ``gated_deltanet``, ``backend`` when it is not one of the layer's, and a parameter that has no place (a
    mapping that missed one).

    Example:
        >>> converted, record = gated_deltanet_to_bayes(source)  # doctest: +SKIP
        >>> converted.save_pretrained("runs/gdn-as-bayes")  # doctest: +SKIP
    """
    if not isinstance(model, LinmemForCausalLM):
        raise TypeError(f"gated_deltanet_to_bayes: `model` must be a LinmemForCausalLM, got {type(model).__name__}")
    source = model.config
    if source.memory != "gated_deltanet":
        raise ValueError(f"gated_deltanet_to_bayes: the model's `memory` must be 'gated_deltanet', got "
                         f"{source.memory!r}")
    check_choice("gated_deltanet_to_bayes", "backend", backend, LAYER_BACKENDS)
    weights = model.state_dict()
    reference = next(iter(weights.values()))
    config = LinmemConfig.from_dict({**source.to_dict(), "memory": "bayes", "recurrence_backend": backend})
    with torch.device(reference.device):
        converted = LinmemForCausalLM(config).to(reference.dtype)
    record = BayesConversion()
    state = {}
    for name, target in converted.state_dict().items():
        leaf = name.rsplit(".", 1)[-1]
        if ".mixer." in name and leaf in BAYES_ONLY:
            state[name] = torch.full_like(target, BAYES_ONLY[leaf])
            record.initialised[name] = BAYES_ONLY[leaf]
            continue
        origin = _source_name(name)
        if origin not in weights:
            raise ValueError(f"gated_deltanet_to_bayes: the converted model's {name} has no counterpart {origin} "
                             "in the source")
        state[name] = weights[origin]
        record.copied[name] = origin
    left = sorted(set(weights) - set(record.copied.values()))
    if left:
        raise ValueError(f"gated_deltanet_to_bayes: the source's {left[0]} has no place in the converted model")
    converted.load_state_dict(state, strict=True)
    converted.train(model.training)
    return converted, record
