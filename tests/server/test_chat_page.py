"""The chat page at `/`: served without the API key and with nothing to fetch from a network,
left out by --disable-chat-page, a failed answer kept out of the conversation (its script
under node), and (slow) used in a real browser, Debian's chromium through
selenium: it asks for the key, streams an answer with its timings, leaves a screenshot in
docs/images/chat-page.png, and stops a long answer with its stop button."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient

from pagedserve.arg_utils import add_server_args, server_config
from pagedserve.config import EngineConfig
from pagedserve.server.api import build_app
from tests.utils.server import ServerProcess

SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "images" / "chat-page.png"


def test_page_is_served_without_the_key(agent_server) -> None:
    reply = httpx.get(agent_server.url + "/", timeout=30)  # the server wants a key elsewhere
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/html")
    page = reply.text
    assert "<title>pagedserve chat</title>" in page and "/v1/chat/completions" in page
    # Nothing from a network: no external scripts, styles, fonts or images.
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)
    assert "@import" not in page and "url(" not in page


def _stub_llm() -> SimpleNamespace:
    engine = SimpleNamespace(model_name="stub", max_model_len=64, config=EngineConfig(),
                             mm_processor=None)
    return SimpleNamespace(engine=engine, observer=None, tokenizer=None, snapshot=None)


@pytest.mark.parametrize("flags", [[], ["--disable-chat-page"]])
def test_disable_chat_page_flag(flags) -> None:
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    config = server_config(parser.parse_args(flags))
    assert config.enable_chat_page == (not flags)
    reply = TestClient(build_app(_stub_llm(), config)).get("/")
    assert reply.status_code == (404 if flags else 200)


# The page's script under node, with just enough of a browser stubbed for send(): elements that
# take what the script sets, a localStorage, and a fetch that answers each chat request from a
# queue (status, body). It prints the conversation after each send.
_NODE_HARNESS = r"""
const vm = require("vm");
const fs = require("fs");
const [script, replies] = JSON.parse(fs.readFileSync(0, "utf8"));
class El {
  constructor() { this.value = ""; this.innerHTML = ""; this.disabled = false; this.parts = {};
                  const names = new Set(); this.classList = names; names.remove = names.delete; }
  appendChild(child) { shown.push(child); } addEventListener() {}
  querySelector(sel) { return this.parts[sel] || (this.parts[sel] = new El()); }
}
const elements = {};
const sent = [];
const shown = [];  // the messages the log shows
const encode = (text) => new TextEncoder().encode(text);
const sandbox = {
  document: { getElementById: (id) => elements[id] || (elements[id] = new El()),
              createElement: () => new El() },
  localStorage: { getItem: () => null, setItem() {} }, prompt: () => null,
  performance, TextDecoder, TextEncoder, AbortController, console,
  fetch: async (path, init) => {
    if (path === "/v1/models") return { ok: true, status: 200, json: async () => ({ data: [] }) };
    sent.push(JSON.parse(init.body).messages);
    const [status, body] = replies.shift();
    const chunks = [encode(body)];
    return { ok: status === 200, status, text: async () => body,
             body: { getReader: () => ({ read: async () => chunks.length
                 ? { value: chunks.shift(), done: false } : { done: true } }) } };
  },
};
vm.createContext(sandbox);
vm.runInContext(script + "\nglobalThis.__page = { send, conversation };", sandbox);
(async () => {
  for (const text of ["first", "second"]) {
    await sandbox.__page.send(text);
  }
  const bodies = shown.map((m) => m.querySelector(".body").innerHTML);
  console.log(JSON.stringify({ conversation: sandbox.__page.conversation, sent, bodies }));
})();
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node")
def test_a_failed_answer_stays_out_of_the_conversation() -> None:
    """The error text of a failed answer went into the conversation as the assistant's turn, so
    the next request fed it to the model (which answered with the error's JSON). The error
    shows as the API's message, not its JSON."""
    from pagedserve.server.chat_page import page

    script = page().split("<script>", 1)[1].split("</script>", 1)[0]
    error = '{"error": {"message": "this model\'s maximum context length is 8192 tokens"}}'
    answer = ('data: {"choices": [{"index": 0, "delta": {"content": "Paris."}}]}\n\n'
              'data: [DONE]\n\n')
    run = subprocess.run(["node", "-e", _NODE_HARNESS], capture_output=True, text=True,
                         timeout=30, input=json.dumps([script, [[400, error], [200, answer]]]))
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["sent"] == [[{"role": "user", "content": "first"}],
                              [{"role": "user", "content": "second"}]]
    assert result["conversation"] == [{"role": "user", "content": "second"},
                                      {"role": "assistant", "content": "Paris."}]
    assert result["bodies"][1] == ("<p>Error: 400: this model&#39;s maximum context length is "
                                   "8192 tokens</p>")


def _browser_tools() -> None:
    """Debian's chromium and its driver, and selenium: installed when missing."""
    if shutil.which("chromium") is None or shutil.which("chromedriver") is None:
        subprocess.run(["apt-get", "install", "-y", "chromium", "chromium-driver"], check=True,
                       env={"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/bin:/bin"})
    try:
        import selenium  # noqa: F401
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "selenium"], check=True)


@pytest.mark.slow
def test_chat_in_a_real_browser(tmp_path) -> None:
    _browser_tools()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    # The bundled SmolLM2, so that the screenshot shows words.
    server = ServerProcess(["--served-model-name", "SmolLM2-135M-Instruct", "--api-key", "k1"],
                           tmp_path / "server.log")
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                "--window-size=1280,860"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    try:
        wait = WebDriverWait(driver, 120)
        driver.get(server.url + "/")
        alert = wait.until(ec.alert_is_present())  # /v1/models answered 401: the key, once
        alert.send_keys("k1")
        alert.accept()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#model option"))
        driver.find_element(By.ID, "system").send_keys("You are a concise assistant.")
        tokens = driver.find_element(By.ID, "max-tokens")
        tokens.clear()
        tokens.send_keys("80")
        driver.find_element(By.ID, "input").send_keys(
            "Write a Python function that adds two numbers.")
        driver.find_element(By.ID, "send").click()
        # The answer streams: text shows while the stop button is live, then it completes.
        wait.until(lambda d: d.find_element(By.CSS_SELECTOR, ".msg.assistant .body").text)
        answer = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, ".msg.assistant.done"))
        stats = answer.find_element(By.CLASS_NAME, "stats").text
        assert re.search(r"\d+ tokens · first token [\d.]+ s · [\d.]+ tokens/s", stats), stats
        assert "Error" not in answer.text and len(answer.text) > 20
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(SCREENSHOT))
        assert driver.execute_script("return localStorage.getItem('pagedserve.apiKey')") == "k1"
        # The stop button aborts a long answer once it has begun.
        tokens.clear()
        tokens.send_keys("1000")
        driver.find_element(By.ID, "input").send_keys("Tell me a very long story.")
        driver.find_element(By.ID, "send").click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]
                   .find_element(By.CLASS_NAME, "body").text)
        driver.find_element(By.ID, "stop").click()
        wait.until(lambda d: "done" in d.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]
                   .get_attribute("class"))
        stats = driver.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats")[-1].text
        assert stats.endswith("stopped") and int(stats.split()[0]) < 1000, stats
    finally:
        driver.quit()
        server.stop()
