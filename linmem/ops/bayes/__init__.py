"""The Bayesian memory of Memory by Design (arXiv 2605.31163): a Kalman filter over an associative memory.

One entry point, :func:`bayes_filter`, with five backends:

* ``"reference"``: the token loop of :mod:`.reference` (fp32, fp64 for fp64 inputs), the oracle;
* ``"delta"``: with ``reset=True`` the filter is exactly the gated delta rule with
  ``beta = p / (p |k|^2 + r)``, computed by ``linear_recurrence`` (chunked, Triton on CUDA);
* ``"triton"``: the fused sequential kernels of :mod:`.kernels` (forward and backward, P in fp32
  registers per head, K <= 128, V in blocks);
* ``"chunk"``: the exact chunked form of :mod:`.chunk` in PyTorch (per chunk of 64 tokens a 64 x 64
  Cholesky factorisation and triangular solves; gradients by autograd), ``reset=False`` only;
* ``"chunk_triton"``: the same chunked form as fused Triton kernels (:mod:`.chunk_triton`: one program per
  sequence and head runs its chunks, forward and a hand-written backward), ``reset=False``, K, V <= 128.

``"auto"`` takes "delta" for ``reset=True``, else on CUDA "chunk_triton", then "triton" where it cannot serve
the inputs (:func:`set_auto_cuda_backends` changes that order), else "reference". A backend that cannot serve
the inputs falls back to the next one named, then to "delta" (reset) or "reference", with the reason logged at
debug level ("chunk", "chunk_triton" beyond their conditioning, :mod:`.conditioning`). Inputs beyond every
backend's conditioning and an initial covariance that is not positive semi-definite are refused by name where
values are checked.
``docs/bayes.md`` derives the chunked form and states the bound.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Callable, Optional

import torch

from .. import parallel
from ..checks import check_backend
from .chunk import chunk_filter
from .conditioning import chunk_refusal
from .delta import delta_filter
from .inputs import FilterInputs, State, compute_dtype, validate
from .reference import filter_step, information_form, reference_filter

__all__ = ["bayes_filter", "bayes_filter_step", "information_form", "set_auto_cuda_backends", "BACKENDS"]

logger = logging.getLogger("linmem.ops")

#: names accepted by ``backend=``
BACKENDS = ("auto", "reference", "delta", "triton", "chunk", "chunk_triton")
#: the backends of :func:`bayes_filter_step`
STEP_BACKENDS = ("auto", "reference", "triton")
#: input dtypes of the Triton kernels
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None

Result = tuple[torch.Tensor, Optional[torch.Tensor], Optional[State]]


def _device_refusal(x: torch.Tensor) -> Optional[str]:
    """None if the Triton kernels run on x's device (CUDA, or the CPU through the interpreter)."""
    if not _TRITON_INSTALLED:
        return "the triton package is not installed"
    if x.device.type == "cuda":
        return None
    if x.device.type == "cpu":
        from ..recurrence.triton.numerics import INTERPRET

        return None if INTERPRET else "CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 before first use)"
    return f"no Triton kernels for {x.device.type} tensors"


def _triton_refusal(inputs: FilterInputs) -> Optional[str]:
    """None if the Triton kernels serve these inputs, else why not."""
    from .launch import MAX_KEY_DIM

    if inputs.reset:
        return "reset=True is the delta rule, served by the 'delta' backend"
    if inputs.q.dtype not in KERNEL_DTYPES:
        return f"dtype {inputs.q.dtype} (the kernels take float16, bfloat16, float32)"
    if inputs.q.shape[-1] > MAX_KEY_DIM:
        return f"key head dim K = {inputs.q.shape[-1]} (P [K, K] is held on chip: K <= {MAX_KEY_DIM})"
    if inputs.q.shape[1] == 0:
        return "no tokens"
    return _device_refusal(inputs.q)


def _chunk_refusal(inputs: FilterInputs) -> Optional[str]:
    if inputs.reset:
        return "reset=True is the delta rule, served by the 'delta' backend"
    return chunk_refusal(inputs.condition, inputs.q.dtype, inputs.q.shape[1])


