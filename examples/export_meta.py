"""Export a (possibly huge) example model on the meta device: no memory, shapes only.

    python examples/export_meta.py gpt3-175b --num-layers 2
    python examples/export_meta.py llama3-8b

Prints the parameter count, the export time and the most frequent aten ops of the graph the
planner would work from.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

try:
    import autoplan  # noqa: F401
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

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
    start = time.perf_counter()
    exported = torch.export.export(example.model, example.example_inputs)
    elapsed = time.perf_counter() - start
    ops = collections.Counter(str(node.target) for node in exported.graph.nodes
                              if node.op == "call_function")
    print(f"{example.name}: {params:,} parameters, exported in {elapsed:.2f} s, "
          f"{len(exported.graph.nodes)} nodes")
    for op, count in ops.most_common(10):
        print(f"  {count:6d}  {op}")


if __name__ == "__main__":
    main()
