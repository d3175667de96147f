"""One configurable model for every architecture: a stack of (mixer, MLP) blocks whose
mixers follow the config's layer pattern (DESIGN section 5)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from ..layers import LayerState, build_mixer
from ..layers.modules import RMSNorm, positions_in_sequence
from .cache import LinmemCache
from .config import LinmemConfig


class SwiGLU(nn.Module):
    """down(silu(x W_gate) * x W_up)."""

    def __init__(self, hidden_size: int, intermediate_size: int, std: float) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=False)
        for linear in (self.gate_up, self.down):
            nn.init.normal_(linear.weight, std=std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class LinmemBlock(nn.Module):
    """Pre-norm residual block: h + mixer(norm(h)), then h + mlp(norm(h))."""

    def __init__(self, config: LinmemConfig, layer_idx: int) -> None:
        super().__init__()
        self.mixer_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mixer = build_mixer(config.mixer_name(layer_idx), config.mixer_args(layer_idx))
        self.mlp_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.mlp_width, config.initializer_range)

    def forward(
        self,
        hidden: torch.Tensor,
        *,
        cu_seqlens: Optional[torch.Tensor],
        cache: Optional[LayerState],
        token_mask: Optional[torch.Tensor],
        position_ids: Optional[torch.Tensor],
    ) -> torch.Tensor:
        x = self.mixer_norm(hidden)
        if token_mask is not None:  # padded tokens enter no state
            x = x * token_mask[..., None].to(x.dtype)
        hidden = hidden + self.mixer(x, cu_seqlens=cu_seqlens, cache=cache, token_mask=token_mask,
                                     position_ids=position_ids)
        return hidden + self.mlp(self.mlp_norm(hidden))


class LinmemPreTrainedModel(PreTrainedModel):
    """Weights initialise in the constructors: each mixer owns the initialisation of its paper."""

    config_class = LinmemConfig
    base_model_prefix = "model"
    _no_split_modules = ["LinmemBlock"]
    _supports_cache_class = True
    _is_stateful = True

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=self.config.initializer_range)


class LinmemModel(LinmemPreTrainedModel):
    """Embeddings -> blocks -> final norm. Returns hidden states [B, T, D]."""

    def __init__(self, config: LinmemConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LinmemBlock(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        past_key_values: Optional[LinmemCache] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        cu_seqlens: Optional[torch.Tensor] = None,
        use_cache: Optional[bool] = None,
        output_hidden_states: bool = False,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """input_ids: [B, T] (or inputs_embeds [B, T, D]); attention_mask: [B, past + T] 1 = token, 0 = pad;
        cu_seqlens: [N + 1] boundaries of packed sequences (B == 1)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of `input_ids` and `inputs_embeds`")
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, T = hidden.shape[:2]
        if cu_seqlens is not None and B != 1:
            raise ValueError(f"`cu_seqlens` packs sequences along T and needs batch size 1, got {B}")
        use_cache = (not self.training) if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = LinmemCache(self.config.num_hidden_layers)
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        token_mask = _token_mask(attention_mask, T)
        if position_ids is None:
            position_ids = _positions(B, T, past, attention_mask, cu_seqlens, hidden.device)

        all_hidden = []
        for i, layer in enumerate(self.layers):
            if output_hidden_states:
                all_hidden.append(hidden)
            hidden = layer(hidden, cu_seqlens=cu_seqlens, cache=past_key_values[i] if use_cache else None,
                           token_mask=token_mask, position_ids=position_ids)
        hidden = self.norm(hidden)
        if use_cache:
            past_key_values.seen_tokens += T
        if output_hidden_states:
            all_hidden.append(hidden)
        return BaseModelOutputWithPast(
            last_hidden_state=hidden,
            past_key_values=past_key_values if use_cache else None,
            hidden_states=tuple(all_hidden) if output_hidden_states else None,
        )


def _token_mask(attention_mask: Optional[torch.Tensor], T: int) -> Optional[torch.Tensor]:
    """[B, T] bool of the current tokens, or None when nothing is padded."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise ValueError(f"`attention_mask` must be [B, past + T] of 0/1, got shape {list(attention_mask.shape)}")
    mask = attention_mask[:, -T:].bool()
    return None if bool(mask.all()) else mask


def _positions(B, T, past, attention_mask, cu_seqlens, device) -> torch.Tensor:
    """Positions of the current tokens: restart per packed sequence, skip left padding."""
    if cu_seqlens is not None:
        return positions_in_sequence(T, cu_seqlens, device)[None]
    if attention_mask is not None:
        positions = attention_mask.long().cumsum(-1) - 1
        return positions.clamp(min=0)[:, -T:]
    return (torch.arange(T, device=device) + past)[None].expand(B, T)


class LinmemForCausalLM(LinmemPreTrainedModel, GenerationMixin):
    """A causal language model over :class:`LinmemModel`.

    Example:
        >>> import torch
        >>> from linmem.models import LinmemConfig, LinmemForCausalLM
        >>> config = LinmemConfig(vocab_size=256, hidden_size=64, num_heads=2, layer_pattern="LLN")
        >>> model = LinmemForCausalLM(config).eval()
        >>> ids = torch.randint(0, 256, (1, 8))
        >>> model(ids, labels=ids).loss.shape
        torch.Size([])
        >>> model.generate(ids, max_new_tokens=4, do_sample=False).shape
        torch.Size([1, 12])
    """

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: LinmemConfig) -> None:
        super().__init__(config)
        self.model = LinmemModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        nn.init.normal_(self.lm_head.weight, std=config.initializer_range)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model makes its own LinmemCache

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        past_key_values: Optional[LinmemCache] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        labels: Optional[torch.LongTensor] = None,
        cu_seqlens: Optional[torch.Tensor] = None,
        use_cache: Optional[bool] = None,
        output_hidden_states: bool = False,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits [B, T, vocab]; with ``labels`` [B, T] (-100 = ignore) the next-token loss.

        Labels are shifted inside: position t predicts label t + 1. Under ``cu_seqlens``
        the last token of a sequence predicts nothing of the next one.
        """
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, inputs_embeds=inputs_embeds, cu_seqlens=cu_seqlens,
            use_cache=use_cache, output_hidden_states=output_hidden_states,
        )
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = causal_lm_loss(logits, labels, cu_seqlens)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values,
                                      hidden_states=out.hidden_states)

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        past_key_values: Optional[LinmemCache] = None,
        attention_mask: Optional[torch.Tensor] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        use_cache: bool = True,
        **kwargs,
    ) -> dict:
        """Feed only the tokens the cache has not seen; positions follow the attention mask."""
        seen = past_key_values.get_seq_length() if past_key_values is not None else 0
        inputs = {"past_key_values": past_key_values, "attention_mask": attention_mask, "use_cache": use_cache}
        if inputs_embeds is not None and seen == 0:
            inputs["inputs_embeds"] = inputs_embeds
        else:
            inputs["input_ids"] = input_ids[:, seen:]
        if kwargs.get("logits_to_keep") is not None:
            inputs["logits_to_keep"] = kwargs["logits_to_keep"]
        return inputs


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
                   ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross-entropy (fp32) over labels != ignore_index."""
    targets = labels[:, 1:].clone()
    if cu_seqlens is not None:  # the last token of each packed sequence has no target
        ends = cu_seqlens[1:-1].long() - 1
        targets[0, ends[(ends >= 0) & (ends < targets.shape[1])]] = ignore_index
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), targets.flatten(), ignore_index=ignore_index)
