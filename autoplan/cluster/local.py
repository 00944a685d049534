"""Describe the machine autoplan runs on, as a cluster dictionary (``Cluster.local`` builds it).

With CUDA: one node of the visible GPUs (NCCL). Device specs come from ``cost_models`` when the
driver's product name matches an alias there, else from the calibration mapping or conservative
placeholders; the links come from ``nvidia-smi topo -m`` (NV# = that many NVLinks, PIX/PXB =
behind the same PCIe switch, PHB/NODE = same CPU socket, SYS = across sockets).

Without CUDA: ``nproc`` CPU rank processes on one node (gloo), each owning ``1/nproc`` of host
memory and joined to the host by a ``loopback`` link (shared memory / TCP loopback).

A torchrun job on several nodes (``Cluster.local_job``: ``LOCAL_WORLD_SIZE`` ranks on each of
``WORLD_SIZE / LOCAL_WORLD_SIZE`` nodes) is that many nodes like this one. What a node cannot
see is listed in the cluster's ``unseen`` and stood in for: the network between nodes (a 25 GbE
stand-in, ``ASSUMED_FABRIC``), and without ``nvidia-smi`` the NVLinks. Plans are matched to a
cluster by its hardware (``hardware.py``), which leaves the unseen out of the comparison.

CPU rates come from the installed profile of this CPU (``autoplan profile``). A CPU without one
is calibrated on first use (``python -m autoplan.machine.first_use``, a program of its own: the
one thread a rank runs with measures a GEMM, a copy, a tiny op, AdamW and a net of tiny layers
for the eager framework's per-op time, then all-reduces between two rank processes for the
loopback link; about 6 s, logged at INFO) and the result cached as its profile, so later calls
and the ranks of a job read the same figures. ``AUTOPLAN_AUTO_CALIBRATE=0`` turns that off (the
test suite does, for figures that do not depend on the machine): the rates are then
``DEFAULT_CPU_CALIBRATION``, deliberately conservative placeholders (a few cores of a current
server CPU), not measurements. ``calibration`` (any of ``matmul_flops_per_s``,
``memory_bandwidth_bytes_per_s``, ``launch_s``) overrides both.
"""

from __future__ import annotations

import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

from autoplan.cluster import specs, values
from autoplan.cluster.profile_db import ProfileDB
from autoplan.errors import ClusterError, ProfileError

log = logging.getLogger(__name__)

DEFAULT_CPU_CALIBRATION: Mapping[str, float] = {
    "matmul_flops_per_s": 10.0e9,          # conservative placeholder, not a measurement
    "memory_bandwidth_bytes_per_s": 5.0e9,  # conservative placeholder, not a measurement
    "launch_s": 10.0e-6,                   # eager PyTorch per-op overhead on CPU, typical order
}
ADAM_BYTES_PER_PARAM = 28  # fp32 Adam step: read param, grad, m, v (16 B), write param, m, v (12 B)
# Estimate: a vectorised CPU Adam is memory bound; one core streams about 1.5 GB/s of it, i.e.
# about 5e7 parameters/s at ADAM_BYTES_PER_PARAM. Calibrate on the machine for a real figure.
ADAM_PARAMS_PER_CORE_S = 5.0e7
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RELATIONS = ("X", "PIX", "PXB", "PHB", "NODE", "SYS", "SOC")


# --------------------------------------------------------------------------- this machine
CPU_NAME_ENV = "AUTOPLAN_CPU_NAME"


def cpu_model_name() -> str:
    """The CPU model: ``$AUTOPLAN_CPU_NAME`` where set (to take the profile of a CPU that this
    machine reports under another name, or none), else /proc/cpuinfo's ``model name``, else
    platform's description."""
    if os.environ.get(CPU_NAME_ENV, "").strip():
        return os.environ[CPU_NAME_ENV].strip()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def slug(name: str) -> str:
    """``"Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz"`` -> ``"intel-xeon-platinum-8375c"``."""
    cleaned = re.sub(r"\((r|tm|c)\)", " ", name.lower())
    cleaned = cleaned.split("@")[0]
    words = [w for w in re.split(r"[^a-z0-9]+", cleaned) if w and w not in ("cpu", "processor")]
    return "-".join(words[:8]) or "unknown"


