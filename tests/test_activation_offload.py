"""Activation offload (``ParallelConfig.offload_activations``): the saved activations of the
first layers of every chunk go to host memory and come back for backward. Checked: a plan that
offloads trains like one device (2 gloo ranks; fp32 and bf16; autoplan's GPT and HF Llama;
with and without full recomputation; FSDP2 and a pipeline), the bytes its hooks copy in one
step equal the prediction, the estimate saves device memory and prices the copies, the search
offloads where memory is tight on a GPU, and the refusals.
"""

import pytest

from autoplan import Cluster, ConfigError
from autoplan import plan as make_plan
from autoplan.graph import trace
from autoplan.models import build_example
from autoplan.planner.planfile import Plan
from autoplan.sharding.parallel_config import ParallelConfig
from tests.conftest import has_transformers
from tests.distributed import run_ranks
from tests.test_zoo import GLOBAL_BATCH, STEPS, _optimizer, assert_equal_to_one_device

# the hooks copy each saved storage once per layer call; the estimate counts each kept value
# once per layer (``cost.memory.activation_parts``; under autocast each product's own 16-bit
# copy of what it reads, ``cost.dtypes.cast_copies``). What the estimate misses: the float copy
# of a boolean attention mask that CPU attention makes and keeps (HF Llama: 2,048 of 208,384
# bytes per micro-batch of 4 in bf16, 1.0 %; 1.4 % in fp32). Under full recomputation a layer
# copies its input alone: exact
BYTES_TOLERANCE = 0.02

def _plan(name, world, force, precision="fp32"):
    small = build_example(name, batch_size=1, seed=0)
    g = trace(small.model, small.example_inputs, loss_fn=small.loss_fn, targets=small.targets)
    return make_plan(g, Cluster.local(world), global_batch_size=GLOBAL_BATCH,
                     precision=precision, profile=None, force=force, sharding="megatron",
                     max_pp=force.get("pp", 1))


def _rank(rank, world, name, plan_json):
    from autoplan.runtime.trainer import compile
    ex = build_example(name, batch_size=GLOBAL_BATCH, seed=0)
    small = build_example(name, batch_size=1, seed=0)
    trainer = compile(ex.model, "local", example_inputs=small.example_inputs,
                      example_targets=small.targets, loss_fn=ex.loss_fn, optimizer=_optimizer,
                      global_batch_size=GLOBAL_BATCH, plan=Plan.from_json(plan_json))
    batch = tuple(ex.example_inputs) + (ex.targets,)
    counter = trainer.activation_offload
    losses = []
    for _ in range(STEPS):
        counter.reset()
        losses.append(trainer.step(batch))
    state = trainer.full_state_dict()
    return (losses, {k: v.tolist() for k, v in state.items()}, trainer.rank,
            counter.total_to_host_bytes, counter.total_to_device_bytes)


def _check_bytes(plan, results):
    """Each rank's copies in its last step against its stage's prediction per micro-batch
    times the micro-batches it runs; a stage after the first keeps its received input on the
    device (the schedule holds it for backward): neither copied nor predicted."""
    from autoplan.sharding.mesh_axes import MeshAxis
    cfg = plan.config
    m = cfg.microbatches(GLOBAL_BATCH)
    stages = plan.predicted["stages"]
    for _, _, rank, up, down in results:
        stage = stages[cfg.dims.index(rank, MeshAxis.PP)]
        want = stage.get("offloaded_activation_bytes_per_microbatch", 0.0) * m
        assert up == down, (up, down)            # every copy came back
        assert up > 0 and up == pytest.approx(want, rel=BYTES_TOLERANCE), (rank, up, want)


CASES = [
    # a pipeline (the last stage's layer offloads what it saves, less its received input), an
    # HF model under bf16 autocast (three 16-bit copies of the normed input for q, k and v)
    ("hf-llama-gqa-tiny", dict(pp=2, schedule="1f1b", offload_activations=1), "bf16"),
    # full recomputation offloads each checkpoint's input; under FSDP2
    ("gpt-tiny", dict(dp=2, zero_stage=3, recompute="full", offload_activations=1), "fp32"),
]


