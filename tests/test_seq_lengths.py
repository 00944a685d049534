"""``--seq-lengths``: the length file's forms and their errors (fuzzed), the packing, and the
attention work priced over it (issue 40 item 4)."""

import json
import random
import re

import pytest

from autoplan.errors import ConfigError
from autoplan.sharding import ring_work
from autoplan.sharding.doc_work import PackedWork, ring_critical_pairs
from autoplan.sharding.seq_lengths import (LengthHistogram, histogram_of, parse_seq_lengths,
                                           read_seq_lengths)


def test_every_form_reads_to_the_same_histogram(tmp_path):
    want = histogram_of([(300, 2), (1000, 1), (8192, 3)])
    sample = [300, 8192, 1000, 8192, 300, 8192]
    forms = ["length,count\n300,2\n1000,1\n8192,3\n",
             "# tokens\tdocs\n300\t2\n\n1000 1   # a comment\n8192\t3\n",
             "300,1\n8192,3\n1000,1\n300,1\n",                      # repeats add up
             "\n".join(map(str, sample)) + "\n",
             json.dumps({"histogram": [[300, 2], [1000, 1], [8192, 3]]}),
             json.dumps({"lengths": sample, "source": "a crawl"}),
             json.dumps(sample), json.dumps([[8192, 3], [300, 2], [1000, 1], [5, 0]])]
    for k, text in enumerate(forms):
        h = parse_seq_lengths(text)
        assert (h.lengths, h.counts) in ((want.lengths, want.counts),
                                         ((5,) + want.lengths, (0,) + want.counts)), (k, h)
    path = tmp_path / "lengths.csv"
    path.write_text(forms[0])
    h = read_seq_lengths(path)
    assert (h.documents, h.tokens, h.max_length, h.quantile(0.5)) == (6, 26176, 8192, 1000)
    assert "median 1,000" in h.describe()


@pytest.mark.parametrize("text,says", [
    ("", "no document lengths"),
    ("length,count\n", "no document lengths"),
    ("300,2\n400\n", "one form throughout"),
    ("300,2,5\n", "3 columns"),
    ("0,2\n", "out of range"),
    ("300,-1\n", "out of range"),
    ("3e2,1\n", "not a whole number"),
    ("300,0\n400,0\n", "every count is 0"),
    ("99999999999,1\n", "out of range"),
    ('{"histogram": [[300]]}', "expected [LENGTH, COUNT]"),
    ('{"histogram": [[300, 1]], "lengths": [3]}', "exactly one of"),
    ('{"lengths": "300"}', "must be a list"),
    ('{"lengths": [300.5]}', "whole number"),
    ('{"lengths": [true]}', "whole number"),
    ('{"lengths": [300,', "not valid JSON"),
    ('"300"', "not a whole number"),
    ('{"a": 1}', "exactly one of"),
])
def test_bad_files_say_what_to_write(text, says):
    with pytest.raises(ConfigError, match=".") as e:
        parse_seq_lengths(text)
    assert says in str(e.value), str(e.value)


def test_missing_file_and_bytes_that_are_not_text(tmp_path):
    with pytest.raises(ConfigError, match="no --seq-lengths file"):
        read_seq_lengths(tmp_path / "none.csv")
    with pytest.raises(ConfigError, match="not UTF-8"):
        parse_seq_lengths(b"300,1\n\xff\xfe")


def test_fuzzed_files_give_a_histogram_or_a_config_error():
    """Random mutations of valid files: every outcome is a valid histogram or a ConfigError
    (never another exception), and a valid histogram holds what its rows say."""
    rnd = random.Random(0)
    seeds = ["length,count\n300,2\n1000,1\n", "300\n400\n", '{"histogram": [[300, 2]]}',
             '{"lengths": [300, 5000]}', "[[1, 2], [3, 4]]"]
    alphabet = "0123456789,;\t #\n-+.e[]{}\":ltx\x00\u00e9"
    for _ in range(1500):
        text = list(rnd.choice(seeds))
        for _ in range(rnd.randint(1, 4)):
            at = rnd.randrange(len(text) + 1)
            op = rnd.random()
            if op < 0.4:
                text.insert(at, rnd.choice(alphabet))
            elif op < 0.7 and text:
                del text[min(at, len(text) - 1)]
            elif text:
                text[min(at, len(text) - 1)] = rnd.choice(alphabet)
        try:
            h = parse_seq_lengths("".join(text))
        except ConfigError:
            continue
        assert isinstance(h, LengthHistogram) and h.documents >= 1
        assert all(1 <= n <= 1 << 24 for n in h.lengths)


