"""The chat page (``/``) and the status page (``/status``) in a real, headless Chromium.

The chat tests use the shared deployment (2 replicas); the key prompt, the admin controls and a
``kill -9`` use the session's keyed deployment (``tests/helpers/keyed.py``: API keys and an admin
token, one replica), which the kill breaks for a while (the worker comes back). Screenshots of
both pages (1280×800) go into the tests' tmp folder (printed with ``-s``). Every test ends by
checking the browser's network log: no request went anywhere but the router.
"""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from tests.helpers.browser import Browser
from tests.helpers.deployment import Deployment, wait_for
from tests.helpers.keyed import ADMIN_TOKEN, ENV_KEYS

QUESTION = "What is the capital of France?"  # the README's
API_KEY = ENV_KEYS[0]


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    path = tmp_path_factory.mktemp("screenshots")
    yield path
    print(f"\npage screenshots: {path}")


@pytest.fixture(scope="module")
def keyed(browser, secured):
    """The session's keyed deployment (``tests/helpers/keyed.py``), once the browser is there."""
    return secured


def only_router(browser: Browser, *deployments: Deployment, expected: tuple[str, ...] = ()) -> None:
    """Nothing was requested from another origin than the router's, and the console shows no error
    (no CSP violation, no script error) but the ``expected`` ones."""
    foreign = browser.foreign_requests(*(d.url for d in deployments))
    assert not foreign, f"the page requested other hosts than the router: {foreign}"
    errors = browser.console_errors(expected)
    assert not errors, errors


def with_key(browser: Browser, d: Deployment, path: str) -> None:
    """Open ``path`` with the API key already in the tab's sessionStorage (as after the dialog)."""
    browser.leave()
    browser.open(f"{d.url}/health/live")
    browser.js("sessionStorage.setItem('llamadeploy.apiKey', arguments[0])", API_KEY)
    browser.open(f"{d.url}{path}")


def open_chat(browser: Browser, d: Deployment, temperature: str = "0", max_tokens: str = "512") -> None:
    """Load ``/`` on a fresh conversation, with the model list loaded and the settings given."""
    browser.open(f"{d.url}/")
    browser.js("sessionStorage.removeItem('llamadeploy.chat'); localStorage.clear();")
    browser.open(f"{d.url}/")
    browser.wait(lambda: browser.find("#model").get_attribute("value"), 30, "the model list")
    browser.set_value("#temperature", temperature)
    browser.set_value("#max-tokens", max_tokens)


def ask(browser: Browser, text: str) -> None:
    """Type ``text``, press Enter; returns once the answer's bubble is there (still streaming)."""
    from selenium.webdriver.common.keys import Keys

    before = len(browser.find_all(".message.assistant"))
    browser.find("#prompt").send_keys(text, Keys.ENTER)
    browser.wait(lambda: len(browser.find_all(".message.assistant")) > before, 10, "the answer's bubble")


def answered(browser: Browser, timeout: float = 120) -> str:
    """Wait for the running answer to end (Send is back and its stats are written); its text."""
    browser.wait(
        lambda: browser.find("#send").is_displayed() and browser.find_all(".message.assistant .stats")[-1].text,
        timeout,
        "the answer to finish",
    )
    return last_answer(browser)


def last_answer(browser: Browser) -> str:
    """The text of the last answer (read again if the page redrew it meanwhile)."""
    return browser.wait(lambda: browser.find_all(".message.assistant .markdown")[-1].text, 10, "the answer's text")


# ---- the chat page --------------------------------------------------------------------------


def test_pages_are_served_with_a_strict_content_security_policy(deployment):
    for path in ("/", "/status", "/pages/chat.js", "/pages/style.css"):
        r = httpx.get(f"{deployment.url}{path}", timeout=10)
        assert r.status_code == 200, (path, r.text[:200])
        csp = r.headers["Content-Security-Policy"]
        assert "default-src 'none'" in csp and "script-src 'self'" in csp and "connect-src 'self'" in csp
        assert "http" not in csp and "unsafe" not in csp
    assert httpx.get(f"{deployment.url}/pages/..%2Fui.py", timeout=10).status_code == 404
    assert httpx.get(f"{deployment.url}/pages/nope.js", timeout=10).status_code == 404
    assert httpx.post(f"{deployment.url}/v1/models", timeout=10).status_code == 405  # the API is as it was


