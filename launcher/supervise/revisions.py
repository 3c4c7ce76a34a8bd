"""Revisions of a running deployment's configuration: a number, a hash, the last few files.

Each configuration a deployment runs (the one ``up`` started with is revision 1, each ``apply``
the next) is kept as ``revisions/r<N>.json`` in the run directory (mode 0700: the files hold the
router's secrets), the last :data:`KEEP` of them, so ``apply --rollback`` can return to the
previous one. The hash covers the configuration without its secrets, so it can be shown.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from launcher.config import DeployConfig

KEEP = 5  # revision files kept in the run dir
SECRETS = {"router": {"api_keys", "admin_token"}}


def config_hash(cfg: DeployConfig) -> str:
    """12 hex digits of the SHA-256 of the configuration's canonical JSON, secrets left out."""
    data = cfg.model_dump(mode="json", exclude=SECRETS)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Revision:
    """One applied configuration: its ``number``, ``hash`` and the config itself."""

    number: int
    hash: str
    config: DeployConfig


class Revisions:
    """The deployment's revisions, kept under ``run_dir/revisions``; :attr:`current` is the one
    the deployment runs (or is rolling out to)."""

    def __init__(self, run_dir: Path, first: DeployConfig):
        self.folder = run_dir / "revisions"
        self.folder.mkdir(mode=0o700, exist_ok=True)
        self.history: list[Revision] = []
        self.current = self.record(first)

    def record(self, cfg: DeployConfig) -> Revision:
        """A new revision for ``cfg`` (the next number), written and made :attr:`current`; the
        oldest files beyond :data:`KEEP` are removed."""
        rev = Revision(self.history[-1].number + 1 if self.history else 1, config_hash(cfg), cfg)
        (self.folder / f"r{rev.number}.json").write_text(cfg.model_dump_json())
        self.history.append(rev)
        for old in self.history[:-KEEP]:
            (self.folder / f"r{old.number}.json").unlink(missing_ok=True)
        self.history = self.history[-KEEP:]
        self.current = rev
        return rev

    def previous(self) -> Revision | None:
        """The revision before :attr:`current` (``apply --rollback``'s target), None if none is kept."""
        numbers = [r.number for r in self.history]
        at = numbers.index(self.current.number)
        return self.history[at - 1] if at > 0 else None

    def restore(self, rev: Revision) -> None:
        """Make an earlier revision :attr:`current` again (``--rollback`` keeps its number)."""
        self.current = rev

    def forget(self, rev: Revision, back_to: Revision) -> None:
        """A rollout to ``rev`` failed and was rolled back to ``back_to``: ``rev`` is dropped, so
        a later ``--rollback`` does not return to it."""
        self.history = [r for r in self.history if r.number != rev.number]
        (self.folder / f"r{rev.number}.json").unlink(missing_ok=True)
        self.current = back_to