def local_cpu_device_name() -> str:
    """DeviceSpec name of one CPU rank on this machine, e.g. ``"cpu-intel-xeon-platinum-8375c"``."""
    return "cpu-" + slug(cpu_model_name())


def host_memory_bytes() -> int:
    try:
        import psutil  # lazily: an optional dependency

        return int(psutil.virtual_memory().total)
    except ImportError:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def socket_link_name() -> str:
    return "xgmi" if "amd" in cpu_model_name().lower() else "upi"


def _calibration(calibration: Mapping[str, float] | None) -> dict[str, float]:
    merged = dict(DEFAULT_CPU_CALIBRATION)
    for key, value in (calibration or {}).items():
        if key not in DEFAULT_CPU_CALIBRATION:
            raise ClusterError(f"calibration key {key!r} unknown; allowed: {', '.join(DEFAULT_CPU_CALIBRATION)}")
        merged[key] = values.number(value, key, "calibration", positive=key != "launch_s")
    return merged


def profiled_calibration(device: str) -> tuple[dict[str, float], int] | None:
    """The calibration of the installed profile for ``device`` (``autoplan profile``) and the
    thread count it was measured with, if there is one."""
    db = ProfileDB.find(device)
    if db is None:
        return None
    return _figures(db)


def _figures(db: ProfileDB) -> tuple[dict[str, float], int]:
    c = db.calibration
    return ({"matmul_flops_per_s": c.matmul_flops_per_s,
             "memory_bandwidth_bytes_per_s": c.memory_bandwidth_bytes_per_s,
             "launch_s": c.launch_s}, int(db.threads))


def profiled_links(device: str) -> dict[str, dict[str, float]]:
    """Link figures ``autoplan calibrate`` fitted on this machine (link name -> figures)."""
    db = ProfileDB.find(device)
    return {k: dict(v) for k, v in db.links.items()} if db is not None else {}


AUTO_CALIBRATE_ENV = "AUTOPLAN_AUTO_CALIBRATE"
# the intra-op threads of one CPU rank process (runtime/worker.py sets it; torchrun's
# OMP_NUM_THREADS default): first-use calibration measures with as many
RANK_THREADS = 1
FIRST_USE_TIMEOUT_S = 600   # the calibration takes about 6 s, the link probe at most 120


def auto_calibration(device: str) -> tuple[dict[str, float], int] | None:
    """Calibrate this CPU now and cache it as its profile (first use on a machine without one).
    Not inside a multi-process job (its ranks would measure each other) and not when
    ``AUTOPLAN_AUTO_CALIBRATE=0``.

    The measuring is a program of its own (``python -m autoplan.machine.first_use``): this layer
    describes machines and imports nothing of the code that measures them (``autoplan.machine``
    sits above ``cluster`` and ``cost``), and a fresh process with one thread measures what a
    rank process will run with."""
    if os.environ.get(AUTO_CALIBRATE_ENV, "1") == "0" or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return None
    path = ProfileDB.write_path(device)
    # progress notes (--log-level INFO shows them); the busy-machine warning below is one a
    # user can act on
    log.info("no profile for this CPU (%s) yet: calibrating it once (about 6 s; %s=0 skips "
             "this)...", device, AUTO_CALIBRATE_ENV)
    t0 = time.perf_counter()
    db = _first_use_measurement(device)
    if db is None:
        return None
    link = db.links.get("loopback")
    cal = db.calibration
    try:
        db.save(path)
        where = f"saved to {path}"
    except Exception as e:  # noqa: BLE001 (a read-only home: use the figures, say so)
        where = f"not saved ({e})"
    log.info(f"calibrated in {time.perf_counter() - t0:.1f} s: matmul "
             f"{cal.matmul_flops_per_s / 1e9:.1f} GFLOP/s, memory "
             f"{cal.memory_bandwidth_bytes_per_s / 1e9:.1f} GB/s, op launch "
             f"{cal.launch_s * 1e6:.1f} us with {db.threads} thread(s)"
             + (f", loopback {link['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s and "
                f"{link['latency_s'] * 1e6:.0f} us" if link else "")
             + f"; {where} (`autoplan profile` also measures ops)")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > (os.cpu_count() or 1) * 0.75:
        log.warning(f"the machine was busy while calibrating this CPU (load {load:.1f} on "
                    f"{os.cpu_count()} cores): its figures may be low; re-measure when it is "
                    "idle with `autoplan profile --calibrate-only`")
    return _figures(db)


