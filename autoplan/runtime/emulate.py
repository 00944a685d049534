"""One rank of a large plan, run alone on this machine's one device.

``emulate`` joins a process group of the ``fake`` backend (torch's ``FakeStore``): the plan's
whole world exists in name, this process is rank ``R`` of it, and every collective returns at
once and moves nothing (what it "receives" is whatever the buffer held). Everything else is
real: rank ``R``'s program (its tensor-parallel shards, its FSDP units, its pipeline chunks),
materialized from the meta device shard by shard, its forward, backward and optimizer on this
device. So its peak memory and compute time per step are measured, and set beside what the
plan priced for that rank, the communication left out (Megatron-LM's
``--fake-init-process-group`` is the same idea). The numbers are garbage; the times and bytes
are not.

On a pipeline, torch's stages first agree over point-to-point messages whether their declared
shapes stand (the warm-up vote); a fake group cannot carry the vote, so the emulated stages
take theirs as declared (they always are: ``build.py``).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from autoplan.errors import PlanError, ClusterError
from autoplan.sharding.mesh_axes import MeshAxis
from autoplan.runtime.optim import local_tensor
from autoplan.runtime.trainer import compile
from autoplan.runtime.meta_init import values_unneeded
from autoplan.cluster import Cluster
from autoplan.cost.memory import autocast_copy_bytes
from autoplan.estimate.arguments import cluster_arg


@dataclass(frozen=True)
class RankPrediction:
    """What the plan priced for one rank, communication left out."""

    stage: int
    compute_s: float              # forward, backward, recomputation, optimizer: one step
    peak_memory_bytes: float
    weight_bytes: float           # the weights the rank holds between steps (its shards)
    what: str
    copy_bytes: float = 0.0       # autocast's 16-bit weight copies the plan's weights count                     # how ``compute_s`` was read off the plan


@dataclass(frozen=True)
class Emulation:
    plan_config: str
    rank: int
    world_size: int
    device: str
    step_s: tuple[float, ...]     # measured, every step after the first
    # CUDA: the allocator's peak over the timed steps; CPU: live tensors' bytes over one step
    peak_memory_bytes: float | None
    weight_bytes: int             # the weights this rank holds (its shards), between steps
    predicted: RankPrediction

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_s)

    def report(self) -> str:
        p = self.predicted
        lines = [f"rank {self.rank} of {self.world_size} ({self.plan_config}), pipeline stage "
                 f"{p.stage}, alone on {self.device}; collectives move nothing",
                 f"  compute per step  measured {self.median_step_s * 1e3:10.1f} ms (median of "
                 f"{len(self.step_s)})   predicted {p.compute_s * 1e3:10.1f} ms   ratio "
                 f"{self.median_step_s / p.compute_s:.2f}" if p.compute_s > 0 else "",
                 f"    (predicted: {p.what})"]
        if self.peak_memory_bytes is not None:
            lines.append(f"  peak memory       measured {_size(self.peak_memory_bytes)}   "
                         f"predicted {_size(p.peak_memory_bytes)}   ratio "
                         f"{self.peak_memory_bytes / p.peak_memory_bytes:.2f}")
        else:
            lines.append("  peak memory       not measured")
        lines.append(f"  weights held      measured {_size(self.weight_bytes)}   "
                     f"predicted {_size(self.predicted.weight_bytes)}   between steps"
                     + (f" (the plan's weights also count {_size(p.copy_bytes).strip()} of "
                        "autocast's 16-bit copies, in the peak)" if p.copy_bytes else ""))
        return "\n".join(x for x in lines if x)


def _size(nbytes: float) -> str:
    return (f"{nbytes / 2**30:10.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:10.2f} MiB")


def predicted_for_rank(plan: Any, rank: int) -> RankPrediction:
    """Rank ``rank``'s share of the plan's prediction: without pipelines the step's compute,
    recomputation and optimizer (communication is priced apart); with them, its stage's
    micro-batches (forward and backward, tensor-parallel communication included as the plan
    prices it per stage) and the optimizer. Memory: its stage's peak."""
    cfg = plan.config
    pred = plan.predicted
    stage = cfg.dims.index(rank, MeshAxis.PP)
    st = pred["stages"][stage] if cfg.pp > 1 else pred["stages"][0]
    mem = st["memory"]
    peak = sum(float(v) for k, v in mem.items() if k != "offloaded_bytes")
    t = pred["time"]
    if cfg.pp == 1:
        compute = float(t["compute_s"]) + float(t["recompute_s"]) + float(t["optimizer_s"])
        what = "compute + recomputation + optimizer of the step"
    else:
        m = int(pred["num_microbatches"])
        if cfg.dp_shares is not None:      # this rank's replica's own count
            m = cfg.dp_shares[cfg.dims.index(rank, MeshAxis.DP)]
        compute = m * (float(st["fwd_s"]) + float(st["bwd_s"])) + float(t["optimizer_s"])
        what = (f"{m} micro-batches x this stage's forward + backward (its tensor-parallel "
                "communication inside, as priced) + optimizer")
    # the plan's weights include autocast's 16-bit copies, made by each step's forward and
    # kept to its backward (in the peak): the rank holds the fp32 weights alone between steps
    copies = autocast_copy_bytes(float(st["params_per_device"]), precision=cfg.precision,
                                 mixed_precision=cfg.mixed_precision,
                                 zero_stage=cfg.zero_stage, offload_params=cfg.offload_params)
    return RankPrediction(stage=stage, compute_s=compute, peak_memory_bytes=peak,
                          weight_bytes=float(mem["params_bytes"]) - copies, what=what,
                          copy_bytes=copies)


