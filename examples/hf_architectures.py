"""Train a Hugging Face architecture autoplan has no test for, under a plan, against one process.

    torchrun --nproc-per-node 2 examples/hf_architectures.py gemma2
    torchrun --nproc-per-node 4 examples/hf_architectures.py falcon '{"tp": 2, "dp": 2, "zero_stage": 3}'
    torchrun --nproc-per-node 2 examples/hf_architectures.py bloom '{"pp": 2}'

Builds a small model from its config (2 layers, hidden size 512: no weights are downloaded),
wraps it as a user would (forward returns logits), lets autoplan plan it with the given fields
forced (default tp=2), trains 3 AdamW steps in fp32 and compares the losses with the same
training in one process. Rank 0 prints the plan, how many weights it splits (over tp, and over
dp under ZeRO-3) and its most frequent per-op strategies, then one verdict:

- OK: the losses match and the plan splits weights (or pipelines the model), so sharded
  training was checked;
- REPLICATED (exit 3; torchrun then reports the rank as failed): the losses match but the plan
  keeps every weight whole on every rank (splitting did not pay for this architecture at this
  size on this machine), so no sharded weight was checked;
- FAIL (exit 1): the losses differ.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter

import torch
import torch.nn.functional as F

import autoplan

# large enough that splitting the layers pays on a CPU (at hidden size 64 the planner kept every
# weight of every architecture whole: the comparison then checked no sharded numerics)
VOCAB, SEQ, BATCH = 128, 64, 8
HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM = 512, 2048, 8, 4, 64
# token ids inside the small vocabulary (some configs default to ids of their real vocabulary,
# which transformers warns about)
TOKENS = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)


def configs() -> dict:
    import transformers as T
    c = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2,
             num_attention_heads=HEADS, max_position_embeddings=SEQ, **TOKENS)
    gqa = dict(c, num_key_value_heads=KV_HEADS)
    return {
        "gemma": lambda: T.GemmaForCausalLM(T.GemmaConfig(**gqa, head_dim=HEAD_DIM)),
        "gemma2": lambda: T.Gemma2ForCausalLM(T.Gemma2Config(**gqa, head_dim=HEAD_DIM)),
        "phi": lambda: T.PhiForCausalLM(T.PhiConfig(**c, resid_pdrop=0.0, embd_pdrop=0.0,
                                                     attention_dropout=0.0)),
        "phi3": lambda: T.Phi3ForCausalLM(T.Phi3Config(**gqa)),
        "gpt_neox": lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**c, hidden_dropout=0.0,
                                                                 attention_dropout=0.0)),
        "opt": lambda: T.OPTForCausalLM(T.OPTConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, ffn_dim=FFN, num_hidden_layers=2,
            num_attention_heads=HEADS, max_position_embeddings=SEQ, word_embed_proj_dim=HIDDEN,
            dropout=0.0, attention_dropout=0.0)),
        "qwen3": lambda: T.Qwen3ForCausalLM(T.Qwen3Config(**gqa, head_dim=HEAD_DIM)),
        "olmo2": lambda: T.Olmo2ForCausalLM(T.Olmo2Config(**gqa)),
        "stablelm": lambda: T.StableLmForCausalLM(T.StableLmConfig(
            **gqa, hidden_dropout=0.0, attention_dropout=0.0)),
        "starcoder2": lambda: T.Starcoder2ForCausalLM(T.Starcoder2Config(
            **gqa, residual_dropout=0.0, embedding_dropout=0.0, attention_dropout=0.0)),
        "granite": lambda: T.GraniteForCausalLM(T.GraniteConfig(**gqa)),
        "falcon": lambda: T.FalconForCausalLM(T.FalconConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS,
            hidden_dropout=0.0, attention_dropout=0.0)),
        "bloom": lambda: T.BloomForCausalLM(T.BloomConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=2, n_head=HEADS, hidden_dropout=0.0,
            attention_dropout=0.0)),
        "bart": lambda: T.BartForCausalLM(T.BartConfig(
            vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN,
            decoder_ffn_dim=FFN, max_position_embeddings=SEQ, dropout=0.0,
            attention_dropout=0.0, activation_dropout=0.0)),
        "mpt": lambda: T.MptForCausalLM(T.MptConfig(vocab_size=VOCAB, d_model=HIDDEN, n_heads=HEADS,
                                                     n_layers=2, max_seq_len=SEQ)),
        "deberta": lambda: T.DebertaV2ForMaskedLM(T.DebertaV2Config(
            **c, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            relative_attention=True, pos_att_type=["p2c", "c2p"])),
        "electra": lambda: T.ElectraForMaskedLM(T.ElectraConfig(
            vocab_size=VOCAB, embedding_size=HIDDEN // 2, hidden_size=HIDDEN, intermediate_size=FFN,
            num_hidden_layers=2, num_attention_heads=HEADS, max_position_embeddings=SEQ,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
        "roberta": lambda: T.RobertaForMaskedLM(T.RobertaConfig(
            **dict(c, max_position_embeddings=SEQ + 2), hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)),
        "distilbert": lambda: T.DistilBertForMaskedLM(T.DistilBertConfig(
            vocab_size=VOCAB, dim=HIDDEN, hidden_dim=FFN, n_layers=2, n_heads=HEADS,
            max_position_embeddings=SEQ, dropout=0.0, attention_dropout=0.0)),
    }


class Logits(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=ids).logits


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = configs()[name]()
    model.config.use_cache = False
    return Logits(model).train()


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def main() -> int:
    torch.set_num_threads(1)
    if len(sys.argv) < 2 or sys.argv[1] not in configs():
        raise SystemExit(f"usage: hf_architectures.py {{{','.join(configs())}}} [FORCE_JSON]")
    name = sys.argv[1]
    force = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {"tp": 2}
    rank = int(os.environ.get("RANK", "0"))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    trainer = autoplan.compile(build(name), "local", example_inputs=(x,), loss_fn=loss_fn,
                               example_targets=y, global_batch_size=BATCH, precision="fp32",
                               optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                               force=force)
    got = [float(trainer.step((x, y))) for _ in range(3)]
    if rank != 0:
        return 0
    model = build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref = []
    for _ in range(3):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        ref.append(loss.item())
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    plan = trainer.plan
    top = Counter(plan.op_strategies.values()).most_common(5)
    split = sharded(plan)
    verdict = ("FAIL" if worst > 1e-5 else "OK" if split or plan.config.pp > 1
               else "REPLICATED")
    print(f"{verdict} {name} {plan.config.short()}: worst relative loss difference "
          f"{worst:.1e}; {split} of {len(plan.param_placements)} weights split"
          + _over(plan) + f"; strategies {top}")
    if verdict == "REPLICATED":
        ops = sum(s != "replicate" for s in plan.op_strategies.values())
        print(f"  no weight is split: every rank holds every weight whole (the plan splits the "
              f"work of {ops} ops), so this run checked no sharded weights; the planner found "
              "splitting them not worth it here (try a larger HIDDEN)")
    return {"OK": 0, "FAIL": 1, "REPLICATED": 3}[verdict]


def sharded(plan) -> int:
    """How many of the plan's weights are split over a mesh axis (tp, or dp under ZeRO-3)."""
    zero3 = plan.config.zero_stage == 3 and plan.config.dp > 1
    return sum(p.tp != "R" or (zero3 and p.dp != "R") or p.ep != "R"
               for p in plan.param_placements.values())


def _over(plan) -> str:
    places = plan.param_placements.values()
    axes = [f"{sum(p.tp != 'R' for p in places)} over tp"]
    if plan.config.zero_stage == 3 and plan.config.dp > 1:
        axes.append(f"{sum(p.dp != 'R' for p in places)} over dp (ZeRO-3)")
    if plan.config.pp > 1:
        axes.append(f"each on one of {plan.config.pp} pipeline stages")
    return " (" + ", ".join(axes) + ")"


if __name__ == "__main__":
    sys.exit(main())