def _chunk_triton_refusal(inputs: FilterInputs) -> Optional[str]:
    """None if the chunked kernels serve these inputs, else why not."""
    from .chunk_fwd import MAX_FP32_HEAD_DIM, MAX_HEAD_DIM

    if inputs.reset:
        return "reset=True is the delta rule, served by the 'delta' backend"
    if inputs.q.dtype not in KERNEL_DTYPES:
        return f"dtype {inputs.q.dtype} (the kernels take float16, bfloat16, float32)"
    K, V = inputs.q.shape[-1], inputs.v.shape[-1]
    if max(K, V) > MAX_HEAD_DIM:
        return f"head dims K = {K}, V = {V} (P [K, K] and m [K, V] are held on chip: K, V <= {MAX_HEAD_DIM})"
    if inputs.q.dtype == torch.float32 and max(K, V) > MAX_FP32_HEAD_DIM:
        return (f"float32 inputs at head dims K = {K}, V = {V} (their tiles take 257 KiB of shared memory at 128, "
                f"past the 227 of an H100 or H200: K, V <= {MAX_FP32_HEAD_DIM} in float32)")
    if inputs.q.shape[1] == 0:
        return "no tokens"
    return chunk_refusal(inputs.condition, inputs.q.dtype, inputs.q.shape[1], "chunk_triton") or \
        _device_refusal(inputs.q)


def _chunk_triton_filter(inputs: FilterInputs) -> Result:
    from .chunk_triton import chunk_triton_filter

    return chunk_triton_filter(inputs)


def _delta_refusal(inputs: FilterInputs) -> Optional[str]:
    return None if inputs.reset else "the delta rule is the filter with reset=True only"


