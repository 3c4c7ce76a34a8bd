"""The start-up heap freeze (:mod:`worker.contract.heap`): garbage is collected first, what lives
is frozen, objects made afterwards are collected as before, and a slow collection is logged."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest

from worker.contract.heap import CollectionWatch, freeze_startup_heap


class _Node:
    def __init__(self):
        self.other = self


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()
    gc.callbacks[:] = [cb for cb in gc.callbacks if not isinstance(cb, CollectionWatch)]


def test_the_freeze_collects_garbage_first_and_keeps_later_garbage_collectable(unfrozen):
    dead = _Node()  # a cycle: only the collector frees it
    dead_ref = weakref.ref(dead)
    alive = _Node()
    del dead
    frozen = freeze_startup_heap()
    assert dead_ref() is None  # collected, not frozen for ever
    assert 0 < gc.get_freeze_count() <= frozen  # frozen objects may die since (another thread's), none join
    assert not any(o is alive for o in gc.get_objects())  # frozen: no generation holds it any more
    later = _Node()
    later_ref = weakref.ref(later)
    del later
    gc.collect()
    assert later_ref() is None


def test_a_slow_collection_is_logged_and_a_quick_one_is_not(caplog):
    now = [0.0]
    watch = CollectionWatch(slow_s=0.05, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="worker.contract.heap"):
        watch("start", {"generation": 0})
        now[0] = 0.01
        watch("stop", {"generation": 0, "collected": 3})
        watch("start", {"generation": 2})
        now[0] = 0.31
        watch("stop", {"generation": 2, "collected": 7})
    assert len(caplog.records) == 1
    assert "generation 2 took 300 ms" in caplog.records[0].getMessage()
