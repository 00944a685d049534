"""Tracing and planning raise the collector's young-generation threshold while they run and
restore it after (autoplan/gc_pause.py)."""

import gc
import threading

import pytest

from autoplan import Cluster, plan
from autoplan.gc_pause import GEN0_THRESHOLD, fewer_collections
from autoplan.graph import trace
from autoplan.models import build_example


@pytest.fixture
def default_threshold():
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*saved)


def test_raised_inside_restored_after_nested_once(default_threshold):
    with fewer_collections():
        assert gc.get_threshold() == (GEN0_THRESHOLD, 10, 10)
        with fewer_collections():
            assert gc.get_threshold()[0] == GEN0_THRESHOLD
        assert gc.get_threshold()[0] == GEN0_THRESHOLD      # the inner exit keeps it
    assert gc.get_threshold() == (700, 10, 10)


def test_what_exists_is_frozen_inside_and_unfrozen_after(default_threshold):
    """Objects made before the block are left out of its collections; a cycle made inside is
    still collected; after it nothing stays frozen, and a process's own freeze is kept."""
    import weakref

    class Node:
        pass
    assert gc.get_freeze_count() == 0
    with fewer_collections():
        assert gc.get_freeze_count() > 0
        a = Node()
        a.self = a
        gone = weakref.ref(a)
        del a
        gc.collect()
        assert gone() is None
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        fresh = [[] for _ in range(1000)]        # tracked, made after the process's freeze
        with fewer_collections():
            pass
        # kept (not unfrozen to 0) and not frozen again (that would take ``fresh`` in); a
        # frozen object that dies meanwhile leaves the count, so it may only go down
        assert 0 < gc.get_freeze_count() <= frozen
        del fresh
    finally:
        gc.unfreeze()


def test_restored_when_the_call_raises(default_threshold):
    with pytest.raises(ValueError):
        with fewer_collections():
            raise ValueError("boom")
    assert gc.get_threshold() == (700, 10, 10)


def test_a_users_own_choice_is_kept(default_threshold):
    gc.set_threshold(10 * GEN0_THRESHOLD, 5, 5)
    with fewer_collections():
        assert gc.get_threshold() == (10 * GEN0_THRESHOLD, 5, 5)
    gc.set_threshold(0)                        # collection disabled stays disabled
    with fewer_collections():
        assert gc.get_threshold()[0] == 0
    assert gc.get_threshold()[0] == 0


def test_threads_share_one_raise(default_threshold):
    inside, leave = threading.Barrier(3), threading.Event()

    def work():
        with fewer_collections():
            inside.wait()
            leave.wait()
    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    inside.wait()
    assert gc.get_threshold()[0] == GEN0_THRESHOLD
    leave.set()
    for t in threads:
        t.join()
    assert gc.get_threshold() == (700, 10, 10)


def test_trace_and_plan_run_with_it(default_threshold):
    seen = []
    ex = build_example("gpt-tiny", device="meta")
    g = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    assert gc.get_threshold() == (700, 10, 10)
    plan(g, Cluster.local(2), global_batch_size=4, profile=None,
         progress=lambda _msg: seen.append(gc.get_threshold()[0]))
    assert seen and set(seen) == {GEN0_THRESHOLD}
    assert gc.get_threshold() == (700, 10, 10)
