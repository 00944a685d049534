"""Every bad argument is a typed error that names the fix, and nothing hangs (issue 37, part 5).

One test per class of mistake a held-out set of bad arguments found: ``--force`` with an
unknown field, a plan that is not a path, a training batch that is not what the model was
traced with (one process, and a pipelined plan on two ranks), ``estimate --tp 0``, outputs
that cannot be written, ``module:function`` specs that name no function, and sizes too large
to plan. ``tests/test_fuzz.py`` runs the generated cases over every sub-command.
"""

import signal

import pytest
import torch
from torch import nn

import autoplan
from autoplan import AutoplanError, Cluster, ConfigError, ParallelConfig, PlanError
from autoplan.cli.main import main
from tests.distributed import run_ranks


@pytest.fixture(scope="module")
def small():
    """A two-layer MLP traced on 2-row examples, and its one-process plan for a batch of 8."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(2, 8), torch.randint(0, 4, (2,))
    g = autoplan.trace(model, (x,), loss_fn=nn.functional.cross_entropy, targets=y)
    plan = autoplan.plan(g, Cluster.local(1), global_batch_size=8, precision="fp32",
                         profile=None)
    return model, x, y, g, plan


@pytest.fixture(scope="module")
def files(tmp_path_factory, small):
    tmp = tmp_path_factory.mktemp("bad-arguments")
    g, plan = small[3], small[4]
    (tmp / "graph.json").write_text(g.to_json())
    plan.save(str(tmp / "plan.json"))
    (tmp / "notes.txt").write_text("a file, not a folder\n")
    return tmp


class _Hang(Exception):
    pass


def _bounded(fn, limit_s=60):
    """``fn()`` under a hang guard (not a speed assertion): over ``limit_s`` it fails."""
    def alarm(*_):
        raise _Hang(f"no answer within {limit_s} s")
    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _cli(capsys, *argv):
    """(exit status, stderr) of ``autoplan ARGV`` run in this process, under the hang guard."""
    try:
        rc = _bounded(lambda: main([str(a) for a in argv]))
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


# ---- --force and the search options ---------------------------------------------------------

def test_unknown_force_field_lists_the_valid_ones(capsys, files):
    rc, err = _cli(capsys, "plan", files / "graph.json", "--cluster", "local:1",
                   "--global-batch", "8", "-o", files / "out.json", "--force", "Tp=2")
    assert rc == 1 and "no ParallelConfig field 'Tp'" in err and "did you mean 'tp'" in err
    assert "zero_stage" in err and "micro_batch_size" in err      # the valid fields, listed
    assert not (files / "out.json").exists()
    with pytest.raises(ConfigError, match="the fields are dp, tp, pp"):
        autoplan.plan(autoplan.OpGraph.from_json((files / "graph.json").read_text()),
                      "local:1", global_batch_size=8, profile=None, force={"bogus": 1})


def test_plan_help_lists_the_force_fields(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    fields = text.split("FIELD is one of:")[1]
    for name in ("tp", "zero_stage", "micro_batch_size", "offload_params", "virtual_stages"):
        assert name in fields


@pytest.mark.parametrize("options, words", [
    (dict(top_k="a"), "top_k must be an integer >= 0"),
    (dict(max_tp="2"), "max_tp must be None (no limit) or a positive integer"),
    (dict(micro_batch_sizes=(0,)), "micro_batch_sizes must be"),
    (dict(zero_stages=(7,)), "zero_stages must be a non-empty list of ZeRO stages"),
    (dict(memory_margin_bytes="x"), "memory_margin_bytes must be None"),
    (dict(force={"tp": "2"}), "force tp='2' must be an integer"),
    (dict(force={"zero_stage": 9}), "ZeRO stages are 0 to 3"),
    (dict(progress=3), "progress must be None or a function"),
])
def test_search_options_of_the_wrong_kind_are_refused(small, options, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        autoplan.plan(small[3], "local:1", global_batch_size=8, profile=None, **options)


# ---- plans given as something other than a path -------------------------------------------------

@pytest.mark.parametrize("value", [3, None, ["plan.json"], {"path": "plan.json"}, 2.5,
                                   "a\0b", b"\0"])
def test_load_plan_and_compile_refuse_a_non_path(small, value):
    with pytest.raises(PlanError, match="must be a path|NUL character"):
        autoplan.load_plan(value)
    if value is None:                     # compile(plan=None) plans now
        return
    model, x, y, _, _ = small
    with pytest.raises(PlanError, match="must be a path|NUL character"):
        autoplan.compile(model, "local", example_inputs=(x,), example_targets=y,
                         loss_fn=nn.functional.cross_entropy, global_batch_size=8,
                         optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), plan=value)


def test_load_plan_refuses_a_graph_or_cluster_of_the_wrong_kind(files):
    with pytest.raises(PlanError, match="graph must be None or an OpGraph"):
        autoplan.load_plan(files / "plan.json", graph="model.json")
    with pytest.raises(AutoplanError, match="cluster must be an autoplan.Cluster"):
        autoplan.load_plan(files / "plan.json", cluster=3)


# ---- Trainer.step's batch -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def trainer(small):
    model, x, y, _, plan = small
    return autoplan.compile(model, "local", example_inputs=(x,), example_targets=y,
                            loss_fn=nn.functional.cross_entropy, global_batch_size=8,
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), plan=plan)


X, Y = torch.randn(8, 8), torch.randint(0, 4, (8,))


@pytest.mark.parametrize("batch, words", [
    (None, "got None"),
    ((), "got a batch of 0 tensor"),
    ((X,), "traced with 2 (the targets go last)"),
    ((X, Y, Y), "got a batch of 3 tensor"),
    ((torch.randn(8, 9), Y), "input 0 has shape [8, 9], traced as [8, 8]"),
    ((X[:7], Y[:7]), "input 0 has 7 rows, the plan is for a global batch of 8"),
    ((X.double(), Y), "input 0 is float64, traced as float32"),
    ((X, Y.float()), "targets is float32, traced as int64"),
    ((X.to("meta"), Y), "input 0 is a meta tensor"),
    ((X.tolist(), Y), "input 0 is a list"),
    ({"x": X, "y": Y}, "takes the global batch as a tuple"),
])
def test_step_refuses_a_batch_unlike_the_traced_one(trainer, batch, words):
    before = trainer.steps_done
    with pytest.raises(PlanError) as info:
        trainer.step(batch)
    assert words in str(info.value)
    assert "xpected (input 0: float32 [8, 8], targets: int64 [8])" in str(info.value)
    assert trainer.steps_done == before                            # nothing ran


def test_step_still_trains_on_the_right_batch(trainer):
    before = trainer.steps_done
    losses = [trainer.step((X, Y)) for _ in range(3)]
    assert trainer.steps_done == before + 3 and losses[-1] < losses[0]


def _pipelined(rank, world, plan_json):
    from autoplan.models import build_example
    from autoplan.planner.planfile import Plan
    ex = build_example("gpt-tiny", batch_size=8, seed=0, num_layers=2, num_heads=2)
    small = build_example("gpt-tiny", batch_size=1, seed=0, num_layers=2, num_heads=2)
    trainer = autoplan.compile(ex.model, "local", example_inputs=small.example_inputs,
                               example_targets=small.targets, loss_fn=ex.loss_fn,
                               optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                               global_batch_size=8, plan=Plan.from_json(plan_json))
    (ids,), targets = ex.example_inputs, ex.targets
    answers = []
    for bad in [ids, (ids,), (ids[:4], targets[:4]), (ids.float(), targets),
                (ids[:, :5], targets)]:
        try:
            trainer.step(bad)
            answers.append("accepted")
        except PlanError as e:
            answers.append(str(e))
    loss = trainer.step((ids, targets))          # the ranks are still in step with each other
    return answers, loss


def test_pipelined_step_refuses_a_bad_batch_on_every_rank_before_any_collective():
    from autoplan.models import build_example
    small = build_example("gpt-tiny", batch_size=1, seed=0, num_layers=2, num_heads=2)
    g = autoplan.trace(small.model, small.example_inputs, loss_fn=small.loss_fn,
                       targets=small.targets)
    plan = autoplan.plan(g, Cluster.local(2), global_batch_size=8, precision="fp32",
                         profile=None, force={"pp": 2}, max_pp=2, sharding="megatron")
    results = run_ranks(_pipelined, 2, plan.to_json(), timeout_s=240)
    assert results[0][0] == results[1][0]                     # the same answer on each rank
    answers = results[0][0]
    assert "takes the global batch as a tuple" in answers[0]  # a lone tensor: no targets
    assert "traced with 2 (the targets go last)" in answers[1]
    assert "has 4 rows, the plan is for a global batch of 8" in answers[2]
    assert "input 0 is float32, traced as int64" in answers[3]
    assert "input 0 has shape [8, 5]" in answers[4]
    assert all(isinstance(loss, float) for _, loss in results)


# ---- the CLI -------------------------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--tp", "--pp", "--cp"])
def test_estimate_with_a_zero_degree_names_the_flag(capsys, files, flag):
    rc, err = _cli(capsys, "estimate", files / "graph.json", "--cluster", "local:2",
                   "--global-batch", "8", flag, "0")
    assert rc == 1 and f"{flag} takes a degree >= 1, got 0" in err


def test_estimate_stage_recompute_names_the_policies(capsys, files):
    rc, err = _cli(capsys, "estimate", files / "graph.json", "--cluster", "local:2",
                   "--global-batch", "8", "--pp", "2", "--stage-recompute", "full,bogus")
    assert rc == 1 and "none, selective, ops, full" in err


def test_outputs_that_cannot_be_written_are_refused_before_any_work(capsys, files):
    under_a_file = files / "notes.txt" / "graph.json"
    rc, err = _cli(capsys, "trace", "mlp-tiny", "-o", under_a_file)
    assert rc == 1 and "does not exist" in err
    rc, err = _cli(capsys, "trace", "mlp-tiny", "-o", files)
    assert rc == 1 and "is a folder" in err
    for flag in ("--timeline", "--memory"):
        rc, err = _cli(capsys, "inspect", files / "plan.json", flag, files / "figure.unknown")
        assert rc == 1 and ".png" in err and ".svg" in err           # the formats written
        rc, err = _cli(capsys, "inspect", files / "plan.json", flag, "/proc/autoplan.png")
        assert rc == 1 and "cannot be written" in err
    rc, err = _cli(capsys, "export", files / "no-checkpoint", "-o", files / "model.bin")
    assert rc == 1 and ".safetensors or .pt" in err
    assert not (files / "figure.unknown").exists()


@pytest.mark.parametrize("flag, value, words", [
    ("--lr", "nan", "--lr takes a learning rate >= 0, got nan"),
    ("--lr", "-1", "--lr takes a learning rate >= 0, got -1.0"),
    ("--master-port", "70000", "--master-port takes a TCP port, 1 to 65535, got 70000"),
])
def test_run_refuses_a_learning_rate_or_port_that_cannot_be(capsys, files, flag, value, words):
    rc, err = _cli(capsys, "run", files / "plan.json", "--model", "mlp-tiny", "--print-command",
                   flag, value)
    assert rc == 1 and words in err


@pytest.mark.parametrize("spec, words", [
    ("os:sep", "not a function of no arguments"),
    ("json:decoder", "not a function of no arguments"),
    ("json:dumps", "not a function of no arguments"),
    ("os:getcwd", "returned str, not an autoplan.models.Example"),
    (":make", "is not a model spec"),
    ("..os:sep", "is not a model spec"),
    ("json:", "is not a model spec"),
    ("autoplan_no_such_module:make", "cannot load"),
])
def test_module_function_specs_that_name_no_example_builder(capsys, spec, words):
    rc, err = _cli(capsys, "trace", spec)
    assert rc == 1 and words in err


def test_model_sizes_beyond_reason_are_refused_before_building(capsys):
    rc, err = _cli(capsys, "trace", "gpt-tiny", "--layers", "1000000000")   # hung before
    assert rc == 1 and "--layers 1000000000 is out of range: give 1 to 1,024 layers" in err
    rc, err = _cli(capsys, "trace", "gpt-tiny", "--seq-len", "0")
    assert rc == 1 and "--seq-len 0 is out of range" in err


# ---- sizes that cannot be planned in reasonable time ------------------------------------------

def test_a_global_batch_of_ten_to_the_twelve_is_refused_up_front(small):
    g = small[3]
    for who, call in [("plan()", lambda: autoplan.plan(g, "local:4", global_batch_size=10 ** 12,
                                                      profile=None)),
                      ("estimate()", lambda: autoplan.estimate(
                          g, "local:4", config=ParallelConfig(pp=2, dp=2),
                          global_batch_size=10 ** 12, profile=None))]:
        with pytest.raises(ConfigError, match=f"{who.replace('(', '.').replace(')', '.')}: a "
                                              "global batch of 1,000,000,000,000 samples"):
            _bounded(call)


def test_a_pipelined_step_of_too_many_micro_batches_is_refused(small):
    g = small[3]
    with pytest.raises(ConfigError, match="8,192 micro-batches per step .* at most 4,096"):
        _bounded(lambda: autoplan.estimate(g, "local:2", config=ParallelConfig(pp=2),
                                           global_batch_size=8192, profile=None))
    # the same batch without a pipeline is priced in closed form
    est = _bounded(lambda: autoplan.estimate(g, "local:2", config=ParallelConfig(dp=2),
                                             global_batch_size=8192, profile=None))
    assert est.step_time_s > 0
    # and the search plans it, leaving out the pipelines it cannot simulate
    plan = _bounded(lambda: autoplan.plan(g, "local:2", global_batch_size=2 ** 20,
                                          profile=None))
    assert plan.config.pp == 1 or plan.config.microbatches(2 ** 20) <= 4096
