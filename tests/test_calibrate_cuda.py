"""`autoplan calibrate` on GPUs. Without a GPU: the kernel attribution runs on events built as
torch.profiler builds them (torch's own ``FunctionEvent``s, its own tree-building: a CUDA
kernel carries the id of the CPU op that launched it in ``linked_correlation_id``), and the
refit's arithmetic recovers known rates from kernels timed by them. With one (the ``gpu``
tests): a real plan's steps profiled on the GPU, and `autoplan calibrate` end to end."""

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import EventList, FunctionEvent

from autoplan.cost.compute import size_efficiency
from autoplan.cost.refit import refit_device, typed_bytes
from autoplan.estimate.attribution import attribute
from autoplan.runtime.step_trace import DEVICE_TIMELINE, device_kernels

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
STREAM, NCCL_STREAM = 7, 20


def _op(id, name, start, end, shapes=(), dtypes=(), thread=1, linked=0):
    return FunctionEvent(id=id, name=name, thread=thread, start_us=start, end_us=end,
                         input_shapes=[list(s) for s in shapes], input_dtypes=list(dtypes),
                         linked_correlation_id=linked, use_device="cuda")


def _kernel(id, name, start, end, linked, stream=STREAM):
    return FunctionEvent(id=id, name=name, thread=0, start_us=start, end_us=end,
                         device_type=DeviceType.CUDA, device_resource_id=stream,
                         linked_correlation_id=linked, use_device="cuda")


def _profiled_step():
    """One step as torch.profiler gives it (times in us): an autocast linear's product (its
    casts inside it), a GELU, an all-reduce, AdamW, a Triton kernel of a compiled region; the
    CUDA runtime's launch calls carry the launching op's id too, and one API call linked to
    nothing has an id an op also has."""
    bf16, f32 = "c10::BFloat16", "float"
    events = [
        _op(1, "aten::mm", 0, 100, [[64, 128], [128, 256]], [f32, f32]),
        _op(2, "aten::_to_copy", 5, 20, [[64, 128], []], [f32, "Scalar"]),
        _op(3, "aten::copy_", 6, 19, [[64, 128], [64, 128], []], [bf16, f32, "Scalar"]),
        _op(1001, "cudaLaunchKernel", 7, 9, linked=3),
        _op(4, "aten::mm", 30, 90, [[64, 128], [128, 256]], [bf16, bf16]),
        _op(1002, "cudaLaunchKernel", 31, 33, linked=4),
        _op(9, "aten::gelu", 110, 120, [[64, 256], []], [bf16, ""]),
        _op(1006, "cudaLaunchKernel", 111, 113, linked=9),
        _op(7, "nccl:all_reduce", 150, 160, [[256]], [f32]),
        _op(1004, "cudaLaunchKernel", 151, 153, linked=7),
        _op(5, "Optimizer.step#AdamW.step", 200, 300),
        _op(6, "aten::_foreach_add_", 210, 220),
        _op(1003, "cudaLaunchKernel", 211, 213, linked=6),
        _op(8, "Torch-Compiled Region: 0/0", 400, 500),
        _op(1005, "cuLaunchKernel", 410, 412, linked=8),
        _op(4, "cudaStreamIsCapturing", 600, 601),          # an API call linked to no op
        _kernel(1001, "elementwise_kernel<cast>", 10, 14, linked=3),
        _kernel(1002, "sm90_xmma_gemm_bf16bf16_bf16f32", 40, 80, linked=4),
        _kernel(1006, "vectorized_elementwise_kernel<gelu>", 120, 126, linked=9),
        _kernel(1004, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 160, 190, linked=7,
                stream=NCCL_STREAM),
        _kernel(1003, "multi_tensor_apply_kernel", 230, 250, linked=6),
        _kernel(1005, "triton_poi_fused_add_0", 420, 430, linked=8),
    ]
    found = EventList(events, use_device="cuda")
    found._build_tree()                                 # torch's own parent/child tree
    return found


