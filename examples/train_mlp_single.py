"""Train an example model from the registry for a few steps in one plain PyTorch process.

    python examples/train_mlp_single.py                       # mlp-tiny, 20 steps
    python examples/train_mlp_single.py --model gpt-tiny --steps 5 --batch-size 8

The training a plan must reproduce, without autoplan: with the same model, batch and learning
rate (3e-3, `autoplan run`'s default), its losses are those `autoplan run` prints under any plan
of that model and global batch. For example, these print the same five losses as the second
command above (5.5669, 5.2206, 5.0374, 4.8584, 4.7015):

    autoplan plan gpt-tiny --cluster local:2 --global-batch 8 --precision fp32 --force tp=2 -o tp.plan.json
    autoplan run tp.plan.json --model gpt-tiny --steps 5

The same name, seed and batch size always give the same losses.
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--model", default="mlp-tiny", choices=list_examples())
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)   # autoplan run's default
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    example = build_example(args.model, batch_size=args.batch_size, seed=args.seed)
    params = sum(p.numel() for p in example.model.parameters())
    print(f"{example.name} ({example.family}): {params:,} parameters")
    optimizer = torch.optim.AdamW(example.model.parameters(), lr=args.lr)
    for step in range(args.steps):
        start = time.perf_counter()
        # The same batch every step: the loss must fall, which makes a quick sanity check.
        loss = example.loss_fn(example.model(*example.example_inputs), example.targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed_ms = 1e3 * (time.perf_counter() - start)
        print(f"step {step:3d}  loss {loss.item():.6f}  {elapsed_ms:.1f} ms")


if __name__ == "__main__":
    main()