def test_question_streams_paris(browser, deployment):
    open_chat(browser, deployment)
    ask(browser, QUESTION)
    assert "Paris" in answered(browser)
    stats = browser.find_all(".message.assistant .stats")[-1].text
    assert "TTFT" in stats and "tok/s" in stats, stats
    # It came as Server-Sent Events (the same stream the SDKs read), not one JSON body.
    browser.network()
    assert browser.responses[f"{deployment.url}/v1/chat/completions"] == "text/event-stream"
    # The conversation is in the tab's sessionStorage, and survives a reload.
    browser.open(f"{deployment.url}/")
    browser.wait(lambda: "Paris" in browser.find("#messages").text, 10, "the conversation after a reload")
    only_router(browser, deployment)


def test_stop_cancels_the_answer_on_the_server(browser, deployment):
    open_chat(browser, deployment, max_tokens="1500")
    ask(browser, "Count from 1 to 2000, separated by commas.")
    browser.wait(lambda: len(browser.find_all(".message.assistant .markdown")[-1].text) > 30, 120, "some text")
    assert any(w["in_flight"] for w in deployment.workers())
    browser.find("#stop").click()
    browser.wait(lambda: "stopped" in browser.find_all(".message.assistant .stats")[-1].text, 10, "stopped")
    shown = last_answer(browser)

    def idle() -> bool:
        rows = [deployment.next_heartbeat(w["id"]) for w in deployment.workers()]
        return all(w["running"] == 0 and w["in_flight"] == 0 for w in rows)

    wait_for(idle, 30, what="every worker's running count back to 0 after Stop")
    assert last_answer(browser) == shown  # nothing came after Stop
    only_router(browser, deployment)


def test_markdown_from_the_model_renders_a_code_block(browser, deployment, shots):
    open_chat(browser, deployment)
    ask(browser, QUESTION)
    answered(browser)
    ask(browser, "Write a Python function that reverses a string.")
    answered(browser)
    code = browser.find_all(".message.assistant")[-1].find_elements("css selector", "figure.md-code pre code")
    assert code and "def " in code[0].text and "```" not in browser.find_all(".message.assistant")[-1].text
    browser.screenshot(shots / "chat.png")
    only_router(browser, deployment)


def test_script_in_model_output_is_shown_as_text(browser, deployment):
    open_chat(browser, deployment)
    browser.js("window.__pwned = false;")
    ask(browser, "What does the HTML tag <script> do? Answer in one sentence.")
    text = answered(browser)
    assert "<script>" in text  # the model names the tag: the page shows it as characters
    assert "<script>" in browser.find_all(".message.user")[-1].text
    assert (
        browser.js("return document.querySelectorAll('#messages script, #messages iframe, #messages img').length") == 0
    )
    only_router(browser, deployment)


CRAFTED = """# Title
Some **bold**, *italic*, `a < b` and a [link](https://example.com/x) and a [bad one](javascript:alert(1)).

```js
const x = "<script>window.__pwned = true</script>";
```

| name | value |
|------|------:|
| a    | 1     |

- one
- two
  - nested

1. first
2. second

<script>window.__pwned = true</script>
<img src=x onerror="window.__pwned = true">
![pic](http://example.com/pic.png)
"""


