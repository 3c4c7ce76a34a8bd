"""When the supervisor may load a standby router: at a quiet moment.

A standby router's load (imports, tokenizers, grammar compilers: seconds of CPU) slows the workers
whose cores it shares far beyond its share of the CPU, at any nice value: a standby runs in a
session of its own, and under Linux's autogroup scheduling a session weighs as one whatever the nice
values inside it, so the workers' spinning OpenMP teams get fewer cores than threads
(docs/benchmarks/results.md, "A standby router's load" and "2026-12-04 (afternoon)";
:mod:`worker.cpu_share`). So the standby waits for :data:`QUIET_S` without a request in flight on
any worker, or, on a deployment that never pauses, :data:`LONGEST_WAIT_S`, and then loads anyway
(once: a few slow seconds against every failover loading from scratch).
"""

from __future__ import annotations

QUIET_S = 1.0  # seconds without a request in flight before a standby loads (a closed loop's gaps are milliseconds)
LONGEST_WAIT_S = 600.0  # a standby due this long loads under load


class QuietGate:
    """Says when a due standby may load. :meth:`open` is asked on every poll (``now``: seconds on
    the supervisor's clock) with whether any request is in flight (None: the router's table could
    not be read, taken as busy); its first call starts the wait, :meth:`done` ends it once the
    standby loads. The only writer of its own state."""

    def __init__(self, quiet_s: float = QUIET_S, longest_wait_s: float = LONGEST_WAIT_S) -> None:
        self.quiet_s, self.longest_wait_s = quiet_s, longest_wait_s
        self._due_since: float | None = None
        self._quiet_since: float | None = None

    def open(self, now: float, busy: bool | None) -> bool:
        """True when the standby may load now: quiet for :attr:`quiet_s`, or due for
        :attr:`longest_wait_s`."""
        if self._due_since is None:
            self._due_since = now
        if busy is not False:
            self._quiet_since = None
        elif self._quiet_since is None:
            self._quiet_since = now
        quiet = self._quiet_since is not None and now - self._quiet_since >= self.quiet_s
        return quiet or now - self._due_since >= self.longest_wait_s

    def done(self) -> None:
        """The standby loads: the next one waits afresh."""
        self._due_since = self._quiet_since = None
