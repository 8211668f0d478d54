"""The web page at / and Swagger UI at /docs in a real headless Chromium (Playwright): sign in,
watch a job train, kill a worker, see the recovery on the page; /docs with nothing fetched from
outside. Screenshots go to $ETRAIN_TEST_ARTIFACTS (default <repo>/test-artifacts/)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from service import ledger, rundir
from service.settings import Settings
from tests.conftest import ROOT
from tests.fakes import FakeGateway
from tests.helpers.threaded_server import Server
from tests.service.conftest import TOKEN, small_job, wait_for
from workers import events

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(os.environ.get("ETRAIN_TEST_ARTIFACTS") or ROOT / "test-artifacts")
FAKE_TOKEN = "web-test-token-0123456789"


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM}")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


class Page:
    """A browser tab that can reach 127.0.0.1 only, recording what else it tried and any JS error."""

    def __init__(self, browser):
        self.context = browser.new_context(viewport={"width": 1440, "height": 1000})
        self.tab = self.context.new_page()
        self.outside: list[str] = []
        self.errors: list[str] = []
        self.tab.route("**/*", self._only_local)
        self.tab.on("pageerror", lambda e: self.errors.append(str(e)))

    def _only_local(self, route) -> None:
        if urlparse(route.request.url).hostname == "127.0.0.1":
            route.continue_()
        else:
            self.outside.append(route.request.url)
            route.abort()

    def shot(self, name: str) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"web-{name}.png"
        self.tab.screenshot(path=str(path), full_page=True)
        return path

    def number(self, selector: str, attr: str = "points") -> int:
        return int(self.tab.get_attribute(selector, f"data-{attr}") or 0)

    def sign_in(self, url: str, token: str) -> None:
        self.tab.goto(url + "/")
        self.tab.fill("#token", token)
        self.tab.click("#signin-button")


@pytest.fixture
def page(browser):
    p = Page(browser)
    try:
        yield p
        assert p.errors == [], p.errors
        assert p.outside == [], f"the page fetched from outside 127.0.0.1: {p.outside}"
    finally:
        p.context.close()


# ---------------------------------------------------------------- without Ray: a fake gateway


@pytest.fixture
def fake_app(tmp_path):
    return create_app(Settings(data_dir=tmp_path, token=FAKE_TOKEN), FakeGateway(), reconcile=False)


@pytest.fixture
def fake_server(fake_app):
    server = Server(fake_app)
    try:
        yield server
    finally:
        server.stop()


def test_page_docs_and_static_need_no_token_but_data_does(fake_app):
    with TestClient(fake_app) as c:
        page = c.get("/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert 'id="signin-form"' in page.text
        docs = c.get("/docs")
        assert docs.status_code == 200 and "/static/vendor/swagger/swagger-ui-bundle.js" in docs.text
        assert "cdn" not in docs.text.lower()
        for path in ("/kinds.js", "/static/app.js", "/static/chart.js", "/static/style.css",
                     "/static/vendor/swagger/swagger-ui.css"):
            assert c.get(path).status_code == 200, path
        assert c.get("/redoc").status_code == 404
        assert c.get("/v1/jobs").status_code == 401
        schema_paths = c.get("/openapi.json").json()["paths"]
        assert "/" not in schema_paths and "/docs" not in schema_paths


def test_docs_render_offline(fake_server, page):
    page.tab.goto(fake_server.url + "/docs")
    page.tab.wait_for_selector(".swagger-ui .info .title", timeout=20_000)
    page.tab.wait_for_selector(".opblock-summary-path[data-path='/v1/jobs']", timeout=20_000)
    assert "elastic-train" in page.tab.inner_text(".swagger-ui .info .title")
    assert page.tab.locator(".opblock").count() >= 10
    page.shot("docs")


def test_wrong_token_is_refused_with_a_message(fake_server, page):
    page.sign_in(fake_server.url, "not-the-token")
    page.tab.wait_for_function("document.querySelector('#signin-error')?.textContent.includes('401')")
    assert page.tab.is_visible("#signin-form") and not page.tab.is_visible("#main")
    assert page.tab.evaluate("sessionStorage.getItem('etrain.token')") is None
    page.sign_in(fake_server.url, FAKE_TOKEN)
    page.tab.wait_for_selector("#no-jobs", state="visible")
    assert page.tab.evaluate("sessionStorage.getItem('etrain.token')") == FAKE_TOKEN


def test_job_page_draws_a_recorded_recovery(fake_app, fake_server, page):
    """A run record written by hand (fake gateway): charts, markers, timeline, the 409 message."""
    with TestClient(fake_app, headers={"Authorization": f"Bearer {FAKE_TOKEN}"}) as c:
        c.post("/v1/jobs", json={**small_job("recorded", steps=60), "evaluation": {"every_steps": 20}}).raise_for_status()
    rd = rundir.run_dir(fake_app.state.settings.runs_dir, "recorded")
    events.emit(rd, "job_started", pid=1)
    events.emit(rd, "attempt_started", attempt=1, world_size=2, from_step=0)
    for step in range(1, 31):
        val = {"val_loss": 2 / step, "val_accuracy": min(1.0, step / 30)} if step % 20 == 0 else {}
        events.log_metrics(rd, step=step, epoch=0, loss=2.3 / step, lr=0.001, samples_per_s=900 + step,
                           step_s=0.07, attempt=1, **val)
    page.sign_in(fake_server.url, FAKE_TOKEN)
    page.tab.click("#jobs-table tr[data-job='recorded'] a")
    page.tab.wait_for_function("Number(document.querySelector('#chart-loss')?.dataset.points) === 30")
    assert page.number("#chart-val") == 1

    page.tab.click("#kill-button")  # the job is SUBMITTED, not training: the API says 409 and why
    page.tab.wait_for_selector("#action-message.error")
    assert "Not now" in page.tab.inner_text("#action-message")

    events.emit(rd, "fault_injected", rank=1, kind="crash", step=30)
    events.emit(rd, "worker_failed", rank=1, error="worker process died", process_died=True)
    events.emit(rd, "attempt_started", attempt=2, world_size=2, from_step=20)
    events.emit(rd, "resumed", attempt=2, failed_rank=1, cause="crash", from_step=20, reached_step=30, lost_steps=10,
                recovery_s=12.5)
    for step in range(31, 61):
        events.log_metrics(rd, step=step, epoch=1, loss=2.3 / step, lr=0.001, samples_per_s=950, step_s=0.07,
                           attempt=2, **({"val_loss": 2 / step, "val_accuracy": 1.0} if step % 20 == 0 else {}))
    page.tab.wait_for_function("Number(document.querySelector('#chart-loss')?.dataset.points) === 60")
    page.tab.wait_for_selector("#timeline .ev-resumed")
    assert "10 steps recomputed" in page.tab.inner_text("#timeline .ev-resumed")
    assert page.number("#chart-loss", "markers") == 1
    assert page.tab.locator("#chart-loss .marker-failure").count() == 1
    assert page.number("#chart-val") == 3
    row = page.tab.inner_text("#recoveries tbody tr")
    assert "rank 1" in row and "crash" in row and "12.5 s" in row
    page.shot("recorded-recovery")


def test_a_job_deleted_and_made_again_under_its_id_is_read_afresh_by_an_open_page(fake_app, fake_server, page):
    auth = {"Authorization": f"Bearer {FAKE_TOKEN}"}
    rd = rundir.run_dir(fake_app.state.settings.runs_dir, "again")

    def make(steps: int, world: int) -> None:
        with TestClient(fake_app, headers=auth) as c:
            c.post("/v1/jobs", json=small_job("again", steps=60)).raise_for_status()
        events.emit(rd, events.JobStarted(pid=1))
        events.emit(rd, events.AttemptStarted(attempt=1, world_size=world, from_step=0))
        for step in range(1, steps + 1):
            events.log_metrics(rd, events.MetricsLine(step=step, epoch=0, loss=2.3 / step, attempt=1))

    make(30, world=2)
    page.sign_in(fake_server.url, FAKE_TOKEN)
    page.tab.click("#jobs-table tr[data-job='again'] a")
    page.tab.wait_for_function("Number(document.querySelector('#chart-loss')?.dataset.points) === 30")
    ledger.update_job(fake_app.state.ledger, job_id="again", state=ledger.JobState.CANCELLED)
    with TestClient(fake_app, headers=auth) as c:
        assert c.delete("/v1/jobs/again").status_code == 204
    time.sleep(0.01)  # another created_at
    make(5, world=3)
    # The old page held 30 steps and an events offset past the new file's few events.
    page.tab.wait_for_function("Number(document.querySelector('#chart-loss')?.dataset.points) === 5")
    page.tab.wait_for_function("document.querySelector('#timeline')?.textContent.includes('3 worker(s)')")
    assert "2 worker(s)" not in page.tab.inner_text("#timeline")


# ---------------------------------------------------------------- with Ray: a real job, a real kill


@pytest.mark.ray
def test_watch_a_job_recover_from_a_killed_worker(api, page):
    with api.client() as c:
        c.post("/v1/jobs", json={**small_job("web-fault", steps=800, size=4096),
                                 "evaluation": {"every_steps": 100}}).raise_for_status()
    page.sign_in(api.url, TOKEN)
    page.tab.wait_for_selector("#jobs-table tr[data-job='web-fault']")
    page.shot("jobs")
    page.tab.click("#jobs-table tr[data-job='web-fault'] a")
    # Each predicate below tolerates the view not drawn yet: Playwright stops at one that
    # throws (once in CI: the chart was not in the page yet, right after the click).

    page.tab.wait_for_function("Number(document.querySelector('#chart-loss')?.dataset.points) >= 15", timeout=90_000)
    before = page.number("#chart-loss")
    page.tab.wait_for_function(f"Number(document.querySelector('#chart-loss')?.dataset.points) > {before}",
                               timeout=20_000)
    page.shot("training")

    page.tab.wait_for_selector("#kill-rank option[value='1']", state="attached")
    page.tab.select_option("#kill-rank", "1")
    deadline = time.time() + 20
    while True:  # the API answers 409 while the job is starting; the page says so
        page.tab.click("#kill-button")
        page.tab.wait_for_selector("#action-message.ok, #action-message.error")
        if "Killed rank 1" in page.tab.inner_text("#action-message") or time.time() > deadline:
            break
        time.sleep(1)
    assert "Killed rank 1" in page.tab.inner_text("#action-message")
    # The ledger's RECOVERING (set by the reconciler) lasts the ~10 s of the restart; the page polls every 2 s.
    page.tab.wait_for_function("document.querySelector('#job-state')?.textContent.includes('RECOVERING')",
                               timeout=60_000)

    page.tab.wait_for_selector("#timeline .ev-resumed", timeout=90_000)
    assert "rank 1" in page.tab.inner_text("#timeline .ev-resumed")
    page.tab.wait_for_function("Number(document.querySelector('#chart-loss')?.dataset.markers) >= 1")
    assert page.tab.locator("#chart-loss .marker-failure").count() >= 1
    assert "rank 1" in page.tab.inner_text("#recoveries tbody tr")
    page.shot("recovered")

    page.tab.wait_for_function("document.querySelector('#job-state')?.textContent.includes('SUCCEEDED')",
                               timeout=120_000)
    with api.client() as c:
        job = wait_for(c, "web-fault", {"SUCCEEDED", "FAILED"}, timeout=10)
        resumed = [e for e in c.get("/v1/jobs/web-fault/events").json()["data"] if e["event"] == "resumed"]
        metrics = c.get("/metrics").text
    assert job["state"] == "SUCCEEDED" and job["restarts"] == 1, job
    assert len(resumed) == 1 and resumed[0]["failed_rank"] == 1 and resumed[0]["lost_steps"] <= 10, resumed
    assert 'etrain_jobs{state="SUCCEEDED"}' in metrics and "etrain_recovery_seconds_count 1.0" in metrics
    page.tab.wait_for_selector("#timeline .ev-finished")
    assert page.number("#chart-loss") >= 700
    assert page.number("#chart-val") >= 8  # validation at steps 100, 200, ... 800, from the workers
    page.shot("succeeded")
