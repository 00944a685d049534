"""NVMe offload (ZeRO-Infinity, issue 39 part 6): the cluster's drives, the 1T-parameter GPT
on one DGX A100 node fitting only with NVMe, and compile's refusal."""

import pytest

from autoplan import Cluster, ParallelConfig, estimate
from autoplan.cluster.specs import HostSpec
from autoplan.errors import ClusterError, ConfigError, PlanError


def test_host_spec_nvme_optional():
    old = HostSpec.from_dict({"memory_bytes": 2**40, "device_to_host_bandwidth_bytes_per_s": 1e10,
                              "cpu_adam_params_per_s": 1e8})
    assert not old.has_nvme and "nvme_bytes" not in old.to_dict()
    assert Cluster.preset("dgx-a100-80gb", nodes=1).host.nvme_bytes == 30_720_000_000_000
    with pytest.raises(ClusterError, match="without nvme_bytes"):
        HostSpec(memory_bytes=2**40, device_to_host_bandwidth_bytes_per_s=1e10,
                 cpu_adam_params_per_s=1e8, nvme_read_bytes_per_s=1e9)
    with pytest.raises(ConfigError, match="offload_nvme"):
        ParallelConfig(offload_nvme=True)


@pytest.fixture(scope="module")
def gpt_1t():
    from autoplan.graph import trace
    from autoplan.models import build_example
    ex = build_example("gpt-1t", device="meta", batch_size=1)
    return trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)


def test_1t_gpt_fits_one_dgx_a100_only_on_nvme(gpt_1t):
    """1T parameters' ZeRO-3 state (16 bytes each) outgrows a DGX A100's 2 TB of host memory
    but fits its 30 TB of NVMe; the NVMe traffic is priced, and the plan says where the bytes
    live."""
    cl = Cluster.preset("dgx-a100-80gb", nodes=1)
    base = dict(dp=2, tp=4, sequence_parallel=True, micro_batch_size=4, zero_stage=3,
                recompute="full", offload_params=True, offload_optimizer=True)
    host = estimate(gpt_1t, cl, config=ParallelConfig(**base), global_batch_size=8)
    nvme = estimate(gpt_1t, cl, config=ParallelConfig(**base, offload_nvme=True),
                    global_batch_size=8)
    assert not host.fits and nvme.fits
    assert host.peak_offloaded_bytes > host.host_memory_per_device_bytes
    assert nvme.peak_nvme_bytes == pytest.approx(host.peak_offloaded_bytes)
    assert nvme.peak_offloaded_bytes < nvme.host_memory_per_device_bytes   # the buffers
    assert nvme.time.comm_exposed_s["offload"] > host.time.comm_exposed_s["offload"]
    d = nvme.to_dict()
    assert d["stages"][0]["memory"]["nvme_bytes"] > 0 and d["nvme_per_device_bytes"] > 0
    assert "nvme_bytes" not in host.to_dict()["stages"][0]["memory"]


def test_compile_refuses_nvme_plans():
    from types import SimpleNamespace
    from autoplan.runtime.trainer import _refuse_unrunnable
    cfg = ParallelConfig(dp=2, zero_stage=3, offload_optimizer=True, offload_nvme=True)
    with pytest.raises(PlanError, match="offload_nvme=false"):
        _refuse_unrunnable(SimpleNamespace(config=cfg, recompute={}), has_loss=True)


def test_estimate_refuses_nvme_on_a_node_without_drives(gpt_1t):
    """A DGX H100 has no NVMe described: an NVMe config is refused with the fix, not priced
    over a zero drive rate."""
    cfg = ParallelConfig(dp=2, tp=4, sequence_parallel=True, zero_stage=3, recompute="full",
                         offload_params=True, offload_optimizer=True, offload_nvme=True)
    with pytest.raises(ConfigError, match="has none: give its host nvme_bytes"):
        estimate(gpt_1t, Cluster.preset("dgx-h100", nodes=1), config=cfg, global_batch_size=8)
