"""What the text evaluations ask of a causal LM: next-token scores and greedy continuations.

:func:`next_token_scores` runs the model once over a batch and computes log-probabilities only at
the positions asked for (the hidden states of those positions go through the output layer, in
fp32, in chunks), so scoring long sequences over a large vocabulary never holds ``[B, T, V]``
logits. :func:`greedy_generate` continues a batch of prompts of different lengths: prompts are
left-padded, the prompt is read in one forward pass, and every further token is one step with the
model's decoding cache (the recurrent state of memory layers, the KV cache of attention layers).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..models import LinmemCache

IGNORE_INDEX = -100
SCORE_CHUNK_ROWS = 4096  # positions whose logits are materialised at once


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's parameters."""
    return next(model.parameters()).device


@contextlib.contextmanager
def inference_mode(model: nn.Module) -> Iterator[None]:
    """``torch.no_grad``, eval mode, and bf16 autocast on CUDA (as the trainer runs); restores train mode.

    Example:
        >>> with inference_mode(torch.nn.Linear(2, 2)):
        ...     pass
    """
    device = model_device(model)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            yield
    finally:
        model.train(was_training)


@torch.no_grad()
def next_token_scores(
    model: nn.Module, input_ids: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of ``targets[b, t]`` given ``input_ids[b, :t + 1]``, and whether it is the argmax.

    input_ids: [B, T]; targets: [B, T], ``-100`` where nothing is scored (the usual choice is
    ``targets[:, t] = input_ids[:, t + 1]``). Returns ``(logprob [B, T] fp32, greedy [B, T] bool)``,
    0 and False at unscored positions. The model's base (``model.base_model``) gives hidden
    states; only the scored ones go through the output embedding.

    Example:
        >>> from linmem.models import LinmemConfig, LinmemForCausalLM
        >>> model = LinmemForCausalLM(LinmemConfig(vocab_size=16, hidden_size=16, num_heads=2, layer_pattern="L"))
        >>> ids = torch.randint(0, 16, (2, 5))
        >>> targets = torch.full_like(ids, -100); targets[:, :-1] = ids[:, 1:]
        >>> logprob, greedy = next_token_scores(model, ids, targets)
        >>> logprob.shape, bool((logprob <= 0).all())
        (torch.Size([2, 5]), True)
    """
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"input_ids must be an integer tensor [B, T]; got {input_ids.dtype} {tuple(input_ids.shape)}")
    if targets.shape != input_ids.shape:
        raise ValueError(f"targets must have the shape of input_ids {tuple(input_ids.shape)}; "
                         f"got {tuple(targets.shape)}")
    device = model_device(model)
    input_ids, targets = input_ids.to(device), targets.to(device)
    hidden = model.base_model(input_ids=input_ids, use_cache=False).last_hidden_state  # [B, T, D]
    scored = targets != IGNORE_INDEX
    picked, wanted = hidden[scored], targets[scored]  # [N, D], [N]
    weight = model.get_output_embeddings().weight.float()  # [V, D]
    logprob, greedy = [], []
    with torch.autocast(device.type, enabled=False):
        for start in range(0, len(picked), SCORE_CHUNK_ROWS):
            logits = F.linear(picked[start:start + SCORE_CHUNK_ROWS].float(), weight)  # [n, V]
            target = wanted[start:start + SCORE_CHUNK_ROWS]
            logprob.append(logits.log_softmax(-1).gather(-1, target[:, None])[:, 0])
            greedy.append(logits.argmax(-1) == target)
    out_logprob = torch.zeros(targets.shape, dtype=torch.float32, device=device)
    out_greedy = torch.zeros(targets.shape, dtype=torch.bool, device=device)
    if logprob:
        out_logprob[scored] = torch.cat(logprob)
        out_greedy[scored] = torch.cat(greedy)
    return out_logprob, out_greedy


@torch.no_grad()
def greedy_generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    stop: Optional[Callable[[list[int]], bool]] = None,
    pad_token_id: int = 0,
) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (token id lists, lengths may differ), batched, with the cache.

    Returns, per prompt, the new tokens: ``max_new_tokens`` of them, or fewer when ``stop`` (called
    with the tokens generated so far for that prompt) says True; the batch ends once every prompt
    has stopped. Prompts are left-padded with ``pad_token_id`` under an attention mask, so the
    padding changes nothing. Run it inside :func:`inference_mode`.

    Example:
        >>> from linmem.models import LinmemConfig, LinmemForCausalLM
        >>> model = LinmemForCausalLM(LinmemConfig(vocab_size=16, hidden_size=16, num_heads=2, layer_pattern="LN"))
        >>> [len(c) for c in greedy_generate(model.eval(), [[1, 2, 3], [4]], 5)]
        [5, 5]
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token id lists")
    device = model_device(model)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.as_tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    ids, mask = ids.to(device), mask.to(device)
    cache = LinmemCache(model.config.num_hidden_layers)  # filled in place by every forward call
    out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=1)
    generated: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for step in range(max_new_tokens):
        token = out.logits[:, -1].argmax(-1)  # [B]
        for row, value in enumerate(token.tolist()):
            if not done[row]:
                generated[row].append(value)
                done[row] = stop is not None and stop(generated[row])
        if all(done) or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, mask.new_ones(len(prompts), 1)], dim=1)
        out = model(input_ids=token[:, None], attention_mask=mask, past_key_values=cache, use_cache=True)
    return generated