def test_packing_cuts_every_seq_len_tokens_and_restarts_documents():
    w = PackedWork(histogram_of([(3000, 1), (700, 3)]), 4096, samples=64)
    assert len(w.sequences) == 64
    assert all(sum(s) == 4096 for s in w.sequences)
    assert all(1 <= d <= 3000 for s in w.sequences for d in s)
    assert w.sequences == PackedWork(w.histogram, 4096, samples=64).sequences   # seeded
    # one document per sequence, as long as it: the masked work is the causal square's
    whole = PackedWork(histogram_of([(4096, 1)]), 4096, samples=4)
    assert whole.dense_share() == pytest.approx(1.0)
    # documents of d tokens in a sequence of S: (S/d) d(d+1)/2 over S(S+1)/2
    even = PackedWork(histogram_of([(512, 1)]), 4096, samples=4)
    assert even.dense_share() == pytest.approx(8 * 512 * 513 / (4096 * 4097))
    assert even.dense_share(causal=False) == pytest.approx(1 / 8)


@pytest.mark.parametrize("c", [2, 4, 8])
def test_one_document_rings_cost_what_ring_work_prices(c):
    w = PackedWork(histogram_of([(4096, 1)]), 4096, samples=2)
    for layout in ring_work.CP_LAYOUTS:
        assert w.ring_share(c, layout) == pytest.approx(
            ring_work.critical_share(c, layout, True), rel=2e-3)
        assert w.ring_share(c, layout, causal=False) == pytest.approx(1 / c)


def test_ring_pairs_count_the_document_mask_by_brute_force():
    """Pairs per (rank, step) summed by the closed form equal a token-by-token count."""
    rnd = random.Random(1)
    for _ in range(6):
        s, c = 48, rnd.choice([2, 3, 4])
        layout = rnd.choice(ring_work.CP_LAYOUTS if s % (2 * c) == 0 else ["contiguous"])
        docs, left = [], s
        while left:
            docs.append(min(left, rnd.randint(1, 20)))
            left -= docs[-1]
        doc = [k for k, d in enumerate(docs) for _ in range(d)]
        w = s // (2 * c) if layout == "zigzag" else s // c
        def owner(t):
            k = t // w
            return (min(k, 2 * c - 1 - k) if layout == "zigzag" else k)
        for causal in (True, False):
            brute = 0
            for step in range(c):
                per = [0] * c
                for q in range(s):
                    for k in range(s):
                        if doc[q] == doc[k] and (k <= q or not causal) \
                                and owner(k) == (owner(q) - step) % c:
                            per[owner(q)] += 1
                brute += max(per)
            assert ring_critical_pairs(tuple(docs), s, c, layout, causal) == brute


def test_short_documents_make_attention_cheap_and_rings_unbalanced():
    """Long-tailed lengths at 32K: attention is a small share of one causal square, and the
    expected slowest rank of a ring does more than the balanced share (where boundaries fall),
    zigzag less than contiguous."""
    h = histogram_of([(300, 500), (2000, 300), (8000, 100), (32768, 10)])
    w = PackedWork(h, 32768, samples=64)
    dense = w.dense_share()
    assert 0.05 < dense < 0.5
    for c in (2, 4, 8):
        zig, cont = w.ring_share(c, "zigzag"), w.ring_share(c, "contiguous")
        assert dense / c < zig < cont
    with pytest.raises(ConfigError, match="divisible"):
        w.ring_share(3, "zigzag")


def _meta_llama(seq_len=2048):
    from autoplan.graph import trace
    from autoplan.models import build_example
    ex = build_example("llama-tiny", batch_size=1, seq_len=seq_len, device="meta",
                       hidden_size=512, num_heads=8, num_kv_heads=8)
    return trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)


