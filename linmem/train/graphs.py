"""CUDA-graph micro-steps: a micro-batch's forward and backward replayed from one captured graph.

An eager training step is bound by the host: Python launches every kernel of every block one by one
(hundreds of microseconds of host time per block and pass), and at short sequences the GPU waits for it.
A CUDA graph launches the whole forward and backward at once, so the step's wall time falls to its GPU time.

How it works (:class:`GraphedMicroSteps`):

* one graph per batch shape, all in one memory pool. A packed batch's ``cu_seqlens`` is padded to a
  power-of-two number of sequences with empty ones at the end (which every op skips), so that its
  graph serves every packing of the same tokens per row;
* the first micro-batch of a shape runs eagerly on a side stream (Triton compiles and tunes its kernels,
  the allocator warms up), the second is captured, and it and every later one replay the graph;
* every trained parameter has its gradient before the first capture, and the graphs add into it as the
  eager backward does; the trainer zeroes the gradients in place (``zero_grad(set_to_none=False)``);
* a micro-batch's share of the step's targets, which weighs its loss, is a device scalar set before each
  replay.

Clipping and the optimiser step run eagerly after the graphs (a few launches with fused AdamW). The kernels
are the same as eager ones, so the losses are those of eager training (to the bit where the kernels are
deterministic). Refused by name (:func:`graph_refusal`): a CPU device, several processes, routed layers
(MoE, MoM: their tokens per expert are counted on the host) and Titans' memory with momentum (its op reads
packed sequences' bounds on the host). A model that reads a GPU value on the host
anywhere else (``LINMEM_DEBUG=1``'s value checks, say) fails its capture with an error that names the option.

Example:
    >>> steps = GraphedMicroSteps(model, autocast_dtype=torch.bfloat16)  # doctest: +SKIP
    >>> loss = steps(batch, weight=1.0)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from ..layers.moe import MoEFeedForward
from ..layers.mom import MixtureOfMemories
from ..layers.titans import TitansMemory

logger = logging.getLogger("linmem.train")

#: eager micro-batches of a shape before its graph is captured (compiles and tunes the kernels)
WARMUP_MICRO_STEPS = 1


def graph_refusal(model: torch.nn.Module, device: torch.device, world: int) -> Optional[str]:
    """None if :class:`GraphedMicroSteps` can capture ``model``'s training micro-steps, else why not."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device, not {device.type}"
    if world > 1:
        return "CUDA-graph steps run on one process (FSDP's collectives are launched from the host)"
    for name, module in model.named_modules():
        if isinstance(module, (MoEFeedForward, MixtureOfMemories)):
            return f"{name} routes tokens, and the tokens per expert are counted on the host"
        if isinstance(module, TitansMemory) and module.args.momentum:
            return f"{name} is Titans' memory with momentum, whose op reads packed sequences' bounds on the host"
    return None


def capacity(sequences: int) -> int:
    """The number of sequences a packed graph holds: the next power of two (at least 1).

    Example:
        >>> [capacity(n) for n in (1, 3, 4, 5)]
        [1, 4, 4, 8]
    """
    return 1 << max(sequences - 1, 0).bit_length()


def pad_cu_seqlens(cu_seqlens: torch.Tensor, sequences: int) -> torch.Tensor:
    """``cu_seqlens`` [N + 1] with empty sequences appended up to ``sequences``: [sequences + 1].

    Example:
        >>> pad_cu_seqlens(torch.tensor([0, 3, 5], dtype=torch.int32), 4).tolist()
        [0, 3, 5, 5, 5]
    """
    extra = sequences + 1 - cu_seqlens.shape[0]
    if extra < 0:
        raise ValueError(f"pad_cu_seqlens: {cu_seqlens.shape[0] - 1} sequences do not fit in {sequences}")
    return torch.cat([cu_seqlens, cu_seqlens[-1:].expand(extra)])


