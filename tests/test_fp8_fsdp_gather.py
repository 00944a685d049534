"""FSDP's fp8 all-gather (issue 39, part 5): under FSDP2 with tensorwise scaling the fp8
linears' weights are gathered in fp8, as torchao's ``enable_fsdp_float8_all_gather`` does it.
The pricing (one byte per gathered element, no weight cast in the linear, the casts and scales
as extra work; ``cost/float8.py``, ``estimate/dp_terms.py``), which weights it applies to, and
the runtime's plumbing (``runtime/float8.py``) on two gloo ranks of this CPU: the wrapped
weights go through FSDP2's fp8 gather and train as the unwrapped ones. A whole fp8 plan is
refused on a CPU (``test_fp8_precision.py``); the GPU test is
``test_fp8_fsdp_plan_trains_as_torchao_by_hand_on_one_gpu``."""

import math

import pytest
import torch
from torch import nn

from autoplan.cluster.cluster import Cluster
from autoplan.cost.compute import compute_model
from autoplan.cost.float8 import (SHARD_CAST_BYTES, Float8Setting, cast_passes,
                                  fp8_gathered_weights, gathers_fp8)
from autoplan.estimate.dp_terms import StageParams, dp_collectives, stage_terms
from autoplan.graph import trace
from autoplan.sharding.parallel_config import ParallelConfig

from distributed import run_ranks


