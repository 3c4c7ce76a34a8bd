"""The start-up heap freeze (:mod:`worker.contract.heap`): garbage is collected first, what lives
is frozen, and objects made afterwards are collected as before."""

from __future__ import annotations

import gc
import weakref

import pytest

from worker.contract.heap import freeze_startup_heap


class _Node:
    def __init__(self):
        self.other = self


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()


def test_the_freeze_collects_garbage_first_and_keeps_later_garbage_collectable(unfrozen):
    dead = _Node()  # a cycle: only the collector frees it
    dead_ref = weakref.ref(dead)
    alive = _Node()
    del dead
    frozen = freeze_startup_heap()
    assert dead_ref() is None  # collected, not frozen for ever
    assert frozen == gc.get_freeze_count() > 0
    assert not any(o is alive for o in gc.get_objects())  # frozen: no generation holds it any more
    later = _Node()
    later_ref = weakref.ref(later)
    del later
    gc.collect()
    assert later_ref() is None
