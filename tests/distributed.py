"""Run a function on N local ranks (gloo) by forking: fast, and each rank single-threaded.

Forking is 20-50x faster than spawn here; a forked child that runs multi-threaded ops after the
parent did can deadlock, so every rank sets one thread first. The function must be module-level
and return plain Python values (lists, floats, dicts of lists).

Rank 0 hosts the rendezvous store on a port the OS picks while binding it and hands the port to
its peers; the ranks then join it as torchrun's workers join their agent's store
(``TORCHELASTIC_USE_AGENT_STORE``). A port chosen free beforehand can be taken by another process
before rank 0 binds it (seen with two test processes side by side: EADDRINUSE).
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_module
import os
import socket
import time
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world, port, finished, queue, args):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    store = None
    try:
        if rank == 0:
            # the store lives as long as this rank: its peers' groups hold connections to it
            store = dist.TCPStore("127.0.0.1", 0, world, is_master=True,
                                  wait_for_workers=False)
            with port.get_lock():
                port.value = store.port
        elif not _wait_until(lambda: port.value != 0, 60.0):
            raise TimeoutError("rank 0 did not publish its store's port in 60 s")
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port.value),
                          TORCHELASTIC_USE_AGENT_STORE="True", RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world))
        queue.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # report everything, the parent raises
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        with finished.get_lock():
            finished.value += 1
        if store is not None:    # rank 0 serves the store until its peers are through
            _wait_until(lambda: finished.value >= world, 30.0)


def _wait_until(condition, limit_s: float) -> bool:
    """Poll ``condition`` until it holds (True) or ``limit_s`` seconds have passed (False)."""
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def run_ranks(fn, world: int, *args, timeout_s: float = 180.0) -> list:
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port, finished = ctx.Value("i", 0), ctx.Value("i", 0)
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, finished, queue, args),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    try:
        _collect(procs, queue, results, errors, timeout_s)
    finally:
        if errors:     # a rank that died never counts itself finished: rank 0 need not wait
            with finished.get_lock():
                finished.value = world
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world)]


def _collect(procs, queue, results: dict, errors: list, timeout_s: float) -> None:
    """Every rank's result or error from ``queue`` into ``results`` and ``errors``, each within
    ``timeout_s`` of the previous one. Once a rank failed, its peers are likely stuck in a
    collective: they get 10 s more. A rank whose process ended without a word (``os._exit``, a
    signal) is an error as soon as the queue is drained, not after the time limit."""
    world = len(procs)
    deadline = time.monotonic() + timeout_s
    reported: set[int] = set()
    while len(reported) < world:
        try:
            rank, status, value = queue.get(timeout=0.2)
        except queue_module.Empty:
            silent = [r for r in range(world)
                      if r not in reported and procs[r].exitcode is not None]
            if silent:
                _drain(queue, results, errors, reported)       # what it wrote before ending
                silent = [r for r in silent if r not in reported]
                for r in silent:
                    errors.append(f"rank {r}: exited with code {procs[r].exitcode} and "
                                  "no result")
                    reported.add(r)
                if silent:
                    deadline = min(deadline, time.monotonic() + 10.0)
                continue
            if time.monotonic() > deadline:
                missing = sorted(set(range(world)) - reported)
                errors.append(f"ranks {missing}: no result within the time limit (hung?)")
                return
            continue
        _record(rank, status, value, results, errors, reported)
        deadline = time.monotonic() + (10.0 if errors else timeout_s)   # for the next one


def _drain(queue, results: dict, errors: list, reported: set) -> None:
    while True:
        try:
            rank, status, value = queue.get(timeout=1.0)
        except queue_module.Empty:
            return
        _record(rank, status, value, results, errors, reported)


def _record(rank: int, status: str, value, results: dict, errors: list, reported: set) -> None:
    reported.add(rank)
    if status == "ok":
        results[rank] = value
    else:
        errors.append(f"rank {rank}:\n{value}")
