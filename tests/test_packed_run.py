"""`autoplan run` on packed documents (issue 40 item 4): a plan made with `plan --seq-lengths`
trains on documents drawn from its length histogram, packed into its sequences with position
ids restarting per document, equal to one process on the same packed rows; models that cannot
take a document mask, and plans for unpacked sequences, are refused with the fix."""

import json
import subprocess
import sys

import pytest
import torch

from autoplan.errors import ConfigError
from autoplan.models import build_example
from autoplan.models.packing import document_position_ids, eod_position_ids
from autoplan.runtime.packed_data import packed_documents_example
from autoplan.sharding.doc_work import PackedWork, pack_documents
from autoplan.sharding.seq_lengths import histogram_of, read_seq_lengths

LENGTHS = "length,count\n5,3\n16,2\n32,1\n"


def _cli(*argv, timeout=240):
    return subprocess.run([sys.executable, "-m", "autoplan.cli.main", *argv],
                          capture_output=True, text=True, timeout=timeout)


def test_run_trains_packed_documents_equal_to_one_process(tmp_path):
    """One launch, 4 ranks (pp 2 x tp 2): the plan's documents, packed and masked, carried
    through the pipeline's stages and the tensor-parallel attention; the losses are one
    process's on the same rows."""
    from autoplan.runtime.worker import build_run_model
    lengths = tmp_path / "lengths.csv"
    lengths.write_text(LENGTHS)
    plan = str(tmp_path / "p.json")
    out = _cli("plan", "llama-tiny", "--cluster", "local:4", "--global-batch", "8",
               "--precision", "fp32", "--seq-lengths", str(lengths), "--force", "pp=2",
               "--force", "tp=2", "-q", "-o", plan)
    assert out.returncode == 0, out.stderr[-2000:]
    saved = json.loads(open(plan).read())
    assert saved["training"]["seq_lengths"] == [[5, 3], [16, 2], [32, 1]]
    assert saved["config"]["pp"] == 2 and saved["config"]["tp"] == 2
    record = tmp_path / "run.json"
    out = _cli("run", plan, "--model", "llama-tiny", "--steps", "3", "--lr", "3e-3",
               "--json", str(record), "--master-port", "29653")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "packed rows of 32 tokens" in out.stdout
    losses = json.loads(record.read_text())["losses"]

    built = build_run_model("llama-tiny", batch=8, documents=read_seq_lengths(lengths))
    ex = built.data
    tokens, pos = ex.example_inputs
    assert pos.shape == tokens.shape == (8, 32) and not bool((pos == torch.arange(32)).all())
    opt = torch.optim.AdamW(ex.model.parameters(), lr=3e-3)
    ref = []
    for _ in range(3):
        loss = ex.loss_fn(ex.model(tokens, pos), ex.targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.append(loss.item())
    assert losses == pytest.approx(ref, rel=1e-5)


def test_models_without_position_ids_and_unpacked_plans_are_refused(tmp_path, capsys):
    """HF GPT-2 (learned positions, no position-id input) would attend across documents: `run`
    refuses its packed plan before any rank starts; `run --seq-lengths` on a plan made for
    unpacked sequences says to re-plan."""
    from autoplan.cli.main import main
    lengths = tmp_path / "lengths.csv"
    lengths.write_text(LENGTHS)
    gpt2 = "hf-gpt2-lm-tiny"
    for model, extra in ((gpt2, ["--seq-lengths", str(lengths)]), ("llama-tiny", [])):
        assert main(["plan", model, "--cluster", "local:2", "--global-batch", "4", "-q",
                     "-o", str(tmp_path / f"{model}.json"), *extra]) == 0
    capsys.readouterr()
    assert main(["run", str(tmp_path / f"{gpt2}.json"), "--model", gpt2,
                 "--print-command"]) == 1
    err = capsys.readouterr().err
    assert "takes no position ids" in err and "re-plan without --seq-lengths" in err
    assert main(["run", str(tmp_path / "llama-tiny.json"), "--model", "llama-tiny",
                 "--seq-lengths", str(lengths), "--print-command"]) == 1
    err = capsys.readouterr().err
    assert "made for unpacked sequences" in err and "--seq-lengths" in err


def test_the_run_packs_as_the_planner_prices():
    """The run's rows are the sequences PackedWork prices (one packing, one seed), and the
    packed example's position ids restart at each of them."""
    h = histogram_of([(3, 5), (10, 2), (40, 1)])
    rows = pack_documents(h, 16, 6, seed=0)
    assert rows == PackedWork(h, 16, samples=6).sequences
    assert all(sum(r) == 16 for r in rows)
    ex = packed_documents_example(build_example("llama-tiny", batch_size=6, seq_len=16), h)
    assert torch.equal(ex.example_inputs[1], document_position_ids(rows, 16))
    with pytest.raises(ConfigError, match="takes no position ids"):
        packed_documents_example(build_example("gpt-tiny", batch_size=2), h)


def test_end_of_document_tokens_split_documents():
    tokens = torch.tensor([[5, 1, 2, 0, 3, 4, 0, 7], [0, 0, 1, 2, 3, 0, 5, 6]])
    assert eod_position_ids(tokens, 0).tolist() == [[0, 1, 2, 3, 0, 1, 2, 0],
                                                    [0, 0, 0, 1, 2, 3, 0, 1]]


def test_a_graph_given_position_ids_is_priced_as_document_masked_causal():
    """The packed trace reads its mask from the position ids (ring_work.causal_at: not
    causal); its mask ands a causal comparison in, so under --seq-lengths its attention is
    priced as each document's causal attention (on a GPU, off a ring), as the unpacked causal
    trace is."""
    from autoplan.graph import trace
    from autoplan.graph.oprules import is_attention
    from autoplan.sharding.doc_work import attention_share, document_causal_at, packed_work
    from autoplan.sharding.ring_work import causal_at
    h = histogram_of([(5, 3), (16, 2), (32, 1)])
    plain = build_example("llama-tiny", batch_size=1, seq_len=32)
    packed = packed_documents_example(plain, h)
    shares = []
    for ex in (plain, packed):
        g = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
        i = next(i for i, op in enumerate(g.ops) if is_attention(op))
        docs = packed_work(g, h)
        shares.append((attention_share(g, i, docs, 1, "", 1),
                       attention_share(g, i, docs, 2, "zigzag", 1)))
        if ex is packed:
            assert not causal_at(g, i) and document_causal_at(g, i)
    assert shares[0] == shares[1]
    assert shares[0][0] == pytest.approx(PackedWork(h, 32).dense_share(causal=True))
    assert shares[0][0] != pytest.approx(PackedWork(h, 32).dense_share(causal=False))
    assert shares[0][1] == 0.5          # a ring computes every block whole: half the square


def test_verify_checks_a_packed_plan_on_packed_documents(tmp_path, capsys):
    """`autoplan verify` of a plan for packed documents runs the shrunk plan and one device
    on the same packed rows (it refused the plan as another model's: its graph takes
    position ids)."""
    from autoplan.cli.main import main
    lengths = tmp_path / "lengths.csv"
    lengths.write_text(LENGTHS)
    plan = str(tmp_path / "p.json")
    assert main(["plan", "llama-tiny", "--cluster", "local:2", "--global-batch", "4",
                 "--seq-lengths", str(lengths), "-q", "-o", plan]) == 0
    capsys.readouterr()
    assert main(["verify", plan, "--model", "llama-tiny", "--ranks", "2"]) == 0
    out = capsys.readouterr().out
    assert "packed with documents" in out and "PASS" in out
