"""The rules the newer memory and precision fields of a ParallelConfig obey, alone and together
(per-layer recomputation and activation offload, fp8, NVMe offload, gradient compression):
each a function of the config, called by ``ParallelConfig.__post_init__``. Each raises a
ConfigError that says what is wrong and what to do."""

from __future__ import annotations

from typing import Any

from autoplan.errors import ConfigError
from autoplan.sharding.config_values import FP8_RECIPES, RECOMPUTE, one_of, strongest_recompute


def check_layer_recompute(c: Any) -> None:
    if c.layer_recompute is None:
        return
    if c.stage_recompute is not None:
        raise ConfigError("layer_recompute (one policy per layer) and stage_recompute (one "
                          "per stage) are exclusive; give one of them")
    if not c.layer_recompute:
        raise ConfigError("layer_recompute must name one policy per layer, got []")
    check_policies(c, "layer_recompute", "layer")


def check_fp8(c: Any) -> None:
    one_of("fp8", c.fp8, FP8_RECIPES)
    v = c.fp8_skip
    if isinstance(v, str) or not hasattr(v, "__iter__") or not all(
            isinstance(x, str) and x for x in v):
        raise ConfigError(f"fp8_skip must be a list of module paths or patterns, got {v!r}")
    object.__setattr__(c, "fp8_skip", tuple(sorted(set(v))))
    if c.fp8 != "none" and (c.precision != "bf16"
                               or c.mixed_precision != "autocast"):
        raise ConfigError(f"fp8={c.fp8!r} runs its linear layers in fp8 inside bf16 "
                          f"autocast (torchao's float8 training): it needs precision='bf16' "
                          f"and mixed_precision='autocast', got precision="
                          f"{c.precision!r}, mixed_precision={c.mixed_precision!r}")
    if c.fp8 != "none" and not c.compiled:
        raise ConfigError(f"fp8={c.fp8!r} needs compiled=True: torchao's float8 training is "
                          f"fast only under torch.compile, which fuses its casts and amax "
                          f"reductions (run eagerly on an H200, an fp8 plan of HF Llama 0.89B "
                          f"was 1.88x slower than bf16 and held 12.8 GiB more); use --force "
                          f"compiled=true (compiled=True), or drop fp8")
    if c.fp8_skip and c.fp8 == "none":
        raise ConfigError("fp8_skip names linear layers kept in 16 bits under fp8; with "
                          "fp8='none' there are none to skip: drop fp8_skip or set fp8")


def check_offload_activations(c: Any) -> None:
    k = c.offload_activations
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ConfigError(f"offload_activations must be a layer count >= 0 (the first layers "
                          f"of every model chunk whose activations go to host memory), "
                          f"got {k!r}")
    if k and c.compiled:
        raise ConfigError("offload_activations does not run with compiled=True yet: its "
                          "saved-tensor hooks would sit inside each layer's compiled "
                          "region; drop one of the two")
    policies = c.stage_recompute or c.layer_recompute or (c.recompute,)
    if k and "selective" in policies:
        raise ConfigError("offload_activations runs with recompute 'none' or 'full', not "
                          "'selective': selective checkpointing keeps its saved tensors in "
                          "torch's caching dispatch mode, out of reach of the "
                          "saved-tensor hooks that offload; use recompute='full' (its "
                          "checkpoint input is offloaded) or 'none'")


def check_layer_offload(c: Any) -> None:
    v = c.layer_offload
    if v is None:
        return
    if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__") or not all(
            isinstance(x, bool) for x in v) or not v:
        raise ConfigError(f"layer_offload must list true/false per layer (model order) or "
                          f"be None, got {v!r}")
    object.__setattr__(c, "layer_offload", tuple(v))
    if c.offload_activations:
        raise ConfigError(f"layer_offload (a flag per layer) and offload_activations="
                          f"{c.offload_activations} (the first layers of every chunk) "
                          f"are exclusive; give one of them")
    if any(v) and c.compiled:
        raise ConfigError("layer_offload does not run with compiled=True yet: its "
                          "saved-tensor hooks would sit inside each layer's compiled "
                          "region; drop one of the two")
    # under stage_recompute, a layer's policy depends on its stage: any selective one
    # counts for every layer
    worst = ("selective" if "selective" in (c.stage_recompute or ())
             else c.recompute)
    policies = c.layer_recompute or (worst,) * len(v)
    if len(policies) != len(v):
        raise ConfigError(f"layer_offload has {len(v)} flags, layer_recompute "
                          f"{len(policies)} policies: give one of each per layer")
    bad = [i for i, (off, pol) in enumerate(zip(v, policies)) if off and pol == "selective"]
    if bad:
        raise ConfigError(f"layers {bad} offload and recompute selectively: selective "
                          f"checkpointing keeps its saved tensors in torch's caching "
                          f"dispatch mode, out of reach of the saved-tensor hooks that "
                          f"offload; give them recompute 'none', 'ops' or 'full', or no "
                          f"offload")


def check_offload_nvme(c: Any) -> None:
    if c.offload_nvme and not (c.offload_optimizer or c.offload_params):
        raise ConfigError("offload_nvme=True puts what the plan offloads on NVMe: it needs "
                          "offload_optimizer=True or offload_params=True")


