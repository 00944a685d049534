"""ParallelConfig: one point of the search space, as a user writes it or the planner picks it.

Its degrees (pp, dp, cp, tp, HSDP's dp_shard, ep) make a ``ParallelDims`` (``config.dims``,
``sharding/mesh_axes.py``): the rank layout, the group of a rank on any set of mesh axes and the
device mesh live there; the per-axis group methods here name the groups the cost model and the
runtime speak of (who averages gradients, who shares a parameter shard) in its terms.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property, lru_cache
from typing import Any

from autoplan.errors import ConfigError
# the rules the newer memory and precision fields obey, and the values each field may take
# (re-exported here for the layers above: the config's vocabulary)
from autoplan.sharding.config_rules import (check_dp_shares, check_fp8, check_policies,
                                            check_grad_compression,
                                            check_layer_offload, check_layer_recompute,
                                            check_offload_activations, check_offload_nvme)
from autoplan.sharding.config_values import (ALWAYS_WRITTEN, CP_LAYOUTS, GRAD_COMPRESSION,
                                             MIXED_PRECISION,
                                             MULTI_CHUNK_SCHEDULES, OPTIMIZER_STATES,
                                             OPTIMIZERS, PRECISIONS, RECOMPUTE, SCHEDULES,
                                             SPLIT_BACKWARD, V_SCHEDULES, one_of,
                                             strongest_recompute)
from autoplan.sharding.mesh_axes import MeshAxis as A, ParallelDims

@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Degrees and policies of one training configuration.

    ``num_microbatches`` may be left ``None``: it is derived from the global batch as
    ``global_batch_size / (dp * micro_batch_size)``. ``virtual_stages`` is the number of model
    chunks per pipeline rank (with ``interleaved_1f1b`` or ``zero_bubble``). ``zero_bubble``
    splits each backward into its input-gradient and weight-gradient halves and runs the latter
    in the bubbles (Qi et al. 2024, ZB-H1 over interleaved chunks; torch's
    ``ScheduleInterleavedZeroBubble``). ``zbv`` (ZB-V, Qi et al. 2024 Sec. 6; torch's
    ``ScheduleZBVZeroBubble``) and ``dualpipev`` (DeepSeek's DualPipe folded into a V; torch's
    ``ScheduleDualPipeV``) run two chunks per rank placed in a V (``chunk_ranks``), with the
    backward split the same way.

    ``chunk_layers`` (pipelines only): how many layers each of the ``pp * virtual_stages``
    chunks holds, in model order; ``None`` balances them. ``stage_recompute``: one recompute
    policy per pipeline stage where stages differ (the first stages hold the most micro-batches
    in flight); ``recompute`` then names the most memory-saving of them. ``layer_recompute``:
    one recompute policy per layer of the model (``partition.pipeline_units``, in model order),
    chosen by ``planner/recompute_dp.py``; ``recompute`` then names the most memory-saving of
    them, as with ``stage_recompute`` (the two are exclusive).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    micro_batch_size: int = 1
    num_microbatches: int | None = None
    schedule: str = "1f1b"
    virtual_stages: int = 1
    zero_stage: int = 0
    sequence_parallel: bool = False
    recompute: str = "none"
    offload_optimizer: bool = False
    offload_params: bool = False          # weights and gradients in host memory (ZeRO-3 only)
    chunk_layers: tuple[int, ...] | None = None
    stage_recompute: tuple[str, ...] | None = None
    precision: str = "bf16"
    optimizer: str = "adamw"
    # tensor-parallel collectives pipelined with the GEMMs that consume or produce them
    # (Megatron-LM's --tp-comm-overlap): priced, never searched, and refused by this runtime
    tp_comm_overlap: bool = False
    # HSDP (hybrid sharding): ZeRO-2/3 shard each parameter over groups of ``dp_shard``
    # consecutive dp ranks (a node, say) and replicate it over the dp / dp_shard groups;
    # None shards over all of dp
    dp_shard: int | None = None
    # expert parallelism (MoE): each expert weight split on its expert dim over groups of
    # ``ep`` consecutive dp ranks, every routed token row sent to the rank of its expert and
    # back (all-to-all); expert weights are replicated over the dp / ep groups (expert data
    # parallelism, Megatron-Core's layout). 1: experts held whole like any weight
    ep: int = 1
    # ZeRO-3 with some weights kept whole: parameter names (fnmatch patterns over FQNs,
    # "layers.*.attention.*") that stay whole on every dp rank instead of sharded. Nothing
    # gathers them; their gradients are all-reduced over dp once a step, in buckets behind the
    # last micro-batch's backward, and their optimizer state is whole (ZeRO-0 for them). The sharding ILP picks them per weight
    # (``planner/dp_problem.py``): FSDP as a placement, not only a switch
    dp_whole: tuple[str, ...] = ()
    # context parallelism: the sequence of every micro-batch split over ``cp`` ranks of its own
    # mesh axis (between dp and tp), attention run as ring attention over it, every other op on
    # its sequence shard (``sharding/context_axis.py``). Weights are whole on the axis; their
    # gradients are averaged over dp x cp and ZeRO shards the model state over dp x cp (as
    # torchtitan's dp_shard_cp). 1: no such axis (ring attention may still run on the tp axis)
    cp: int = 1
    # how the cp axis lays the sequence out (``sharding/ring_work.py``): "contiguous" (rank r
    # holds piece r of cp: a causal ring's last rank computes 2cp - 1 times the first's
    # attention), or "zigzag" (head-tail: the sequence cut into 2 cp chunks, rank r holding
    # chunks r and 2cp - 1 - r, every rank the same causal work; torch's context_parallel
    # load balancer). Inputs, labels, positions and masks all take it; gathers undo it.
    # Moot at cp = 1; plan files without it are contiguous
    cp_layout: str = "contiguous"
    # how 16-bit training holds its tensors (``cost/dtypes.py``): "autocast", autoplan's
    # runtime: fp32 weights, gradients and optimizer state, products in ``precision`` under
    # torch.autocast (its fp32 ops, softmax and norms on CUDA, keep fp32 activations);
    # "params": weights and activations in ``precision``, the fp32 master copy with the
    # optimizer (Megatron-LM's --bf16): priced, never searched, refused by this runtime
    mixed_precision: str = "autocast"
    # torch.compile of the rank program, one layer at a time (regional, as torchtitan): each
    # layer's element-wise chains fused into single kernels, priced so (``cost/compute.py``)
    compiled: bool = False
    # ZeRO-Infinity (Rajbhandari et al. 2021): what the plan offloads (optimizer state; with
    # offload_params the weights and gradients too) lives on the node's NVMe drives, host
    # memory holding only the buffers it streams through: priced, chosen where host memory is
    # short, refused by this runtime
    offload_nvme: bool = False
    # gradient compression of DDP's all-reduce: "powersgd" sends rank-``powersgd_rank`` factors
    # P (n x r) and Q (m x r) of each n x m gradient with error feedback (lossy: the numerics
    # differ from exact training); 1-D gradients go uncompressed
    grad_compression: str = "none"
    powersgd_rank: int = 1
    # fp8 linear layers on top of bf16 autocast (torchao's float8 training,
    # ``convert_to_float8_training`` with the recipe named here): "none", "tensorwise" (one
    # scale per tensor) or "rowwise" (one per row). ``fp8_skip``: the linear layers (module
    # paths, fnmatch patterns) left in 16 bits where fp8 does not pay (``cost/float8.py``):
    # torchao's ``module_filter_fn``. Needs a GPU with fp8 tensor cores (H100 and later)
    fp8: str = "none"
    fp8_skip: tuple[str, ...] = ()
    # activation offload: the saved activations of the first ``offload_activations`` layers of
    # every model chunk go to host memory in forward and come back for backward (Megatron-Core's
    # --cpu-offloading-num-layers counts layers the same way); those layers' backward runs
    # latest, so their prefetch hides behind the layers after them. A recomputed layer
    # offloads what it keeps: its checkpoint's input. 0: none
    offload_activations: int = 0
    # one recompute policy per layer, in model order (None: the stage's or the config's)
    layer_recompute: tuple[str, ...] | None = None
    # activation offload per layer, in model order (``partition.pipeline_units``), as the
    # joint recompute/offload DP (``planner/recompute_dp.py``) chooses it: True where the
    # layer's saved activations go to host memory. None: ``offload_activations``'s count per
    # chunk (the form users force); the two are exclusive
    layer_offload: tuple[bool, ...] | None = None
    # Adam's two moments held in less memory (lossy: numerics differ from exact AdamW):
    # "bf16" (Megatron-Core's precision-aware optimizer: moments in bf16, the weights' fp32
    # update), "8bit" (torchao's AdamW8bit: block-wise quantised moments, Dettmers et al. 2022);
    # "fp32" as torch.optim keeps them. Adam and AdamW only (``runtime/lowbit_optim.py``)
    optimizer_state: str = "fp32"
    # uneven data parallelism (heterogeneous clusters: a faster replica takes more of the
    # batch): how many micro-batches each dp replica runs per step, in dp-index order; the
    # global batch is micro_batch_size x sum(dp_shares), replica d takes the contiguous
    # micro-batches sum(dp_shares[:d]) .. sum(dp_shares[:d + 1]) - 1 of it, and each replica's
    # losses are weighted by dp x dp_shares[d] / sum(dp_shares), so that the gradients averaged
    # over dp are one device's mean over the global batch. None: even, global batch / dp each.
    # num_microbatches is then None (the shares are the counts); rules in
    # ``config_rules.check_dp_shares``
    dp_shares: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "micro_batch_size", "virtual_stages", "ep", "cp"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        if self.num_microbatches is not None and (
                not isinstance(self.num_microbatches, int) or self.num_microbatches < 1):
            raise ConfigError(f"num_microbatches must be a positive integer or None, "
                              f"got {self.num_microbatches!r}")
        one_of("schedule", self.schedule, SCHEDULES)
        one_of("recompute", self.recompute, RECOMPUTE)
        one_of("precision", self.precision, PRECISIONS)
        one_of("optimizer", self.optimizer, OPTIMIZERS)
        one_of("mixed_precision", self.mixed_precision, MIXED_PRECISION)
        one_of("grad_compression", self.grad_compression, GRAD_COMPRESSION)
        one_of("cp_layout", self.cp_layout, CP_LAYOUTS)
        check_fp8(self)
        one_of("optimizer_state", self.optimizer_state, OPTIMIZER_STATES)
        if self.optimizer_state != "fp32" and self.optimizer not in ("adam", "adamw"):
            raise ConfigError(f"optimizer_state={self.optimizer_state!r} holds Adam's two "
                              f"moments in less memory (torchao's low-bit Adam/AdamW); "
                              f"optimizer {self.optimizer!r} has no such form: use "
                              f"optimizer_state='fp32' or optimizer 'adam'/'adamw'")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.virtual_stages > 1 and self.schedule not in MULTI_CHUNK_SCHEDULES:
            raise ConfigError(f"virtual_stages={self.virtual_stages} needs a schedule of "
                              f"several chunks per rank, one of {list(MULTI_CHUNK_SCHEDULES)} "
                              f"(got {self.schedule!r})")
        if self.schedule in V_SCHEDULES and self.pp > 1 and self.virtual_stages != 2:
            raise ConfigError(f"schedule {self.schedule!r} places exactly two chunks per "
                              f"pipeline rank in a V; set virtual_stages=2 (got "
                              f"{self.virtual_stages})")
        check_offload_activations(self)
        check_layer_offload(self)
        if self.offload_params and self.zero_stage != 3:
            raise ConfigError("offload_params=True needs zero_stage=3: the weights are offloaded "
                              "as FSDP shards and gathered to the device layer by layer")
        self._check_layout()
        self._check_dp_shard()
        check_offload_nvme(self)
        check_grad_compression(self)
        self._check_dp_whole()
        check_dp_shares(self)
        if self.dp % self.ep:
            raise ConfigError(f"ep={self.ep} must divide dp={self.dp}: expert-parallel groups "
                              "are made of data-parallel ranks")
        if self.ep > 1 and self.dp_shard is not None:
            raise ConfigError(f"expert parallelism (ep={self.ep}) runs with data, tensor and "
                              f"pipeline parallelism, ZeRO-0 to 3 and optimizer and parameter "
                              f"offload, not with dp_shard={self.dp_shard} (HSDP); use ep=1 or "
                              f"drop dp_shard")
        if self.cp > 1:
            other = [what for what, on in (("ep > 1", self.ep > 1),
                                           ("dp_whole", bool(self.dp_whole))) if on]
            if other:
                raise ConfigError(f"context parallelism (cp={self.cp}) runs with data, tensor, "
                                  f"pipeline and sharded data parallelism (ZeRO, HSDP, offload) "
                                  f"for now, not with {', '.join(other)}: use cp=1 or drop "
                                  "those")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("sequence_parallel=True needs tp > 1 (it shards the "
                              "activations that tensor parallelism leaves replicated)")
        if self.tp_comm_overlap and not (self.tp > 1 and self.sequence_parallel):
            raise ConfigError("tp_comm_overlap=True needs tp > 1 with sequence_parallel: it "
                              "pipelines the sequence-parallel all-gathers and reduce-scatters "
                              "with their GEMMs")

    def _check_layout(self) -> None:
        for name in ("chunk_layers", "stage_recompute", "layer_recompute"):
            v = getattr(self, name)
            if v is not None:
                if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
                    raise ConfigError(f"{name} must be a list or None, got {v!r}")
                object.__setattr__(self, name, tuple(v))
        n = self.pp * self.virtual_stages
        if self.chunk_layers is not None:
            if len(self.chunk_layers) != n or any(
                    not isinstance(c, int) or isinstance(c, bool) or c < 1
                    for c in self.chunk_layers):
                raise ConfigError(f"chunk_layers must list a positive layer count for each of the "
                                  f"pp x virtual_stages = {n} chunks, got "
                                  f"{list(self.chunk_layers)}")
        if self.stage_recompute is not None:
            if len(self.stage_recompute) != self.pp:
                raise ConfigError(f"stage_recompute must name one policy per pipeline stage "
                                  f"({self.pp}), got {list(self.stage_recompute)}")
            check_policies(self, "stage_recompute", "stage")
        check_layer_recompute(self)

    def layer_policy(self, layer: int, stage: int) -> str:
        """The recompute policy of layer ``layer`` (model order) on pipeline stage ``stage``."""
        if self.layer_recompute is not None:
            return self.layer_recompute[layer]
        return self.stage_policy(stage)

    def fp8_converts(self, module_path: str) -> bool:
        """Whether the linear layer at ``module_path`` runs in fp8 (``fp8`` on, not skipped)."""
        from fnmatch import fnmatchcase
        return self.fp8 != "none" and not any(fnmatchcase(module_path, p)
                                               for p in self.fp8_skip)
    def offloads_layer(self, position: int, layer: int | None = None) -> bool:
        """Whether the layer at ``position`` (0-based) in its model chunk, ``layer`` in model
        order, offloads its saved activations (``layer_offload``'s flag where set)."""
        if self.layer_offload is not None and layer is not None:
            return self.layer_offload[layer]
        return position < self.offload_activations

    @property
    def offloads_activations(self) -> bool:
        """Whether any layer offloads its saved activations (either form)."""
        return bool(self.offload_activations) or any(self.layer_offload or ())

    def _check_dp_shard(self) -> None:
        s = self.dp_shard
        if s is None:
            return
        if not isinstance(s, int) or isinstance(s, bool) or not 1 < s < self.dp \
                or self.dp % s:
            raise ConfigError(f"dp_shard must divide dp={self.dp} and lie strictly between 1 "
                              f"and dp (None shards over all of dp), got {s!r}")
        if self.zero_stage not in (2, 3):
            raise ConfigError(f"dp_shard={s} (HSDP) needs zero_stage 2 or 3: it is FSDP's "
                              f"sharding inside groups of {s} ranks, replicated across groups")

    def _check_dp_whole(self) -> None:
        v = self.dp_whole
        if isinstance(v, str) or not hasattr(v, "__iter__") or not all(
                isinstance(x, str) and x for x in v):
            raise ConfigError(f"dp_whole must be a list of parameter names or patterns, "
                              f"got {v!r}")
        object.__setattr__(self, "dp_whole", tuple(sorted(set(v))))
        if not self.dp_whole:
            return
        if self.zero_stage != 3 or self.grad_degree == 1:
            raise ConfigError("dp_whole keeps some weights whole where ZeRO-3 shards the rest: "
                              f"it needs zero_stage=3 and dp > 1 (got zero_stage="
                              f"{self.zero_stage}, dp={self.dp})")
        other = [what for what, on in (("pp > 1", self.pp > 1), ("ep > 1", self.ep > 1),
                                       ("HSDP (dp_shard)", self.dp_shard is not None),
                                       ("offload_params", self.offload_params)) if on]
        if other:
            raise ConfigError(f"dp_whole runs without pipelines, expert parallelism, HSDP and "
                              f"parameter offload for now, not with {', '.join(other)}: drop "
                              f"dp_whole (every weight sharded) or those")

    @property
    def uses_fsdp(self) -> bool:
        """Whether the runtime shards the model state with FSDP2 (ZeRO-2/3 over dp > 1, or
        parameter offload, FSDP2's CPU offload even at dp = 1)."""
        return (self.grad_degree > 1 and self.zero_stage >= 2) or self.offload_params

    @property
    def split_backward_on_fsdp_unsupported(self) -> bool:
        """A split-backward schedule on FSDP2 stages the runtime cannot run (torch 2.13): under
        ZeRO-3 (or parameter offload) the weights are resharded after forward and torch's
        weight-gradient pass no longer finds them (wrong gradients); the V schedules put the
        embedding and a tied head in two FSDP units of one rank. ZeRO-2 runs with
        ``zero_bubble`` (tests/test_pipeline_runtime.py)."""
        return (self.schedule in SPLIT_BACKWARD and self.uses_fsdp
                and (self.zero_stage == 3 or self.offload_params
                     or self.schedule in V_SCHEDULES))

    def keeps_whole(self, fqn: str) -> bool:
        """Whether parameter ``fqn`` stays whole on the dp axis (``dp_whole``)."""
        from fnmatch import fnmatchcase
        return any(fnmatchcase(fqn, p) for p in self.dp_whole)

    @property
    def shard_degree(self) -> int:
        """Over how many ranks ZeRO shards the model state: ``dp_shard`` under HSDP, else dp;
        times cp (the context-parallel ranks of a replica hold the same weights)."""
        return (self.dp_shard or self.dp) * self.cp

    @property
    def grad_degree(self) -> int:
        """Over how many ranks the gradients are averaged: dp x cp."""
        return self.dp * self.cp

    def grad_view(self) -> ParallelConfig:
        """This config as its model state sees it: the dp x cp ranks that average gradients and
        share ZeRO's shards as one data-parallel axis of dp x cp (their rank layout is the
        same: dp index ``d * cp + c``), cp 1; under ``dp_shares`` each of a replica's cp ranks
        runs its replica's share. Itself when cp is 1."""
        if self.cp == 1:
            return self
        from dataclasses import replace
        shares = (None if self.dp_shares is None
                  else tuple(s for s in self.dp_shares for _ in range(self.cp)))
        return replace(self, dp=self.dp * self.cp, cp=1, dp_shares=shares,
                       dp_shard=None if self.dp_shard is None else self.dp_shard * self.cp)

    @cached_property
    def dims(self) -> ParallelDims:
        """The mesh axes' degrees, rank layout and groups (``sharding/mesh_axes.py``)."""
        return ParallelDims.of(pp=self.pp, dp=self.dp, cp=self.cp, tp=self.tp,
                               dp_shard=self.dp_shard, ep=self.ep)

    def dp_shard_group(self, pp_index: int = 0, tp_index: int = 0,
                       replica: int = 0) -> tuple[int, ...]:
        """The ranks one parameter shard group spans: dp_shard x cp under HSDP, else all of
        dp x cp."""
        d = self.dims
        return d.group((A.DP_SHARD, A.CP), d.rank_at({A.PP: pp_index, A.TP: tp_index,
                                                      A.DP_REPLICATE: replica}))

    def dp_replicate_group(self, pp_index: int = 0, tp_index: int = 0,
                           shard: int = 0) -> tuple[int, ...]:
        """The ranks holding the same shard under HSDP, one per shard group (``shard``: the
        index in a shard group of dp_shard x cp)."""
        d = self.dims
        shard_index, cp_index = divmod(shard, self.cp)
        return d.group(A.DP_REPLICATE, d.rank_at({A.PP: pp_index, A.TP: tp_index,
                                                  A.DP_SHARD: shard_index, A.CP: cp_index}))

    def ep_group(self, pp_index: int = 0, tp_index: int = 0,
                 replica: int = 0) -> tuple[int, ...]:
        """The ranks one expert-parallel group spans: ``ep`` consecutive dp indices."""
        d = self.dims
        return d.group(A.EP, d.rank_at({A.PP: pp_index, A.TP: tp_index, A.EDP: replica}))

    def expert_dp_group(self, pp_index: int = 0, tp_index: int = 0,
                        ep_index: int = 0) -> tuple[int, ...]:
        """The ranks holding the same experts (one per expert-parallel group): over them the
        expert weights' gradients are averaged."""
        d = self.dims
        return d.group(A.EDP, d.rank_at({A.PP: pp_index, A.TP: tp_index, A.EP: ep_index}))

    def mesh_axes(self) -> tuple[str, ...]:
        """The device mesh's axis names, outermost first (the plan file's ``mesh.axes`` and the
        runtime's DeviceMesh): pp when pipelined, dp (or dp_replicate x dp_shard under HSDP,
        or edp x ep under expert parallelism), cp when split, tp."""
        return self.dims.mesh_names()

    def mesh_shape(self) -> tuple[int, ...]:
        return self.dims.mesh_shape()

    def stage_policy(self, stage: int) -> str:
        """The recompute policy of pipeline stage (rank) ``stage``: its own, or the config's."""
        if self.stage_recompute is not None:
            return self.stage_recompute[stage]
        return self.recompute

    def chunk_policy(self, chunk: int) -> str:
        """The recompute policy of model chunk ``chunk``: its pipeline rank's."""
        return self.stage_policy(self.chunk_rank(chunk))

    def chunk_rank(self, chunk: int) -> int:
        """The pipeline rank (pp index) that runs model chunk ``chunk`` of ``pp * v``."""
        return chunk_ranks(self.schedule, self.pp, self.virtual_stages)[chunk]

    def rank_chunks(self, pp_index: int) -> tuple[int, ...]:
        """The chunks pipeline rank ``pp_index`` runs, in model order (its local chunks)."""
        return rank_chunks(self.schedule, self.pp, self.virtual_stages)[pp_index]

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    def microbatches(self, global_batch_size: int) -> int:
        """Micro-batches per step per pipeline; raises ConfigError if the batch does not divide.
        Under ``dp_shares``, the largest replica's count (the most any pipeline runs)."""
        if self.dp_shares is not None:
            return max(self.replica_microbatches(global_batch_size))
        per_replica, rem = divmod(global_batch_size, self.dp)
        if rem:
            raise ConfigError(f"global batch {global_batch_size} does not divide into dp={self.dp} "
                              f"replicas; use a multiple of {self.dp}")
        m, rem = divmod(per_replica, self.micro_batch_size)
        if rem:
            raise ConfigError(f"the per-replica batch {per_replica} (= {global_batch_size} / dp "
                              f"{self.dp}) is not a multiple of micro_batch_size "
                              f"{self.micro_batch_size}; pick a micro-batch size dividing it")
        if self.num_microbatches is not None and self.num_microbatches != m:
            raise ConfigError(f"num_microbatches={self.num_microbatches} but global batch "
                              f"{global_batch_size} / (dp {self.dp} x micro_batch_size "
                              f"{self.micro_batch_size}) = {m}; drop num_microbatches or fix it")
        return m

    def replica_microbatches(self, global_batch_size: int) -> tuple[int, ...]:
        """Micro-batches each dp replica runs per step, in dp-index order: ``dp_shares``, or
        the even count on every replica. Raises ConfigError if the batch does not fit them."""
        if self.dp_shares is None:
            return (self.microbatches(global_batch_size),) * self.dp
        want = self.micro_batch_size * sum(self.dp_shares)
        if global_batch_size != want:
            raise ConfigError(f"dp_shares={list(self.dp_shares)} with micro_batch_size "
                              f"{self.micro_batch_size} make a global batch of {want} "
                              f"(micro_batch_size x sum of the shares), got "
                              f"{global_batch_size}; scale the shares or the batch to agree")
        return self.dp_shares

    def replica_rows(self, global_batch_size: int, dp_index: int) -> tuple[int, int]:
        """The rows of the global batch replica ``dp_index`` takes: (first row, row count), a
        contiguous slice in dp-index order, so that the replicas together hold the global
        batch in one device's order."""
        counts = self.replica_microbatches(global_batch_size)
        mbs = self.micro_batch_size
        return sum(counts[:dp_index]) * mbs, counts[dp_index] * mbs

    def tp_group(self, pp_index: int = 0, dp_index: int = 0, cp_index: int = 0
                 ) -> tuple[int, ...]:
        d = self.dims
        return d.group(A.TP, d.rank_at({A.PP: pp_index, A.DP: dp_index, A.CP: cp_index}))

    def cp_group(self, pp_index: int = 0, dp_index: int = 0, tp_index: int = 0
                 ) -> tuple[int, ...]:
        """The ranks one micro-batch's sequence is split over (ring attention's ring)."""
        d = self.dims
        return d.group(A.CP, d.rank_at({A.PP: pp_index, A.DP: dp_index, A.TP: tp_index}))

    def dp_group(self, pp_index: int = 0, tp_index: int = 0) -> tuple[int, ...]:
        """The ranks that average gradients: dp (x cp, the context-parallel ranks too)."""
        d = self.dims
        return d.group(d.data_axes(), d.rank_at({A.PP: pp_index, A.TP: tp_index}))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (the layout tuples as lists): those of the first plan files
        (``ALWAYS_WRITTEN``) always, every later one only where it differs from its default,
        so plans written before it existed read back byte for byte."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ALWAYS_WRITTEN or v != f.default:
                out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    @staticmethod
    def from_dict(d: dict[str, Any]) -> ParallelConfig:
        known = {f.name for f in fields(ParallelConfig)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown ParallelConfig keys {unknown}; known: {sorted(known)}")
        return ParallelConfig(**d)

    def short(self) -> str:
        s = (f"dp{self.dp}" + (f" cp{self.cp}" if self.cp > 1 else "")
             + f" tp{self.tp} pp{self.pp} mbs{self.micro_batch_size}")
        if self.pp > 1:
            s += f" {self.schedule}" + (f"x{self.virtual_stages}" if self.virtual_stages > 1 else "")
        if self.zero_stage:
            s += f" zero{self.zero_stage}"
        if self.dp_shard is not None:
            s += f" hsdp{self.dp_shard}x{self.dp // self.dp_shard}"
        if self.ep > 1:
            s += f" ep{self.ep}"
        if self.dp_whole:
            s += f" whole{len(self.dp_whole)}"
        if self.dp_shares is not None:
            s += " shares" + ":".join(map(str, self.dp_shares))
        if self.sequence_parallel:
            s += " sp"
        if self.layer_recompute is not None:      # how many layers each policy has
            counts = {r: self.layer_recompute.count(r) for r in self.layer_recompute}
            s += " recompute=layers:" + "/".join(f"{r}*{k}" for r, k in counts.items())
        elif self.stage_recompute is not None:
            runs: list[list] = []
            for r in self.stage_recompute:
                if runs and runs[-1][0] == r:
                    runs[-1][1] += 1
                else:
                    runs.append([r, 1])
            s += " recompute=" + "/".join(r if k == 1 else f"{r}*{k}" for r, k in runs)
        elif self.recompute != "none":
            s += f" recompute={self.recompute}"
        if self.offload_optimizer:
            s += " offload-opt"
        if self.offload_params:
            s += " offload-params"
        if self.offload_nvme:
            s += " nvme"
        if self.grad_compression == "powersgd":
            s += f" powersgd{self.powersgd_rank}"
        if self.offload_activations:
            s += f" offload-act{self.offload_activations}"
        if self.layer_offload is not None:        # how many layers offload, of how many
            s += f" offload-act=layers:{sum(self.layer_offload)}/{len(self.layer_offload)}"
        if self.tp_comm_overlap:
            s += " tp-overlap"
        if self.compiled:
            s += " compiled"
        if self.fp8 != "none":
            s += f" fp8-{self.fp8}" + (f"(skip{len(self.fp8_skip)})" if self.fp8_skip else "")
        if self.optimizer_state != "fp32":
            s += f" adam-{self.optimizer_state}"
        if self.mixed_precision != "autocast" and self.precision != "fp32":
            s += f" {self.precision}-{self.mixed_precision}"
            return s
        return s + f" {self.precision}"


@lru_cache(maxsize=256)
def chunk_ranks(schedule: str, p: int, v: int) -> tuple[int, ...]:
    """The pipeline rank of each of the ``p * v`` model chunks, in model order. Looped (chunk
    ``c`` on rank ``c % p``, Megatron-LM's interleaving) for every schedule but the V-shaped
    ones, where rank ``r`` holds chunks ``r`` and ``2p - 1 - r``: the activations flow down the
    ranks and back up, and the last chunk (the loss) sits beside the first."""
    if schedule in V_SCHEDULES and p > 1:
        if v != 2:
            raise ConfigError(f"schedule {schedule!r} needs two chunks per rank, got {v}")
        return tuple(range(p)) + tuple(reversed(range(p)))
    return tuple(c % p for c in range(p * v))


@lru_cache(maxsize=256)
def rank_chunks(schedule: str, p: int, v: int) -> tuple[tuple[int, ...], ...]:
    """Per pipeline rank, the chunks it runs in model order (``chunk_ranks`` inverted)."""
    ranks = chunk_ranks(schedule, p, v)
    return tuple(tuple(c for c in range(p * v) if ranks[c] == r) for r in range(p))
