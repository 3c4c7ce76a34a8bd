"""The documentation at ``/docs/``, served by ``llamadeploy up``: over HTTP, behind the pages' key
rule, and in a real headless Chromium whose search runs offline.

Uses the shared deployment and the session's keyed one (``tests/helpers/keyed.py``). The site is
the one scripts/setup.sh builds into ``router/docs_site/``; where it was not built yet (a fresh
worktree), the module builds it there the same way first.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from router.docs_site import SITE_DIR

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def built() -> Path:
    if not (SITE_DIR / "index.html").is_file():
        subprocess.run(
            [sys.executable, "-m", "mkdocs", "build", "--quiet"],
            cwd=ROOT,
            check=True,
            timeout=240,
            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        )
    return SITE_DIR


def test_up_serves_the_docs(deployment, built):
    r = httpx.get(f"{deployment.url}/docs/", timeout=10)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/html"), r.text[:200]
    assert "<title>llamadeploy</title>" in r.text
    csp = r.headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "'sha256-" in csp and "unsafe" not in csp and "http" not in csp
    moved = httpx.get(f"{deployment.url}/docs", timeout=10)
    assert moved.status_code == 301 and moved.headers["Location"] == "/docs/"
    reference = httpx.get(f"{deployment.url}/docs/reference/configuration/", timeout=10)
    assert reference.status_code == 200 and "workers.max_num_seqs" in reference.text
    index = httpx.get(f"{deployment.url}/docs/search/search_index.json", timeout=10)
    assert index.status_code == 200 and index.json()["docs"]
    for escape in ("/docs/..%2F..%2Frouter%2Fui.py", "/docs/%2E%2E/%2E%2E/pyproject.toml", "/docs/nope/"):
        assert httpx.get(f"{deployment.url}{escape}", timeout=10).status_code == 404, escape
    for page in ("/", "/status"):  # the chat and status pages link to it
        assert 'href="/docs/"' in httpx.get(f"{deployment.url}{page}", timeout=10).text


def test_the_docs_need_no_key_where_the_api_does(secured, built):
    assert httpx.get(f"{secured.url}/v1/models", timeout=10).status_code == 401
    r = httpx.get(f"{secured.url}/docs/api/", timeout=10)
    assert r.status_code == 200 and "text/html" in r.headers["Content-Type"]
    assert httpx.post(f"{secured.url}/docs/", timeout=10).status_code in (401, 405)  # read-only


def test_search_in_a_browser_asks_only_the_router(browser, deployment, built):
    browser.leave()
    browser.open(f"{deployment.url}/status")
    browser.wait(lambda: browser.find("a[href='/docs/']"), 30, "the status page's Docs link").click()
    browser.wait(lambda: browser.driver.title == "llamadeploy", 30, "the docs' home page")
    search = browser.wait(lambda: browser.find("input.md-search__input"), 30, "the search box")
    search.click()
    search.send_keys("tensor parallel")
    results = browser.wait(lambda: browser.find_all(".md-search-result__item a"), 60, "search results")
    assert "matching" in browser.find(".md-search-result__meta").text
    results[0].click()
    browser.wait(lambda: "/docs/" in browser.driver.current_url and "h=" in browser.driver.current_url, 30, "a result")
    assert "parallel" in browser.find("article").text.lower()
    search_index = f"{deployment.url}/docs/search/search_index.json"
    assert search_index in browser.network() + browser.requests  # the index came from the router
    foreign = browser.foreign_requests(deployment.url)
    assert not foreign and not [u for u in browser.requests if not u.startswith((deployment.url, "data:", "blob:"))]
    errors = browser.console_errors()
    assert not errors, errors  # no CSP violation, no script error
