"""The registry of routing policies: the one list of their names.

``router.policy`` (config: its allowed names and its help, :func:`describe_policies`), the CLI's
``--policy`` help, the admin API and the affinity bench read it. A new policy is a module
``router/policies/<name>.py`` that defines ``POLICY`` (a class implementing
:class:`router.policies.base.Policy`, its ``name`` the module's, its ``summary`` the config's help)
plus its line in :data:`REGISTERED`: nothing else names the policies.
"""

from __future__ import annotations

from importlib import import_module
from typing import Literal

from router.policies.base import Policy

REGISTERED = (
    "least_loaded",  # the default: fewest in flight, a cached prefix breaks a tie
    "round_robin",  # strict rotation
    "cache_aware",  # a cached prefix first, within a few requests of the least loaded
)

POLICIES: dict[str, type[Policy]] = {name: import_module(f"router.policies.{name}").POLICY for name in REGISTERED}
PolicyName = Literal[REGISTERED]  # the config's type: exactly the registered names


def describe_policies() -> str:
    """Every registered policy's name and summary, in :data:`REGISTERED`'s order: the help of
    ``router.policy`` (the configuration reference is generated from it)."""
    return "; ".join(f"{name}: {cls.summary}" for name, cls in POLICIES.items()) + " (router/policies/)"


def make_policy(name: str) -> Policy:
    """A new instance of the policy called ``name`` (its own state). Raises ``KeyError`` for an
    unknown name."""
    return POLICIES[name]()
