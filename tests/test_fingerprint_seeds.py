"""Deterministic model fingerprints (issue 37): the fingerprint is a canonical form of the traced
graph, the same whatever names fx gave the ops and whatever order independent ops were traced
in. Hugging Face Gemma 3 and ModernBERT loop over a ``set`` of layer types, so their two
rotary-embedding chains swap places with ``PYTHONHASHSEED``: a plan made in one process must
load and run in processes with other hash seeds.

Run as a script (``python tests/test_fingerprint_seeds.py plan|check DIR``), this file is the
subprocess the last test starts under each hash seed."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("gemma3", "modernbert")
GBS, SEQ, VOCAB = 4, 16, 128


# ================================================================ the canonical form
def _graph_dict():
    from autoplan.graph import trace
    from autoplan.models import build_example
    ex = build_example("gpt-tiny", device="meta", batch_size=1)
    g = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    return g, g.to_dict()


def _renamed(d):
    """``d`` with every op and value renamed (as another trace order would number them)."""
    names = {v["name"]: f"v{k}" for k, v in enumerate(d["values"])}
    names.update({op["name"]: f"op{k}" for k, op in enumerate(d["ops"]) if op["name"] not in names})
    new = json.loads(json.dumps(d))
    for key in ("inputs", "outputs"):
        new[key] = [names[n] for n in d[key]]
    for v in new["values"]:
        v["name"], v["base"] = names[v["name"]], names[v["base"]]
    for op in new["ops"]:
        op["name"] = names[op["name"]]
        for key in ("inputs", "outputs", "saved"):
            op[key] = [names[n] for n in op[key]]
        for old, nu in names.items():
            op["args"] = op["args"].replace(f'{{"v":"{old}"}}', f'{{"v":"{nu}"}}')
    return new


def _swap_independent(d):
    """``d`` with the first two adjacent independent ops (inside one block instance or both
    outside every block) traced the other way round."""
    where = {}
    for b in d["blocks"]:
        for path, start, stop in b["instances"]:
            where.update({i: path for i in range(start, stop)})
    ops = d["ops"]
    for i in range(len(ops) - 1):
        if where.get(i) == where.get(i + 1) and not set(ops[i]["outputs"]) & set(
                ops[i + 1]["inputs"] + ops[i + 1]["saved"]):
            new = json.loads(json.dumps(d))
            new["ops"][i], new["ops"][i + 1] = new["ops"][i + 1], new["ops"][i]
            return new, i
    raise AssertionError("no two adjacent independent ops")


def _positional_fingerprint(d):
    """The fingerprint before issue 37: the graph's JSON in trace order, names included."""
    d = {k: v for k, v in d.items() if k not in ("meta", "name")}
    return hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def test_the_fingerprint_ignores_names_and_the_order_of_independent_ops():
    from autoplan.graph.opgraph import OpGraph
    g, d = _graph_dict()
    swapped, i = _swap_independent(_renamed(d))
    other = OpGraph.from_dict(swapped)          # a valid graph: checked whole on reading
    assert [op.name for op in other.ops] != [op.name for op in g.ops]
    assert _positional_fingerprint(swapped) != _positional_fingerprint(d)
    assert other.fingerprint() == g.fingerprint()
    # what the model computes does change it
    for change in (lambda o: o.__setitem__("fwd_flops", o["fwd_flops"] + 1),
                   lambda o: o.__setitem__("module_path", o["module_path"] + ".x"),
                   lambda o: o.__setitem__("differentiable", not o["differentiable"])):
        edited = json.loads(json.dumps(d))
        change(edited["ops"][i])
        assert OpGraph.from_dict(edited).fingerprint() != g.fingerprint()
    doubled = json.loads(json.dumps(d))
    doubled["batch_size"] = 2
    assert OpGraph.from_dict(doubled).fingerprint() != g.fingerprint()


# ================================================================ Gemma 3 and ModernBERT
def hf_lm(name, *, vocab, hidden, ffn, layers, heads, kv_heads, head_dim, seq, window):
    """HF Gemma 3 (sliding and full layers in turn) or ModernBERT (a global layer every second)
    built from a config at these sizes, returning logits of ``input_ids``."""
    import torch.nn as nn
    import transformers as T

    class Logits(nn.Module):
        def __init__(self, inner, **kw):
            super().__init__()
            self.inner, self.kw = inner, kw

        def forward(self, ids):
            return self.inner(input_ids=ids, **self.kw).logits

    if name == "gemma3":
        config = T.Gemma3TextConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
            head_dim=head_dim, max_position_embeddings=seq, sliding_window=window,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2))
        return Logits(T.Gemma3ForCausalLM(config), use_cache=False)
    config = T.ModernBertConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, max_position_embeddings=seq, local_attention=window,
        global_attn_every_n_layers=2, pad_token_id=0, eos_token_id=1, bos_token_id=2,
        cls_token_id=3, sep_token_id=4)
    return Logits(T.ModernBertForMaskedLM(config))


def _model(name):
    import torch
    torch.manual_seed(0)
    model = hf_lm(name, vocab=VOCAB, hidden=64, ffn=128, layers=2 if name == "gemma3" else 3,
                  heads=4, kv_heads=2, head_dim=16, seq=SEQ, window=8)
    ids = torch.randint(0, VOCAB, (GBS, SEQ), generator=torch.Generator().manual_seed(1))
    return model, ids


def _loss(logits, targets):
    import torch.nn.functional as F
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _trace(name):
    from autoplan.graph import trace
    model, ids = _model(name)
    return trace(model, (ids,), loss_fn=_loss, targets=ids)


def _subprocess(step, folder):
    """One step in this process (its PYTHONHASHSEED is the test's choice)."""
    import autoplan
    from autoplan.planner.loading import load_plan
    for name in MODELS:
        graph = _trace(name)
        (folder / f"{name}.{step}.graph.json").write_text(graph.to_json())
        plan_path = folder / f"{name}.plan.json"
        if step == "plan":
            autoplan.plan(graph, autoplan.Cluster.local(2), global_batch_size=GBS, profile=None,
                          force={"tp": 2}).save(plan_path)
        else:
            load_plan(plan_path, graph=graph)


def _start(step, folder, seed):
    env = {**os.environ, "PYTHONHASHSEED": str(seed)}
    done = subprocess.run([sys.executable, __file__, step, str(folder)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{step} under PYTHONHASHSEED={seed}:\n{done.stderr[-3000:]}"


def test_gemma3_and_modernbert_plans_load_under_other_hash_seeds(tmp_path):
    """A plan made under one hash seed loads (fingerprint checked) in a process under another,
    whose trace has the rotary chains the other way round. (That such ranks also train like one
    process, each under a seed of its own, is tests/test_plan_seeds.py's.)"""
    pytest.importorskip("transformers")
    # seeds 1 and 0 iterate {"sliding_attention", "full_attention"} in opposite orders
    _start("plan", tmp_path, seed=1)
    _start("check", tmp_path, seed=0)
    for name in MODELS:
        planned, checked = (json.loads((tmp_path / f"{name}.{s}.graph.json").read_text())
                            for s in ("plan", "check"))
        # the traces really differ in order (the old, positional fingerprint refused them)
        assert [op["params"] for op in planned["ops"]] != [op["params"] for op in checked["ops"]]
        assert _positional_fingerprint(planned) != _positional_fingerprint(checked)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _subprocess(sys.argv[1], Path(sys.argv[2]))
