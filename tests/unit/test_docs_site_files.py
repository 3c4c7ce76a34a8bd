"""router/docs_site.py's pure parts: which file a URL names (never one outside the site), the
policy's script hashes, and the API-key rule (the site loads without a key, like the pages)."""

from __future__ import annotations

import base64
import hashlib

import pytest

from router import docs_site, ui

pytestmark = pytest.mark.unit


@pytest.fixture
def site(tmp_path):
    root = tmp_path / "site"
    (root / "api").mkdir(parents=True)
    (root / "index.html").write_text("<html>home</html>")
    (root / "api" / "index.html").write_text("<html>api</html>")
    (root / "search").mkdir()
    (root / "search" / "search_index.json").write_text("{}")
    (tmp_path / "secret.txt").write_text("not for the web")
    return root


def test_a_path_names_a_file_of_the_site(site):
    assert docs_site.resolve(site, "") == (site / "index.html").resolve()
    assert docs_site.resolve(site, "api/") == (site / "api" / "index.html").resolve()
    assert docs_site.resolve(site, "api") == (site / "api" / "index.html").resolve()
    assert docs_site.resolve(site, "search/search_index.json") == (site / "search" / "search_index.json").resolve()
    assert docs_site.resolve(site, "nope.html") is None


@pytest.mark.parametrize("rel", ["../secret.txt", "api/../../secret.txt", "/etc/passwd", "..", "api/../.."])
def test_no_path_leaves_the_site(site, rel):
    assert docs_site.resolve(site, rel) is None


def test_a_link_out_of_the_site_is_not_followed(site, tmp_path):
    (site / "out").symlink_to(tmp_path / "secret.txt")
    assert docs_site.resolve(site, "out") is None


def test_the_policy_lists_each_inline_script_by_its_hash():
    body = (
        b"<script>var a=1</script><script src='x.js'></script>"
        b'<script id="__config" type="application/json">{"k": 1}</script><script>var a=1</script>'
    )
    want = base64.b64encode(hashlib.sha256(b"var a=1").digest()).decode()
    csp = docs_site.csp_for(body)
    assert csp.count("'sha256-") == 1 and f"'sha256-{want}'" in csp  # JSON data is not a script
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert "unsafe" not in csp and "http" not in csp


def test_the_site_loads_without_an_api_key_like_the_pages():
    for path in ("/docs", "/docs/", "/docs/api/", "/docs/search/search_index.json"):
        assert ui.is_open(path)
    for path in ("/docsx", "/v1/models", "/workers"):
        assert not ui.is_open(path)
