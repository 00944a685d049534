"""The rank program compiled (``ParallelConfig.compiled``): regional ``torch.compile``, one
layer at a time, composed with tensor parallelism, FSDP2, pipelines, recomputation and
checkpoints, and computing what the eager program computes.

Inductor builds C++ on the CPU (seconds to a minute a graph here), so the cases are few and
small: layers of one kind share one compiled graph (``program_modules.share_code``), which is what
keeps compile time bounded at any depth.
"""

import json
from dataclasses import dataclass

import pytest

from autoplan import Cluster
from autoplan import plan as make_plan
from autoplan.graph import trace
from autoplan.models import build_example
from autoplan.planner.planfile import Plan
from autoplan.runtime.program_modules import OUTSIDE
from tests.conftest import has_transformers
from tests.distributed import run_ranks
from tests.test_zoo import GLOBAL_BATCH, STEPS, _optimizer, assert_equal_to_one_device


def _plan(name, world, force, sharding="ilp", precision="fp32"):
    small = build_example(name, batch_size=1, seed=0)
    g = trace(small.model, small.example_inputs, loss_fn=small.loss_fn, targets=small.targets)
    return make_plan(g, Cluster.local(world), global_batch_size=GLOBAL_BATCH,
                     precision=precision, profile=None, force=force, sharding=sharding,
                     max_pp=force.get("pp", 1))


def _rank(rank, world, name, plan_json, ckpt):
    from autoplan.runtime.trainer import compile
    ex = build_example(name, batch_size=GLOBAL_BATCH, seed=0)
    small = build_example(name, batch_size=1, seed=0)
    trainer = compile(ex.model, "local", example_inputs=small.example_inputs,
                      example_targets=small.targets, loss_fn=ex.loss_fn, optimizer=_optimizer,
                      global_batch_size=GLOBAL_BATCH, plan=Plan.from_json(plan_json))
    compiled = {n.replace("_checkpoint_wrapped_module.", ""): type(m)
                for n, m in trainer.model.named_modules()
                if getattr(m, "_compiled_call_impl", None) is not None}
    from torch._dynamo.utils import counters
    counters.clear()
    batch = tuple(ex.example_inputs) + (ex.targets,)
    losses = [trainer.step(batch)]
    first = counters["stats"]["unique_graphs"]
    losses += [trainer.step(batch) for _ in range(STEPS - 1)]
    graphs = counters["stats"]["unique_graphs"]
    if ckpt:
        trainer.save(ckpt)                      # the weights keep the user's names
    state = trainer.full_state_dict()
    return losses, {k: v.tolist() for k, v in state.items()}, Compiled(
        sorted(compiled), len(set(compiled.values())), first, graphs,
        sorted(str(k) for k in counters["graph_break"]))


@dataclass(frozen=True)
class Compiled:
    """What one rank compiled: the modules (paths), their classes (layers of one kind share
    one, so do identical parts between layers), dynamo's graphs after the first step and after
    the last (equal: nothing recompiled), and the graph breaks' reasons."""

    modules: list[str]
    kinds: int
    graphs_first_step: int
    graphs: int
    breaks: list[str]

    def check(self, label: str, collectives: bool) -> None:
        outside = [m for m in self.modules if m.rpartition(".")[2].startswith(OUTSIDE)]
        # the layers and the parts between them (embedding, head, loss) compiled: a part left
        # out would run eagerly, silently
        assert outside and len(outside) < len(self.modules), (label, self.modules)
        assert self.graphs == self.graphs_first_step, (label, "recompiled", self)
        if collectives:         # tp: each collective a graph break, pieces compiled around it
            assert self.graphs >= self.kinds, (label, self)
        else:                   # one graph per kind of region: none stayed eager
            assert self.graphs == self.kinds and not self.breaks, (label, self)


CASES = [
    # (model, world, forced fields, sharding rule): tensor and sequence parallelism under full
    # recomputation (compiled inside the checkpoint, collectives between compiled pieces), a
    # pipeline whose one-layer stages recompute selectively (compiled with the checkpoint)
    ("gpt-tiny", 2, dict(tp=2, recompute="full"), "megatron"),
    ("gpt-tiny", 2, dict(pp=2, schedule="1f1b", stage_recompute=("selective", "none")), "ilp"),
    # FSDP2 (ZeRO-3): the root unit's weights (embedding, final norm, head) gathered by the
    # root and read by the compiled parts between layers; an HF model from its config under
    # tp (vocabulary-parallel embedding and loss: eager calls inside the compiled parts)
    ("gpt-tiny", 2, dict(tp=1, zero_stage=3), "ilp"),
    ("hf-llama-gqa-tiny", 2, dict(tp=2), "megatron"),
]


@pytest.mark.parametrize("name,world,force,sharding", CASES,
                         ids=[f"{c[0]}-{c[3]}-" + ",".join(f"{k}={v}" for k, v in c[2].items())
                              for c in CASES])
