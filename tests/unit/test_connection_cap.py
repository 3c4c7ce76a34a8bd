"""The open-connection cap stays below the process's open-file limit."""

from __future__ import annotations

import resource

from router.connections import RESERVED_FDS, connection_cap, raise_file_limit


def test_cap_defaults_to_the_file_limit_less_a_reserve_and_never_exceeds_it():
    assert connection_cap(None, 1024) == 1024 - RESERVED_FDS
    assert connection_cap(None, 1_048_576) == 1_048_576 - 1_048_576 // 10
    assert connection_cap(10, 1024) == 10
    assert connection_cap(5000, 1024) == 1024 - RESERVED_FDS  # clamped, with a warning
    assert connection_cap(None, 100) == 1


def test_raise_file_limit_reaches_the_hard_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        assert raise_file_limit() == resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= soft
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
