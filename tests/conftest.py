"""Shared test fixtures. Torch is limited to one thread per process for stable, fast tests
(and because forked distributed ranks deadlock otherwise; see ARCHITECTURE.md)."""

import atexit
import os
import shutil
import tempfile

import pytest
import torch

torch.set_num_threads(int(os.environ.get("AUTOPLAN_TEST_THREADS", "1")))
# no first-use calibration of this CPU (its figures would depend on the machine and its load);
# tests/test_cluster.py checks that path on its own, with a private profile folder
os.environ.setdefault("AUTOPLAN_AUTO_CALIBRATE", "0")
# nor the user's profile cache: a profile another process writes there mid-run (a first-use
# calibration, `autoplan profile`) would change Cluster.local() under the suite
if "AUTOPLAN_PROFILE_CACHE" not in os.environ:
    os.environ["AUTOPLAN_PROFILE_CACHE"] = tempfile.mkdtemp(prefix="autoplan-test-cache-")
    atexit.register(shutil.rmtree, os.environ["AUTOPLAN_PROFILE_CACHE"], ignore_errors=True)
# nor the profile shipped for this CPU: the local cluster takes the default calibration on every
# machine, so the ILP's choices the runtime tests run do not change with the CPU (with this
# machine's profile the ILP replicated every op of the small HF Llama over tp, testing nothing)
os.environ.setdefault("AUTOPLAN_CPU_NAME", "autoplan test CPU")


def has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
        return True
    except ImportError:
        return False


@pytest.fixture(scope="session")
def gpt3_two_layers():
    """GPT-3 175B shapes (s=2048, h=12288, a=96) with 2 layers, traced on the meta device."""
    from autoplan.graph import trace
    from autoplan.models import build_example
    ex = build_example("gpt3-175b", device="meta", batch_size=1, num_layers=2)
    return trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)


@pytest.fixture(scope="session")
def gpt_tiny_two_rank_plan_path(tmp_path_factory):
    """gpt-tiny planned for two local ranks (global batch 8, fp32, tp 1, ZeRO-1, the ILP),
    saved once: the plan the torchrun tests of the checkpoint folder and of restarts run."""
    from autoplan import Cluster
    from autoplan import plan as make_plan
    from autoplan.graph import trace
    from autoplan.models import build_example
    small = build_example("gpt-tiny", batch_size=1, seed=0)
    g = trace(small.model, small.example_inputs, loss_fn=small.loss_fn, targets=small.targets,
              name="gpt-tiny")
    plan = make_plan(g, Cluster.local(2), global_batch_size=8, precision="fp32", profile=None,
                     force=dict(tp=1, zero_stage=1), sharding="ilp")
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    plan.save(str(path))
    return str(path)