def _first_use_measurement(device: str) -> ProfileDB | None:
    """``python -m autoplan.machine.first_use``'s profile of this CPU as ``device``; None, with
    a warning that says why and what to run, when it fails."""
    with tempfile.TemporaryDirectory(prefix="autoplan-calibration-") as tmp:
        out = os.path.join(tmp, f"{device}.json")
        env = {**os.environ, "OMP_NUM_THREADS": str(RANK_THREADS)}
        why = ""
        try:
            done = subprocess.run([sys.executable, "-m", "autoplan.machine.first_use", device, out],
                                  capture_output=True, text=True, env=env, check=False,
                                  timeout=FIRST_USE_TIMEOUT_S)
            if done.returncode == 0 and os.path.exists(out):
                return ProfileDB.load(out)
            lines = (done.stderr or "").strip().splitlines()
            why = f"exit status {done.returncode}" + (f": {lines[-1]}" if lines else "")
        except subprocess.TimeoutExpired:
            why = f"no result in {FIRST_USE_TIMEOUT_S} s"
        except (OSError, ProfileError) as e:
            why = str(e)
    log.warning(f"the first-use calibration of this CPU failed ({why}): planning with "
                "conservative placeholder figures; measure it with `autoplan profile "
                "--calibrate-only`")
    return None


def job_shape() -> tuple[int, int]:
    """(ranks per node, nodes) of this torchrun job from its environment (``WORLD_SIZE``,
    ``LOCAL_WORLD_SIZE``); (1, 1) outside one."""
    def env(name: str, default: int) -> int:
        raw = os.environ.get(name, "").strip()
        try:
            value = int(raw) if raw else default
        except ValueError:
            raise ClusterError(f"environment variable {name}={raw!r} is not a whole number; "
                               "torchrun sets it: launch with torchrun or `autoplan run`") from None
        if value < 1:
            raise ClusterError(f"environment variable {name}={value} must be >= 1")
        return value

    world = env("WORLD_SIZE", 1)
    per_node = env("LOCAL_WORLD_SIZE", world)
    if world % per_node:
        raise ClusterError(f"WORLD_SIZE {world} is not a whole number of nodes of LOCAL_WORLD_SIZE "
                           f"{per_node} ranks; autoplan needs the same number of ranks on every node")
    return per_node, world // per_node


# the network between nodes is not discovered: a conservative stand-in (listed in ``unseen``)
ASSUMED_FABRIC = {"link": "eth-25g", "leaf_ports": 32, "oversubscription": 1.0,
                  "source": "NOT DISCOVERED: a 25 GbE stand-in; describe the real network in a "
                            "cluster file (--cluster) to plan with it"}


def with_nodes(d: dict[str, Any], nodes: int, nic_link: str) -> dict[str, Any]:
    """``d`` (one node) as ``nodes`` nodes like it, joined by the assumed network through one
    NIC per node on its first socket."""
    if nodes == 1:
        return d
    node = {"components": {**d["node"]["components"], "nic0": "nic"},
            "links": [*d["node"]["links"], {"a": "nic0", "b": "socket0", "link": nic_link}]}
    return {**d, "num_nodes": nodes, "node": node, "fabric": dict(ASSUMED_FABRIC),
            "unseen": sorted({*d.get("unseen", ()), "fabric"}),
            "description": f"{d['description']}; {nodes} such nodes"}


