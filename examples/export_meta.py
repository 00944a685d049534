"""Trace a (possibly huge) example model on the meta device: no memory, shapes only.

    python examples/export_meta.py gpt3-175b --num-layers 2
    python examples/export_meta.py llama3-8b

Traces the model with its loss as the planner does (``autoplan.trace``: torch.export on the
meta device), then prints the parameter count, the graph's summary (the trace time, ops by
kind, FLOPs, repeated blocks) and its most frequent aten ops: the graph the planner works from.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

try:
    import autoplan  # noqa: F401
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autoplan.graph import trace
from autoplan.models import build_example, list_examples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=list_examples())
    parser.add_argument("--num-layers", type=int, default=None,
                        help="override the layer count (transformer models)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=None)
    args = parser.parse_args()

    overrides = {} if args.num_layers is None else {"num_layers": args.num_layers}
    example = build_example(args.model, device="meta", batch_size=args.batch_size,
                            seq_len=args.seq_len, **overrides)
    params = sum(p.numel() for p in example.model.parameters())
    graph = trace(example.model, example.example_inputs, loss_fn=example.loss_fn,
                  targets=example.targets)
    print(f"{example.name}: {params:,} parameters")
    print(graph.summary())
    print("most frequent aten ops:")
    for op, count in collections.Counter(op.target for op in graph.ops).most_common(10):
        print(f"  {count:6d}  {op}")


if __name__ == "__main__":
    main()