def test_the_renderer_builds_elements_never_html(browser, deployment):
    browser.open(f"{deployment.url}/")
    browser.js("window.__pwned = false;")
    out = browser.driver.execute_async_script(
        """
        const [source, done] = arguments;
        import('/pages/markdown.js').then(({renderMarkdown}) => {
          const root = document.createElement('div');
          document.body.append(root);
          renderMarkdown(source, root);
          const q = (s) => [...root.querySelectorAll(s)];
          setTimeout(() => done({
            tags: q('*').map(e => e.tagName.toLowerCase()),
            code: q('pre code').map(e => e.textContent),
            cells: q('td, th').map(e => e.textContent),
            links: q('a').map(e => e.getAttribute('href')),
            nested: q('ul ul li').map(e => e.textContent),
            ordered: q('ol li').map(e => e.textContent),
            text: root.textContent,
            pwned: window.__pwned,
          }), 200);
        });
        """,
        CRAFTED,
    )
    assert not out["pwned"]
    assert not {"script", "img", "iframe", "object"} & set(out["tags"]), out["tags"]
    assert {"h3", "strong", "em", "code", "pre", "table", "ul", "ol"} <= set(out["tags"]), out["tags"]
    assert out["code"] == ['const x = "<script>window.__pwned = true</script>";']
    assert out["cells"] == ["name", "value", "a", "1"]
    # javascript: is not a link; the image is a link to it, never loaded
    assert out["links"] == ["https://example.com/x", "http://example.com/pic.png"]
    assert out["nested"] == ["nested"] and out["ordered"] == ["first", "second"]
    for shown in ("<script>window.__pwned = true</script>", '<img src=x onerror="window.__pwned = true">', "a < b"):
        assert shown in out["text"]
    only_router(browser, deployment)


def test_document_flow_shows_the_parsed_keywords(browser, deployment):
    open_chat(browser, deployment, max_tokens="200")
    browser.find("#mode-document").click()
    browser.set_value(
        "#document",
        "Acme Corp of Berlin hired 40 engineers in May to build electric bicycles. "
        "The new factory in Leipzig opens next spring.",
    )
    browser.set_value("#task", "keywords")
    browser.find("#json-schema").click()
    browser.find("#send").click()
    answered(browser)
    chips = [c.text for c in browser.find_all(".message.assistant .keywords .chip")]
    assert chips and all(chips), browser.find_all(".message.assistant")[-1].text
    assert "Document" in browser.find_all(".message.user")[-1].text
    only_router(browser, deployment)


# ---- the status page --------------------------------------------------------------------------


def test_status_shows_every_replica_live(browser, deployment, shots):
    deployment.chat(QUESTION, max_tokens=20)  # something for the charts
    browser.open(f"{deployment.url}/status")
    browser.wait(lambda: len(browser.find_all("#workers tbody tr")) == deployment.replicas, 30, "a row per replica")
    rows = browser.find_all("#workers tbody tr")
    pids = {str(w["pid"]) for w in deployment.workers()}
    assert {r.find_element("css selector", "td:nth-child(5)").text for r in rows} == pids
    models = {r.find_element("css selector", "td[data-model]").text for r in rows}
    assert models == {w["model"] for w in deployment.workers()} and "" not in models and "\u2013" not in models
    assert all(r.find_element("css selector", "[data-state]").get_attribute("data-state") == "ready" for r in rows)
    assert browser.find("#live").text == "live"
    assert browser.find_all("#events [data-kind='ready']")
    assert browser.find_all("#chart-rate svg path.line")
    assert browser.find("#admin-button").get_attribute("hidden") is not None  # no admin token configured
    assert not browser.find_all("[data-action]")
    browser.wait(lambda: browser.find("#card-ttft").text != "\u2013", 10, "the TTFT card")
    browser.screenshot(shots / "status.png")
    only_router(browser, deployment)


# ---- api keys, admin token, kill -9 (a deployment of its own) -----------------------------------


