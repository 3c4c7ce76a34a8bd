"""How urgent a generation is: OpenAI's ``service_tier`` and vLLM's ``priority``, resolved once per request.

A request may say ``service_tier``: ``"flex"`` (it may wait: the worker serves interactive requests
first and may preempt it when the KV cache is full) or ``"default"``, ``"auto"``, ``"priority"``
(interactive). Without one, its API key's ``service_tier`` in ``router.api_keys`` decides (a
batch-only key defaults to flex), else ``auto``. The answer echoes the tier used, as OpenAI does
when the request (or its key) named one: ``"flex"``, ``"priority"``, or ``"default"`` for
``default`` and ``auto``. ``priority`` is vLLM's integer: lower is served first, ties in arrival
order. Lines of a batch (:mod:`router.batch`) always run flex, whatever they say.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from router.auth import bearer_token
from router.state import API

FLEX = "flex"
FORCED_TIER = web.RequestKey("forced_tier", str)  # set by the batch runner on its lines' requests


@dataclass(frozen=True)
class Urgency:
    """What a generation's :class:`~worker.contract.protocol.Generate` carries (``priority``,
    ``flex``) and the ``service_tier`` its answer echoes (None: none asked, none echoed)."""

    priority: int = 0
    flex: bool = False
    echoed: str | None = None


INTERACTIVE = Urgency()


def urgency_of(request: web.Request, asked: str | None, priority: int = 0) -> Urgency:
    """The urgency of ``request`` whose body asked ``service_tier`` ``asked`` (None: not given)
    and ``priority``: the batch runner's forced tier, else the body's, else the API key's default."""
    tier = request.get(FORCED_TIER) or asked or key_tier(request)
    if tier is None:
        return Urgency(priority=priority)
    return Urgency(priority=priority, flex=tier == FLEX, echoed="default" if tier == "auto" else tier)


def key_tier(request: web.Request) -> str | None:
    """The ``service_tier`` configured for the request's API key (None: none configured)."""
    return request.app[API].cfg.router.key_tier(bearer_token(request))
