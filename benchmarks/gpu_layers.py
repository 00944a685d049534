"""One rank's transformer layer of each H100 validation row: measured on a CUDA GPU, and priced
by autoplan's compute model for the same shapes.

    python benchmarks/gpu_layers.py --measure out.json   # on a CUDA GPU (about a minute)
    python benchmarks/gpu_layers.py benchmarks/data/h100-sxm5-layers.json   # anywhere: compare

Issue 14 asks where the H100 rows of ``benchmarks/validate.py`` lose the 10-14 % that the
model predicts too fast. This measures the compute of one pipeline-stage layer as one rank of
each row runs it (Megatron-LM's tensor + sequence parallel split of a GPT layer, bf16, no
communication): the layer norms and residual adds on the rank's 1/t of the tokens, the four
GEMMs on all tokens with a 1/t slice of the weights, causal flash attention (torch's SDPA) over
the rank's heads, GELU; and the output layer with its fp32 cross entropy over a 1/t slice of the
vocabulary. Each part is timed alone (forward, and forward + backward) and the whole layer in
one piece, with CUDA events, the median of ``--repeats`` after warm-up. The same modules traced
on the meta device and priced op by op by ``autoplan.cost.compute`` (the H100's roofline from
cost_models/devices.yaml, as the validation prices them) give the predicted column.

The measured file records the device, torch and CUDA versions and the command; commit it under
benchmarks/data/ with the date.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

SEQ = 4096
VOCAB = 131072
HEAD_DIM = 128

# (row label, hidden, heads, tp, micro-batch) as validate.py prices the H100 rows (its
# "autoplan's configuration" column): one case per distinct per-rank layer
CASES = [("1.7B", 2048, 16, 1, 4), ("7.1B", 4096, 32, 2, 4), ("16B", 6144, 48, 4, 4),
         ("32B", 7168, 56, 8, 4), ("70B", 8192, 64, 8, 4), ("119B", 10240, 80, 8, 1),
         ("177B", 12288, 96, 8, 1), ("177B mbs2", 12288, 96, 8, 2), ("314B", 16384, 128, 8, 1),
         ("462B", 18432, 144, 8, 1)]
PARTS = ("norm", "qkv", "attention", "proj", "add", "fc1", "gelu", "fc2", "layer", "head")


class Attention(nn.Module):
    """Causal SDPA over [batch, seq, heads * 128] q, k, v (the layer's view of them)."""

    def __init__(self, heads: int):
        super().__init__()
        self.heads = heads

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, s, _ = q.shape

        def split(x: torch.Tensor) -> torch.Tensor:
            return x.view(b, s, self.heads, HEAD_DIM).transpose(1, 2)
        out = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
        return out.transpose(1, 2).reshape(b, s, self.heads * HEAD_DIM)


class RankLayer(nn.Module):
    """One rank's share of a GPT layer under tensor + sequence parallelism of degree ``tp``:
    norms and residuals on seq/tp tokens, GEMMs on all of them (the all-gathers and
    reduce-scatters left out: one GPU measures compute only; a repeat stands in for the
    gather's output and a slice for the scatter's, as cheap as the copies those make)."""

    def __init__(self, hidden: int, heads: int, tp: int):
        super().__init__()
        self.tp = tp
        width = heads // tp * HEAD_DIM
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * width)
        self.attention = Attention(heads // tp)
        self.proj = nn.Linear(width, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden // tp)
        self.fc2 = nn.Linear(4 * hidden // tp, hidden)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x.repeat(1, self.tp, 1) if self.tp > 1 else x

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, : x.shape[1] // self.tp] if self.tp > 1 else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.gather(self.norm1(x))).chunk(3, dim=-1)
        x = x + self.scatter(self.proj(self.attention(q, k, v)))
        h = F.gelu(self.fc1(self.gather(self.norm2(x))))
        return x + self.scatter(self.fc2(h))


class Head(nn.Module):
    """The output layer's share of a rank: logits over vocab/tp, fp32 cross entropy."""

    def __init__(self, hidden: int, tp: int):
        super().__init__()
        self.out = nn.Linear(hidden, VOCAB // tp, bias=False)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self.out(x).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), target.view(-1))


class Unary(nn.Module):
    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


class Add(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y


class WithInputs(nn.Module):
    """``module`` called on ``inputs`` held as parameters (floats) and buffers (indices)."""

    def __init__(self, module: nn.Module, inputs: Sequence[torch.Tensor]):
        super().__init__()
        self.part = module
        self.names = []
        for i, x in enumerate(inputs):
            name = f"input{i}"
            if x.is_floating_point():
                self.register_parameter(name, nn.Parameter(x))
            else:
                self.register_buffer(name, x)
            self.names.append(name)

    def forward(self, unused: torch.Tensor) -> torch.Tensor:
        return self.part(*(getattr(self, n) for n in self.names))


def parts(hidden: int, heads: int, tp: int, mbs: int, device: str
          ) -> dict[str, tuple[nn.Module, tuple[torch.Tensor, ...]]]:
    """Each part of one case: (module, inputs), fp32 modules and tensors on ``device``."""
    width = heads // tp * HEAD_DIM
    ffn = 4 * hidden // tp

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device)
    with torch.device(device):
        return _parts(hidden, heads, tp, mbs, width, ffn, t)


def _parts(hidden, heads, tp, mbs, width, ffn, t):
    layer = RankLayer(hidden, heads, tp)
    return {
        "norm": (nn.LayerNorm(hidden), (t(mbs, SEQ // tp, hidden),)),
        "qkv": (nn.Linear(hidden, 3 * width), (t(mbs, SEQ, hidden),)),
        "attention": (Attention(heads // tp), tuple(t(mbs, SEQ, width) for _ in range(3))),
        "proj": (nn.Linear(width, hidden), (t(mbs, SEQ, width),)),
        "add": (Add(), (t(mbs, SEQ // tp, hidden), t(mbs, SEQ // tp, hidden))),
        "fc1": (nn.Linear(hidden, ffn), (t(mbs, SEQ, hidden),)),
        "gelu": (Unary(F.gelu), (t(mbs, SEQ, ffn),)),
        "fc2": (nn.Linear(ffn, hidden), (t(mbs, SEQ, ffn),)),
        "layer": (layer, (t(mbs, SEQ // tp, hidden),)),
        "head": (Head(hidden, tp), (t(mbs, SEQ, hidden),
                                    torch.randint(0, VOCAB // tp, (mbs, SEQ)))),
    }


# ---- measuring on CUDA ------------------------------------------------------------------------

def _time_s(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return statistics.median(samples)


def measure_case(hidden: int, heads: int, tp: int, mbs: int, *, warmup: int, repeats: int
                 ) -> dict[str, dict[str, float]]:
    """{part: {"fwd_s", "fwd_bwd_s"}} of one case, bf16 weights and activations as Megatron
    trains (fp32 master weights live in its optimizer, not in the layer)."""
    out = {}
    for name, (module, inputs) in parts(hidden, heads, tp, mbs, "cuda").items():
        out[name] = _time_part(module, inputs, warmup=warmup, repeats=repeats)
        del module, inputs
        torch.cuda.empty_cache()
    return out


def _time_part(module: nn.Module, inputs: Sequence[torch.Tensor], *, warmup: int, repeats: int
               ) -> dict[str, float]:
    module = module.to(torch.bfloat16)
    xs = [x.to(torch.bfloat16).requires_grad_(True) if x.is_floating_point() else x
          for x in inputs]
    with torch.no_grad():
        fwd = _time_s(lambda: module(*xs), warmup, repeats)
    grad = torch.randn_like(module(*xs))

    def fwd_bwd() -> None:
        for p in module.parameters():
            p.grad = None
        for x in xs:
            if x.is_floating_point():
                x.grad = None
        module(*xs).backward(grad)
    return {"fwd_s": fwd, "fwd_bwd_s": _time_s(fwd_bwd, warmup, repeats)}


def measure(path: str, *, warmup: int, repeats: int) -> None:
    if not torch.cuda.is_available():
        sys.exit("--measure needs a CUDA GPU; without one, compare a measured file: "
                 "python benchmarks/gpu_layers.py benchmarks/data/h100-sxm5-layers.json")
    torch.manual_seed(0)
    data = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(),
            "command": "python " + " ".join(sys.argv), "seq": SEQ, "vocab": VOCAB,
            "warmup": warmup, "repeats": repeats, "cases": {}}
    for label, hidden, heads, tp, mbs in CASES:
        data["cases"][label] = measure_case(hidden, heads, tp, mbs, warmup=warmup,
                                            repeats=repeats)
        layer = data["cases"][label]["layer"]
        print(f"{label:10s} layer fwd {layer['fwd_s'] * 1e3:7.2f} ms  fwd+bwd "
              f"{layer['fwd_bwd_s'] * 1e3:7.2f} ms", flush=True)
        Path(path).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


# ---- pricing with autoplan's compute model ----------------------------------------------------

def predict_case(hidden: int, heads: int, tp: int, mbs: int, device_name: str = "H100-SXM5-80GB"
                 ) -> dict[str, dict[str, float]]:
    """{part: {"fwd_s", "fwd_bwd_s"}}: each part traced on meta and priced op by op by
    autoplan's compute model for ``device_name`` in bf16 (the roofline the validation uses)."""
    from autoplan.cluster import specs
    from autoplan.cost.compute import ComputeModel
    from autoplan.graph import trace

    device = specs.load_device(device_name)
    out = {}
    for name, (module, inputs) in parts(hidden, heads, tp, mbs, "meta").items():
        # the float inputs as parameters: they need a gradient, as inside a layer, so every
        # op's backward is priced (a traced graph's inputs are data, with no gradient)
        graph = trace(WithInputs(module, inputs), (torch.zeros(1, device="meta"),))
        # measured with bf16 weights and activations (no autocast), as Megatron-LM trains
        model = ComputeModel(graph, device, "bf16", mixed_precision="params")
        fwd = bwd = 0.0
        for i, op in enumerate(graph.ops):
            c = model.op_cost(i)
            fwd += c.fwd_s
            bwd += c.bwd_s
        out[name] = {"fwd_s": fwd, "fwd_bwd_s": fwd + bwd}
    return out


def layer_flops(hidden: int, heads: int, tp: int, mbs: int) -> float:
    """Model FLOPs of one rank's layer forward + backward (Megatron's count: 24 T h^2 (1 +
    s / 6h) per layer over t ranks, causal attention counted whole)."""
    tokens = mbs * SEQ
    return 3 * 24 * tokens * hidden ** 2 * (1 + SEQ / (6 * hidden)) / tp


def compare(path: str) -> list[str]:
    data = json.loads(Path(path).read_text())
    lines = [f"measured on {data['device']} (torch {data['torch']}, CUDA {data['cuda']}): "
             f"{path}", "",
             "| row | part | measured fwd ms | predicted fwd ms | measured fwd+bwd ms | "
             "predicted fwd+bwd ms | predicted / measured |", "|---|---|---|---|---|---|---|"]
    totals = []
    for label, hidden, heads, tp, mbs in CASES:
        measured = data["cases"].get(label)
        if measured is None:
            continue
        predicted = predict_case(hidden, heads, tp, mbs)
        for part in PARTS:
            m, p = measured[part], predicted[part]
            lines.append(f"| {label} | {part} | {m['fwd_s'] * 1e3:.3f} | {p['fwd_s'] * 1e3:.3f} | "
                         f"{m['fwd_bwd_s'] * 1e3:.3f} | {p['fwd_bwd_s'] * 1e3:.3f} | "
                         f"{p['fwd_bwd_s'] / m['fwd_bwd_s']:.2f} |")
        flops = layer_flops(hidden, heads, tp, mbs)
        totals.append((label, measured["layer"]["fwd_bwd_s"], predicted["layer"]["fwd_bwd_s"],
                       flops))
    lines += ["", "| row | layer fwd+bwd measured ms | predicted ms | predicted / measured | "
              "measured model TFLOP/s | MFU of the layer |", "|---|---|---|---|---|---|"]
    for label, m, p, flops in totals:
        lines.append(f"| {label} | {m * 1e3:.2f} | {p * 1e3:.2f} | {p / m:.3f} | "
                     f"{flops / m / 1e12:.0f} | {flops / m / 989.4e12 * 100:.0f} % |")
    return lines


def published_vs_measured(data: dict, labels: Sequence[str] | None = None) -> list[str]:
    """Each H100 row of benchmarks/validate.py: its published step against the compute its
    busiest rank would do at the measured rates (no communication, no overheads): the last
    pipeline rank's layers and the output layer, for m micro-batches plus interleaved 1F1B's
    fill and drain ((p - 1) / v micro-batches), at the micro-batch size and virtual stages
    autoplan priced the row with (``labels``: only these rows)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import validate
    lines = ["| row | configuration | measured compute s | published s | published / measured |"
             " predicted / published |", "|---|---|---|---|---|---|"]
    graphs: dict = {}
    for row in validate.rows():
        if row.preset != "dgx-h100" or labels is not None and row.label not in labels:
            continue
        result = validate.predict(row, graphs)
        mbs, v = result.micro_batch_size, result.virtual_stages
        case = next((c for c in CASES if c[1] == row.hidden and c[4] == mbs), None)
        if case is None or case[0] not in data["cases"]:
            continue
        parts = data["cases"][case[0]]
        per = (row.layers / row.pp * parts["layer"]["fwd_bwd_s"] + parts["head"]["fwd_bwd_s"])
        m = row.global_batch // (row.dp * mbs)
        measured = (m + (row.pp - 1) / v) * per
        lines.append(f"| {row.label} | {result.config} | {measured:.3f} | "
                     f"{row.published_s:.3f} | {row.published_s / measured:.2f} | "
                     f"{result.predicted_s / row.published_s:.2f} |")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("measured", nargs="?", help="a measured file to compare with the model")
    ap.add_argument("--measure", metavar="OUT", help="measure on this CUDA GPU into OUT")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)
    if args.measure:
        measure(args.measure, warmup=args.warmup, repeats=args.repeats)
        return 0
    if not args.measured:
        ap.error("give a measured file to compare, or --measure OUT on a CUDA GPU")
    print("\n".join(compare(args.measured)))
    print("\n" + "\n".join(published_vs_measured(json.loads(Path(args.measured).read_text()))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