def local_cluster_dict(nproc: int | None = None, *, nodes: int = 1,
                       calibration: Mapping[str, float] | None = None) -> dict[str, Any]:
    if nproc is not None:
        nproc = values.integer(nproc, "nproc", "local cluster", maximum=values.MAX_LOCAL_PROCESSES)
    nodes = values.integer(nodes, "nodes", "local cluster", maximum=values.MAX_NODES)
    cal = _calibration(calibration)
    try:
        import torch  # lazily: describing a cluster needs no torch, only this machine's GPUs do

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        threads = 1
        if calibration is None:
            found = profiled_calibration(local_cpu_device_name())
            if found is None:
                found = auto_calibration(local_cpu_device_name())
            if found is not None:
                calibration, threads = found
            cal = _calibration(calibration)
        d = cpu_cluster_dict(nproc or 1, cal, calibrated=calibration is not None,
                             measured_threads=threads)
        fitted = profiled_links(local_cpu_device_name()).get("loopback")
        if fitted is not None:
            d["links"] = {"loopback": {**fitted, "efficiency": 1.0,
                                       "source": "measured on this machine (first-use probe or `autoplan calibrate`: "
                                                 "least squares over timed transfers)"}}
        return with_nodes(share_links(d), nodes, "pcie4-x16")

    count = torch.cuda.device_count()
    nproc = count if nproc is None else nproc
    if nproc > count:
        raise ClusterError(f"local cluster: nproc {nproc} but only {count} CUDA device(s) are visible; use nproc <= {count}")
    props = [torch.cuda.get_device_properties(i) for i in range(nproc)]
    return gpu_nodes_dict([p.name for p in props], [int(p.total_memory) for p in props],
                          _nvidia_smi_topo(), cal if calibration is not None else None, nodes=nodes)


# --------------------------------------------------------------------------- CPU ranks
def share_links(d: dict[str, Any]) -> dict[str, Any]:
    """Rank processes that outnumber the cores move their bytes with a share of a core too
    (gloo's copies and reductions are CPU work): the loopback link runs ``compute_share`` as
    fast, with latencies as much longer."""
    share = float(d["device"].get("compute_share", 1.0))
    if share >= 1.0:
        return d
    links = dict(d.get("links") or {})
    base = links.get("loopback") or specs.load_link("loopback").to_dict()
    links["loopback"] = {**{k: v for k, v in base.items() if k != "name"},
                         "bandwidth_bytes_per_s": base["bandwidth_bytes_per_s"] * share,
                         "latency_s": base["latency_s"] / share,
                         "source": f"{base.get('source', '')} (times the ranks' share of the "
                                   f"cores, {share:.2f})"}
    return {**d, "links": links}


