"""Content-Security-Policy in a real headless Chromium: every main page carries the header and runs
without a single violation (no inline script, handler or style left), and a violation is caught when
one happens (the check can fail)."""

from __future__ import annotations

from pathlib import Path

import pytest
from playwright.sync_api import expect

from rlplatform.security_headers import CONTENT_SECURITY_POLICY

NO_CHROMIUM = pytest.mark.skipif(
    not Path("/usr/bin/chromium").exists(), reason="/usr/bin/chromium is absent (apt-get install chromium)"
)
pytestmark = [pytest.mark.e2e, NO_CHROMIUM, pytest.mark.django_db(transaction=True)]

# Installed before any page script: records what the browser refused, as the page sees it.
RECORD_VIOLATIONS = """
window.__csp = [];
document.addEventListener("securitypolicyviolation", (e) => {
  window.__csp.push(`${e.violatedDirective} ${e.blockedURI} ${e.sourceFile}:${e.lineNumber}`);
});
"""


def _watch(page) -> list[str]:
    """Console messages about the policy (Chromium logs every refusal there)."""
    console: list[str] = []
    page.add_init_script(RECORD_VIOLATIONS)
    page.on("console", lambda msg: console.append(msg.text) if "Content Security Policy" in msg.text else None)
    return console


def _load(page, path: str, console: list[str]) -> tuple[str | None, list[str]]:
    """(the policy header of ``path``, every violation reported while it loaded and ran its scripts)."""
    response = page.goto(path)
    assert response is not None and response.status == 200, path
    page.wait_for_load_state("networkidle")  # module scripts and what they fetch
    if page.locator("#stream-status").count():  # the live stream's WebSocket is allowed by connect-src
        expect(page.locator("#stream-status")).to_have_text("live")
    return response.headers.get("content-security-policy"), [*page.evaluate("window.__csp"), *console]


def test_every_main_page_has_the_policy_and_no_violation(
    server, login_as, in_thread, editor, superuser, experiment, submit, shot
):
    run = in_thread(submit, experiment)
    pages = [
        "/",
        f"/experiments/{experiment.pk}/",
        f"/experiments/{experiment.pk}/compare/",
        f"/runs/{run.pk}/",
        f"/runs/{run.pk}/checkpoints/",
        "/cluster/",
        "/groups/",
        "/submit/",
        "/api/docs/",
    ]
    page = login_as(editor)
    console = _watch(page)
    for path in pages:
        header, violations = _load(page, path, console)
        assert (path, header, violations) == (path, CONTENT_SECURITY_POLICY, [])
        if path == f"/runs/{run.pk}/":
            shot(page, "csp-run-page", full=False)  # the run page as it renders under the policy

    staff = login_as(superuser)
    staff_console = _watch(staff)
    for path in ["/quotas/", "/admin/", "/admin/rlplatform/apitoken/"]:
        header, violations = _load(staff, path, staff_console)
        assert (path, header, violations) == (path, CONTENT_SECURITY_POLICY, [])


def test_the_login_page_has_the_policy_and_no_violation(browser, server):
    context = browser.new_context(base_url=server)
    page = context.new_page()
    console = _watch(page)
    header, violations = _load(page, "/login/", console)
    assert (header, violations) == (CONTENT_SECURITY_POLICY, [])
    context.close()


def test_an_injected_inline_script_handler_and_style_are_refused_and_reported(
    server, login_as, editor, experiment, shot
):
    page = login_as(editor)
    console = _watch(page)
    _load(page, "/", console)
    page.evaluate(
        """() => {
            const s = document.createElement("script");
            s.textContent = "window.__ran = true";
            document.body.append(s);
            document.body.insertAdjacentHTML("beforeend", '<img src="data:," onerror="window.__ran = true">');
            document.body.insertAdjacentHTML("beforeend", '<p id="injected" style="color: red">inline style</p>');
        }"""
    )
    page.wait_for_function("window.__csp.length >= 3")
    shot(page, "csp-injected-refused", page.locator("#injected"))  # its text is not red: the style was refused
    assert page.locator("#injected").evaluate("e => getComputedStyle(e).color") != "rgb(255, 0, 0)"
    assert page.evaluate("window.__ran === undefined")  # neither script ran
    assert sorted(v.split()[0] for v in page.evaluate("window.__csp")) == [
        "script-src-attr",
        "script-src-elem",
        "style-src-attr",
    ]