def test_the_page_asks_for_a_key_and_says_when_it_is_wrong(browser, keyed):
    assert httpx.get(f"{keyed.url}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{keyed.url}/", timeout=10).status_code == 200  # the page itself holds no data
    browser.leave()
    browser.open(f"{keyed.url}/")
    browser.js("sessionStorage.clear()")
    browser.open(f"{keyed.url}/")
    browser.wait(lambda: browser.find("#api-key-dialog").is_displayed(), 10, "the key dialog")
    assert "needs an API key" in browser.find("#api-key-message").text
    browser.find("#api-key-input").send_keys("wrong-key")
    browser.find("#api-key-save").click()
    browser.wait(lambda: "refused" in browser.find("#api-key-message").text, 10, "the refusal")
    assert "401" in browser.find("#api-key-message").text
    browser.find("#api-key-input").send_keys(API_KEY)
    browser.find("#api-key-save").click()
    browser.wait(lambda: browser.find("#model").get_attribute("value"), 10, "the models with the key")
    assert browser.js("return sessionStorage.getItem('llamadeploy.apiKey')") == API_KEY
    browser.set_value("#temperature", "0")
    ask(browser, QUESTION)
    assert "Paris" in answered(browser)
    only_router(browser, keyed, expected=("status of 401",))


def test_admin_controls_need_the_admin_token(browser, keyed):
    auth = keyed.auth_headers()
    assert httpx.get(f"{keyed.url}/status/admin", headers=auth, timeout=10).status_code == 401
    wrong = {**auth, "X-Admin-Token": "nope"}
    assert httpx.post(f"{keyed.url}/status/admin/workers/0/drain", headers=wrong, timeout=10).status_code == 401
    with_key(browser, keyed, "/status")
    browser.wait(lambda: browser.find_all("#workers tbody tr"), 30, "the table")
    assert not browser.find_all("[data-action]")  # no token yet: no controls
    browser.wait(lambda: browser.find("#admin-button").is_displayed(), 10, "the admin button")
    browser.find("#admin-button").click()
    browser.find("#admin-token-input").send_keys("wrong")
    browser.find("#admin-token-save").click()
    browser.wait(lambda: "refused" in browser.find("#admin-token-message").text, 10, "the refusal")
    browser.find("#admin-token-input").clear()
    browser.find("#admin-token-input").send_keys(ADMIN_TOKEN)
    browser.find("#admin-token-save").click()
    browser.wait(lambda: browser.find_all("[data-action='drain']"), 10, "the drain button")
    browser.find("[data-action='drain']").click()
    browser.wait(lambda: keyed.worker(0)["state"] == "draining", 10, "the worker draining")
    browser.wait(lambda: browser.find_all("[data-action='undrain']"), 10, "the resume button")
    browser.find("[data-action='undrain']").click()
    browser.wait(lambda: keyed.worker(0)["state"] == "ready", 10, "the worker ready again")
    browser.wait(lambda: browser.find_all("#events [data-kind='undrained']"), 10, "the undrain event")
    only_router(browser, keyed, expected=("status of 401",))


def test_kill_9_shows_the_worker_dead_and_back(browser, keyed):
    with_key(browser, keyed, "/status")
    browser.wait(lambda: browser.find_all("#workers tbody tr [data-state='ready']"), 30, "a ready row")
    pid, restarts = keyed.worker(0)["pid"], keyed.worker(0)["restarts"]
    os.kill(pid, signal.SIGKILL)
    browser.wait(lambda: browser.find_all("#workers tbody tr [data-state='dead']"), 30, "the row dead")
    assert "SIGKILL" in browser.find("#workers tbody tr .reason").text
    browser.wait(lambda: "SIGKILL" in browser.find("#events").text, 30, "the death and its reason in the events")
    assert browser.find_all("#events [data-kind='died']")
    browser.wait(lambda: browser.find_all("#events [data-kind='restarted']"), 60, "the restart event")
    keyed.wait_ready(240)
    browser.wait(lambda: browser.find_all("#workers tbody tr [data-state='ready']"), 30, "the row ready again")
    row = browser.find("#workers tbody tr")
    assert row.find_element("css selector", "td:nth-child(10)").text == str(restarts + 1)
    assert row.find_element("css selector", "td:nth-child(5)").text == str(keyed.worker(0)["pid"]) != str(pid)
    only_router(browser, keyed)
