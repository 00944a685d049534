"""Builders for small Hugging Face ``transformers`` models, made from configs only (no weights
are ever downloaded).

Each model is wrapped in :class:`HFWrapper`, whose forward calls the Hugging Face model with
``use_cache=False`` (``torch.export`` cannot return a cache object) and returns one plain tensor:
logits for the causal LMs, ``last_hidden_state`` for BERT. Module paths therefore start with
``model.`` (e.g. ``model.transformer.h.0`` for GPT-2, ``model.model.layers.0`` for Llama,
``model.encoder.layer.0`` for BERT).

``transformers`` is imported only when a model is built; without it the builders raise
``ImportError`` saying how to install it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

_ARCHITECTURES = ("gpt2", "llama", "bert")
_ATTN_IMPLEMENTATIONS = ("eager", "sdpa")


@dataclass(frozen=True, kw_only=True)
class HFModelConfig:
    """Architecture-neutral description of a small Hugging Face model. ``num_kv_heads`` and
    ``intermediate_size`` default to ``num_heads`` and ``4 * hidden_size``. ``max_positions``
    is the position table size; ``seq_len`` the default example length."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    vocab_size: int
    max_positions: int
    seq_len: int
    num_kv_heads: int | None = None
    intermediate_size: int | None = None
    dropout: float = 0.0
    attn_implementation: str = "sdpa"

    def __post_init__(self) -> None:
        if self.architecture not in _ARCHITECTURES:
            raise ValueError(
                f"HFModelConfig.architecture must be one of {_ARCHITECTURES}, "
                f"got {self.architecture!r}"
            )
        if self.attn_implementation not in _ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"HFModelConfig.attn_implementation must be one of {_ATTN_IMPLEMENTATIONS} "
                f"(both export cleanly), got {self.attn_implementation!r}"
            )
        for field in ("num_layers", "hidden_size", "num_heads", "vocab_size", "max_positions",
                      "seq_len"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"HFModelConfig.{field} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"HFModelConfig.hidden_size ({self.hidden_size}) must be divisible by "
                f"num_heads ({self.num_heads})"
            )
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"HFModelConfig.num_kv_heads ({self.num_kv_heads}) must divide num_heads "
                f"({self.num_heads})"
            )
        if self.seq_len > self.max_positions:
            raise ValueError(
                f"HFModelConfig.seq_len ({self.seq_len}) exceeds max_positions "
                f"({self.max_positions}); raise max_positions or shorten the sequence"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"HFModelConfig.dropout must be in [0, 1), got {self.dropout!r}")


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "The Hugging Face example models need the `transformers` package, which is not "
            "installed. Install it with `pip install transformers` (or `pip install "
            "autoplan[hf]`)."
        ) from exc
    return transformers


class HFWrapper(nn.Module):
    """Calls a Hugging Face model on ``input_ids`` with ``use_cache=False`` and returns the
    tensor field ``output`` of its result (``logits`` or ``last_hidden_state``)."""

    def __init__(self, model: nn.Module, *, output: str):
        super().__init__()
        self.model = model
        self.output = output

    def forward(self, input_ids: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``position_ids`` (packed documents, restarting at 0 in each): Hugging Face builds a
        document mask from them (``masking_utils.find_packed_sequence_indices``) when no
        attention mask is given, so attention never crosses documents."""
        if position_ids is None:
            result = self.model(input_ids=input_ids, use_cache=False)
        else:
            result = self.model(input_ids=input_ids, position_ids=position_ids,
                                use_cache=False)
        return getattr(result, self.output)


def _hf_config(config: HFModelConfig) -> Any:
    tf = _import_transformers()
    common = dict(vocab_size=config.vocab_size, attn_implementation=config.attn_implementation,
                  use_cache=False)
    ffn = config.intermediate_size or 4 * config.hidden_size
    if config.architecture == "gpt2":
        # Token ids for BOS/EOS must lie inside the (small) vocabulary.
        return tf.GPT2Config(
            n_layer=config.num_layers, n_embd=config.hidden_size, n_head=config.num_heads,
            n_positions=config.max_positions, n_inner=ffn, resid_pdrop=config.dropout,
            embd_pdrop=config.dropout, attn_pdrop=config.dropout,
            bos_token_id=config.vocab_size - 1, eos_token_id=config.vocab_size - 1, **common,
        )
    if config.architecture == "llama":
        return tf.LlamaConfig(
            num_hidden_layers=config.num_layers, hidden_size=config.hidden_size,
            num_attention_heads=config.num_heads,
            num_key_value_heads=config.num_kv_heads or config.num_heads,
            intermediate_size=ffn, max_position_embeddings=config.max_positions,
            attention_dropout=config.dropout, bos_token_id=0, eos_token_id=1, **common,
        )
    return tf.BertConfig(
        num_hidden_layers=config.num_layers, hidden_size=config.hidden_size,
        num_attention_heads=config.num_heads, intermediate_size=ffn,
        max_position_embeddings=config.max_positions, hidden_dropout_prob=config.dropout,
        attention_probs_dropout_prob=config.dropout, **common,
    )


def build_hf_model(config: HFModelConfig) -> HFWrapper:
    """Build the wrapped model on the current default device (use ``with torch.device(...)``).
    Weights are the library's random initialisation, drawn from torch's global RNG."""
    tf = _import_transformers()
    hf_config = _hf_config(config)
    if config.architecture == "gpt2":
        return HFWrapper(tf.GPT2LMHeadModel(hf_config), output="logits")
    if config.architecture == "llama":
        return HFWrapper(tf.LlamaForCausalLM(hf_config), output="logits")
    # No pooler: its parameters would get no gradient from a loss on the hidden states, which
    # DDP and FSDP treat as an error.
    return HFWrapper(tf.BertModel(hf_config, add_pooling_layer=False), output="last_hidden_state")


# Named configurations (project test models, shaped like the real architectures).
HF_CONFIGS: dict[str, HFModelConfig] = {
    "hf-gpt2-tiny": HFModelConfig(architecture="gpt2", num_layers=2, hidden_size=64, num_heads=4,
                                  vocab_size=256, max_positions=64, seq_len=32),
    "hf-llama-tiny": HFModelConfig(architecture="llama", num_layers=2, hidden_size=64,
                                   num_heads=4, num_kv_heads=2, intermediate_size=128,
                                   vocab_size=256, max_positions=64, seq_len=32),
    "hf-bert-tiny": HFModelConfig(architecture="bert", num_layers=2, hidden_size=64, num_heads=4,
                                  vocab_size=256, max_positions=64, seq_len=32),
}
