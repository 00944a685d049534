"""Shared CLI helpers: turning a MODEL argument into a traced OpGraph; comma-separated lists."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from autoplan.errors import AutoplanError


def comma_list(raw: str | None, kind: type, flag: str) -> tuple | None:
    """``"10,14"`` -> ``(10, 14)`` with ``kind`` applied to each item; None stays None."""
    from autoplan.errors import ConfigError
    if raw is None:
        return None
    try:
        return tuple(kind(x.strip()) for x in raw.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{flag} takes a comma-separated list, got {raw!r}") from None


def add_plan_model_args(p: argparse.ArgumentParser) -> None:
    """PLAN and the model it was made for, built as `autoplan plan` built it (``run``,
    ``emulate``)."""
    p.add_argument("plan", help="plan.json written by `autoplan plan`")
    p.add_argument("--model", required=True,
                   help="the model the plan was made for: an example name or "
                        "'package.module:function' returning an autoplan.models.Example")
    p.add_argument("--layers", type=int, default=None,
                   help="the example's layer count, as given to `autoplan plan --layers`")
    p.add_argument("--seq-len", type=int, default=None,
                   help="the example's sequence length, as given to `autoplan plan --seq-len`")


def add_model_args(p: argparse.ArgumentParser, *, optional: bool = False,
                   flag: bool = False) -> None:
    """MODEL and how to build it; ``flag``: as an optional ``--model`` option."""
    what = ("an example name (see `autoplan trace --list`), 'package.module:function' "
            "returning an autoplan.models.Example, or an OpGraph JSON file")
    if flag:
        p.add_argument("--model", metavar="MODEL", default=None, help=what)
    else:
        p.add_argument("model", metavar="MODEL", nargs="?" if optional else None, help=what)
    p.add_argument("--batch-size", type=int, default=1,
                   help="batch size to trace with (costs scale to the micro-batch; default 1)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (LMs)")
    p.add_argument("--max-positions", type=int, default=None,
                   help="position table / rotary cache length of an example that has one "
                        "(GPT's learned positions, the HF examples' max_position_embeddings), to "
                        "plan sequences longer than its own, e.g. 131072 with RoPE; "
                        "llama3-* compute theirs for any --seq-len")
    p.add_argument("--device", default=None, choices=("meta", "cpu"),
                   help="build the model on the meta device (the default: nothing is "
                        "allocated) or really on the CPU (`plan` for a CPU cluster defaults "
                        "to it where the model fits: some models trace differently per device)")
    p.add_argument("--layers", type=int, default=None,
                   help="override the number of layers of an example (e.g. to trace faster)")


def add_capacity_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--expert-capacity-factor", type=float, default=1.0, metavar="C",
                   help="MoE models: price the busiest expert-parallel rank with up to C times "
                        "the balanced share of routed tokens, as a router with this capacity "
                        "factor allows (default 1: balanced routing)")


def add_seq_lengths_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq-lengths", default=None, metavar="FILE",
                   help="the data's document lengths: a histogram (LENGTH,COUNT rows, CSV or "
                        "whitespace) or a sample (one LENGTH a row), or JSON {\"histogram\": "
                        "[[LENGTH, COUNT], ...]} / {\"lengths\": [...]}. Documents are packed "
                        "into the sequence length behind a document mask, and attention is "
                        "priced at its expected masked work (on a cp ring, its slowest rank's)")


def seq_lengths_arg(args: argparse.Namespace) -> Any:
    """``--seq-lengths FILE`` read and checked (before the trace: cheap first), or None."""
    if getattr(args, "seq_lengths", None) is None:
        return None
    from autoplan.sharding.seq_lengths import read_seq_lengths
    return read_seq_lengths(args.seq_lengths)


def documents_note(graph: Any, seq_lengths: Any, config: Any, device_kind: str = "gpu") -> str:
    """What ``--seq-lengths`` priced: the data, its packing, the kernel that runs, and on a
    ring what a ring skipping masked pairs would do beside what this runtime's does."""
    from autoplan.sharding.doc_work import packed_work
    work = packed_work(graph, seq_lengths, device_kind)
    lines = [f"\ndata     {seq_lengths.describe()}", f"packing  {work.describe()}"]
    if config.cp > 1:
        ring = work.ring_share(config.cp, config.cp_layout)
        lines.append(f"ring     cp{config.cp} {config.cp_layout}: priced at the balanced "
                     f"{1 / config.cp:.4g} of the square (this runtime's ring computes a masked "
                     "attention's blocks whole); a ring skipping masked pairs would do "
                     f"{ring:.4g} on its slowest rank, "
                     f"{ring * config.cp / work.dense_share():.3g}x the balanced "
                     f"{work.dense_share() / config.cp:.4g} (where document boundaries fall)")
    return "\n".join(lines)