def _pipeline_as_declared(trainer: Any) -> None:
    """Pipeline stages take their declared shapes (the fake group cannot carry torch's warm-up
    vote over them: see the module docstring), and what a stage "receives" is zeroed before it
    runs: a fake receive leaves the buffer as allocated, and an uninitialized token id or
    target is out of range (denormal floats would slow a CPU down)."""
    schedule = getattr(trainer.runner, "schedule", None)
    if schedule is None:
        return
    for index, chunk in trainer.runner.chunks.items():
        if index > 0:
            chunk.register_forward_pre_hook(_zero_received)
    try:
        from torch.distributed.pipelining.stage import InferenceMode
    except ImportError:          # torch before the vote: declared shapes are used as they are
        return

    def static(stages: Any, has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC
    schedule._warmup_p2p = static


class LiveBytes:
    """Peak bytes of the tensors alive on the CPU while a step runs (CUDA has its allocator's
    own counters): the storages already alive when it starts (``alive``: weights, gradients,
    optimizer state), and every storage an op makes under it, each counted until freed."""

    def __init__(self, alive: Sequence[torch.Tensor]):
        from torch.utils._python_dispatch import TorchDispatchMode
        self.now = self.peak = 0
        self._seen: set[int] = set()
        for t in alive:
            self._add(t)
        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in torch.utils._pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        tracker._add(t)
                return out
        self.mode = Mode()

    def _add(self, t: torch.Tensor) -> None:
        import weakref
        if getattr(t, "is_meta", True) or t.device.type != "cpu":
            return
        try:
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):    # no storage of its own (a subclass, a
            return                                     # storage FSDP2 freed by resizing)
        if not nbytes or key in self._seen:
            return
        self._seen.add(key)
        self.now += nbytes
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._free, key, nbytes)

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.now -= nbytes


def _alive(trainer: Any) -> list[torch.Tensor]:
    """The tensors a rank holds between steps: its weights (local shards), their gradients and
    the optimizer's state."""
    out: list[torch.Tensor] = []
    for p in trainer.model.parameters():
        out.append(_local(p))
        if p.grad is not None:
            out.append(_local(p.grad))
    out += list(trainer.model.buffers())
    state = getattr(trainer.optimizer, "state", {})
    for per_param in (state.values() if hasattr(state, "values") else ()):
        out += [_local(v) for v in per_param.values() if isinstance(v, torch.Tensor)]
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return local_tensor(t)


def _zero_received(module: Any, args: tuple) -> None:
    with torch.no_grad():
        for a in args:
            if isinstance(a, torch.Tensor):
                a.zero_()


def _ddp_moves_nothing(trainer: Any) -> None:
    """DDP's buckets reduced by a hook that moves nothing: torch's fake process group answers
    an all-reduce with an empty future, which DDP's reducer refuses (torch 2.13); the
    communication is left out as priced anyway."""
    runner = trainer.runner
    found = [getattr(runner, "module", None), *getattr(runner, "chunks", {}).values()]
    for m in found:
        if isinstance(m, torch.nn.parallel.DistributedDataParallel):
            m.register_comm_hook(None, _kept_as_is)