def test_each_kernel_is_attributed_to_the_op_that_launched_it():
    kernels = {k["kernel"]: k for k in device_kernels(_profiled_step())}
    assert len(kernels) == 6 and all(k["thread"] == DEVICE_TIMELINE for k in kernels.values())
    gemm = kernels["sm90_xmma_gemm_bf16bf16_bf16f32"]
    assert (gemm["name"], gemm["kind"], gemm["leaf"]) == ("aten::mm", "matmul", True)
    assert gemm["shapes"] == [[64, 128], [128, 256]] and gemm["dtypes"] == ["bfloat16"] * 2
    assert gemm["start_s"] == pytest.approx(40e-6) and gemm["dur_s"] == pytest.approx(40e-6)
    cast = kernels["elementwise_kernel<cast>"]          # autocast's cast inside the product
    assert (cast["name"], cast["kind"]) == ("aten::copy_", "other")
    assert cast["dtypes"] == ["bfloat16", "float32", None]
    gelu = kernels["vectorized_elementwise_kernel<gelu>"]
    assert (gelu["name"], gelu["kind"], gelu["dtypes"]) == ("aten::gelu", "other",
                                                            ["bfloat16", None])
    nccl = kernels["ncclDevKernel_AllReduce_Sum_f32_RING_LL"]
    assert (nccl["name"], nccl["leaf"], nccl["stream"]) == ("nccl:all_reduce", False,
                                                            NCCL_STREAM)
    adam = kernels["multi_tensor_apply_kernel"]
    assert adam["name"].startswith("Optimizer.step") and not adam["leaf"]
    triton = kernels["triton_poi_fused_add_0"]          # launched outside any aten op
    assert (triton["name"], triton["kind"], triton["shapes"]) == ("triton_poi_fused_add_0",
                                                                   "other", [])


def test_the_phases_are_the_gpus_time():
    kernels = device_kernels(_profiled_step())
    ph = attribute(kernels, [600e-6])
    s = ph.seconds
    assert s["compute.matmul"] == pytest.approx(40e-6)
    assert s["compute.other"] == pytest.approx((4 + 6 + 10) * 1e-6)    # cast, GELU, Triton
    assert s["optimizer"] == pytest.approx(20e-6)
    assert s["comm.all_reduce"] == pytest.approx(30e-6)                # nothing overlaps it
    assert s["other"] == pytest.approx((600 - 110) * 1e-6)             # the GPU waited
    assert ph.total_s() == pytest.approx(ph.step_s)


def _event(name, kind, shapes, dtypes, dur):
    return {"name": name, "kind": kind, "leaf": True, "shapes": shapes, "dtypes": dtypes,
            "dur_s": dur, "start_s": 0.0, "thread": DEVICE_TIMELINE}


