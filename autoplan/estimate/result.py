"""What ``estimate`` returns: step time, memory per device, and their breakdowns."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from autoplan.sharding.parallel_config import ParallelConfig


@dataclass(frozen=True, kw_only=True)
class TimeBreakdown:
    """Seconds per training step on the slowest pipeline stage, by cause.

    ``compute_s`` is forward + backward work, ``recompute_s`` the forward work done again,
    ``comm_exposed_s`` the communication that is not hidden behind compute (by kind: ``tp``,
    ``dp_grad_sync``, ``zero_param_gather``, ``pp_p2p``, ``offload``; ``ep_all_to_all`` with
    expert parallelism, ``cp_ring`` with ring attention), ``bubble_s`` the pipeline
    fill and drain, ``optimizer_s`` the optimizer step, ``overhead_s`` fixed per-step costs.
    """

    compute_s: float
    recompute_s: float
    comm_exposed_s: Mapping[str, float]
    bubble_s: float
    optimizer_s: float
    overhead_s: float

    @property
    def comm_s(self) -> float:
        return sum(self.comm_exposed_s.values())

    @property
    def total_s(self) -> float:
        return (self.compute_s + self.recompute_s + self.comm_s + self.bubble_s
                + self.optimizer_s + self.overhead_s)


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Bytes on one device at its peak."""

    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float       # kept for backward, all micro-batches in flight
    transient_bytes: float         # recompute working set, gathered FSDP weights, buffers
    margin_bytes: float            # workspace reserve (allocator, CUDA context, kernels)
    offloaded_bytes: float = 0.0   # model state and activations held in host memory instead
    nvme_bytes: float = 0.0        # model state held on the node's NVMe (``offload_nvme``)

    @property
    def total_bytes(self) -> float:
        return (self.params_bytes + self.grads_bytes + self.optimizer_bytes
                + self.activations_bytes + self.transient_bytes + self.margin_bytes)


