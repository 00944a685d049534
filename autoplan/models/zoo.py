"""Models autoplan did not write: Hugging Face architectures built from their configs, and
models written the way people write them. The test zoo and the planning targets at real size.

Hugging Face models (``transformers``, no weights downloaded): GPT-2, Llama, Mistral, Qwen2,
Mixtral (mixture of experts), BERT with its masked-LM head, T5 (encoder-decoder, fed
``decoder_input_ids``) and ViT. Written by hand, as users do: ``torch-encoder``
(``nn.TransformerEncoder``, whose attention is ``nn.MultiheadAttention``), ``nanogpt`` (one fused
qkv ``nn.Linear`` split by hidden size, the head count a literal in ``view``), ``rootparam`` (an
``nn.Parameter`` on the root module used in a matmul), ``cnn`` (convolutions with batch norm),
``titan-llama`` (torchtitan's Llama), ``titan-moe`` (its blocks with a top-k mixture of
experts on ``torch._grouped_mm``), ``titan-ecmoe`` (the same blocks with expert-choice
routing over stacked experts applied with ``torch.bmm``) and ``region-llama`` (a Llama in
Hugging Face 4.x's eager style, whose rotary tables are computed in an autocast-disabled region: ``region-llama-tiny``
keys it on the tensor's device, ``region-cuda-llama-tiny`` on "cuda", as GPU runs meet it).

Each comes tiny (``*-tiny``: two layers, hidden 64, dropout 0, what the equivalence tests run)
and, for the planner, at real size where the architecture has a famous one (``hf-llama3-8b``,
``titan-llama3-8b``, ``hf-mixtral-8x7b``, ``titan-ecmoe-8x7b`` (Mixtral's sizes), ``hf-t5-large``,
``hf-bert-large``, ``hf-gpt2-xl``, ``hf-vit-l``; build those on the meta device).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

HF_CAUSAL = ("gpt2", "llama", "mistral", "qwen2", "mixtral")


@dataclass(frozen=True, kw_only=True)
class ZooConfig:
    """One zoo model: an architecture, its sizes, and the example input shape."""

    architecture: str
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 4
    ffn: int = 128
    vocab: int = 128
    seq_len: int = 16
    max_positions: int = 64
    experts: int = 4
    experts_per_token: int = 2
    image_size: int = 32
    patch: int = 8
    channels: int = 3
    classes: int = 10
    extra: tuple[tuple[str, Any], ...] = field(default=())    # more config fields, verbatim


def _tf() -> Any:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("the Hugging Face zoo models need `transformers`: "
                          "pip install transformers (or autoplan[hf])") from exc
    return transformers


class HFCall(nn.Module):
    """Calls a Hugging Face model with positional inputs bound to keyword names, without a
    cache (``torch.export`` cannot return one), and returns one tensor field of the result."""

    def __init__(self, model: nn.Module, *, inputs: tuple[str, ...], output: str,
                 cache: bool = True):
        super().__init__()
        self.model = model
        self.input_names = inputs
        self.output = output
        self.cache = cache

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        kw = dict(zip(self.input_names, args))
        if self.cache:
            kw["use_cache"] = False
        return getattr(self.model(**kw), self.output)


def _hf(c: ZooConfig) -> nn.Module:
    tf = _tf()
    extra = dict(c.extra)
    a = c.architecture
    if a == "gpt2":
        cfg = tf.GPT2Config(vocab_size=c.vocab, n_embd=c.hidden, n_layer=c.layers, n_head=c.heads,
                            n_positions=c.max_positions, n_inner=c.ffn, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=c.vocab - 1,
                            eos_token_id=c.vocab - 1, **extra)
        return HFCall(tf.GPT2LMHeadModel(cfg), inputs=("input_ids",), output="logits")
    if a in ("llama", "mistral", "qwen2", "mixtral"):
        common = dict(vocab_size=c.vocab, hidden_size=c.hidden, intermediate_size=c.ffn,
                      num_hidden_layers=c.layers, num_attention_heads=c.heads,
                      num_key_value_heads=c.kv_heads, max_position_embeddings=c.max_positions,
                      bos_token_id=0, eos_token_id=1, pad_token_id=None, **extra)
        if a == "mixtral":
            common.update(num_local_experts=c.experts, num_experts_per_tok=c.experts_per_token)
        cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
               "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
               "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
               "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM)}[a]
        return HFCall(cls[1](cls[0](**common)), inputs=("input_ids",), output="logits")
    if a == "bert-mlm":
        cfg = tf.BertConfig(vocab_size=c.vocab, hidden_size=c.hidden, num_hidden_layers=c.layers,
                            num_attention_heads=c.heads, intermediate_size=c.ffn,
                            max_position_embeddings=c.max_positions, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0, **extra)
        return HFCall(tf.BertForMaskedLM(cfg), inputs=("input_ids",), output="logits",
                      cache=False)
    if a == "t5":
        cfg = tf.T5Config(vocab_size=c.vocab, d_model=c.hidden, d_kv=c.hidden // c.heads,
                          d_ff=c.ffn, num_layers=c.layers, num_heads=c.heads, dropout_rate=0.0,
                          decoder_start_token_id=0, pad_token_id=0, **extra)
        return HFCall(tf.T5ForConditionalGeneration(cfg),
                      inputs=("input_ids", "decoder_input_ids"), output="logits")
    if a == "vit":
        cfg = tf.ViTConfig(image_size=c.image_size, patch_size=c.patch, hidden_size=c.hidden,
                           num_hidden_layers=c.layers, num_attention_heads=c.heads,
                           intermediate_size=c.ffn, num_labels=c.classes,
                           num_channels=c.channels, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0, **extra)
        return HFCall(tf.ViTForImageClassification(cfg), inputs=("pixel_values",),
                      output="logits", cache=False)
    raise ValueError(f"unknown zoo architecture {a!r}")


# ---- written by hand, the way people write them ----------------------------------------------

class TorchEncoder(nn.Module):
    """Token embedding, ``nn.TransformerEncoder`` (``nn.MultiheadAttention`` inside) and a
    token-classification head."""

    def __init__(self, c: ZooConfig):
        super().__init__()
        self.embed = nn.Embedding(c.vocab, c.hidden)
        layer = nn.TransformerEncoderLayer(c.hidden, c.heads, c.ffn, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, c.layers, enable_nested_tensor=False)
        self.head = nn.Linear(c.hidden, c.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


class NanoBlock(nn.Module):
    def __init__(self, c: ZooConfig):
        super().__init__()
        self.n_embd = c.hidden
        self.ln_1 = nn.LayerNorm(c.hidden)
        self.c_attn = nn.Linear(c.hidden, 3 * c.hidden)
        self.c_proj = nn.Linear(c.hidden, c.hidden)
        self.ln_2 = nn.LayerNorm(c.hidden)
        self.fc = nn.Linear(c.hidden, 4 * c.hidden)
        self.proj = nn.Linear(4 * c.hidden, c.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(self.ln_1(x)).split(self.n_embd, dim=2)
        k = k.view(B, T, 4, C // 4).transpose(1, 2)      # the head count, written as a literal
        q = q.view(B, T, 4, C // 4).transpose(1, 2)
        v = v.view(B, T, 4, C // 4).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.c_proj(y)
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    def __init__(self, c: ZooConfig):
        super().__init__()
        if c.heads != 4:
            raise ValueError("nanogpt writes its head count as the literal 4")
        self.wte = nn.Embedding(c.vocab, c.hidden)
        self.wpe = nn.Embedding(c.max_positions, c.hidden)
        self.h = nn.ModuleList(NanoBlock(c) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.hidden)
        self.lm_head = nn.Linear(c.hidden, c.vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class RootParam(nn.Module):
    """Weights held directly by the root module and used in matmuls (``x @ self.w_in``), and a
    learned scalar (a residual scale: FSDP2 cannot shard a 0-dim parameter)."""

    def __init__(self, c: ZooConfig):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(c.hidden, c.ffn) * 0.05)
        self.bias = nn.Parameter(torch.zeros(c.ffn))
        self.w_out = nn.Parameter(torch.randn(c.ffn, c.hidden) * 0.05)
        self.scale = nn.Parameter(torch.tensor(0.5))
        self.norm = nn.LayerNorm(c.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(x @ self.w_in + self.bias)
        return self.norm(x + self.scale * (h @ self.w_out))


class SmallCNN(nn.Module):
    def __init__(self, c: ZooConfig):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(c.channels, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(32, c.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def _freqs_cis(head_dim: int, end: int, theta: float) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(end).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)          # complex64


class TitanAttention(nn.Module):
    """Llama attention as torchtitan writes it: separate wq/wk/wv/wo, rotary embedding with
    complex numbers, grouped-query heads repeated with expand + reshape."""

    def __init__(self, c: ZooConfig):
        super().__init__()
        self.n_heads, self.n_kv = c.heads, c.kv_heads
        self.head_dim = c.hidden // c.heads
        self.wq = nn.Linear(c.hidden, c.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(c.hidden, c.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(c.hidden, c.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(c.heads * self.head_dim, c.hidden, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
        f = freqs_cis[0:seqlen].view(1, seqlen, 1, xq_.shape[-1])
        xq = torch.view_as_real(xq_ * f).flatten(3).type_as(xq)
        xk = torch.view_as_real(xk_ * f).flatten(3).type_as(xk)
        rep = self.n_heads // self.n_kv
        keys = xk[:, :, :, None, :].expand(bs, seqlen, self.n_kv, rep, self.head_dim)
        keys = keys.reshape(bs, seqlen, self.n_kv * rep, self.head_dim)
        values = xv[:, :, :, None, :].expand(bs, seqlen, self.n_kv, rep, self.head_dim)
        values = values.reshape(bs, seqlen, self.n_kv * rep, self.head_dim)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), keys.transpose(1, 2),
                                             values.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class TopKMoE(nn.Module):
    """A top-k mixture of experts written in plain PyTorch, the way torchtitan writes it: a
    linear router, softmax then top-k, the routed rows sorted by expert, the experts' stacked
    SwiGLU weights applied with ``torch._grouped_mm`` (in bf16, its only dtype), and the rows
    added back to their tokens (no token dropped)."""

    def __init__(self, c: ZooConfig):
        super().__init__()
        self.k, self.n = c.experts_per_token, c.experts
        self.router = nn.Linear(c.hidden, c.experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(c.experts, c.hidden, c.ffn) * 0.05)
        self.w3 = nn.Parameter(torch.randn(c.experts, c.hidden, c.ffn) * 0.05)
        self.w2 = nn.Parameter(torch.randn(c.experts, c.ffn, c.hidden) * 0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seqlen, dim = x.shape
        x = x.reshape(-1, dim)
        weights, chosen = self.router(x).softmax(dim=-1).topk(self.k, dim=-1)
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)
        token = order // self.k
        rows = x[token]
        counts = torch.histc(flat.float(), bins=self.n, min=0, max=self.n - 1)
        offs = counts.cumsum(0).to(torch.int32)
        # torch._grouped_mm multiplies bf16 only: cast in, and back (as torchtitan does)
        rows = rows.bfloat16()
        h = (F.silu(torch._grouped_mm(rows, self.w1.bfloat16(), offs=offs))
             * torch._grouped_mm(rows, self.w3.bfloat16(), offs=offs))
        y = torch._grouped_mm(h, self.w2.bfloat16(), offs=offs).type_as(x)
        y = y * weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add(0, token, y).reshape(bs, seqlen, dim)


class ExpertChoiceMoE(nn.Module):
    """Expert-choice routing (Zhou et al. 2022, "Mixture-of-Experts with Expert Choice
    Routing") written as research code writes it: each expert picks the tokens of every
    sequence it scores highest (``experts_per_token * seq / experts`` of them: its capacity),
    the picked tokens are gathered into one ``(experts, tokens, hidden)`` tensor, the experts'
    stacked SwiGLU weights applied with ``torch.bmm``, and the outputs, scaled by their
    scores, added back to their tokens (``scatter_add``). Routing per sequence keeps a
    sample's result independent of the other samples of its batch."""

    def __init__(self, c: ZooConfig):
        super().__init__()
        self.n, self.k = c.experts, c.experts_per_token
        self.router = nn.Linear(c.hidden, c.experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(c.experts, c.hidden, c.ffn) * 0.05)
        self.w3 = nn.Parameter(torch.randn(c.experts, c.hidden, c.ffn) * 0.05)
        self.w2 = nn.Parameter(torch.randn(c.experts, c.ffn, c.hidden) * 0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seqlen, dim = x.shape
        capacity = max(1, seqlen * self.k // self.n)
        scores = self.router(x).softmax(dim=-1)                         # (b, s, E)
        gate, token = scores.transpose(1, 2).topk(capacity, dim=-1)     # (b, E, cap)
        where = token.reshape(bs, self.n * capacity, 1).expand(-1, -1, dim)
        picked = torch.gather(x, 1, where).view(bs, self.n, capacity, dim)
        rows = picked.permute(1, 0, 2, 3).reshape(self.n, bs * capacity, dim)
        h = F.silu(torch.bmm(rows, self.w1)) * torch.bmm(rows, self.w3)
        y = torch.bmm(h, self.w2).view(self.n, bs, capacity, dim).permute(1, 0, 2, 3)
        y = y.reshape(bs, self.n * capacity, dim) * gate.reshape(bs, self.n * capacity, 1)
        # under autocast the products (and the router) run in 16 bits: add back in x's dtype
        return torch.zeros_like(x).scatter_add(1, where, y.type_as(x))


class TitanBlock(nn.Module):
    def __init__(self, c: ZooConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(c.hidden, eps=1e-5)
        self.attention = TitanAttention(c)
        self.ffn_norm = nn.RMSNorm(c.hidden, eps=1e-5)
        if c.architecture == "titan-moe":
            self.moe = TopKMoE(c)
        elif c.architecture == "titan-ecmoe":
            self.moe = ExpertChoiceMoE(c)
        else:
            self.w1 = nn.Linear(c.hidden, c.ffn, bias=False)
            self.w2 = nn.Linear(c.ffn, c.hidden, bias=False)
            self.w3 = nn.Linear(c.hidden, c.ffn, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        y = self.ffn_norm(h)
        if hasattr(self, "moe"):
            return h + self.moe(y)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


class TitanLlama(nn.Module):
    """A Llama-3 written the way torchtitan (and meta's autoparallel examples) write it: layers
    in an ``nn.ModuleDict``, the rotary table a complex buffer, RMSNorm modules."""

    def __init__(self, c: ZooConfig):
        super().__init__()
        self.tok_embeddings = nn.Embedding(c.vocab, c.hidden)
        self.register_buffer("freqs_cis", _freqs_cis(c.hidden // c.heads, c.max_positions,
                                                     dict(c.extra).get("rope_theta", 10000.0)))
        self.layers = nn.ModuleDict({str(i): TitanBlock(c) for i in range(c.layers)})
        self.norm = nn.RMSNorm(c.hidden, eps=1e-5)
        self.output = nn.Linear(c.hidden, c.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


class RegionRotary(nn.Module):
    """Rotary tables as Hugging Face transformers 4.x computed them (Llama, Mistral, Qwen2,
    Mixtral): in fp32 inside ``torch.autocast(device_type=..., enabled=False)``, keyed on the
    tensor's device (``region_device=""``) or on "cuda" (what a GPU run meets; a CPU trace keeps
    that region too), then cast to the activations' dtype."""

    def __init__(self, head_dim: int, theta: float, region_device: str):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.region_device = region_device

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        pos = position_ids[:, None, :].float()
        with torch.autocast(device_type=self.region_device or x.device.type, enabled=False):
            freqs = (inv.float() @ pos.float()).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class UpcastRMSNorm(nn.Module):
    """RMSNorm as Hugging Face writes it: computed in fp32, cast back to its input's dtype."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class RegionBlock(nn.Module):
    """A Llama layer in Hugging Face 4.x's eager style: q/k/v/o projections, rotary tables from
    ``RegionRotary`` applied in an autocast-disabled region too, grouped-query heads repeated, softmax in fp32 cast back to the query's
    dtype (``.to(q.dtype)``: bf16 under autocast, fp32 in an fp32 trace), SwiGLU."""

    def __init__(self, c: ZooConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.heads, c.kv_heads, c.hidden // c.heads
        self.region_device = dict(c.extra).get("region_device", "")
        self.input_layernorm = UpcastRMSNorm(c.hidden)
        self.q_proj = nn.Linear(c.hidden, c.hidden, bias=False)
        self.k_proj = nn.Linear(c.hidden, c.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden, c.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(c.hidden, c.hidden, bias=False)
        self.post_attention_layernorm = UpcastRMSNorm(c.hidden)
        self.gate_proj = nn.Linear(c.hidden, c.ffn, bias=False)
        self.up_proj = nn.Linear(c.hidden, c.ffn, bias=False)
        self.down_proj = nn.Linear(c.ffn, c.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        # the rotation in fp32, its 16-bit inputs upcast inside the region (as Qwen2-VL and
        # ChatGLM write it), then back to the values' dtype
        with torch.autocast(device_type=self.region_device or x.device.type, enabled=False):
            q, k = q.float(), k.float()
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        q, k = q.to(v.dtype), k.to(v.dtype)
        rep = self.heads // self.kv_heads
        k = k[:, :, None].expand(b, self.kv_heads, rep, s, self.head_dim).reshape(
            b, self.heads, s, self.head_dim)
        v = v[:, :, None].expand(b, self.kv_heads, rep, s, self.head_dim).reshape(
            b, self.heads, s, self.head_dim)
        scores = q @ k.transpose(2, 3) / self.head_dim ** 0.5
        causal = torch.full((s, s), float("-inf"), device=x.device).triu(1)
        probs = F.softmax(scores + causal, dim=-1, dtype=torch.float32).to(q.dtype)
        out = (probs @ v).transpose(1, 2).reshape(b, s, -1)
        x = x + self.o_proj(out)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class RegionLlama(nn.Module):
    """A small Llama whose rotary embedding opens an autocast-disabled region: the pattern
    that crashed 16-bit plans of HF Llama, Mistral, Qwen2 and Mixtral on a GPU."""

    def __init__(self, c: ZooConfig):
        super().__init__()
        extra = dict(c.extra)
        self.embed_tokens = nn.Embedding(c.vocab, c.hidden)
        self.rotary = RegionRotary(c.hidden // c.heads, extra.get("rope_theta", 10000.0),
                                   extra.get("region_device", ""))
        self.layers = nn.ModuleList(RegionBlock(c) for _ in range(c.layers))
        self.norm = UpcastRMSNorm(c.hidden)
        self.lm_head = nn.Linear(c.hidden, c.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(tokens)
        positions = torch.arange(tokens.shape[1], device=tokens.device)[None].expand(
            tokens.shape[0], -1)
        cos, sin = self.rotary(h, positions)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.lm_head(self.norm(h))


_BY_HAND = {"torch-encoder": TorchEncoder, "nanogpt": NanoGPT, "rootparam": RootParam,
            "cnn": SmallCNN, "titan-llama": TitanLlama, "titan-moe": TitanLlama,
            "titan-ecmoe": TitanLlama,
            "region-llama": RegionLlama}


def build_zoo(c: ZooConfig) -> nn.Module:
    """The model of ``c`` on the current default device, in train mode."""
    if c.architecture in _BY_HAND:
        return _BY_HAND[c.architecture](c)
    model = _hf(c)
    inner = model.model
    if hasattr(inner, "config"):
        inner.config.use_cache = False
    return model


def inputs_kind(c: ZooConfig) -> str:
    """What the model eats and its loss: tokens -> next token, (tokens, decoder tokens) ->
    tokens, an image -> a class, features -> features."""
    if c.architecture == "t5":
        return "seq2seq"
    if c.architecture in ("vit", "cnn"):
        return "image"
    if c.architecture == "rootparam":
        return "features"
    return "tokens"


# ---- named configurations ------------------------------------------------------------------------

_GQA = dict(heads=4, kv_heads=2)
ZOO_CONFIGS: dict[str, ZooConfig] = {
    "hf-mistral-tiny": ZooConfig(architecture="mistral", **_GQA),
    "hf-qwen2-tiny": ZooConfig(architecture="qwen2", **_GQA),
    "hf-mixtral-tiny": ZooConfig(architecture="mixtral", ffn=64, **_GQA),
    "hf-llama-gqa-tiny": ZooConfig(architecture="llama", **_GQA),
    "hf-gpt2-lm-tiny": ZooConfig(architecture="gpt2"),
    "hf-bert-mlm-tiny": ZooConfig(architecture="bert-mlm"),
    "hf-t5-tiny": ZooConfig(architecture="t5", layers=3),   # block 0 differs (position bias)
    "hf-vit-tiny": ZooConfig(architecture="vit"),
    "torch-encoder-tiny": ZooConfig(architecture="torch-encoder"),
    "nanogpt-tiny": ZooConfig(architecture="nanogpt"),
    "rootparam-tiny": ZooConfig(architecture="rootparam"),
    "cnn-tiny": ZooConfig(architecture="cnn", image_size=16),
    "titan-llama-tiny": ZooConfig(architecture="titan-llama", **_GQA),
    "titan-moe-tiny": ZooConfig(architecture="titan-moe", ffn=32, **_GQA),
    "titan-ecmoe-tiny": ZooConfig(architecture="titan-ecmoe", ffn=32, **_GQA),
    # autocast-disabled regions: keyed on the tensor's device (kept by a trace under autocast)
    # and on "cuda" (kept by any trace: the case GPU runs met)
    "region-llama-tiny": ZooConfig(architecture="region-llama", **_GQA),
    "region-cuda-llama-tiny": ZooConfig(architecture="region-llama", **_GQA,
                                        extra=(("region_device", "cuda"),)),
    # real sizes, for planning on the meta device
    "hf-llama3-8b": ZooConfig(architecture="llama", hidden=4096, layers=32, heads=32,
                              kv_heads=8, ffn=14336, vocab=128256, seq_len=8192,
                              max_positions=8192, extra=(("rope_theta", 500000.0),)),
    "hf-mixtral-8x7b": ZooConfig(architecture="mixtral", hidden=4096, layers=32, heads=32,
                                 kv_heads=8, ffn=14336, vocab=32000, seq_len=4096,
                                 max_positions=32768, experts=8, experts_per_token=2),
    # Mixtral-8x7B's sizes with expert-choice routing over stacked experts (bmm)
    "titan-ecmoe-8x7b": ZooConfig(architecture="titan-ecmoe", hidden=4096, layers=32,
                                  heads=32, kv_heads=8, ffn=14336, vocab=32000, seq_len=4096,
                                  max_positions=32768, experts=8, experts_per_token=2),
    "titan-llama3-8b": ZooConfig(architecture="titan-llama", hidden=4096, layers=32, heads=32,
                                 kv_heads=8, ffn=14336, vocab=128256, seq_len=8192,
                                 max_positions=8192, extra=(("rope_theta", 500000.0),)),
    "hf-t5-large": ZooConfig(architecture="t5", hidden=1024, layers=24, heads=16, ffn=4096,
                             vocab=32128, seq_len=512, max_positions=512),
    "hf-bert-large": ZooConfig(architecture="bert-mlm", hidden=1024, layers=24, heads=16,
                               ffn=4096, vocab=30522, seq_len=512, max_positions=512),
    "hf-gpt2-xl": ZooConfig(architecture="gpt2", hidden=1600, layers=48, heads=25, ffn=6400,
                            vocab=50257, seq_len=1024, max_positions=1024),
    "hf-vit-l": ZooConfig(architecture="vit", hidden=1024, layers=24, heads=16, ffn=4096,
                          image_size=224, patch=16, classes=1000),
}