class Tied(nn.Module):
    """Two fp8-sized linears and an embedding tied to the head: the head's weight is read in 16
    bits by the embedding too, so FSDP cannot gather it in fp8."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(256, 64)
        self.up = nn.Linear(64, 128, bias=False)
        self.down = nn.Linear(128, 64, bias=False)
        self.head = nn.Linear(64, 256, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.down(self.up(self.emb(x)))).float().pow(2).mean()


@pytest.fixture(scope="module")
def graph():
    with torch.device("meta"):
        m = Tied()
    return trace(m, (torch.zeros(2, 32, dtype=torch.long, device="meta"),))


def _cfg(**kw):
    return ParallelConfig(**{"dp": 8, "zero_stage": 3, "fp8": "tensorwise", "compiled": True,
                             **kw})


def test_which_configs_gather_fp8():
    assert gathers_fp8(_cfg()) and Float8Setting.of(_cfg()).weight_gathered_fp8
    assert gathers_fp8(_cfg(zero_stage=2))
    assert not gathers_fp8(_cfg(fp8="rowwise"))          # torchao refuses it for rowwise
    assert not gathers_fp8(_cfg(zero_stage=1))           # no FSDP: nothing gathered per layer
    assert not gathers_fp8(_cfg(fp8="none"))
    assert gathers_fp8(_cfg(dp=1, offload_params=True))  # FSDP2's CPU offload at dp 1


def test_gathered_weights_leave_out_tied_and_whole_ones(graph):
    ops = {graph.ops[i].module_path: i for i in compute_model(
        graph, Cluster.preset("dgx-h100").device, "bf16", fused=True,
        fp8=Float8Setting.of(_cfg())).fp8_ops}
    assert set(ops) == {"up", "down", "head"}
    assert sorted(fp8_gathered_weights(graph, ops.values()).values()) == [
        "down.weight", "up.weight"]                       # head: tied to the embedding
    assert list(fp8_gathered_weights(graph, ops.values(), ("down.*",)).values()) == ["up.weight"]
    cm = compute_model(graph, Cluster.preset("dgx-h100").device, "bf16", fused=True,
                       fp8=Float8Setting.of(_cfg(dp_whole=("down.weight",))))
    assert sorted(cm.fp8_gathered.values()) == ["up.weight"]


def test_a_gathered_linear_casts_no_weight(graph):
    setting = Float8Setting.of(_cfg())
    sides = (64.0, 128.0, 64.0)
    own = cast_passes(sides, setting, compiled=True, weight_cast=True)
    gathered = cast_passes(sides, setting, compiled=True, weight_cast=False)
    # the weight (N x K, 16 bits gathered) cast once forward and once backward, one kernel pair
    weight = 128 * 64 * (2 * 2 + 1) + 4.0
    assert own.fwd_bytes - gathered.fwd_bytes == weight == own.bwd_bytes - gathered.bwd_bytes
    assert own.fwd_kernels - gathered.fwd_kernels == 2


def test_fsdp_gathers_are_priced_at_one_byte_per_fp8_element():
    cluster = Cluster.preset("dgx-h100", nodes=2)
    cfg = _cfg(dp=16)
    params, fp8, layers = 8e9, 6e9, 32
    _, ag16, rs16 = dp_collectives(cfg, cluster, params, layers, 0)
    _, ag8, rs8 = dp_collectives(cfg, cluster, params, layers, 0, fp8_params=fp8)
    group = cfg.dp_shard_group(pp_index=0)
    assert ag16 == pytest.approx(cluster.collective_time_s("all_gather", params * 2 / layers,
                                                           group))
    assert ag8 == pytest.approx(cluster.collective_time_s(
        "all_gather", ((params - fp8) * 2 + fp8 * 1) / layers, group))
    assert ag8 < 0.7 * ag16 and rs8 == rs16               # gradients reduced as before

    # the casts and the scales: each gather casts a layer's shards (read 4, write 1 byte per
    # element, a kernel per weight), each step reads every shard for its amax and
    # all-reduces the amaxes
    h100 = cluster.device
    g = _tiny_graph()
    cm = compute_model(g, h100, "bf16", fused=True, fp8=Float8Setting.of(cfg))
    stage = StageParams(params=params, layer_params=params, tensors=96, layers=layers,
                        fp8=fp8, fp8_tensors=64)
    plain = StageParams(params=params, layer_params=params, tensors=96, layers=layers)
    terms = stage_terms(cfg, cluster, stage, 4, 0, cm, None)
    extra = [t for t in terms if t.seconds not in
             {u.seconds for u in stage_terms(cfg, cluster, plain, 4, 0, cm, None)}]
    bw, launch = cm.tput.memory_bytes_per_s, cm.tput.launch_s
    owned = fp8 / 16
    per_gather = owned / layers * SHARD_CAST_BYTES / bw + 64 / layers * launch
    per_step = (owned * 4 / bw + 4 * launch
                + cluster.collective_time_s("all_reduce", 4.0 * 64, group))
    scale = [t for t in extra if t.window == "" and t.shares == (("zero_param_gather", 1.0),)]
    assert len(scale) == 1
    assert scale[0].seconds == pytest.approx(layers * 2 * 4 * per_gather + per_step)


def _tiny_graph():
    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(64, 64, bias=False))
    return trace(m, (torch.zeros(4, 64, device="meta"),))


def test_runtime_wraps_the_weights_the_planner_priced(graph):
    from autoplan.runtime.float8 import _configs, fsdp_float8_weights, fsdp_gathered_fqns
    assert fsdp_gathered_fqns(graph, _cfg()) == {"up.weight", "down.weight"}
    assert fsdp_gathered_fqns(graph, _cfg(fp8="rowwise")) == frozenset()
    assert fsdp_gathered_fqns(graph, _cfg(zero_stage=1)) == frozenset()
    config, _ = _configs("tensorwise", fsdp_all_gather=True)
    assert config.enable_fsdp_float8_all_gather
    assert not _configs("tensorwise")[0].enable_fsdp_float8_all_gather
    m = Tied()
    new = fsdp_float8_weights(m, fsdp_gathered_fqns(graph, _cfg()))
    assert [type(p).__name__ for p in new] == ["WeightWithDynamicFloat8CastTensor"] * 2
    assert m.up.weight is new[0] and m.down.weight is new[1]
    assert type(m.head.weight) is nn.Parameter and m.head.weight is m.emb.weight


class _Fp8Linear(nn.Linear):
    """A linear whose product is the rank program's fp8 call (``float8.float8_linear``). Its
    fp32 bias beside the fp8 weight makes FSDP2 gather the unit as bytes (uint8): gloo has no
    fp8 collectives (NCCL has)."""

    def forward(self, x):
        from autoplan.runtime.float8 import float8_linear
        return float8_linear(x, self.weight, self.bias, "tensorwise")


class _TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = _Fp8Linear(32, 64)
        self.b = _Fp8Linear(64, 16)

    def forward(self, x):
        return self.b(self.a(x)).float().pow(2).mean()


def _fsdp_fp8_rank(rank, world):
    """Two FSDP2 models of the same weights on ``world`` gloo ranks, one with its weights
    wrapped for the fp8 all-gather: (losses, largest gradient difference, fp8 gathers made,
    the scale ``Float8Scales`` set against finfo.max / amax)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from autoplan.runtime.float8 import Float8Scales, fsdp_float8_weights
    dist.init_process_group("gloo", rank=rank, world_size=world)
    gathers = []
    pre = WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather

    def counted(self, mesh):          # (FSDP2 reads the signature: torchao's own)
        out = pre(self, mesh)
        gathers.append(out[0][0].dtype)
        return out
    WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather = counted
    torch.manual_seed(0)
    fp8, plain = _TwoLayers(), _TwoLayers()
    plain.load_state_dict(fp8.state_dict())
    whole_a = fp8.a.weight.detach().clone()
    assert len(fsdp_float8_weights(fp8, frozenset({"a.weight", "b.weight"}))) == 2
    mesh = init_device_mesh("cpu", (world,))
    for m in (fp8, plain):
        for unit in (m.a, m.b, m):
            fully_shard(unit, mesh=mesh)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))
    losses = []
    for m in (fp8, plain):
        loss = m(x)
        loss.backward()
        losses.append(loss.item())
    diff = max((p.grad.full_tensor() - q.grad.full_tensor()).abs().max().item()
               for p, q in zip(fp8.parameters(), plain.parameters()))
    Float8Scales([fp8])()
    scale = fp8.a.weight._local_tensor._precomputed_scale.item()
    want = torch.finfo(torch.float8_e4m3fn).max / whole_a.abs().max().double().item()
    again = fp8(x).item()           # gathered with the precomputed scales
    return losses + [again], diff, [str(d) for d in gathers], scale / want