def test_estimates_price_attention_at_the_documents_work():
    """One document per sequence prices as no --seq-lengths (data parallel, and on a zigzag
    ring); short documents make the step cheaper, by attention's work only, where the kernel
    that runs skips masked blocks (flex attention, on a GPU off a ring), and not on a ring,
    which computes every block whole; MFU counts the masked FLOPs either way."""
    from autoplan import Cluster, ParallelConfig, estimate
    g = _meta_llama()
    cluster = Cluster.from_spec("dgx-h100/2")
    whole = histogram_of([(2048, 1)])
    short = histogram_of([(128, 1)])
    for cfg in (ParallelConfig(), ParallelConfig(cp=2, cp_layout="zigzag", dp=1)):
        c = replace_world(cfg, cluster)
        base = estimate(g, cluster, config=c, global_batch_size=8, profile=None)
        same = estimate(g, cluster, config=c, global_batch_size=8, profile=None,
                        seq_lengths=whole)
        cheap = estimate(g, cluster, config=c, global_batch_size=8, profile=None,
                         seq_lengths=short)
        assert same.step_time_s == pytest.approx(base.step_time_s, rel=1e-3)
        if cfg.cp == 1:
            assert cheap.step_time_s < base.step_time_s
        else:
            assert cheap.step_time_s == pytest.approx(base.step_time_s, rel=1e-9)
        attention = sum(op.fwd_flops + op.bwd_flops for op in g.ops
                        if op.kind == "attention") * 8
        assert base.model_flops_per_step - cheap.model_flops_per_step == pytest.approx(
            attention * (1 - 16 * 128 * 129 / (2048 * 2049)), rel=1e-6)


def test_a_cpu_cluster_prices_the_dense_mask_it_runs():
    """On a CPU the runtime runs SDPA with the dense document mask (flex attention has no
    backward there): the whole square is priced, the documents change no step time."""
    from autoplan import Cluster, ParallelConfig, estimate
    from autoplan.sharding.doc_work import packed_work
    g = _meta_llama(256)
    cluster = Cluster.local(2)
    c = replace_world(ParallelConfig(), cluster)
    short = histogram_of([(16, 1)])
    base = estimate(g, cluster, config=c, global_batch_size=4, profile=None)
    packed = estimate(g, cluster, config=c, global_batch_size=4, profile=None,
                      seq_lengths=short)
    assert packed.step_time_s == pytest.approx(base.step_time_s, rel=1e-9)
    assert packed.model_flops_per_step < base.model_flops_per_step
    assert packed_work(g, short, "cpu").kernel == "dense"
    assert packed_work(g, short, "gpu").kernel == "block_sparse"


def replace_world(cfg, cluster):
    from dataclasses import replace
    return replace(cfg, dp=cluster.world_size // cfg.cp)


def test_the_plan_for_documents_is_priced_as_its_estimate():
    """plan(seq_lengths=...) prices its choice as estimate(..., seq_lengths=...) does, and is
    no slower on the data than the plan made for full-length sequences."""
    from autoplan import Cluster, estimate, plan
    from autoplan.planner.compare import plan_sharding
    g = _meta_llama()
    cluster = Cluster.from_spec("dgx-h100/2")
    h = histogram_of([(64, 20), (512, 4), (2048, 1)])
    aware = plan(g, cluster, global_batch_size=8, profile=None, seq_lengths=h, max_pp=1,
                 top_k=0)
    fixed = plan(g, cluster, global_batch_size=8, profile=None, max_pp=1, top_k=0)
    on_data = {}
    for label, p in (("aware", aware), ("fixed", fixed)):
        on_data[label] = estimate(g, cluster, config=p.config, sharding=plan_sharding(p, g),
                                  global_batch_size=8, profile=None,
                                  seq_lengths=h).step_time_s
    assert on_data["aware"] == pytest.approx(aware.predicted["step_time_s"], rel=1e-4)
    assert on_data["aware"] <= on_data["fixed"] * (1 + 1e-6)
    # the plan records what it was priced for, reads back, explains it, and is re-planned so
    from autoplan.planner.explain import explain_plan
    from autoplan.planner.planfile import Plan
    back = Plan.from_json(aware.to_json())
    assert back.training.seq_lengths == ((64, 20), (512, 4), (2048, 1))
    assert back.to_json() == aware.to_json()
    assert "packed documents" in explain_plan(back)
    assert "seq_lengths" not in fixed.to_json() and "packed documents" not in explain_plan(fixed)
    bad = json.loads(aware.to_json())
    for rows, says in (([[64, 1], [64, 1]], "must be >="), ([[64, 0]], "every count is 0"),
                       ([[64]], "expected [length, count]"), ([], "1 to 256")):
        bad["training"]["seq_lengths"] = rows
        with pytest.raises(Exception, match=re.escape(says)):
            Plan.from_json(json.dumps(bad))


def test_many_lengths_are_priced_in_bins():
    h = histogram_of([(n, 1 + n % 3) for n in range(100, 5000, 7)])
    b = h.binned()
    assert len(h.lengths) > 256 >= len(b.lengths)
    assert b.documents == h.documents
    assert b.tokens == pytest.approx(h.tokens, rel=1e-3)
    assert PackedWork(b, 8192).dense_share() == pytest.approx(
        PackedWork(h, 8192).dense_share(), rel=0.03)