@dataclass(frozen=True, kw_only=True)
class StageEstimate:
    """One pipeline stage (all its TP and DP ranks are alike)."""

    index: int
    layers: tuple[str, ...]          # block instances on this stage (module paths)
    num_ops: int
    params_per_device: float
    fwd_s: float                     # per micro-batch, including TP communication
    bwd_s: float                     # per micro-batch, including recomputation and TP comm
    activation_bytes_per_microbatch: float
    microbatches_in_flight: float
    memory: MemoryBreakdown
    chunks: tuple[tuple[str, ...], ...] = ()   # layers per model chunk (virtual stage) here
    # activation offload: bytes its layers copy to the host per micro-batch (and back); in
    # ``to_dict`` only when offloading
    offloaded_activation_bytes_per_microbatch: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Estimate:
    config: ParallelConfig
    global_batch_size: int
    num_microbatches: int
    step_time_s: float
    time: TimeBreakdown
    peak_memory_bytes: float          # the worst device
    device_memory_bytes: float
    stages: tuple[StageEstimate, ...]
    per_device_memory_bytes: tuple[float, ...]   # index = rank
    model_flops_per_step: float
    mfu: float
    samples_per_s: float
    tokens_per_s: float | None
    activation_bytes_per_layer: float            # one block instance, one micro-batch
    warnings: tuple[str, ...] = field(default_factory=tuple)
    host_memory_per_device_bytes: float = float("inf")   # a device's share of its node's DRAM
    nvme_per_device_bytes: float = 0.0   # a device's share of its node's NVMe (0: none)
    # fp8 configs: per convertible linear, where fp8 pays (``estimate/float8_choice.py``):
    # {"linear", "m", "n", "k", "bf16_s", "fp8_s", "pays"}; written only when there are some
    fp8_linears: tuple[dict[str, Any], ...] = ()
    # with ``config.layer_recompute`` or ``layer_offload``: per layer in model order, its
    # policy, the bytes it keeps on the device per micro-batch, what it saves against keeping
    # everything and its recompute seconds; under ``layer_offload`` also the bytes it sends to
    # the host per micro-batch (``offloaded_bytes``) and their exposed seconds (``offload_s``)
    layer_recompute: tuple[dict[str, Any], ...] = ()

    @property
    def peak_offloaded_bytes(self) -> float:
        return max((s.memory.offloaded_bytes for s in self.stages), default=0.0)

    @property
    def peak_nvme_bytes(self) -> float:
        return max((s.memory.nvme_bytes for s in self.stages), default=0.0)

    @property
    def fits(self) -> bool:
        """Device memory holds the peak, host memory what was offloaded to it, and the node's
        NVMe what was offloaded there."""
        return (self.peak_memory_bytes <= self.device_memory_bytes
                and self.peak_offloaded_bytes <= self.host_memory_per_device_bytes
                and self.peak_nvme_bytes <= self.nvme_per_device_bytes)

    def to_dict(self) -> dict[str, Any]:
        """The fields, the NVMe ones only where the plan puts bytes on NVMe (older plans read
        back byte for byte)."""
        d = asdict(self)
        if not self.peak_nvme_bytes:
            del d["nvme_per_device_bytes"]
        for st in d["stages"]:
            if not st["memory"]["nvme_bytes"]:
                del st["memory"]["nvme_bytes"]
        d["config"] = self.config.to_dict()
        d["fits"] = self.fits
        d["per_device_memory_bytes"] = list(self.per_device_memory_bytes)
        if not self.fp8_linears:
            del d["fp8_linears"]
        else:
            d["fp8_linears"] = [dict(r) for r in self.fp8_linears]
        for st in d["stages"]:
            if not st["offloaded_activation_bytes_per_microbatch"]:
                del st["offloaded_activation_bytes_per_microbatch"]
        if not self.layer_recompute:          # plans without it read back byte for byte
            del d["layer_recompute"]
        else:
            d["layer_recompute"] = [dict(x) for x in self.layer_recompute]
        return d

    def report(self) -> str:
        gib = 1024 ** 3
        t = self.time
        lines = [
            f"config: {self.config.short()}  (global batch {self.global_batch_size}, "
            f"{self.num_microbatches} micro-batches)",
            f"step time {self.step_time_s * 1e3:,.1f} ms   MFU {self.mfu * 100:.1f}%   "
            f"{self.samples_per_s:,.2f} samples/s"
            + (f"   {self.tokens_per_s:,.0f} tokens/s" if self.tokens_per_s else ""),
            f"  compute {t.compute_s * 1e3:,.1f} ms, recompute {t.recompute_s * 1e3:,.1f} ms, "
            f"bubble {t.bubble_s * 1e3:,.1f} ms, optimizer {t.optimizer_s * 1e3:,.1f} ms, "
            f"overhead {t.overhead_s * 1e3:,.1f} ms",
            "  exposed communication: " + (", ".join(
                f"{k} {v * 1e3:,.1f} ms" for k, v in t.comm_exposed_s.items() if v > 0) or "none"),
            f"peak memory {self.peak_memory_bytes / gib:,.2f} GiB of "
            f"{self.device_memory_bytes / gib:,.1f} GiB"
            + ("" if self.fits else "   ** DOES NOT FIT **"),
        ]
        for s in self.stages:
            m = s.memory
            lines.append(
                f"  stage {s.index}: {len(s.layers)} layers, params {m.params_bytes / gib:.2f} "
                f"grads {m.grads_bytes / gib:.2f} optim {m.optimizer_bytes / gib:.2f} "
                f"activations {m.activations_bytes / gib:.2f} "
                f"({s.microbatches_in_flight:g} micro-batches in flight) transient "
                f"{m.transient_bytes / gib:.2f} margin {m.margin_bytes / gib:.2f} "
                f"= {m.total_bytes / gib:.2f} GiB")
            if s.offloaded_activation_bytes_per_microbatch:
                lines.append(f"    activations offloaded to host: "
                             f"{s.offloaded_activation_bytes_per_microbatch / gib:.3f} GiB per "
                             f"micro-batch each way")
            if len(self.stages) > 8 and s.index == 3:
                lines.append(f"  ... {len(self.stages) - 5} more stages ...")
                break
        for w in self.warnings:
            lines.append(f"warning: {w}")
        return "\n".join(lines)