def test_refit_device_recovers_known_rates():
    """bf16 products on a size curve, fp32 products and attention left out of the rate,
    memory-bound kernels by their dtypes' bytes, priced at the eager share of a copy's."""
    import random
    rng = random.Random(0)
    rate, copy_bw, share, fixed = 700e12, 4.0e12, 0.7, 2.5e-6
    curve = ((256.0, 0.3), (1024.0, 0.8), (4096.0, 1.0))
    events = []
    for _ in range(300):
        m, k, n = (rng.choice([128, 512, 2048, 8192]) for _ in range(3))
        eff = size_efficiency(curve, (m * k * n) ** (1 / 3))
        t = fixed + 2 * m * k * n / (rate * eff)
        events.append(_event("aten::mm", "matmul", [[m, k], [k, n]], ["bfloat16"] * 2, t))
        events.append(_event("aten::addmm", "matmul", [[n], [m, k], [k, n]],
                             ["bfloat16"] * 3, t))
        events.append(_event("aten::mm", "matmul", [[m, k], [k, n]], ["float32"] * 2, 9 * t))
        events.append(_event("aten::_flash_attention_forward", "matmul", [[8, 16, 1024, 64]],
                             ["bfloat16"], 1e-3))
        size = rng.choice([1, 256, 1 << 16, 1 << 22, 1 << 26])
        dtype = rng.choice(["bfloat16", "float32"])
        nbytes = typed_bytes([[size], [size]], [dtype, dtype])
        events.append(_event("aten::add", "other", [[size], [size], []], [dtype, dtype, None],
                             fixed + nbytes / (share * copy_bw)))
    events.append(dict(_event("aten::_foreach_add_", "optimizer", [[1 << 20]], ["float32"],
                              1.0), leaf=False))
    fit = refit_device(events, curve, "bfloat16", share)
    assert fit.points == {"matmul": 600, "memory": 300}
    assert fit.matmul_flops_per_s == pytest.approx(rate, rel=1e-6)
    assert fit.memory_bandwidth_bytes_per_s == pytest.approx(copy_bw, rel=1e-6)
    assert fit.launch_s == pytest.approx(fixed, rel=1e-2)
    assert typed_bytes([[4, 4], [4, 4], []], ["bfloat16", "float32", None]) == 32 + 64 + 64
    assert typed_bytes([[4]], ["Scalar"]) is None
    with pytest.raises(ValueError):
        refit_device(events, curve, "bfloat16", 0.0)


def test_the_refit_goes_to_the_gpus_profile_and_keeps_the_rest(tmp_path, monkeypatch):
    """A recorded GPU run refits this GPU's profile: the fitted figures replaced, its size
    curve, element-wise rates, dtype and measured ops kept; planning for the GPU finds it."""
    from autoplan.cli import calibrate_cuda
    from autoplan.cli.calibrate_cmd import Measured
    from autoplan.cluster.profile_db import Calibration, OpTiming, ProfileDB
    from tests.test_checkpoint import _plan
    monkeypatch.setenv("AUTOPLAN_PROFILE_DIR", str(tmp_path))
    cal = Calibration(matmul_flops_per_s=600e12, memory_bandwidth_bytes_per_s=3e12,
                      launch_s=5e-6, optimizer_s_per_param=2e-12, optimizer_s_per_tensor=4e-6,
                      step_overhead_s=1e-4, matmul_dtype="bfloat16",
                      matmul_size_efficiency=((256.0, 0.5), (4096.0, 1.0)),
                      elementwise_s_per_element=(("gelu", 1e-12, 2e-12),))
    base = ProfileDB(device="H200-SXM-141GB", device_kind="cuda", threads=1,
                     torch_version=torch.__version__, calibration=cal,
                     entries={"k": OpTiming(fwd_s=1e-3, bwd_s=2e-3, fwd_cv=0.0, bwd_cv=0.0,
                                            repeats=3)}, sources=("autoplan profile",))
    monkeypatch.setattr(calibrate_cuda, "cuda_profile", lambda: ("H200-SXM-141GB", base))
    plan = _plan(1, {})                  # an fp32 plan: its kernels priced at the full share
    kernels = [_event("aten::mm", "matmul", [[n, n], [n, n]], ["bfloat16"] * 2,
                      1e-6 + 2 * n ** 3 / (800e12 * size_efficiency(cal.matmul_size_efficiency,
                                                                    n)))
               for n in (256, 1024, 4096) for _ in range(3)]
    kernels += [_event("aten::mul", "other", [[n], [n]], ["float32"] * 2, 1e-6 + 12 * n / 4e12)
                for n in (1 << 10, 1 << 20, 1 << 24) for _ in range(4)]
    runs = [Measured(plan, [{"device": "cuda", "kernels": kernels, "step_s": [1e-2]}], None)]
    assert runs[0].cuda and runs[0].share == 1.0
    fits = calibrate_cuda.refit_cuda(runs, [1e-3])
    assert fits["compute"].matmul_flops_per_s == pytest.approx(800e12, rel=1e-6)
    assert fits["compute"].memory_bandwidth_bytes_per_s == pytest.approx(4e12, rel=1e-6)
    assert fits["peak_flops_per_s"] > 0              # the datasheet's bf16 peak of the H200
    path = calibrate_cuda.write_cuda_profile(fits, None)
    assert path == str(tmp_path / "H200-SXM-141GB.json")
    db = ProfileDB.find("H200-SXM-141GB")
    c = db.calibration
    assert c.matmul_flops_per_s == pytest.approx(800e12, rel=1e-3)
    assert c.memory_bandwidth_bytes_per_s == pytest.approx(4e12, rel=1e-3)
    assert c.launch_s == pytest.approx(1e-6, rel=1e-2)
    assert c.optimizer_s_per_param == pytest.approx(1e-3 / runs[0].plan.predicted["stages"][0]
                                                    ["params_per_device"], rel=1e-3)
    assert c.matmul_size_efficiency == cal.matmul_size_efficiency
    assert c.elementwise_s_per_element == cal.elementwise_s_per_element
    assert c.matmul_dtype == "bfloat16" and set(db.entries) == {"k"}
    assert db.device_kind == "cuda" and "autoplan calibrate" in db.sources


