"""`autoplan export CHECKPOINT -o model.safetensors`: one plain state_dict from a checkpoint.

CHECKPOINT is a checkpoint root (its latest step) or one step directory, saved under any plan.
The output loads into the unparallelized model with ``model.load_state_dict(...)``
(``safetensors.torch.load_file`` for ``.safetensors``, ``torch.load`` for ``.pt``).
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a checkpoint's model as one plain state_dict",
                       description=__doc__)
    p.add_argument("checkpoint", help="checkpoint root or step directory")
    p.add_argument("-o", "--output", required=True,
                   help="file to write: NAME.safetensors or NAME.pt")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from autoplan.cli.common import output_arg
    from autoplan.runtime.checkpoint_files import export
    output_arg(args.output, "-o", (".safetensors", ".pt"))
    info = export(args.checkpoint, args.output)
    print(f"wrote {info['path']}: {info['tensors']} tensors, {info['bytes'] / 2**20:.1f} MiB, "
          f"model at step {info['step']}")
    return 0
