"""Llama-style decoder-only transformer: RMSNorm, rotary positions, grouped-query attention,
SwiGLU feed-forward, untied output head.

Layout (module paths the planner and the runtime address):

    tok_embeddings                nn.Embedding  vocab -> h
    layers.<i>                    DecoderLayer
      .attention_norm             RMSNorm
      .attention.q_proj           nn.Linear  h -> heads * head_dim   (no bias)
      .attention.k_proj           nn.Linear  h -> kv_heads * head_dim
      .attention.v_proj           nn.Linear  h -> kv_heads * head_dim
      .attention.o_proj           nn.Linear  heads * head_dim -> h
      .ffn_norm                   RMSNorm
      .feed_forward.gate_proj     nn.Linear  h -> ffn
      .feed_forward.up_proj       nn.Linear  h -> ffn
      .feed_forward.down_proj     nn.Linear  ffn -> h
    norm                          RMSNorm (final)
    lm_head                       nn.Linear  h -> vocab, no bias (untied unless configured)

Tensor parallelism: the forward infers the local query and key/value head counts from the
projected tensors and reads batch and sequence sizes from ``q_proj``'s output, so it runs
unchanged after column-sharding q/k/v/gate/up and row-sharding o/down. The tensor-parallel
degree must divide ``num_kv_heads`` (the ``view`` fails otherwise). Rotary cos/sin are computed
from positions inside the forward, so there are no buffers to re-initialise after building on
the meta device. Pipeline stages may set ``tok_embeddings``/``norm``/``lm_head`` to ``None``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

_ATTENTIONS = ("math", "sdpa")


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape of a :class:`Llama`. ``seq_len`` is the default example length (RoPE has no
    hard maximum)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    seq_len: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    attention: str = "sdpa"
    tie_embeddings: bool = False
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads",
                      "ffn_hidden_size", "vocab_size", "seq_len"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LlamaConfig.{field} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"LlamaConfig.hidden_size ({self.hidden_size}) must be divisible by num_heads "
                f"({self.num_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"LlamaConfig head_dim (hidden_size / num_heads = {self.head_dim}) must be even "
                "for rotary embeddings"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"LlamaConfig.num_kv_heads ({self.num_kv_heads}) must divide num_heads "
                f"({self.num_heads}) for grouped-query attention"
            )
        if self.attention not in _ATTENTIONS:
            raise ValueError(
                f"LlamaConfig.attention must be one of {_ATTENTIONS}, got {self.attention!r}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def param_count(self) -> int:
        h, f, v, d = self.hidden_size, self.ffn_hidden_size, self.vocab_size, self.head_dim
        attn = h * self.num_heads * d + 2 * h * self.num_kv_heads * d + self.num_heads * d * h
        per_layer = attn + 3 * h * f + 2 * h
        head = 0 if self.tie_embeddings else v * h
        return self.num_layers * per_layer + v * h + h + head


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32 and cast back."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rotary_cos_sin(seq_len: int, head_dim: int, theta: float, device: torch.device,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (seq_len, head_dim) for the rotate-half convention."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotary_at(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (b, 1, s, head_dim) at ``position_ids`` (b, s): packed documents'
    positions, restarting in each."""
    exponents = torch.arange(0, head_dim, 2, device=position_ids.device,
                             dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    freqs = position_ids.to(torch.float32)[..., None] * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)[:, None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x of shape (b, heads, s, head_dim) by cos/sin of shape (s, head_dim)."""
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.head_dim = d
        self.rope_theta = config.rope_theta
        self.attention = config.attention
        self.q_proj = nn.Linear(h, config.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        q = self.q_proj(x)
        b, s, _ = q.shape
        d = self.head_dim
        q = q.view(b, s, -1, d).transpose(1, 2)                     # (b, heads, s, d)
        k = self.k_proj(x).view(b, s, -1, d).transpose(1, 2)        # (b, kv_heads, s, d)
        v = self.v_proj(x).view(b, s, -1, d).transpose(1, 2)
        if position_ids is not None:          # packed documents: their own positions and mask
            return self._documents(q, k, v, position_ids)
        cos, sin = rotary_cos_sin(s, d, self.rope_theta, q.device, q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        n_rep = q.shape[1] // k.shape[1]
        if n_rep > 1:  # grouped-query attention: each kv head serves n_rep query heads
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
            causal = torch.ones(s, s, dtype=torch.bool, device=scores.device).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
            y = torch.matmul(torch.softmax(scores.float(), dim=-1).type_as(q), v)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))

    def _documents(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   position_ids: torch.Tensor) -> torch.Tensor:
        """Attention within each packed document (``models/packing.py``): rotary positions
        restart per document, and a block-diagonal causal mask keeps queries to keys of their
        own document."""
        b, _, s, d = q.shape
        cos, sin = rotary_at(position_ids, d, self.rope_theta, q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        n_rep = q.shape[1] // k.shape[1]
        if n_rep > 1:
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        first = position_ids[:, :1] - 1
        doc = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
        idx = torch.arange(s, device=q.device)
        mask = (doc[:, :, None] == doc[:, None, :]) & (idx[None, :] <= idx[:, None])
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        x = x + (self.attention(self.attention_norm(x)) if position_ids is None else
                 self.attention(self.attention_norm(x), position_ids))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """``forward(tokens: (b, s) int64) -> logits (b, s, vocab_size)``; with ``position_ids``
    (b, s), packed documents (positions restarting at 0 in each, ``models/packing.py``)
    attend within their own document only."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
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
        """N(0, init_std) weights, output projections scaled by 1/sqrt(2 * num_layers), norms
        to one. Call again after ``to_empty()`` to materialise a meta model
        (``to_empty`` unties shared weights; this ties them again)."""
        self.tie_weights()
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
        resid_std = std / math.sqrt(2 * self.config.num_layers)
        for layer in self.layers:
            nn.init.normal_(layer.attention.o_proj.weight, mean=0.0, std=resid_std)
            nn.init.normal_(layer.feed_forward.down_proj.weight, mean=0.0, std=resid_std)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        x = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers:
            x = layer(x) if position_ids is None else layer(x, position_ids)
        if self.norm is not None:
            x = self.norm(x)
        if self.lm_head is not None:
            x = self.lm_head(x)
        return x


# Named configurations. Llama 3 shapes: Llama Team, AI @ Meta 2024, "The Llama 3 Herd of
# Models", Table 3 (layers, model dimension, FFN dimension, attention / key-value heads, RoPE
# theta 500,000), with the 128,256-token vocabulary of the released tokenizer and 8,192-token
# pre-training context.
LLAMA_CONFIGS: dict[str, LlamaConfig] = {
    # Project test model; 2 kv heads means tensor parallelism up to 2 (see module docstring).
    "llama-tiny": LlamaConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                              ffn_hidden_size=128, vocab_size=256, seq_len=32),
    # Llama 3 Herd, Table 3 "8B" (8.03B parameters).
    "llama3-8b": LlamaConfig(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                             ffn_hidden_size=14336, vocab_size=128256, seq_len=8192),
    # Llama 3 Herd, Table 3 "70B" (70.6B parameters).
    "llama3-70b": LlamaConfig(num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8,
                              ffn_hidden_size=28672, vocab_size=128256, seq_len=8192),
    # Llama 3 Herd, Table 3 "405B" (405.9B parameters).
    "llama3-405b": LlamaConfig(num_layers=126, hidden_size=16384, num_heads=128, num_kv_heads=8,
                               ffn_hidden_size=53248, vocab_size=128256, seq_len=8192),
}
