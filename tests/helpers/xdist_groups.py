"""Which modules run together on one pytest-xdist worker, and in which order the groups are handed
out (``pytest -n 2``, pyproject's ``--dist loadgroup --no-loadscope-reorder``; tests/conftest.py marks
each test with its group).

A session fixture that starts a deployment or loads a model (``STARTS`` in tests/helpers/fixtures.py)
is made once in each worker that asks for it: so the modules that use one go to one worker, and
modules joined through any such fixture (a module using both ``deployment`` and ``keyed_session``)
form one group. Memory: two workers starting deployments of their own beside the session's ran a
24 GiB machine out of RAM, so every e2e module not on the shared deployment (each starts its own,
or ``curve_busy``) joins one group, :data:`OWN_DEPLOYMENTS`: one worker runs them one after the
other, their session fixture's users first (tests/conftest.py stops a session fixture after its
last user). Every other module is a group of its own. Order: e2e, then Ray, integration and unit
modules; inside each folder the shared groups first. xdist hands each worker one group to start
with: one takes the shared deployment's modules, the other the modules with deployments of their
own; the first free takes Ray's and then the in-process and unit modules, which fill both workers
until the end.
"""

from __future__ import annotations

FOLDERS = ("tests/e2e/", "tests/ray/", "tests/integration/", "tests/unit/")
E2E = FOLDERS[0]
SHARED = "deployment"  # the session deployment most e2e modules use
OWN_DEPLOYMENTS = "e2e-own-deployments"


def module_groups(uses: dict[str, set[str]]) -> dict[str, str]:
    """``{module: group name}`` from ``{module path: the STARTS fixtures its tests use}``.

    Modules connected through shared fixtures get one group, named after those fixtures
    (``"deployment+keyed_session"``); a module using none is its own group, named after its path
    inside tests/ without ``.py`` (``"unit/test_plan"``); then every e2e module outside the group of
    :data:`SHARED` joins :data:`OWN_DEPLOYMENTS` (its deployments, one at a time on one worker).
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
    shared = {groups[m] for m, fixtures in uses.items() if SHARED in fixtures}
    for module in uses:
        if module.startswith(E2E) and groups[module] not in shared:
            groups[module] = OWN_DEPLOYMENTS
    return groups


def own_name(module: str) -> str:
    """A module's own group name: ``"tests/unit/test_plan.py"`` -> ``"unit/test_plan"``."""
    return module.removeprefix("tests/").removesuffix(".py")


def group_order(module: str, group: str, on_session_fixture: bool = False) -> tuple[int, int, int]:
    """Sort key of ``module``'s tests (a stable sort keeps each module's own order): its folder's
    place in :data:`FOLDERS` (unknown folders last), then a shared group before own groups, then
    (inside a group) the modules on a session fixture first, so that it is stopped early."""
    folder = next((i for i, f in enumerate(FOLDERS) if module.startswith(f)), len(FOLDERS))
    return folder, int(group == own_name(module)), int(not on_session_fixture)


def last_users(order: list[tuple[str, set[str]]]) -> dict[str, set[str]]:
    """``{test id: the session fixtures it is the last user of}``, from the tests in the order they
    run and the session fixtures each uses: after that test the fixture can be stopped."""
    last: dict[str, str] = {}
    for test, fixtures in order:
        last.update(dict.fromkeys(fixtures, test))
    out: dict[str, set[str]] = {}
    for fixture, test in last.items():
        out.setdefault(test, set()).add(fixture)
    return out