def _kept_as_is(_state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


# DDP checks the hook's annotations as objects (this module's are strings: __future__)
_kept_as_is.__annotations__ = {"_state": object, "bucket": dist.GradBucket,
                               "return": torch.futures.Future[torch.Tensor]}


def emulate(plan: Any, model: torch.nn.Module, *, example_inputs: Sequence[Any],
            example_targets: Any, loss_fn: Any, rank: int = 0, steps: int = 3,
            cluster: Any = None) -> Emulation:
    """Run rank ``rank`` of ``plan`` alone for ``steps`` steps (the first, which allocates and
    warms up, is not timed) on this machine's GPU (a GPU plan where CUDA is present), else its
    CPU; ``model`` is best built on the
    meta device (only this rank's shards are allocated). ``cluster``: the plan's cluster spec
    where it came from a file (a preset's is rebuilt from the plan)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    cfg = plan.config
    world = cfg.world_size
    if not (isinstance(rank, int) and 0 <= rank < world):
        raise PlanError(f"--rank {rank!r}: the plan has ranks 0 to {world - 1}")
    if not (isinstance(steps, int) and steps >= 2):
        raise PlanError(f"--steps {steps!r}: emulate needs at least 2 steps (the first is not "
                        "timed)")
    if dist.is_initialized():
        raise PlanError("emulate() starts its own fake process group; call it in a process "
                        "without one")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    # what a fake collective "receives" is whatever its buffer held, denormal floats among it,
    # which a CPU computes on tens of times slower than on normal ones (a GPU does not care)
    flushing = torch.set_flush_denormal(True)
    try:
        # the plan's hardware is not this machine's: its prediction is what is compared
        with values_unneeded():       # (a buffer built in __init__ is zero-filled on meta)
            trainer = compile(model, plan_cluster(plan, cluster), example_inputs=example_inputs,
                              example_targets=example_targets, loss_fn=loss_fn,
                              optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4),
                              global_batch_size=plan.training.global_batch_size, plan=plan,
                              allow_cluster_mismatch=True)
        _pipeline_as_declared(trainer)
        _ddp_moves_nothing(trainer)
        use_cuda = trainer.device.type == "cuda"      # a GPU plan where CUDA is present
        batch = [_filled(x, plan.training.global_batch_size) for x in
                 list(example_inputs) + ([example_targets] if example_targets is not None
                                         else [])]
        if use_cuda:
            torch.cuda.reset_peak_memory_stats()
        times = []
        for k in range(steps):
            t0 = time.perf_counter()
            trainer.step(batch)
            if use_cuda:
                torch.cuda.synchronize()
            if k:
                times.append(time.perf_counter() - t0)
        weights = sum(_local(p).numel() * p.element_size() for p in
                      {id(p): p for p in trainer.model.parameters()}.values())
        if use_cuda:
            peak = float(torch.cuda.max_memory_allocated())
        else:                     # one more step, its bytes counted (not timed: the counting
            live = LiveBytes(_alive(trainer))             # slows every op down)
            with live.mode:
                trainer.step(batch)
            peak = float(live.peak)
    finally:
        if flushing:
            torch.set_flush_denormal(False)
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    return Emulation(plan_config=cfg.short(), rank=rank, world_size=world,
                     device=torch.cuda.get_device_name() if use_cuda else "cpu",
                     step_s=tuple(times), peak_memory_bytes=peak, weight_bytes=weights,
                     predicted=predicted_for_rank(plan, rank))


def plan_cluster(plan: Any, spec: Any = None) -> Any:
    """The cluster ``compile`` checks the plan against: ``spec`` (what the plan was made for,
    when it came from a file), else the plan's preset rebuilt at its node count, else this
    machine with the plan's world (the plan then runs with its prediction marked stale, which
    is what is compared anyway)."""
    if spec is not None:
        return cluster_arg(spec, "emulate()")
    try:
        return Cluster.preset(plan.cluster.name, nodes=plan.cluster.num_nodes)
    except ClusterError:
        return Cluster.local(plan.config.world_size)


def _filled(example: Any, rows: int) -> Any:
    """A global batch shaped like ``example`` (``rows`` samples) of zeros, on the CPU: valid
    token ids and class indices, and numbers do not matter to the times and bytes."""
    if not isinstance(example, torch.Tensor):
        return example
    return torch.zeros((rows,) + tuple(example.shape[1:]), dtype=example.dtype)
