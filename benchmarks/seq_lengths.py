"""Plans for the data's length distribution against the best fixed-length plan (issue 40 item 4).

A long-tailed document-length distribution (lognormal, median 2,000 tokens, sigma 1.5, cut to
300 .. 131,072 tokens, as a 64-bin histogram) is packed into sequences of ``--seq-len`` tokens
behind a document mask. Two plans for the same model, cluster and global batch:

- fixed-length: ``plan`` without ``--seq-lengths`` (every sequence one causal square);
- distribution-aware: ``plan --seq-lengths FILE`` (attention priced at its expected masked
  work, on a cp ring at its expected slowest rank's, ``sharding/doc_work.py``).

Both are then priced on the distribution (``estimate(..., seq_lengths=...)``): the fixed-length
plan's step on packed documents is what running it on this data costs. Predictions of the cost
model (roofline/profile, no GPU run): the H200 checks in benchmarks/data did not measure
packed-document steps.

    .venv/bin/python benchmarks/seq_lengths.py                      # Llama-3-8B, 131,072, 8x8 H100
    .venv/bin/python benchmarks/seq_lengths.py --write-histogram examples/seq_lengths_lognormal.csv
"""

from __future__ import annotations

import argparse
import math
import time

from autoplan import Cluster, estimate, plan
from autoplan.graph import trace
from autoplan.models import build_example
from autoplan.planner.compare import plan_sharding
from autoplan.sharding.doc_work import packed_work
from autoplan.sharding.seq_lengths import LengthHistogram, histogram_of


def lognormal_histogram(median: float = 2000.0, sigma: float = 1.5, lo: int = 300,
                        hi: int = 131072, bins: int = 64, documents: int = 1_000_000
                        ) -> LengthHistogram:
    """``documents`` lengths in ``bins`` log-spaced bins from ``lo`` to ``hi``, each bin's
    count its lognormal probability (the tails beyond the cut folded into the end bins), at
    the bin's geometric middle."""
    edges = [lo * (hi / lo) ** (k / bins) for k in range(bins + 1)]

    def cdf(x: float) -> float:
        return 0.5 * (1.0 + math.erf(math.log(x / median) / (sigma * math.sqrt(2.0))))
    pairs = []
    for k in range(bins):
        a = 0.0 if k == 0 else cdf(edges[k])
        b = 1.0 if k == bins - 1 else cdf(edges[k + 1])
        pairs.append((min(hi, round(math.sqrt(edges[k] * edges[k + 1]))),
                      round((b - a) * documents)))
    return histogram_of(pairs, source=f"lognormal median {median:g} sigma {sigma:g}, "
                                      f"{lo}..{hi}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--seq-len", type=int, default=131072)
    ap.add_argument("--cluster", default="dgx-h100:8")
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--write-histogram", default=None, metavar="CSV")
    args = ap.parse_args()
    hist = lognormal_histogram(hi=args.seq_len)
    if args.write_histogram:
        with open(args.write_histogram, "w") as f:
            f.write(f"# {hist.source}\nlength,count\n")
            f.writelines(f"{n},{c}\n" for n, c in zip(hist.lengths, hist.counts))
        print(f"wrote {args.write_histogram}")
        return
    t0 = time.perf_counter()
    ex = build_example(args.model, batch_size=1, seq_len=args.seq_len, device="meta")
    g = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    cluster = Cluster.from_spec(args.cluster)
    work = packed_work(g, hist)
    print(f"data: {hist.describe()}")
    print(f"      {work.describe()}")
    fixed = plan(g, cluster, global_batch_size=args.global_batch, profile="auto")
    aware = plan(g, cluster, global_batch_size=args.global_batch, profile="auto",
                 seq_lengths=work)
    rows = []
    for label, p in (("fixed-length plan", fixed), ("distribution-aware plan", aware)):
        on_docs = estimate(g, cluster, config=p.config, sharding=plan_sharding(p, g),
                           global_batch_size=args.global_batch, profile="auto",
                           seq_lengths=work)
        rows.append((label, p, on_docs))
    print(f"\n{args.model} at {args.seq_len:,} tokens, global batch {args.global_batch}, "
          f"{cluster.world_size} x {cluster.device.name}")
    print(f"{'':26}{'config':44}{'planned step':>14}{'step on the data':>18}")
    for label, p, on_docs in rows:
        c = p.config
        cfg = (f"dp{c.dp} cp{c.cp} tp{c.tp} pp{c.pp} mbs{c.micro_batch_size} "
               f"zero{c.zero_stage} {c.recompute}" + (f" {c.cp_layout}" if c.cp > 1 else ""))
        print(f"{label:26}{cfg:44}{p.predicted['step_time_s']:13.3f}s"
              f"{on_docs.step_time_s:17.3f}s")
    gain = rows[0][2].step_time_s / rows[1][2].step_time_s
    print(f"\nstep on the data: the distribution-aware plan is {gain:.3f}x the fixed-length "
          f"plan's speed ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