def _contiguous_f32(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if x is None else x.float().contiguous()


def _kernel_args(inputs: FilterInputs) -> tuple:
    """(q, k, v, g, r, w) as the kernels take them: contiguous, the gates fp32."""
    q, k, v = (x.contiguous() for x in (inputs.q, inputs.k, inputs.v))
    return (q, k, v, *map(_contiguous_f32, (inputs.log_decay, inputs.obs_noise, inputs.process_noise)))


def _triton_filter(inputs: FilterInputs) -> Result:
    """The fused kernels: under ``torch.compile`` as the custom ops of :mod:`.ops`, else through the launchers
    (the same kernels without the custom ops' dispatch cost)."""
    from .launch import BayesFilterFunction, Launch, filter_forward

    q, k, v, g, r, w = _kernel_args(inputs)
    M0, P0 = (None, None) if inputs.initial_state is None else map(_contiguous_f32, inputs.initial_state)
    cu = None if inputs.cu_seqlens is None else inputs.cu_seqlens.contiguous()
    launch = Launch.default(q.shape[-1], v.shape[-1])
    args = (q, k, v, g, r, w, M0, P0, cu, inputs.scale, inputs.prior, inputs.return_variance)
    if torch.compiler.is_compiling():
        from .ops import filter_fwd_op

        o, var, MT, PT = filter_fwd_op(*args, inputs.records_grad, launch.block_v, launch.num_warps)[:4]
    elif inputs.records_grad:
        o, var, MT, PT = BayesFilterFunction.apply(*args, launch)
    else:
        o, var, MT, PT, _ = filter_forward(*args, False, launch)
    return o, (var if inputs.return_variance else None), ((MT, PT) if inputs.output_final_state else None)


_BACKENDS: dict[str, tuple[Callable[[FilterInputs], Result], Callable[[FilterInputs], Optional[str]]]] = {
    "reference": (reference_filter, lambda inputs: None),
    "delta": (delta_filter, _delta_refusal),
    "triton": (_triton_filter, _triton_refusal),
    "chunk": (chunk_filter, _chunk_refusal),
    "chunk_triton": (_chunk_triton_filter, _chunk_triton_refusal),
}


#: the backends "auto" tries on CUDA tensors with reset=False, in order (:func:`set_auto_cuda_backends`): the
#: sequential kernels, whose Joseph-form update stays finite on inputs of any conditioning; the chunked ones, 2-4x
#: faster, give NaN where a chunk's innovation matrix rounds indefinite, which unchecked GPU inputs cannot rule out
_auto_cuda: tuple[str, ...] = ("triton",)


def set_auto_cuda_backends(*names: str) -> None:
    """Choose the backends that ``bayes_filter(..., backend="auto")`` tries on CUDA tensors with ``reset=False``, in
    order: the first that serves the inputs runs, else "reference". The default is ``("triton",)``, the sequential
    kernels; ``("chunk_triton", "triton")`` takes the chunked kernels (2-4x faster on an H200) where they serve the
    inputs, for models whose observation noise keeps every chunk within the chunked form's conditioning (on GPU
    tensors the choice cannot read it: docs/bayes.md, "Conditioning").

    Example:
        >>> from linmem.ops.bayes import set_auto_cuda_backends
        >>> set_auto_cuda_backends("chunk_triton", "triton")  # the chunked kernels first
        >>> set_auto_cuda_backends("triton")  # the default again
    """
    global _auto_cuda
    if not names:
        raise ValueError("set_auto_cuda_backends: name at least one backend, e.g. \"chunk_triton\", \"triton\"")
    for name in names:
        check_backend("set_auto_cuda_backends", name, tuple(b for b in BACKENDS if b not in ("auto", "delta")))
    _auto_cuda = tuple(names)


def _choose(backend: str, inputs: FilterInputs) -> Callable[[FilterInputs], Result]:
    check_backend("bayes_filter", backend, BACKENDS)
    fallback = "delta" if inputs.reset else "reference"
    if backend == "auto":
        wanted = ["delta"] if inputs.reset else (list(_auto_cuda) if inputs.q.device.type == "cuda" else [])
    else:
        wanted = [backend]
    for i, name in enumerate(wanted):
        fn, refusal = _BACKENDS[name]
        reason = refusal(inputs)
        if reason is None:
            return fn
        after = wanted[i + 1] if i + 1 < len(wanted) else fallback
        logger.debug("bayes_filter: backend %r cannot serve these inputs (%s); using %r", name, reason, after)
    return _BACKENDS[fallback][0]


def bayes_filter(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    log_decay: torch.Tensor,
    obs_noise: torch.Tensor,
    process_noise: Optional[torch.Tensor] = None,
    prior: float = 1.0,
    reset: bool = False,
    scale: Optional[float] = None,
    initial_state: Optional[State] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    return_variance: bool = False,
    backend: str = "auto",
) -> Result:
    """The Bayesian memory: a Kalman filter that writes each (k_t, v_t) into a Gaussian belief over the memory.

    Per head the belief has a mean ``M: [K, V]`` and a covariance ``P: [K, K]`` shared by the V columns.
    Per step, with ``a = exp(log_decay_t)``, ``r = obs_noise_t``, ``Q = process_noise_t``::

        P^- = a^2 P_{t-1} + Q I          (P^- = prior * I when reset)
        u = P^- k_t,   s = k_t . u + r
        M_t = a M_{t-1} + u (v_t - (a M_{t-1})^T k_t)^T / s
        P_t = P^- - u u^T / s
        o_t = scale * M_t^T q_t,   var_t = q_t^T P_t q_t + r

    A sequence starts from ``M = 0``, ``P = prior * I`` unless ``initial_state`` is given.

    Every backend is exact within ``4 eps (K + A kappa T)`` while ``eps kappa <= 0.01``, with ``kappa`` the largest
    ``|k_t|^2 ||P^-_t|| / obs_noise_t`` and ``eps`` fp32's unit roundoff (fp64's for fp64 inputs); beyond it, and
    for an initial covariance that is not symmetric positive semi-definite, a ``ValueError`` names the argument
    (on CPU tensors; on GPU tensors with debug checks on). ``docs/bayes.md``, "Conditioning", has A, the error
    measure and what was measured.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``, all of one floating dtype.
        log_decay: ``[B, T, H]`` natural-log decay, <= 0.
        obs_noise: ``[B, T, H]`` observation-noise variance r, > 0.
        process_noise: ``[B, T, H]`` process-noise variance (Q = process_noise * I), finite and >= 0, or None (0).
        prior: the prior variance p (finite, > 0) of a fresh sequence's covariance.
        reset: reset ``P^- = p I`` at every step: the gated delta rule with ``beta = p / (p |k|^2 + r)``; the
            given initial covariance is then not read.
        scale: read-out scale (finite, > 0), default ``K ** -0.5``; ``var`` is that of the unscaled read-out
            ``q^T W``.
        initial_state: ``(M [N, H, K, V], P [N, H, K, K])``, N = B or the number of sequences; P is read as
            its symmetric part ``(P + P^T) / 2``.
        output_final_state: also return the final ``(M, P)``.
        cu_seqlens: ``[N + 1]`` int32/int64 boundaries of N sequences packed along T (B == 1).
        return_variance: also return the predictive variance ``var``.
        backend: ``"auto"``, ``"reference"``, ``"delta"`` (reset only), ``"triton"``, ``"chunk"`` (the exact
            chunked form in PyTorch, reset=False only) or ``"chunk_triton"`` (the chunked form as Triton kernels,
            reset=False, K, V <= 128).

    Returns:
        ``(o, var, state)``: ``o [B, T, H, V]`` in the dtype of q; ``var [B, T, H]`` (fp32, fp64 for fp64
        inputs) or None; ``state = (M [N, H, K, V], P [N, H, K, K])`` (fp32, fp64 for fp64 inputs) or None.

    Example:
        >>> import torch
        >>> from linmem.ops import bayes_filter
        >>> B, T, H, K, V = 2, 16, 4, 32, 64
        >>> q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K) / K ** 0.5, torch.randn(B, T, H, V)
        >>> g = torch.nn.functional.logsigmoid(torch.randn(B, T, H) + 4)
        >>> o, var, (M, P) = bayes_filter(q, k, v, log_decay=g, obs_noise=torch.full((B, T, H), 0.5),
        ...                               output_final_state=True, return_variance=True)
        >>> o.shape, var.shape, M.shape, P.shape
        (torch.Size([2, 16, 4, 64]), torch.Size([2, 16, 4]), torch.Size([2, 4, 32, 64]), torch.Size([2, 4, 32, 32]))
    """
    inputs = validate(
        q, k, v, log_decay=log_decay, obs_noise=obs_noise, process_noise=process_noise, prior=prior, reset=reset,
        scale=scale, initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        return_variance=return_variance,
    )
    if (handler := parallel.sequence_handler()) is not None:  # the sequences are split over ranks
        return handler.bayes_filter(q, k, v, log_decay=log_decay, obs_noise=obs_noise, process_noise=process_noise,
                                    prior=prior, reset=reset, scale=scale, initial_state=initial_state,
                                    output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                    return_variance=return_variance, backend=backend)
    return _choose(backend, inputs)(inputs)


def _step_kernel_refusal(inputs: FilterInputs, state: State) -> Optional[str]:
    """None if the forward kernel can run this step in place on ``state``."""
    if inputs.records_grad:
        return "autograd records the step"
    if not all(x.is_contiguous() and x.dtype == torch.float32 for x in state):
        return "the state is not contiguous fp32 (it is updated in place)"
    if inputs.v.shape[-1] > 256:
        return f"value head dim V = {inputs.v.shape[-1]} (one program holds all of M: V <= 256)"
    return _triton_refusal(inputs)


def _check_writable(state: State) -> None:
    """Refuse a state the step cannot update in place: an expanded view (elements sharing memory) or an inference
    tensor outside inference mode (not asked under ``torch.compile``, which cannot trace ``is_inference``)."""
    for name, t in (("state[0] (M)", state[0]), ("state[1] (P)", state[1])):
        shared = [d for d in range(t.dim()) if t.stride(d) == 0 and t.shape[d] > 1]
        if shared:
            raise ValueError(
                f"bayes_filter_step: `{name}` is updated in place, but it is an expanded view (stride 0 along dim "
                f"{shared[0]} of shape {list(t.shape)}): its elements share memory; pass a tensor that owns them, "
                "e.g. `.clone()`"
            )
        if not torch.compiler.is_compiling() and t.is_inference() and not torch.is_inference_mode_enabled():
            raise ValueError(
                f"bayes_filter_step: `{name}` is updated in place, but it is an inference tensor (made under "
                "torch.inference_mode) and this step runs outside inference mode; pass `.clone()` of it"
            )


def bayes_filter_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: State,
    *,
    log_decay: torch.Tensor,
    obs_noise: torch.Tensor,
    process_noise: Optional[torch.Tensor] = None,
    prior: float = 1.0,
    reset: bool = False,
    scale: Optional[float] = None,
    return_variance: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, Optional[torch.Tensor], State]:
    """One decoding step of :func:`bayes_filter` against a state ``(M, P)``.

    Shapes are those of ``bayes_filter`` without the time axis: q, k ``[B, H, K]``, v ``[B, H, V]``,
    log_decay, obs_noise, process_noise ``[B, H]``; ``state = (M [B, H, K, V], P [B, H, K, K])`` in fp32
    (fp64 for fp64 inputs). Returns ``(o [B, H, V], var [B, H] or None, state)``. When no gradient is being
    recorded the state is updated in place and the same tensors are returned (on CUDA by the forward kernel), so
    a state that cannot be written (an expanded view, an inference tensor outside inference mode) is refused by
    name; otherwise new tensors are returned and ``state`` is left untouched. ``P`` must be a covariance
    (symmetric positive semi-definite) and the step within the conditioning of ``bayes_filter`` (both checked
    where its value checks run). ``backend``: ``"auto"`` (the forward
    kernel on CUDA, else the PyTorch step), ``"triton"`` (the kernel, on the CPU through the interpreter) or
    ``"reference"`` (the PyTorch step); a kernel that cannot serve the step falls back to PyTorch (logged).

    Example:
        >>> import torch
        >>> from linmem.ops import bayes_filter_step
        >>> B, H, K, V = 1, 2, 8, 8
        >>> state = (torch.zeros(B, H, K, V), torch.eye(K).repeat(B, H, 1, 1))
        >>> o, var, state = bayes_filter_step(torch.randn(B, H, K), torch.randn(B, H, K), torch.randn(B, H, V), state,
        ...                                   log_decay=torch.zeros(B, H), obs_noise=torch.ones(B, H))
        >>> o.shape
        torch.Size([1, 2, 8])
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and t.dim() != 3:
            raise ValueError(f"bayes_filter_step: `{name}` must be 3-D [B, H, D], got shape {list(t.shape)}")
    for name, t in (("log_decay", log_decay), ("obs_noise", obs_noise), ("process_noise", process_noise)):
        if isinstance(t, torch.Tensor) and t.dim() != 2:
            raise ValueError(f"bayes_filter_step: `{name}` must be 2-D [B, H], got shape {list(t.shape)}")
    add_time = lambda t: None if t is None else t.unsqueeze(1)  # noqa: E731
    inputs = validate(
        add_time(q), add_time(k), add_time(v), log_decay=add_time(log_decay), obs_noise=add_time(obs_noise),
        process_noise=add_time(process_noise), prior=prior, reset=reset, scale=scale, initial_state=state,
        output_final_state=True, cu_seqlens=None, return_variance=return_variance,
    )
    M, P = inputs.initial_state
    acc = compute_dtype(q)
    if M.dtype != acc or P.dtype != acc:
        raise TypeError(f"bayes_filter_step: `state` must be {acc} for {q.dtype} inputs, got {M.dtype}, {P.dtype}")
    check_backend("bayes_filter_step", backend, STEP_BACKENDS)
    if not inputs.records_grad:
        _check_writable((M, P))
    kernel = backend == "triton" or (backend == "auto" and q.device.type == "cuda")
    reason = _step_kernel_refusal(inputs, (M, P)) if kernel else None
    if kernel and reason is None:
        from .launch import Launch, _pow2, default_warps, filter_forward

        BV = _pow2(v.shape[-1])
        launch = Launch(BV, default_warps(q.shape[-1], BV))
        if torch.compiler.is_compiling():
            from .ops import step_op

            o, var = step_op(*_kernel_args(inputs), M, P, inputs.scale, inputs.prior, return_variance, launch.block_v,
                             launch.num_warps)
        else:
            o, var, _, _, _ = filter_forward(*_kernel_args(inputs), M, P, None, inputs.scale, inputs.prior,
                                             return_variance, False, launch, MT=M, PT=P)
        return o[:, 0], (var[:, 0] if return_variance else None), (M, P)
    if reason is not None:
        logger.debug("bayes_filter_step: the kernel cannot serve this step (%s); stepping in PyTorch", reason)
    cast = lambda t: None if t is None else t.to(acc)  # noqa: E731
    o, var, M_new, P_new = filter_step(
        M, 0.5 * (P + P.transpose(-1, -2)), *map(cast, (q, k, v)), torch.exp(log_decay.to(acc)), cast(obs_noise),
        cast(process_noise), prior=inputs.prior, reset=reset, scale=inputs.scale, variance=return_variance,
    )
    if inputs.records_grad:
        return o.to(q.dtype), var, (M_new, P_new)
    M.copy_(M_new)
    P.copy_(P_new)
    return o.to(q.dtype), var, (M, P)