# ---- on a GPU ---------------------------------------------------------------------------------

@pytest.mark.gpu
@cuda
def test_a_gpu_step_is_recorded_as_its_kernels():
    from autoplan import Cluster, compile
    from autoplan.models import build_example
    from autoplan.runtime.step_trace import record_steps
    ex = build_example("gpt-tiny", batch_size=4, seed=0)
    small = build_example("gpt-tiny", batch_size=1, seed=0)
    trainer = compile(ex.model, Cluster.local(1), example_inputs=small.example_inputs,
                      example_targets=small.targets, loss_fn=ex.loss_fn,
                      optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3),
                      global_batch_size=4, precision="bf16", force={"compiled": False})
    batch = tuple(ex.example_inputs) + (ex.targets,)
    trainer.step(batch)
    rec = record_steps(trainer, batch, 2)
    assert rec["device"] == "cuda" and rec["kernels"]
    products = [k for k in rec["kernels"] if k["kind"] == "matmul" and k["dtypes"]]
    assert products and {k["dtypes"][-1] for k in products} == {"bfloat16"}
    assert any(k["kind"] == "optimizer" for k in rec["kernels"])
    # nearly every kernel found the op that launched it
    named = sum(k["name"] != k["kernel"] for k in rec["kernels"])
    assert named >= 0.9 * len(rec["kernels"])
    ph = attribute(rec["kernels"], rec["step_s"])
    assert ph.seconds["compute.matmul"] > 0 and ph.seconds["optimizer"] > 0
    assert ph.total_s() == pytest.approx(ph.step_s, rel=1e-9)


@pytest.mark.gpu
@cuda
def test_calibrate_refits_this_gpus_profile(tmp_path):
    env = {**os.environ, "AUTOPLAN_PROFILE_DIR": str(tmp_path / "profiles"),
           "PYTHONWARNINGS": "ignore"}

    def autoplan(*args):
        out = subprocess.run([sys.executable, "-m", "autoplan.cli.main", *args], env=env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout
    plan = str(tmp_path / "plan.json")
    autoplan("plan", "gpt-tiny", "--cluster", "local:1", "--global-batch", "8", "--precision",
             "bf16", "--force", "compiled=false", "-q", "-o", plan)
    text = autoplan("calibrate", plan, "--model", "gpt-tiny", "--steps", "3", "--warmup", "2")
    assert "one GPU each" in text and "refit of" in text and "re-estimated" in text
    (profile,) = (tmp_path / "profiles").glob("*.json")
    data = json.loads(profile.read_text())
    assert data["device_kind"] == "cuda" and "autoplan calibrate" in data["sources"]
    assert 1e11 < data["calibration"]["matmul_flops_per_s"] < 5e15