# sizes of an example model the CLI builds: beyond these, building and tracing take minutes to
# hours (10^9 layers hung) or overflow torch's int64 sizes
MAX_LAYERS = 1024          # 8x the deepest published LLMs (GPT-3 96, Llama-3 405B 126 layers)
MAX_TOKENS = 1 << 24       # sequence / position table length: 16,777,216 tokens


def check_model_sizes(args: argparse.Namespace) -> None:
    """``--batch-size``, ``--seq-len``, ``--max-positions`` and ``--layers``: positive and
    within what can be built and traced."""
    from autoplan.estimate.arguments import MAX_GLOBAL_BATCH
    limits = {"batch_size": (MAX_GLOBAL_BATCH, "samples"), "seq_len": (MAX_TOKENS, "tokens"),
              "max_positions": (MAX_TOKENS, "positions"), "layers": (MAX_LAYERS, "layers")}
    for name, (most, unit) in limits.items():
        v = getattr(args, name, None)
        if v is not None and not 1 <= v <= most:
            flag = "--" + name.replace("_", "-")
            raise AutoplanError(f"{flag} {v} is out of range: give 1 to {most:,} {unit}")


def output_arg(path: str | None, flag: str, suffixes: tuple[str, ...] = ()) -> str | None:
    """An output file named on the command line, checked before any work: not empty, not a
    folder, in a folder that exists and takes a new file, with one of ``suffixes`` (when
    given). The check creates and removes the file when it did not exist."""
    import os
    if path is None:
        return None
    if not path.strip():
        raise AutoplanError(f"{flag} got an empty file name")
    if suffixes and not path.lower().endswith(suffixes):
        raise AutoplanError(f"{flag} {path!r}: write a {' or '.join(suffixes)} file")
    if os.path.isdir(path):
        raise AutoplanError(f"{flag} {path!r} is a folder; name a file in it")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise AutoplanError(f"{flag} {path!r}: the folder {folder!r} does not exist; create it "
                            "first")
    try:
        if os.path.exists(path):
            with open(path, "ab"):
                pass
        else:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            os.remove(path)
    except OSError as e:
        raise AutoplanError(f"{flag} {path!r} cannot be written: {e.strerror or e}") from None
    return path


def figure_suffixes() -> tuple[str, ...]:
    """The image formats matplotlib writes (by file extension)."""
    from matplotlib.backend_bases import FigureCanvasBase
    return tuple(f".{ext}" for ext in sorted(FigureCanvasBase.get_supported_filetypes()))


def build_model_arg(args: argparse.Namespace):
    """The Example named by ``args.model`` (built per the shared model arguments)."""
    spec = args.model
    check_model_sizes(args)
    if ":" in spec and not spec.endswith(".json"):
        from autoplan.models import load_user_example
        return load_user_example(spec)
    from autoplan.models import build_example
    from autoplan.models.registry import layer_overrides
    try:
        extra = ({"max_positions": args.max_positions}
                 if getattr(args, "max_positions", None) else {})
        if extra:
            import dataclasses

            from autoplan.models.registry import get_config
            if "max_positions" not in {f.name for f in dataclasses.fields(get_config(spec))}:
                raise AutoplanError(f"{spec!r} has no position table to lengthen: its positions "
                                    "(rotary, computed for the sequence) cover any --seq-len; "
                                    "drop --max-positions")
        return build_example(spec, device=args.device or "meta", batch_size=args.batch_size,
                             seq_len=args.seq_len, **layer_overrides(spec, args.layers), **extra)
    except ValueError as e:
        raise AutoplanError(str(e)) from e


def graph_from_args(args: argparse.Namespace):
    """Trace the MODEL argument (or read an OpGraph JSON file)."""
    from autoplan.graph import OpGraph, trace
    if args.model.endswith(".json"):
        from autoplan import safe_io
        from autoplan.errors import TraceError
        from autoplan.graph.check import GRAPH_LIMITS
        return OpGraph.from_json(safe_io.read_text(args.model, what="OpGraph file",
                                                   error=TraceError, limits=GRAPH_LIMITS))
    ex = packed_for_documents(build_model_arg(args), seq_lengths_arg(args))
    return trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets,
                 name=getattr(ex, "name", args.model))


def packed_for_documents(ex: Any, documents: Any) -> Any:
    """``ex`` as a plan for the data's documents (``--seq-lengths``) traces it: where its
    forward takes position ids (``models/packing.PACKED_FAMILIES``), with its rows packed as
    documents and their position ids as an input (the graph `autoplan run` then trains on
    packed data, ``runtime/packed_data.py``); other models as they are, priced as if a
    document-masking kernel ran (`autoplan run` refuses to run them on packed documents)."""
    from autoplan.models.packing import PACKED_FAMILIES
    from autoplan.runtime.packed_data import packed_documents_example
    if documents is None or getattr(ex, "family", None) not in PACKED_FAMILIES \
            or len(ex.example_inputs) != 1:
        return ex
    return packed_documents_example(ex, documents)


def eprint(*a: Any) -> None:
    print(*a, file=sys.stderr)