def test_a_compiled_plan_trains_like_one_device(name, world, force, sharding, tmp_path):
    plan = _plan(name, world, dict(force, compiled=True), sharding)
    assert plan.config.compiled and "compiled" in plan.config.short()
    results = run_ranks(_rank, world, name, plan.to_json(), str(tmp_path / "ckpt"),
                        timeout_s=600.0)
    for _, _, compiled in results:
        compiled.check(plan.config.short(), collectives=plan.config.tp > 1)
        print(f"{plan.config.short()}: {compiled}")
    assert_equal_to_one_device(name, [r[:2] for r in results], plan.config.short())
    assert (tmp_path / "ckpt" / "latest").exists()


@pytest.mark.skipif(not has_transformers(), reason="transformers not installed")
def test_a_compiled_zero3_bf16_plan_of_hf_llama_trains_as_eager_autocast():
    """FSDP2's 16-bit gathers and an HF model under torch.compile, in bf16: measured against
    fp32 training as eager autocast is (tests/test_zoo_16bit.py's criterion; inductor fuses
    and reorders element-wise work in fp32 where eager rounds each op to bf16)."""
    from tests.test_zoo_16bit import assert_like_eager_autocast
    name = "hf-llama-gqa-tiny"
    p = _plan(name, 2, dict(tp=1, zero_stage=3, compiled=True), precision="bf16")
    res = run_ranks(_rank, 2, name, p.to_json(), "", timeout_s=600.0)
    for r in res:
        r[2].check(p.config.short(), collectives=False)
    assert_like_eager_autocast(name, "bf16", [r[:2] for r in res], p.config.short())


def test_compiled_layers_with_collectives_never_recompute_selectively():
    """torch.compile cannot trace a tensor-parallel layer whole (its collectives are graph
    breaks), and the selective policy cannot run inside compiled code: the planner leaves
    selective recomputation out of compiled tp plans, refuses it when forced, and the runtime
    refuses a hand-made plan that has it, before any collective."""
    from autoplan import ConfigError
    from autoplan.planner.search_space import selective_compiles
    from autoplan.sharding.parallel_config import ParallelConfig
    assert selective_compiles(ParallelConfig(dp=2, compiled=True))
    assert not selective_compiles(ParallelConfig(tp=2, compiled=True))
    assert selective_compiles(ParallelConfig(tp=2))
    p = _plan("gpt-tiny", 2, dict(tp=2, compiled=True))
    assert p.config.compiled and "selective" not in p.recompute.values()
    with pytest.raises(ConfigError):
        _plan("gpt-tiny", 2, dict(tp=2, compiled=True, recompute="selective"))
    p = _plan("gpt-tiny", 2, dict(tp=2, recompute="selective"))   # eager: selective runs
    assert "selective" in p.recompute.values()
    d = p.to_dict()
    d["config"]["compiled"] = d["predicted"]["config"]["compiled"] = True   # hand-edited
    for said in run_ranks(_refused, 2, "gpt-tiny", json.dumps(d)):
        assert "selectively" in said, said


def _refused(rank, world, name, plan_json):
    from autoplan import PlanError
    from autoplan.runtime.trainer import compile
    ex = build_example(name, batch_size=GLOBAL_BATCH, seed=0)
    small = build_example(name, batch_size=1, seed=0)
    try:
        compile(ex.model, "local", example_inputs=small.example_inputs,
                example_targets=small.targets, loss_fn=ex.loss_fn, optimizer=_optimizer,
                global_batch_size=GLOBAL_BATCH, plan=Plan.from_json(plan_json))
    except PlanError as e:
        import torch.distributed as dist
        assert not dist.is_initialized()            # refused before any process group
        return str(e)
    return "not refused"


def test_ops_recomputation_is_selective_too_for_compiled_tp_layers():
    """Recomputing by ops (keep the products) runs on torch's selective checkpointing, which
    compiled layers with collectives cannot run (``selective_compiles``) as much as
    'selective': a forced or chosen 'ops' on a compiled tp config becomes its eager twin, where
    the runtime used to refuse the plan the search made (GPT-3 175B / 128 A100 with
    recompute=ops forced: dp1 tp8 pp16 compiled)."""
    from autoplan.graph import trace
    from autoplan.planner.options import SearchOptions
    from autoplan.planner.search_space import with_compilation
    from autoplan.sharding.parallel_config import ParallelConfig
    ex = build_example("gpt-tiny", batch_size=1, seed=0)
    g = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    for pp in (1, 2):
        c = ParallelConfig(tp=2, pp=pp, compiled=True, recompute="ops")
        out = with_compilation(c, SearchOptions(force={"recompute": "ops"}), g)
        assert [x.compiled for x in out] == [False], (pp, out)
    one = ParallelConfig(tp=2, compiled=True, recompute="ops")
    assert [x.compiled for x in with_compilation(one, SearchOptions(), g)] == [False]
    full = ParallelConfig(tp=2, compiled=True, recompute="full")
    assert with_compilation(full, SearchOptions(force={"recompute": "full"}), g) == [full]