def check_grad_compression(c: Any) -> None:
    r = c.powersgd_rank
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ConfigError(f"powersgd_rank must be a positive integer, got {r!r}")
    if c.grad_compression == "none":
        return
    why = compression_refusal(c)
    if why is not None:
        raise ConfigError(f"grad_compression={c.grad_compression!r} is DDP's communication "
                          f"hook: {why}")


def compression_refusal(c: Any) -> str | None:
    """Why DDP's PowerSGD hook cannot take ``c``'s gradient sync, with the fix; None where it
    can (whatever ``c.grad_compression`` says): the runtime registers the hook on DDP, which
    runs over dp > 1 with ZeRO-0, no pipeline and no expert parallelism, and not where 16-bit
    weights keep fp32 gradient sums (``mixed_precision="params"``): those are reduced in the
    runtime's own buckets (Megatron-LM's fp32 grad buffers), which no DDP hook sees."""
    if c.grad_degree == 1 or c.zero_stage != 0 or c.pp > 1 or c.ep > 1:
        return (f"it needs dp > 1 with zero_stage=0, pp=1 and ep=1 (got dp={c.dp}, "
                f"cp={c.cp}, zero_stage={c.zero_stage}, pp={c.pp}, ep={c.ep}); drop it or "
                f"plan for plain data parallelism")
    if c.mixed_precision == "params" and c.precision != "fp32":
        return (f"with {c.precision} weights (mixed_precision='params') the fp32 gradient "
                f"sums are reduced in autoplan's own buckets (Megatron-LM's fp32 grad "
                f"buffers), not by DDP, so the hook would never run; drop it or use "
                f"mixed_precision='autocast'")
    return None


def check_policies(c: Any, field: str, unit: str) -> None:
    """Every policy of ``c.<field>`` (one per ``unit``: stage or layer) is a recompute policy,
    and ``c.recompute`` names the most memory-saving of them."""
    policies = getattr(c, field)
    for r in policies:
        one_of(field, r, RECOMPUTE)
    strongest = strongest_recompute(policies)
    if c.recompute != strongest:
        raise ConfigError(f"with {field}, recompute must be the most memory-saving {unit} "
                          f"policy ({strongest!r}), got {c.recompute!r}")


def check_dp_shares(c: Any) -> None:
    """``dp_shares``: one positive micro-batch count per dp replica. Every collective a
    micro-batch issues over the dp ranks must then be one the replicas issue equally often, so
    uneven shares run where the dp ranks meet once a step (DDP's all-reduce behind the last
    backward, ZeRO-1's reduce-scatter, FSDP's gathers and reduce-scatters held to the first and
    last micro-batch: ``runtime/steps.py``), not where they meet in every micro-batch."""
    v = c.dp_shares
    if v is None:
        return
    if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__") or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in v):
        raise ConfigError(f"dp_shares must list one positive micro-batch count per dp "
                          f"replica, or be None (even shares), got {v!r}")
    object.__setattr__(c, "dp_shares", tuple(v))
    if len(c.dp_shares) != c.dp:
        raise ConfigError(f"dp_shares has {len(c.dp_shares)} counts for dp={c.dp} replicas: "
                          f"give one per replica, in dp-index order")
    if c.num_microbatches is not None:
        raise ConfigError(f"num_microbatches={c.num_microbatches} and dp_shares="
                          f"{list(c.dp_shares)} both say how many micro-batches a replica "
                          f"runs; with dp_shares leave num_microbatches None")
    every_micro_batch = [what for what, on in (
        ("ep > 1 (the experts' all-to-all runs over dp ranks in every micro-batch)", c.ep > 1),
        ("pp > 1 with ZeRO-3 or parameter offload (FSDP gathers the weights again for every "
         "micro-batch's forward in the pipeline schedule)",
         c.pp > 1 and (c.zero_stage == 3 or c.offload_params))) if on]
    if every_micro_batch:
        raise ConfigError(f"dp_shares={list(c.dp_shares)} (uneven data parallelism) runs "
                          f"where the dp ranks meet once a step, not with "
                          f"{'; '.join(every_micro_batch)}: drop dp_shares (even shares) or "
                          f"those")
    if c.pp > 1:
        _check_share_schedules(c)


def _check_share_schedules(c: Any) -> None:
    """Each replica's pipeline runs its own count through the schedule, which must take it:
    torch's 1F1B needs at least pp micro-batches, DualPipeV 2 pp, the interleaved schedules a
    multiple of pp (as ``estimate`` asks of an even count)."""
    p, sched = c.pp, c.schedule
    if sched == "1f1b":
        bad, need = [m for m in c.dp_shares if m < p], f"at least pp={p}"
    elif sched == "dualpipev":
        bad, need = [m for m in c.dp_shares if m < 2 * p], f"at least 2 x pp={2 * p}"
    elif sched == "interleaved_1f1b" or (sched == "zero_bubble" and c.virtual_stages > 1):
        bad, need = [m for m in c.dp_shares if m % p], f"a multiple of pp={p}"
    else:
        return
    if bad:
        raise ConfigError(f"dp_shares={list(c.dp_shares)}: schedule {sched!r} needs {need} "
                          f"micro-batches in every replica's pipeline, and {bad} are not; "
                          f"raise those shares or use schedule 'gpipe'")
