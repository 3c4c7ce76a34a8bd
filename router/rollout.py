"""The router's part of ``llamadeploy apply``: the admin endpoints and the live settings.

``POST /admin/apply`` takes the CLI's :class:`~router.rollout_protocol.ApplyRequest`, refuses it
(409, naming what is in progress) while another rollout runs, and passes it to the supervisor as
an :class:`~router.admin_protocol.ApplyRequested` event: the supervisor owns the processes, so it
plans and carries out the rollout, posting its :class:`~router.rollout_protocol.RolloutStatus` as
it advances (``POST /admin/rollout``; the CLI polls ``GET /admin/rollout``) and the router
settings to apply now (``POST /admin/settings``): policy, limits, timeouts, API keys, the admin
token (the old one stays valid for :data:`ADMIN_TOKEN_GRACE_S`), the log level, the served names.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

from aiohttp import web
from pydantic import ValidationError

from router import admin_protocol
from router.admin_protocol import ApplyRequested
from router.errors import ApiError
from router.rollout_protocol import ApplyRequest, LiveSettings, RolloutStatus
from router.served import served_model
from router.settings import RouterSettings
from router.state import API, Api
from worker.contract.settings import ModelConfig

log = logging.getLogger(__name__)

ADMIN_TOKEN_GRACE_S = 300.0  # a rotated-out admin token still works this long (clients switch over)
UNANSWERED_S = 60.0  # an apply the supervisor never took up (no launcher behind this router) stops blocking


class AdminTokens:
    """The admin API's bearer tokens: the current one and, for a grace period after a rotation,
    the previous one. ``clock``: monotonic seconds (a test seam)."""

    def __init__(self, token: str | None, clock=time.monotonic):
        self.current, self.old, self.old_until, self.clock = token, None, 0.0, clock

    def valid(self) -> list[str]:
        """The tokens accepted now (empty: the admin API needs none)."""
        if not self.current:
            return []
        return [self.current, *([self.old] if self.old and self.clock() < self.old_until else [])]

    def rotate(self, token: str | None) -> None:
        """Make ``token`` the current one; the previous one stays valid for the grace period."""
        if token != self.current:
            self.old, self.old_until, self.current = self.current, self.clock() + ADMIN_TOKEN_GRACE_S, token


@dataclass
class Board:
    """The last rollout's status, and when the last word about it came (monotonic seconds)."""

    status: RolloutStatus | None = None
    heard_at: float = 0.0

    def busy(self) -> bool:
        """A rollout runs (one still ``planning`` a minute after its request was never taken up)."""
        s = self.status
        if s is None or not s.active:
            return False
        return s.state != "planning" or time.monotonic() - self.heard_at < UNANSWERED_S

    def post(self, status: RolloutStatus) -> None:
        """The supervisor's latest word."""
        self.status, self.heard_at = status, time.monotonic()


BOARD = web.AppKey("rollout_board", Board)
TOKENS = web.AppKey("admin_tokens", AdminTokens)


def describe(status: RolloutStatus) -> str:
    """One line on a rollout in progress, for the 409."""
    last = status.progress[-1] if status.progress else "planning"
    return f"rollout {status.id} to revision {status.revision} is {status.state} ({last})"


async def _decode(request: web.Request, type_: type):
    try:
        return admin_protocol.decode(await request.read(), type_)
    except ValueError as exc:
        raise ApiError(400, f"invalid {type_.__name__}: {exc}", code="invalid_value") from None


async def apply(request: web.Request) -> web.Response:
    """Accept an apply (202 with its id) and hand it to the supervisor; 409 while one runs."""
    board = request.app[BOARD]
    req: ApplyRequest = await _decode(request, ApplyRequest)
    if board.busy():
        raise ApiError(409, f"another apply is in progress: {describe(board.status)}", code="rollout_in_progress")
    if req.max_unavailable is not None and req.max_unavailable < 0:
        raise ApiError(400, "max_unavailable must be >= 0", param="max_unavailable")
    req.id = uuid.uuid4().hex[:12]
    board.post(RolloutStatus(id=req.id, state="planning"))
    request.app[API].pool.tell_supervisor(ApplyRequested(worker_id=-1, request=req))
    log.info("apply %s requested%s", req.id, " (dry run)" if req.dry_run else "")
    return web.json_response({"id": req.id}, status=202)


