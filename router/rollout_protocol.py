"""The ``llamadeploy apply`` contract: the CLI's request, the rollout's status, the live settings.

* ``POST /admin/apply`` ← :class:`ApplyRequest` (the CLI): 202 with the rollout's id, or 409 while
  another rollout runs. The router passes it on to the supervisor (an
  :class:`~router.admin_protocol.ApplyRequested` event), which plans and carries it out.
* ``POST /admin/rollout`` ← :class:`RolloutStatus` (the supervisor, as the rollout advances);
  ``GET /admin/rollout`` → the last one (the CLI polls it; ``status`` prints it).
* ``POST /admin/settings`` ← :class:`LiveSettings` (the supervisor): router settings applied
  without a restart.

Import-light (msgspec only): the router, the supervisor and the CLI import it.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

RolloutState = Literal["planning", "running", "rolling_back", "done", "failed", "refused", "planned"]
ACTIVE = frozenset({"planning", "running", "rolling_back"})


class ApplyRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Apply ``config`` (a validated deploy.yaml as JSON data) to the running deployment.
    ``dry_run``: plan and report only. ``rollback``: return to the previous revision (``config``
    is then ignored). ``max_unavailable``: replicas out of service at once (None: the default)."""

    config: dict[str, Any] = msgspec.field(default_factory=dict)
    dry_run: bool = False
    rollback: bool = False
    max_unavailable: int | None = None
    id: str = ""  # set by the router


class RolloutStatus(msgspec.Struct, kw_only=True):
    """Where one apply stands. ``plan``: the printed plan's lines; ``progress``: one line per
    event so far; ``reason``: why it failed or was refused (one line per problem); ``revision``
    and ``hash``: the target's; ``wall_s``: seconds since it started (final once it ended)."""

    id: str
    state: RolloutState
    revision: int = 0
    hash: str = ""
    plan: list[str] = msgspec.field(default_factory=list)
    progress: list[str] = msgspec.field(default_factory=list)
    reason: str = ""
    wall_s: float = 0.0

    @property
    def active(self) -> bool:
        """It still runs: another apply is refused."""
        return self.state in ACTIVE


class LiveSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Router settings to apply now (a :class:`~router.settings.RouterSettings` as JSON data), and
    the ``model`` sections served beside its model while replicas of both serve (a rollout that
    renames the model: the new name, each name routed to its own replicas)."""

    settings: dict[str, Any]
    also_models: list[dict[str, Any]] = msgspec.field(default_factory=list)