@dataclass
class _Graph:
    graph: Optional[torch.cuda.CUDAGraph]  # None until captured
    inputs: dict[str, torch.Tensor]  # static input buffers, filled before each replay
    weight: torch.Tensor  # [] fp32: the micro-batch's share of the step's targets
    loss: Optional[torch.Tensor] = None  # [] the weighted loss, written by each replay
    eager_runs: int = 0


class GraphedMicroSteps:
    """Forward + backward of training micro-batches, captured as one CUDA graph per batch shape.

    Args:
        model: the model to train (on its CUDA device); called as ``model(**batch, use_cache=False)`` and
            returning ``.loss``.
        autocast_dtype: the autocast dtype of the step (bf16), or None for none.

    Call with a batch (``input_ids``, ``labels`` [B, T], optional ``cu_seqlens`` [N + 1]; on any device) and
    the micro-batch's weight; returns its weighted loss (a detached [] tensor on the device).
    """

    def __init__(self, model: torch.nn.Module, autocast_dtype: Optional[torch.dtype]) -> None:
        self.model = model
        self.autocast_dtype = autocast_dtype
        self.device = next(model.parameters()).device
        self.graphs: dict[tuple, _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.side = torch.cuda.Stream(self.device)

    @property
    def captured(self) -> int:
        """The graphs captured so far (one per batch shape)."""
        return sum(g.graph is not None for g in self.graphs.values())

    def __call__(self, batch: dict[str, torch.Tensor], weight: float) -> torch.Tensor:
        batch = self._padded(batch)
        key = tuple((name, tuple(t.shape), t.dtype) for name, t in sorted(batch.items()))
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = _Graph(
                graph=None, inputs={n: torch.empty_like(t, device=self.device) for n, t in batch.items()},
                weight=torch.zeros((), dtype=torch.float32, device=self.device))
        for name, t in batch.items():
            entry.inputs[name].copy_(t, non_blocking=True)
        entry.weight.fill_(weight)
        if entry.graph is None and entry.eager_runs < WARMUP_MICRO_STEPS:
            entry.eager_runs += 1
            return self._eager(entry)
        if entry.graph is None:
            self._capture(entry)
        entry.graph.replay()
        return entry.loss.clone()

    def _padded(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        cu = batch.get("cu_seqlens")
        if cu is None:
            return batch
        return {**batch, "cu_seqlens": pad_cu_seqlens(cu, capacity(cu.shape[0] - 1))}

    def _forward_backward(self, entry: _Graph) -> torch.Tensor:
        with torch.autocast("cuda", dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            out = self.model(**entry.inputs, use_cache=False)
        loss = out.loss * entry.weight
        loss.backward()
        return loss.detach()

    def _eager(self, entry: _Graph) -> torch.Tensor:
        """The warm-up run, on the side stream as capture wants it."""
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            loss = self._forward_backward(entry)
        torch.cuda.current_stream(self.device).wait_stream(self.side)
        return loss

    def _capture(self, entry: _Graph) -> None:
        for p in self.model.parameters():  # gradients the graphs add into, outside the graphs' pool
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = {p: p.grad for p in self.model.parameters() if p.grad is not None}
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the warm-up's blocks go back, so the pool does not come on top of them
        graph = torch.cuda.CUDAGraph()
        try:  # a capture records the kernels without running them: the gradients keep their values
            with torch.cuda.graph(graph, pool=self.pool):
                entry.loss = self._forward_backward(entry)
        except RuntimeError as err:
            raise GraphCaptureError(f"the training step could not be captured as a CUDA graph ({err}); set "
                                    f"run.cuda_graph=false") from err
        replaced = [name for name, p in self.model.named_parameters() if p in grads and p.grad is not grads[p]]
        if replaced:
            raise GraphCaptureError(f"the captured backward replaced the gradient of {replaced[0]} instead of "
                                    f"adding into it; set run.cuda_graph=false")
        entry.graph = graph
        logger.info("captured a CUDA graph of the micro-step for %s (%d graphs)",
                    ", ".join(f"{n} {list(t.shape)}" for n, t in entry.inputs.items()), self.captured)


class GraphCaptureError(RuntimeError):
    """The training step cannot be captured as a CUDA graph (it reads a GPU value on the host, say)."""