def test_fsdp2_gathers_the_wrapped_weights_in_fp8_and_trains_as_without():
    for losses, diff, gathers, ratio in run_ranks(_fsdp_fp8_rank, 2):
        # the products cast the same whole weight with the same scale either way
        assert losses[0] == pytest.approx(losses[1], rel=1e-6)
        assert losses[2] == pytest.approx(losses[0], rel=1e-6)
        assert diff < 1e-6
        # both weights gathered for the forward and again for the backward, each in fp8
        assert len(gathers) >= 4 and set(gathers) == {"torch.float8_e4m3fn"}
        assert ratio == pytest.approx(1.0, rel=1e-6)
        assert not math.isnan(losses[0])


def _has_fp8_gpu():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not _has_fp8_gpu(), reason="needs a CUDA GPU with fp8 tensor cores (8.9+)")
def test_fp8_fsdp_plan_trains_as_torchao_by_hand_on_one_gpu():
    """A tensorwise fp8 plan under FSDP2 (ZeRO-3 with its parameters offloaded: FSDP at dp 1,
    the one GPU a device check has) gathers its linears' weights in fp8 and trains 3 steps as
    the model converted by hand with torchao (``enable_fsdp_float8_all_gather=True``, every
    layer and the root ``fully_shard``'d with the same CPU offload, the scales precomputed
    after each step by ``precompute_float8_dynamic_scale_for_fsdp``) under torch.compile and
    bf16 autocast: losses within 1 %, each weight's change within 10 % of its movement (the
    tolerances of ``test_fp8_precision``'s GPU test, for the same reasons). UNMEASURED: written
    without a GPU at hand."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor
    from torchao.float8 import (Float8LinearConfig, convert_to_float8_training,
                                precompute_float8_dynamic_scale_for_fsdp)
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from autoplan import Cluster, compile
    from autoplan.models import build_example
    ex = build_example("hf-llama-gqa-tiny", batch_size=4, seed=0)
    small = build_example("hf-llama-gqa-tiny", batch_size=1, seed=0)
    by_hand = copy.deepcopy(ex.model).cuda()
    trainer = compile(ex.model, Cluster.local(), example_inputs=small.example_inputs,
                      example_targets=small.targets, loss_fn=ex.loss_fn,
                      optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), global_batch_size=4,
                      precision="bf16", force={"fp8": "tensorwise", "fp8_skip": (),
                                               "zero_stage": 3, "offload_params": True,
                                               "offload_optimizer": True,
                                               "micro_batch_size": 4, "recompute": "none",
                                               "compiled": True})
    assert trainer.config.fp8 == "tensorwise" and trainer.config.uses_fsdp
    wrapped = [n for m in trainer.stage_modules for n, p in m.named_parameters()
               if isinstance(p, DTensor)
               and isinstance(p._local_tensor, WeightWithDynamicFloat8CastTensor)]
    assert wrapped, "no weight is gathered in fp8"
    cfg = Float8LinearConfig.from_recipe_name("tensorwise")
    cfg = Float8LinearConfig(**{**cfg.__dict__, "enable_fsdp_float8_all_gather": True})
    convert_to_float8_training(by_hand, config=cfg)
    mesh = init_device_mesh("cuda", (dist.get_world_size(),)) if dist.is_initialized() else None
    if mesh is None:
        pytest.skip("compile() left no process group to shard the by-hand model over")
    kw = dict(mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=True),
              mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                             reduce_dtype=torch.float32))
    for layer in by_hand.model.layers:
        fully_shard(layer, **kw)
    fully_shard(by_hand, **kw)
    run_by_hand = torch.compile(by_hand)
    start = {n: p.full_tensor().detach().cpu().clone() for n, p in by_hand.named_parameters()}
    opt = torch.optim.AdamW(by_hand.parameters(), lr=1e-3)
    batch = [x.cuda() for x in (*ex.example_inputs, ex.targets)]
    losses = [trainer.step(batch) for _ in range(3)]
    want = []
    for _ in range(3):
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = ex.loss_fn(run_by_hand(*batch[:-1]), batch[-1])
        loss.backward()
        opt.step()
        precompute_float8_dynamic_scale_for_fsdp(by_hand)
        want.append(loss.item())
    assert losses == pytest.approx(want, rel=1e-2)
    got = trainer.full_state_dict()
    for n, p in by_hand.named_parameters():
        now = p.full_tensor().detach().cpu()
        now = getattr(now, "_tensor", now)
        moved = (now - start[n]).norm()
        mine = got[n].cpu().to(now.dtype)
        mine = getattr(mine, "_tensor", mine)
        assert (mine - now).norm() <= 1e-1 * moved + 1e-6, n