def cpu_cluster_dict(nproc: int, cal: Mapping[str, float], *, calibrated: bool = False,
                     memory_bytes: int | None = None, measured_threads: int = 1) -> dict[str, Any]:
    total = memory_bytes if memory_bytes is not None else host_memory_bytes()
    # rank processes that outnumber the cores share them: each gets this much of the machine
    # the calibration measured (with ``measured_threads`` threads)
    share = min(1.0, (os.cpu_count() or 1) / (nproc * max(1, measured_threads)))
    rate, bandwidth = cal["matmul_flops_per_s"], cal["memory_bandwidth_bytes_per_s"]
    origin = ("calibration measured on this machine" if calibrated else
              "PLACEHOLDER: conservative defaults (autoplan.cluster.local.DEFAULT_CPU_CALIBRATION), "
              "replaced by `autoplan profile` calibration")
    names = [f"cpu{i}" for i in range(nproc)]
    return {
        "name": "local",
        "description": f"this machine: {nproc} CPU rank process(es) on {cpu_model_name()}, gloo",
        "num_nodes": 1,
        "devices_per_node": nproc,
        "backend": "gloo",
        "device": {
            "name": local_cpu_device_name(), "kind": "cpu",
            # One matmul rate for every dtype: the calibration measures one.
            "peak_flops": {"fp32": rate, "bf16": rate, "fp16": rate},
            "memory_bytes": max(1, total // nproc),
            "memory_bandwidth_bytes_per_s": bandwidth,
            "matmul_efficiency": 1.0, "memory_efficiency": 1.0,  # calibrated rates are achieved rates
            "kernel_launch_s": cal["launch_s"],
            "compute_share": share,
            # no core to spare for gloo's threads: overlapped transfers take compute's cores
            **({"overlap_interference": 1.0} if nproc * RANK_THREADS >= (os.cpu_count() or 1)
               else {}),
            "source": f"{origin}; memory: host memory / nproc",
        },
        "host": {
            "memory_bytes": total,
            "device_to_host_bandwidth_bytes_per_s": bandwidth,  # a CPU rank's memory is host memory
            "cpu_adam_params_per_s": bandwidth / ADAM_BYTES_PER_PARAM,
            "source": f"host memory from the OS; bandwidth and CPU Adam derived from the memory bandwidth ({origin})",
        },
        "node": {"components": {"socket0": "socket"},
                 "links": [{"a": names, "b": "socket0", "link": "loopback"}]},
        "fabric": None,
        "source": "detected on this machine (autoplan.cluster.local)",
    }


# --------------------------------------------------------------------------- GPUs
def _nvidia_smi_topo() -> str:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return ""
    try:
        done = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout if done.returncode == 0 else ""


def parse_nvidia_smi_topo(output: str) -> list[list[str]]:
    """GPU x GPU relation matrix from ``nvidia-smi topo -m`` ("X", "NV12", "PIX", "SYS", ...)."""
    rows: list[list[str]] = []
    count = None
    for line in _ANSI.sub("", output).splitlines():
        tokens = line.split()
        if count is None and tokens and tokens[0] == "GPU0":
            count = sum(1 for t in tokens if re.fullmatch(r"GPU\d+", t))
            continue
        if count is not None and tokens and re.fullmatch(r"GPU\d+", tokens[0]):
            cells = tokens[1:1 + count]
            for cell in cells:
                if cell not in _RELATIONS and not re.fullmatch(r"NV\d+", cell):
                    raise ClusterError(f"nvidia-smi topo -m: unknown relation {cell!r} in row {tokens[0]}")
            rows.append(cells)
    if count is None or len(rows) != count or any(len(r) != count for r in rows):
        raise ClusterError("nvidia-smi topo -m output has no complete GPU matrix; cannot read the topology")
    return rows


def _family_links(product: str) -> tuple[str, str]:
    upper = product.upper()
    if "V100" in upper:
        return "nvlink2", "pcie3-x16"
    if any(tag in upper for tag in ("H100", "H200", "H800", "GH200")):
        return "nvlink4", "pcie5-x16"
    return "nvlink3", "pcie4-x16"


def gpu_node_topology(relations: Sequence[Sequence[str]], *, nvlink: str, pcie: str, socket_link: str) -> dict[str, Any]:
    """A ``node:`` mapping from a relation matrix (see module docstring)."""
    n = len(relations)
    gpus = [f"gpu{i}" for i in range(n)]
    nv = {(i, j): int(relations[i][j][2:]) for i in range(n) for j in range(i + 1, n)
          if relations[i][j].startswith("NV")}
    components: dict[str, str] = {}
    links: list[dict[str, Any]] = []
    if n >= 3 and len(nv) == n * (n - 1) // 2 and len(set(nv.values())) == 1:
        components["nvswitch"] = "nvswitch"  # every pair on the same NV count: a switch
        links.append({"a": gpus, "b": "nvswitch", "link": nvlink, "lanes": next(iter(nv.values()))})
    else:
        links += [{"a": gpus[i], "b": gpus[j], "link": nvlink, "lanes": c} for (i, j), c in nv.items()]
    switch = list(range(n))   # union-find: PIX/PXB share a PCIe switch
    socket = list(range(n))   # PIX/PXB/PHB/NODE share a socket

    def find(parent: list[int], i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in range(n):
        for j in range(i + 1, n):
            rel = relations[i][j]
            if rel in ("PIX", "PXB"):
                switch[find(switch, j)] = find(switch, i)
            if rel in ("PIX", "PXB", "PHB", "NODE"):
                socket[find(socket, j)] = find(socket, i)
    socket_ids = {root: k for k, root in enumerate(dict.fromkeys(find(socket, i) for i in range(n)))}
    for k in socket_ids.values():
        components[f"socket{k}"] = "socket"
    switch_members: dict[int, list[int]] = {}
    for i in range(n):
        switch_members.setdefault(find(switch, i), []).append(i)
    for k, members in enumerate(switch_members.values()):
        sock = f"socket{socket_ids[find(socket, members[0])]}"
        if len(members) == 1:
            links.append({"a": gpus[members[0]], "b": sock, "link": pcie})
        else:
            components[f"pcie{k}"] = "pcie_switch"
            links.append({"a": [gpus[i] for i in members], "b": f"pcie{k}", "link": pcie})
            links.append({"a": f"pcie{k}", "b": sock, "link": pcie})
    sockets = [f"socket{k}" for k in sorted(socket_ids.values())]
    links += [{"a": a, "b": b, "link": socket_link} for i, a in enumerate(sockets) for b in sockets[i + 1:]]
    return {"components": components, "links": links}


def gpu_nodes_dict(product_names: Sequence[str], memory_bytes: Sequence[int], topo_output: str,
                   calibration: Mapping[str, float] | None, *, nodes: int = 1) -> dict[str, Any]:
    """``nodes`` nodes like this one, from what the driver reports of its GPUs (product names,
    memory sizes) and ``nvidia-smi topo -m``: what ``Cluster.local`` describes on a GPU node."""
    d = gpu_cluster_dict(product_names, memory_bytes, topo_output, calibration)
    return with_nodes(d, nodes, _family_links(product_names[0])[1])


def gpu_cluster_dict(product_names: Sequence[str], memory_bytes: Sequence[int], topo_output: str,
                     calibration: Mapping[str, float] | None) -> dict[str, Any]:
    """Cluster dict for one node of GPUs (driver product names and memory sizes, in rank order)."""
    n = len(product_names)
    if n == 0:
        raise ClusterError("local cluster: no CUDA devices to describe")
    if len(set(product_names)) > 1:
        raise ClusterError(f"local cluster: mixed GPU models {sorted(set(product_names))}; autoplan needs identical "
                           "devices (restrict CUDA_VISIBLE_DEVICES to one model)")
    product = product_names[0]
    known = specs.find_device_by_alias(product)
    if known is not None and calibration is None:
        device = known.to_dict()
    else:
        cal = _calibration(calibration)
        rate = cal["matmul_flops_per_s"]
        device = {
            "name": slug(product), "kind": "gpu", "peak_flops": {"fp32": rate, "bf16": rate, "fp16": rate},
            "memory_bytes": 0, "memory_bandwidth_bytes_per_s": cal["memory_bandwidth_bytes_per_s"],
            "matmul_efficiency": 1.0, "memory_efficiency": 1.0, "kernel_launch_s": cal["launch_s"],
            "source": ("calibration measured on this machine" if calibration is not None else
                       f"PLACEHOLDER: {product!r} is not in cost_models/devices.yaml; conservative defaults"),
        }
    device["memory_bytes"] = min(memory_bytes)  # what the driver reports on this machine
    nvlink, pcie = _family_links(product)
    try:
        relations = [row[:n] for row in parse_nvidia_smi_topo(topo_output)[:n]] if topo_output else None
    except ClusterError:
        relations = None
    unseen = []
    if relations is None:  # no nvidia-smi: assume every GPU hangs off one socket, no NVLink
        relations = [["X" if i == j else "PHB" for j in range(n)] for i in range(n)]
        unseen = ["node_links"] if n > 1 else []
    host_total = host_memory_bytes()
    pcie_spec = specs.load_link(pcie)
    return {
        "name": "local",
        "description": f"this machine: {n} x {product}, NCCL",
        "num_nodes": 1,
        "devices_per_node": n,
        "backend": "nccl",
        "device": device,
        "host": {
            "memory_bytes": host_total,
            "device_to_host_bandwidth_bytes_per_s": pcie_spec.bandwidth_bytes_per_s,
            "cpu_adam_params_per_s": (os.cpu_count() or 1) * ADAM_PARAMS_PER_CORE_S / n,
            "source": f"host memory from the OS; device link {pcie} peak (assumes a private x16 link); "
                      "CPU Adam: estimate, ADAM_PARAMS_PER_CORE_S per core shared by the GPUs",
        },
        "node": gpu_node_topology(relations, nvlink=nvlink, pcie=pcie, socket_link=socket_link_name()),
        "fabric": None,
        **({"unseen": unseen} if unseen else {}),
        "source": "detected on this machine (torch.cuda device properties, nvidia-smi topo -m)",
    }