@pytest.mark.parametrize("name,force,precision", CASES,
                         ids=[",".join(f"{k}={v}" for k, v in c[1].items()) for c in CASES])
def test_an_offloading_plan_trains_like_one_device(name, force, precision):
    plan = _plan(name, 2, force, precision)
    assert plan.config.offload_activations == force["offload_activations"]
    assert plan.offload["activations"], plan.offload
    results = run_ranks(_rank, 2, name, plan.to_json(), timeout_s=300.0)
    if precision == "fp32":
        assert_equal_to_one_device(name, [r[:2] for r in results], plan.config.short())
    else:
        from tests.test_zoo_16bit import assert_like_eager_autocast
        assert_like_eager_autocast(name, precision, [r[:2] for r in results],
                                   plan.config.short())
    _check_bytes(plan, results)


def test_a_stage_offloads_none_of_its_received_input():
    """Under full recomputation the first layer of a later pipeline stage keeps only its
    input, which the schedule holds anyway: the estimate moves nothing there."""
    plan = _plan("gpt-tiny", 2, dict(pp=2, schedule="1f1b", recompute="full",
                                     offload_activations=1))
    first, last = plan.predicted["stages"]
    assert first["offloaded_activation_bytes_per_microbatch"] > 0
    assert "offloaded_activation_bytes_per_microbatch" not in last
    # and inspect says which layers offload, the bytes per stage, the host memory and time
    from autoplan.planner.explain import explain_plan
    text = explain_plan(plan)
    assert "activation offload (1 per chunk): layers.0, layers.1" in text, text
    assert "stage 0: 16.00 KiB, stage 1: 0 B" in text and "host memory held" in text, text


def test_offload_saves_device_memory_and_prices_the_copies():
    """Llama-3-8B shapes on one H100: offloading every layer's activations takes them off the
    device (less what one layer holds in flight) and into host memory, and costs the copies
    that the next layer's compute cannot hide (the last layer's whole)."""
    from autoplan import estimate
    from autoplan.models import build_example as build
    ex = build("gpt-tiny", batch_size=1, seed=0)
    g = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    h100 = Cluster.preset("dgx-h100", nodes=1)
    base = ParallelConfig(dp=8, micro_batch_size=4)
    plain = estimate(g, h100, config=base, global_batch_size=32, profile=None)
    off = estimate(g, h100, config=ParallelConfig(dp=8, micro_batch_size=4,
                                                  offload_activations=2),
                   global_batch_size=32, profile=None)
    moved = off.stages[0].offloaded_activation_bytes_per_microbatch
    assert moved > 0 and plain.stages[0].offloaded_activation_bytes_per_microbatch == 0
    assert off.stages[0].activation_bytes_per_microbatch == pytest.approx(
        plain.stages[0].activation_bytes_per_microbatch - moved)
    assert off.stages[0].memory.offloaded_bytes >= moved
    # a tiny layer's copies hide behind the head's compute on an H100: nothing exposed
    assert off.time.comm_exposed_s["activation_offload"] >= 0
    assert "activation_offload" not in plain.time.comm_exposed_s
    assert off.step_time_s >= plain.step_time_s


def test_refusals():
    with pytest.raises(ConfigError, match="selective"):
        ParallelConfig(recompute="selective", offload_activations=1)
    with pytest.raises(ConfigError, match="compiled"):
        ParallelConfig(compiled=True, offload_activations=1)
    with pytest.raises(ConfigError, match="layer count"):
        ParallelConfig(offload_activations=-1)
    c = ParallelConfig(recompute="full", offload_activations=3)
    assert ParallelConfig.from_dict(c.to_dict()) == c and "offload-act3" in c.short()
    assert "offload_activations" not in ParallelConfig().to_dict()
