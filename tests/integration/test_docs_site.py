"""The documentation site builds strictly, loads nothing from another host, and the set-up builds it.

``mkdocs build --strict`` fails on a broken link, a missing anchor or a page left out of the
navigation, so these tests are the docs' CI. The site is built into a temporary folder (the one
the router serves, ``router/docs_site/``, is scripts/setup.sh's).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "scripts" / "setup.sh"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
# A URL the page itself would load or link to: src/href attributes, CSS url(...) and @import.
RESOURCE = re.compile(
    rb"""(?:\b(?:src|href|action|poster|data)\s*=\s*["']?|url\(\s*["']?|@import\s+["'])(https?:)?//([^/"')\s>]+)"""
)


def build(project: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(project / "mkdocs.yml"), "-d", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("docs") / "site"
    done = build(ROOT, out)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    return out


def test_every_page_of_the_navigation_is_built(site):
    for page in ("index.html", "getting-started/index.html", "reference/configuration/index.html"):
        assert (site / page).is_file(), page
    assert "workers.max_num_seqs" in (site / "reference" / "configuration" / "index.html").read_text()
    assert "restart-worker" in (site / "reference" / "cli" / "index.html").read_text()


def test_nothing_is_loaded_or_linked_from_another_host(site):
    foreign = {}
    for path in site.rglob("*"):
        if path.suffix not in (".html", ".css", ".js", ".json") or path.name.endswith(".map"):
            continue
        body = path.read_bytes()
        if path.suffix == ".js":  # a bundle names hosts in code paths this site never takes (repo, mermaid)
            body = b"".join(re.findall(rb"import\s*\(?\s*[\"'][^\"']*[\"']", body))
        hosts = {m.group(2).decode() for m in RESOURCE.finditer(body)}
        hosts = {h for h in hosts if h.split(":")[0] not in LOOPBACK and not h.startswith("HOST")}
        if hosts:
            foreign[str(path.relative_to(site))] = sorted(hosts)
    assert not foreign
    index = (site / "index.html").read_text()
    assert "fonts.googleapis" not in index and "fonts.gstatic" not in index  # theme.font: false


def test_search_works_from_the_site_itself(site):
    index = json.loads((site / "search" / "search_index.json").read_text())
    pages = {doc["location"].split("#")[0] for doc in index["docs"]}
    assert "deploying/tensor-parallel/" in pages and "reference/configuration/" in pages
    config = json.loads(
        re.search(
            r'<script id="__config" type="application/json">(.*?)</script>', (site / "index.html").read_text(), re.S
        ).group(1)
    )
    worker = urlsplit(config["search"])
    assert (
        not worker.scheme and not worker.netloc and (site / worker.path).is_file()
    )  # the search worker is served here


def test_the_drop_folder_never_breaks_the_build(tmp_path):
    project = tmp_path / "project"
    shutil.copytree(ROOT / "docs", project / "docs", ignore=shutil.ignore_patterns("_incoming"))
    shutil.copy(ROOT / "mkdocs.yml", project / "mkdocs.yml")
    (project / "docs" / "_incoming").mkdir()
    (project / "docs" / "_incoming" / "someone.md").write_text("# notes\n\n[a link to nowhere](nowhere.md)\n")
    done = build(project, tmp_path / "site")
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "site" / "_incoming").exists()
    # and a page left out of the navigation does fail it
    (project / "docs" / "orphan.md").write_text("# orphan\n")
    done = build(project, tmp_path / "site2")
    assert done.returncode != 0 and "orphan.md" in done.stdout + done.stderr


def run_build_docs(python: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(python)
    return subprocess.run(
        ["bash", "-c", f"source {SETUP}; build_docs"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
        env={**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"},
    )


def test_setup_builds_the_site_and_survives_a_failed_build(tmp_path):
    recorder = tmp_path / "record.sh"
    recorder.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/args\n')
    recorder.chmod(0o755)
    done = run_build_docs(recorder, tmp_path / "ok")
    assert done.returncode == 0 and (tmp_path / "args").read_text().split()[:3] == ["-m", "mkdocs", "build"]
    failing = tmp_path / "fail.sh"
    failing.write_text("#!/bin/sh\nexit 1\n")
    failing.chmod(0o755)
    done = run_build_docs(failing, tmp_path / "failed")
    assert done.returncode == 0 and "/docs/ will answer 404" in done.stdout


async def _get_all(site_dir: Path | None, paths: list[str]) -> list[tuple[int, dict, bytes]]:
    """GET each path from an app with only the docs' routes and the router's error middleware, on loopback."""
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from router import docs_site
    from router.app import error_middleware

    app = web.Application(middlewares=[error_middleware()])
    if site_dir is not None:
        app[docs_site.SITE_KEY] = site_dir
    docs_site.add_routes(app)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        out = []
        for path in paths:
            r = await client.get(path, allow_redirects=False)
            out.append((r.status, dict(r.headers), await r.read()))
        return out


def test_the_router_serves_the_built_site_read_only(site):
    paths = [
        "/docs/",
        "/docs",
        "/docs/api",
        "/docs/api/",
        "/docs/search/search_index.json",
        "/docs/nope/",
        "/docs/../pyproject.toml",
    ]
    home, bare, no_slash, api, index, missing, escape = asyncio.run(_get_all(site, paths))
    assert (
        home[0] == 200 and home[1]["Content-Type"].startswith("text/html") and b"<title>llamadeploy</title>" in home[2]
    )
    assert "'sha256-" in home[1]["Content-Security-Policy"] and "unsafe" not in home[1]["Content-Security-Policy"]
    assert (bare[0], bare[1]["Location"]) == (301, "/docs/")
    assert (no_slash[0], no_slash[1]["Location"]) == (301, "/docs/api/")  # the page's relative links need it
    assert api[0] == 200 and b"Endpoints" in api[2]
    assert index[0] == 200 and json.loads(index[2])["docs"]
    assert missing[0] == 404 and escape[0] == 404


def test_an_unbuilt_site_says_how_to_build_it(tmp_path):
    ((status, _, body),) = asyncio.run(_get_all(tmp_path / "nothing", ["/docs/"]))
    assert status == 404 and "scripts/setup.sh" in json.loads(body)["error"]["message"]