async def rollout_status(request: web.Request) -> web.Response:
    """The last rollout's :class:`RolloutStatus` (404 before the first apply)."""
    status = request.app[BOARD].status
    if status is None:
        raise ApiError(404, "no apply since this router started", code="no_rollout")
    return web.Response(body=admin_protocol.encode(status), content_type="application/json")


async def post_rollout(request: web.Request) -> web.Response:
    """The supervisor's word on the rollout."""
    status = await _decode(request, RolloutStatus)
    request.app[BOARD].post(status)
    return web.json_response({"state": status.state})


async def post_settings(request: web.Request) -> web.Response:
    """Apply router settings now, no process restarted (:func:`apply_live`)."""
    live: LiveSettings = await _decode(request, LiveSettings)
    try:
        cfg = RouterSettings.model_validate(live.settings)
        also = [ModelConfig.model_validate(m) for m in live.also_models]
    except ValidationError as exc:
        raise ApiError(400, f"invalid router settings: {exc.errors()[0]['msg']}", code="invalid_value") from None
    apply_live(request.app[API], request.app[TOKENS], cfg, also)
    return web.json_response({"policy": cfg.router.policy, "served": list(request.app[API].models)})


def apply_live(api: Api, tokens: AdminTokens, cfg: RouterSettings, also: list[ModelConfig]) -> None:
    """Switch the router to ``cfg``: what handlers read per request (limits, timeouts, retries, API
    keys) follows ``api.cfg``; the policy, the pool's watchdog times, the admin token, the log level
    and the served model (:func:`serve_models`) are set here."""
    if api.pool.routing.name != cfg.router.policy:
        api.pool.routing.set_policy(cfg.router.policy)
    api.pool.heartbeat_timeout_s = cfg.workers.heartbeat_timeout_s
    api.pool.stall_timeout_s = cfg.workers.stall_timeout_s
    tokens.rotate(cfg.router.admin_token)
    logging.getLogger().setLevel(cfg.logging.level.upper())
    api.cfg = cfg
    # several models keep their names (apply refuses a change of which models are served)
    serve_models(api, cfg.models if len(cfg.models) > 1 else [cfg.model, *also])
    log.info("live settings applied (policy %s, serving %s)", cfg.router.policy, ", ".join(api.models))


def serve_models(api: Api, sections: list[ModelConfig]) -> None:
    """Serve the model ``sections`` (the first is the default), reusing what is derived from the
    tokenizer where a section is unchanged. A section takes the folder and the tokenizer of the
    model served under its name now (a renamed model: the default model's): a rollout keeps each
    model's tokenizer (the router tokenizes for the workers)."""
    kept = {m.config.model_dump_json(): m for m in api.models.values()}
    # each section read as at start (task, an embedding model's spec) from the model's own folder
    bases = [api.models.get(c.public_name, api.default_model) for c in sections]
    fresh = [served_model(c, base.path, base.tokenizer) for c, base in zip(sections, bases, strict=True)]
    served = [kept.get(m.config.model_dump_json(), m) for m in fresh]
    for m, base in zip(served, bases, strict=True):
        if m is not base and m.tokenizer is base.tokenizer and "grammar_checker" in base.__dict__:
            # the same tokenizer's compiler (built at start: router.serve.warm_grammar_checkers) and its grammars
            m.grammar_checker = base.grammar_checker
    api.models = {m.name: m for m in served}


def add_routes(app: web.Application) -> None:
    """The apply endpoints, and the admin app's token and rollout board."""
    app[BOARD] = Board()
    app.router.add_post("/admin/apply", apply)
    app.router.add_get("/admin/rollout", rollout_status)
    app.router.add_post("/admin/rollout", post_rollout)
    app.router.add_post("/admin/settings", post_settings)
