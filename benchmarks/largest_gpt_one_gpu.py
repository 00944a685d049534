"""The largest GPT one 80 GB GPU with 1 TB of host memory can train (issue 39), planned.

The GPT family of Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM" (SC'21, https://arxiv.org/abs/2104.04473), Table 1: ten shapes from
1.7B to 1T parameters (hidden size, heads, layers as listed there; sequence 2048, vocabulary
51,200), built as autoplan's own GPT (``gpt3-175b`` example resized) on the meta device.

Clusters (``Cluster.from_dict`` over the ``dgx-h100/1`` preset: one H100 SXM 80 GB with the
whole node's PCIe uplink and CPU-Adam share, ``cluster/node_part.py``):

- ``h100+1tb``: host memory overridden to 1 TiB, no NVMe;
- ``h100+1tb+nvme``: the same with eight striped NVMe drives as the DGX A100 80GB preset
  describes them (``cost_models/clusters.yaml``: 8 x 3.84 TB, 51.2 GB/s read, 30.4 GB/s write).

For each cluster, the shapes are planned in order (bf16, AdamW, global batch 8, roofline
prices; the default search, then with lossy options allowed: bf16/8-bit Adam states) until none
fits; the largest that fits is printed with its configuration, where its bytes live (device,
host, NVMe) and its step time. ``tests/test_one_gpu_gpt.py`` runs that configuration on a
shrunk GPT of the same family on a CPU rank, against one device.

    python benchmarks/largest_gpt_one_gpu.py

Output committed as ``benchmarks/data/largest_gpt_one_gpu.txt``.
"""

from __future__ import annotations

import time
import warnings

import autoplan
from autoplan import Cluster
from autoplan.errors import AutoplanError
from autoplan.models.registry import build_example
from autoplan.planner.search import plan

_GIB = 2.0 ** 30
SEQ, VOCAB, GLOBAL_BATCH = 2048, 51200, 8

# Narayanan et al. 2021, Table 1: (name, heads, hidden size, layers)
SHAPES = [("1.7B", 24, 2304, 24), ("3.6B", 32, 3072, 30), ("7.5B", 32, 4096, 36),
          ("18B", 48, 6144, 40), ("39B", 64, 8192, 48), ("76B", 80, 10240, 60),
          ("145B", 96, 12288, 80), ("310B", 128, 16384, 96), ("530B", 128, 20480, 105),
          ("1T", 160, 25600, 128)]

# the DGX A100 80GB preset's NVMe (cost_models/clusters.yaml cites the drives)
_NVME = dict(nvme_bytes=30_720_000_000_000, nvme_read_bytes_per_s=51.2e9,
             nvme_write_bytes_per_s=30.4e9)


def clusters() -> dict[str, Cluster]:
    host = {"memory_bytes": 1 << 40}
    return {
        "h100+1tb": Cluster.from_dict({"preset": "dgx-h100/1", "name": "h100+1tb", "host": host}),
        "h100+1tb+nvme": Cluster.from_dict({"preset": "dgx-h100/1", "name": "h100+1tb+nvme",
                                            "host": {**host, **_NVME}}),
    }


def gpt_graph(heads: int, hidden: int, layers: int):
    ex = build_example("gpt3-175b", device="meta", batch_size=1, seq_len=SEQ,
                       num_layers=layers, hidden_size=hidden, num_heads=heads,
                       vocab_size=VOCAB, max_positions=SEQ, dropout=0.0)
    return autoplan.trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)


def where_bytes(p) -> str:
    """Device, host and NVMe bytes of the plan's first stage (the only one at pp 1)."""
    m = p.predicted["stages"][0]["memory"]
    dev = {k: m.get(k, 0.0) for k in ("params_bytes", "grads_bytes", "optimizer_bytes",
                                       "activations_bytes", "transient_bytes", "margin_bytes")}
    parts = ", ".join(f"{k[:-6]} {v / _GIB:.1f}" for k, v in dev.items())
    return (f"device {p.predicted['peak_memory_bytes'] / _GIB:.1f} GiB ({parts}); host "
            f"{m.get('offloaded_bytes', 0.0) / _GIB:,.0f} GiB; NVMe "
            f"{m.get('nvme_bytes', 0.0) / _GIB:,.0f} GiB")


def sweep(cluster: Cluster, lossy: bool) -> None:
    best = None
    for name, heads, hidden, layers in SHAPES:
        t0 = time.perf_counter()
        graph = gpt_graph(heads, hidden, layers)
        params = graph.num_params
        try:
            p = plan(graph, cluster, global_batch_size=GLOBAL_BATCH, precision="bf16",
                     profile=None, top_k=0, allow_lossy=lossy)
        except AutoplanError as e:
            print(f"  {name:5s} ({params / 1e9:6.1f}e9) no plan: {' '.join(str(e).split())[:150]}  "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
            break
        pr = p.predicted
        print(f"  {name:5s} ({params / 1e9:6.1f}e9) {p.config.short():80s} step {pr['step_time_s']:9.1f} s  "
              f"peak {pr['peak_memory_bytes'] / _GIB:5.1f} GiB  host "
              f"{pr['stages'][0]['memory'].get('offloaded_bytes', 0) / _GIB:6.0f} GiB  "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        best = (name, p, params)
    if best is not None:
        name, p, _ = best
        print(f"  largest that fits: {name}: {p.config.short()}")
        print(f"    {where_bytes(p)}")
        print(f"    step {p.predicted['step_time_s']:.1f} s for {GLOBAL_BATCH} x {SEQ} tokens, "
              f"MFU {p.predicted['mfu'] * 100:.1f} %")
        fields = {k: v for k, v in p.config.to_dict().items() if k != "layer_recompute"}
        print(f"    config {fields}")
        if p.config.layer_recompute is not None:
            print(f"    layer_recompute {list(p.config.layer_recompute)}")


def main() -> None:
    warnings.simplefilter("ignore")
    for label, cluster in clusters().items():
        for lossy in (False, True):
            print(f"== {label} ({cluster.device.name}, host "
                  f"{cluster.host.memory_bytes / _GIB:,.0f} GiB, NVMe "
                  f"{cluster.host.nvme_bytes / 1e12:.1f} TB), global batch {GLOBAL_BATCH}, "
                  f"sequence {SEQ}, bf16, {'allow_lossy=True' if lossy else 'default search'}",
                  flush=True)
            sweep(cluster, lossy)


if __name__ == "__main__":
    main()
