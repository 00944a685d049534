"""GPT-2 / GPT-3 style decoder-only transformer (learned positions, pre-LayerNorm, tied head).

Layout (module paths the planner and the runtime address):

    tok_embeddings            nn.Embedding  vocab -> h
    pos_embeddings            nn.Embedding  max positions -> h
    emb_dropout               nn.Dropout
    layers.<i>                Block
      .ln_1                   nn.LayerNorm
      .attn.qkv               nn.Linear  h -> 3h (fused; laid out per head, see below)
      .attn.attn_dropout      nn.Dropout on the attention probabilities
      .attn.proj              nn.Linear  h -> h
      .attn.resid_dropout     nn.Dropout
      .ln_2                   nn.LayerNorm
      .mlp.fc                 nn.Linear  h -> ffn (4h)
      .mlp.act                nn.GELU (tanh approximation, as GPT-2)
      .mlp.proj               nn.Linear  ffn -> h
      .mlp.dropout            nn.Dropout
    norm                      nn.LayerNorm (final)
    lm_head                   nn.Linear  h -> vocab, no bias, weight tied to tok_embeddings

The op structure of one layer is the one Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", Sec. 4.1) count to get 34·s·b·h + 5·a·s²·b bytes
of saved activations per layer: LayerNorm, one fused QKV linear split into Q/K/V, Q·Kᵀ (scaled),
causal mask, softmax, attention dropout, ·V, output projection, dropout, residual add,
LayerNorm, fc, GELU, proj, dropout, residual add. Keep it so when editing ``attention="math"``.
Measured with saved-tensor hooks (bf16, CPU eager) one layer saves exactly those tensors, plus
the s x s causal mask and LayerNorm statistics; eager CPU dropout keeps its mask in the input
dtype (2 bytes), where CUDA's fused dropout keeps 1-byte masks as the formula assumes.

Tensor parallelism: the fused ``qkv`` output is laid out as (heads, 3, head_dim) along its
features, as in Megatron-LM, so column-sharding ``qkv`` gives each rank whole heads with their
own Q, K and V. The forward infers the local head count from the tensor (``view(b, s, -1, ·)``)
and reads the batch and sequence sizes from the projection output, so it also runs unchanged
under PyTorch's own ``parallelize_module`` (column ``qkv``/``fc``, row ``proj``; the overhead
benchmark compares autoplan with that). ``tok_embeddings``/``pos_embeddings``/``norm``/``lm_head``
may be ``None``; the forward then passes activations straight through those steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

_ATTENTIONS = ("math", "sdpa")


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape and regularisation of a :class:`GPT`. ``max_positions`` is the number of learned
    positions: the longest sequence the model accepts, and the default example length
    (``seq_len``)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    vocab_size: int
    max_positions: int
    ffn_hidden_size: int | None = None  # None -> 4 * hidden_size
    dropout: float = 0.1
    attention: str = "math"
    tie_embeddings: bool = True
    layer_norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_heads", "vocab_size", "max_positions"):
            _check_positive_int(field, getattr(self, field))
        if self.ffn_hidden_size is not None:
            _check_positive_int("ffn_hidden_size", self.ffn_hidden_size)
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"GPTConfig.hidden_size ({self.hidden_size}) must be divisible by num_heads "
                f"({self.num_heads}); pick a head count that divides it"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if self.attention not in _ATTENTIONS:
            raise ValueError(
                f"GPTConfig.attention must be one of {_ATTENTIONS}, got {self.attention!r}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def seq_len(self) -> int:
        """Default sequence length of examples: the full position table."""
        return self.max_positions

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    def param_count(self) -> int:
        """Parameters, counting a tied embedding/head weight once."""
        h, f, v = self.hidden_size, self.ffn_size, self.vocab_size
        per_layer = (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h) + 4 * h
        head = 0 if self.tie_embeddings else v * h
        return self.num_layers * per_layer + v * h + self.max_positions * h + 2 * h + head


def _check_positive_int(field: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"GPTConfig.{field} must be a positive int, got {value!r}")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.attention = config.attention
        self.dropout_p = config.dropout
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        b, s, _ = qkv.shape
        # (b, s, heads, 3 * head_dim): the head count is whatever this rank holds.
        q, k, v = qkv.view(b, s, -1, 3 * self.head_dim).split(self.head_dim, dim=-1)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (b, heads, s, d)
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout_p if self.training else 0.0, is_causal=True
            )
        else:
            scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
            causal = torch.ones(s, s, dtype=torch.bool, device=scores.device).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
            probs = self.attn_dropout(torch.softmax(scores, dim=-1))
            y = torch.matmul(probs, v)
        y = y.transpose(1, 2).reshape(b, s, -1)
        return self.resid_dropout(self.proj(y))


class FeedForward(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.hidden_size, config.ffn_size)
        self.act = nn.GELU(approximate="tanh")
        self.proj = nn.Linear(config.ffn_size, config.hidden_size)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer layer: x + attn(ln_1(x)), then + mlp(ln_2(·))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """``forward(tokens: (b, s) int64) -> logits (b, s, vocab_size)``.

    A pipeline stage without the embeddings takes hidden states (b, s, h) instead of tokens,
    and one without ``lm_head`` returns hidden states.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.pos_embeddings = nn.Embedding(config.max_positions, config.hidden_size)
        self.emb_dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.init_weights()

    def tie_weights(self) -> None:
        """Share the embedding weight with ``lm_head`` when the config asks for it (and this
        stage holds both)."""
        if (self.config.tie_embeddings and self.lm_head is not None
                and self.tok_embeddings is not None):
            self.lm_head.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 initialisation: N(0, 0.02) weights, zero biases, residual projections scaled
        by 1/sqrt(2 * num_layers). Call again after ``to_empty()`` to materialise a meta model
        (``to_empty`` unties shared weights; this ties them again)."""
        self.tie_weights()
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        resid_std = std / math.sqrt(2 * self.config.num_layers)
        for layer in self.layers:
            nn.init.normal_(layer.attn.proj.weight, mean=0.0, std=resid_std)
            nn.init.normal_(layer.mlp.proj.weight, mean=0.0, std=resid_std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            s = tokens.shape[1]
            positions = torch.arange(s, device=tokens.device)
            x = self.tok_embeddings(tokens)
            if self.pos_embeddings is not None:
                x = x + self.pos_embeddings(positions)
            x = self.emb_dropout(x)
        else:
            x = tokens
        for layer in self.layers:
            x = layer(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.lm_head is not None:
            x = self.lm_head(x)
        return x


# Named configurations. GPT-2 shapes: Radford et al. 2019, "Language Models are Unsupervised
# Multitask Learners", Table 2 (layers, d_model; head counts from the released checkpoints'
# configs: d_model / 64). GPT-3 shapes: Brown et al. 2020, "Language Models are Few-Shot
# Learners", Table 2.1, with the vocabulary padded to 51,200 as Megatron-LM does (Narayanan et
# al. 2021). The 1T shape is Narayanan et al. 2021, "Efficient Large-Scale Language Model
# Training on GPU Clusters Using Megatron-LM", Table 1 (last row).
GPT_CONFIGS: dict[str, GPTConfig] = {
    # Project test model: trains in milliseconds; heads and widths divide 2 and 4.
    "gpt-tiny": GPTConfig(num_layers=2, hidden_size=64, num_heads=4, vocab_size=256,
                          max_positions=32, dropout=0.0),
    # Project CPU model: one training step at batch 2 takes a fraction of a second on 2 cores.
    "gpt-small-cpu": GPTConfig(num_layers=4, hidden_size=256, num_heads=8, vocab_size=2048,
                               max_positions=128, dropout=0.0),
    # Radford et al. 2019, Table 2 (117M / 124M with tied head).
    "gpt2-small": GPTConfig(num_layers=12, hidden_size=768, num_heads=12, vocab_size=50257,
                            max_positions=1024),
    # Radford et al. 2019, Table 2 (345M).
    "gpt2-medium": GPTConfig(num_layers=24, hidden_size=1024, num_heads=16, vocab_size=50257,
                             max_positions=1024),
    # Radford et al. 2019, Table 2 (762M).
    "gpt2-large": GPTConfig(num_layers=36, hidden_size=1280, num_heads=20, vocab_size=50257,
                            max_positions=1024),
    # Radford et al. 2019, Table 2 (1542M).
    "gpt2-xl": GPTConfig(num_layers=48, hidden_size=1600, num_heads=25, vocab_size=50257,
                         max_positions=1024),
    # Brown et al. 2020, Table 2.1 "GPT-3 XL": 24 layers, d_model 2048, d_head 128. The table's
    # 24 heads x 128 does not equal 2048; we keep d_head = 128 and use 16 heads.
    "gpt3-1.3b": GPTConfig(num_layers=24, hidden_size=2048, num_heads=16, vocab_size=51200,
                           max_positions=2048),
    # Brown et al. 2020, Table 2.1 "GPT-3 6.7B": 32 layers, d_model 4096, 32 heads.
    "gpt3-6.7b": GPTConfig(num_layers=32, hidden_size=4096, num_heads=32, vocab_size=51200,
                           max_positions=2048),
    # Brown et al. 2020, Table 2.1 "GPT-3 13B": 40 layers, 40 heads of 128; the table's d_model
    # 5140 is rounded to 40 x 128 = 5120 so heads divide it (as Megatron-LM does).
    "gpt3-13b": GPTConfig(num_layers=40, hidden_size=5120, num_heads=40, vocab_size=51200,
                          max_positions=2048),
    # Brown et al. 2020, Table 2.1 "GPT-3 175B": 96 layers, d_model 12288, 96 heads; vocabulary
    # 51,200 as in Narayanan et al. 2021 Table 1 and Korthikanti et al. 2022 Table 3.
    "gpt3-175b": GPTConfig(num_layers=96, hidden_size=12288, num_heads=96, vocab_size=51200,
                           max_positions=2048),
    # Narayanan et al. 2021, Table 1: 1008B parameters, 128 layers, hidden 25600, 160 heads.
    "gpt-1t": GPTConfig(num_layers=128, hidden_size=25600, num_heads=160, vocab_size=51200,
                        max_positions=2048),
}
