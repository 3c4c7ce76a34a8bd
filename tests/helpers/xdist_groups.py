"""Which modules run together on one pytest-xdist worker, and in which order the groups are handed
out (``pytest -n 2``, pyproject's ``--dist loadgroup --no-loadscope-reorder``; tests/conftest.py marks
each test with its group).

A session fixture that starts a deployment or loads a model (``STARTS`` in tests/helpers/fixtures.py)
is made once in each worker that asks for it: so the modules that use one go to one worker, and
modules joined through any such fixture (a module using both ``deployment`` and ``keyed_session``)
form one group. Every other module is a group of its own, so its module fixtures (its own
deployment) are made once. Order: e2e, then Ray, integration and unit modules; inside each folder
the groups on a session fixture first. The longest group (everything on the shared deployment)
starts at once on one worker while the other takes the modules with deployments of their own, and
the many short unit tests come last, filling both workers until the end.
"""

from __future__ import annotations

FOLDERS = ("tests/e2e/", "tests/ray/", "tests/integration/", "tests/unit/")


def module_groups(uses: dict[str, set[str]]) -> dict[str, str]:
    """``{module: group name}`` from ``{module path: the STARTS fixtures its tests use}``.

    Modules connected through shared fixtures get one group, named after those fixtures
    (``"deployment+keyed_session"``); a module using none is its own group, named after its path
    inside tests/ without ``.py`` (``"unit/test_plan"``).
    """
    components: list[tuple[set[str], set[str]]] = []  # (fixtures, modules), pairwise disjoint fixtures
    for module, fixtures in uses.items():
        if not fixtures:
            continue
        joined_fixtures, joined_modules, apart = set(fixtures), {module}, []
        for component in components:
            if component[0] & joined_fixtures:
                joined_fixtures |= component[0]
                joined_modules |= component[1]
            else:
                apart.append(component)
        components = [*apart, (joined_fixtures, joined_modules)]
    groups = {module: own_name(module) for module in uses}
    for fixtures, modules in components:
        groups.update(dict.fromkeys(modules, "+".join(sorted(fixtures))))
    return groups


def own_name(module: str) -> str:
    """A module's own group name: ``"tests/unit/test_plan.py"`` -> ``"unit/test_plan"``."""
    return module.removeprefix("tests/").removesuffix(".py")


def group_order(module: str, group: str) -> tuple[int, int]:
    """Sort key of ``module``'s tests (a stable sort keeps each module's own order): its folder's
    place in :data:`FOLDERS` (unknown folders last), then a shared group before own groups."""
    folder = next((i for i, f in enumerate(FOLDERS) if module.startswith(f)), len(FOLDERS))
    return folder, int(group == own_name(module))
