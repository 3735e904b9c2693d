"""The Lab in a real headless Chromium (Playwright, Debian's chromium package).

The browser set-up (tests/browser_setup.py) installs Chromium and Playwright on first use, or
skips these tests saying why. The page is served by the real app on loopback, around a tiny
engine; a screenshot of the finished page is saved as artifacts/lab.png.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from browser_setup import ARTIFACTS, launch, require_browser
from server_helpers import serve_in_thread
from understudy.engine.engine import Engine

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def lab_url(tiny_pair):
    require_browser()
    from understudy.server import create_app

    target, draft = tiny_pair
    engine = Engine.from_pretrained(
        target=target, draft=draft, dtype="float32", num_speculative_tokens=2
    )
    with serve_in_thread(create_app(engine, model_name="tiny-pair")) as url:
        yield url + "/lab"


@pytest.fixture(scope="module")
def errors() -> list[str]:
    """JavaScript errors the page reported."""
    return []


@pytest.fixture(scope="module")
def browser():
    require_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = launch(playwright)
        yield browser
        browser.close()


def open_page(browser: Any, url: str, errors: list[str]) -> Any:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(url)
    return page


@pytest.fixture(scope="module")
def page(browser, lab_url, errors):
    return open_page(browser, lab_url, errors)


@pytest.fixture(scope="module")
def auto_k_page(browser, tiny_pair, errors):
    """The Lab of an engine with automatic K, which measures its costs (c, v and the pass
    curve) when it is built, as the default engine does."""
    from understudy.server import create_app

    target, draft = tiny_pair
    engine = Engine.from_pretrained(target=target, draft=draft, dtype="float32")
    with serve_in_thread(create_app(engine, model_name="tiny-auto")) as url:
        page = open_page(browser, url + "/lab", errors)
        page.wait_for_function(
            "document.querySelector('#model-info').innerText.includes('tiny-auto')"
        )
        page.wait_for_function("document.querySelector('#th-e').innerText !== '–'")
        yield page


def counter(page, element_id: str) -> str:
    return page.locator(f"#{element_id}").inner_text().strip()


def test_the_page_loads_complete_and_offline(page, errors):
    assert page.title().startswith("The Understudy")
    page.wait_for_function("document.querySelector('#model-info').innerText.includes('tiny-pair')")
    assert "method draft" in page.locator("#model-info").inner_text()
    for section in ("act1", "act2", "race", "act3", "quiz"):
        assert page.locator(f"#{section}").is_visible()
    assert errors == []


def test_act1_plain_decoding_one_token_per_pass(page):
    page.fill("#prompt", "def add(a, b):")
    page.fill("#max-tokens", "40")
    page.click("#run-plain")
    page.wait_for_function("document.querySelector('#p-tokens').innerText === '40'")
    assert page.locator("#plain-out .tok.target").count() == 40
    assert counter(page, "p-passes") == "40"
    assert counter(page, "p-tpp") == "1.00"


def test_act2_rounds_show_origins_and_counters_move(page):
    page.fill("#max-tokens", "60")
    page.click("#run-spec")
    page.wait_for_function("document.querySelector('#s-tokens').innerText === '60'")
    rounds = page.locator("#spec-rounds .round")
    assert rounds.count() >= 2
    assert page.locator("#spec-rounds .tok.accepted").count() > 0
    assert page.locator("#spec-rounds .tok.corrected, #spec-rounds .tok.bonus").count() > 0
    assert page.locator("#spec-rounds .tok.pending").count() == 0  # every guess was judged
    corrected = page.locator("#spec-rounds .tok.corrected").count()
    assert page.locator("#spec-rounds .tok.rejected").count() >= corrected
    assert page.locator("#spec-out .tok").count() == 60
    passes = int(counter(page, "s-passes"))
    assert passes < 60  # fewer target passes than tokens: that is the point
    assert counter(page, "s-tpp") == f"{60 / passes:.2f}"
    assert re.fullmatch(r"\d+%", counter(page, "s-acc"))


def test_counters_move_during_a_slow_motion_run(page):
    page.select_option("#pace", "slow")
    page.fill("#max-tokens", "24")
    page.click("#run-spec")
    page.wait_for_function("+document.querySelector('#s-tokens').innerText >= 1")
    early = int(counter(page, "s-tokens"))
    page.wait_for_function("document.querySelector('#s-tokens').innerText === '24'", timeout=20000)
    assert early < 24
    page.select_option("#pace", "real")


def test_race_and_the_dial(page):
    page.fill("#max-tokens", "48")
    page.click("#run-race")
    page.wait_for_function(
        "document.querySelector('#race-result').innerText.includes('wall-clock')", timeout=30000
    )
    result = page.locator("#race-result").inner_text()
    assert "identical tokens" in result  # greedy: speculative output == plain output
    assert page.locator("#race-spec .tok.accepted").count() > 0
    # Act 3: the measured point joins the theory curve; the dial answers
    page.wait_for_function("!document.querySelector('#use-run').disabled")
    page.click("#use-run")
    page.wait_for_function("document.querySelector('#chart path') !== null")
    assert "your run" in page.locator("#chart").text_content()
    page.locator("#alpha").fill("0.9")
    page.locator("#c").fill("0.05")
    page.locator("#k").fill("4")
    page.wait_for_function("document.querySelector('#th-e').innerText === '4.10'")
    assert counter(page, "th-optk").isdigit()


def test_the_row_cost_control_moves_the_prediction(auto_k_page, errors):
    """v is preset to the engine's measured row cost; moving it changes the predicted speedup
    exactly as E / (K c + 1 + K v) says, and v = 0 gives Leviathan et al.'s figure."""
    page = auto_k_page
    info = page.evaluate("state.info")
    curve = info["pass_curve"]  # t(n) / t(1) for n = 1..16, the tiny target's row budget
    assert info["row_cost"] >= 0 and len(curve) >= 5 and curve[0] == 1
    preset = float(page.locator("#v").input_value())  # a range input drops trailing zeros
    assert preset == pytest.approx(round(min(1.0, info["row_cost"]), 2))
    page.locator("#alpha").fill("0.9")
    page.locator("#c").fill("0.05")
    page.locator("#k").fill("4")
    # a = 0.9, K = 4: E = 4.0951 (1 + 0.9 + 0.81 + 0.729 + 0.6561)
    for v, speedup in (("0", 4.0951 / 1.2), ("0.25", 4.0951 / 2.2), ("0.5", 4.0951 / 3.2)):
        page.locator("#v").fill(v)  # 0: 3.41x; 0.25: K c + 1 + K v = 2.2, 1.86x; 0.5: 1.28x
        page.wait_for_function(
            f"document.querySelector('#th-speedup').innerText === '{speedup:.2f}×'"
        )
        assert counter(page, "th-free") == f"{4.0951 / 1.2:.2f}×"  # Leviathan's, unmoved
    assert counter(page, "th-cost") == "3.20"
    assert page.locator("#chart #curve-free").count() == 1  # the v = 0 curve, dashed, beside
    assert "v = 0.50" in page.locator("#chart").text_content()
    # the engine's own pass curve instead of v: the slider steps aside, the curve is used
    page.check("#use-curve")
    page.wait_for_function("document.querySelector('#v').disabled")
    expected = 4.0951 / (4 * 0.05 + curve[4])  # K = 4: a pass of 5 rows, T(5) = curve[4]
    page.wait_for_function(f"document.querySelector('#th-speedup').innerText === '{expected:.2f}×'")
    assert "this engine's pass curve" in page.locator("#chart").text_content()
    page.uncheck("#use-curve")
    page.wait_for_function("!document.querySelector('#v').disabled")
    assert errors == []


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ("row_cost=-0.1", "row_cost"),
        ("pass_curve=1,1.2,1.1", "pass_curve"),  # falls
        ("pass_curve=2,3", "pass_curve"),  # does not start at 1
        ("pass_curve=1,x", "pass_curve"),
        ("row_cost=0.1&pass_curve=1,1.1", "pass_curve"),  # two answers to one question
    ],
)
def test_the_theory_api_refuses_bad_row_costs_by_name(auto_k_page, query: str, param: str):
    url = auto_k_page.url.replace("/lab", "/lab/api/theory") + "?alpha=0.9&c=0.05&" + query
    response = auto_k_page.request.get(url)
    assert response.status == 400
    assert response.json()["error"]["param"] == param


def test_check_yourself_and_screenshot(page, errors):
    question = page.locator("#quiz-list .q").nth(1)
    question.locator(".options button").nth(0).click()
    assert question.locator(".why").is_visible()
    assert question.locator("button.right").count() == 1
    page.evaluate("window.scrollTo(0, 0)")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "lab.png"), full_page=True)
    assert (ARTIFACTS / "lab.png").stat().st_size > 10_000
    assert errors == []
