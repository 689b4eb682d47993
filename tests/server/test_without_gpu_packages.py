"""A plain CPU install (no `cuda` extra) runs: `pagedserve generate` and `pagedserve serve` in
subprocesses where triton, flashinfer and flash_attn cannot be imported, as on a machine that
lacks them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import httpx
import pytest

from tests.utils.paged import tiny_chat_model
from tests.utils.server import ServerProcess

BLOCKER = textwrap.dedent('''
    # Make triton, flashinfer and flash_attn invisible, as on a machine without them.
    import importlib.machinery

    _find_spec = importlib.machinery.PathFinder.find_spec

    def _hide(cls, fullname, path=None, target=None):
        if fullname.split(".")[0] in ("triton", "flashinfer", "flash_attn"):
            return None
        return _find_spec(fullname, path, target)

    importlib.machinery.PathFinder.find_spec = classmethod(_hide)
''')


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    site = tmp_path_factory.mktemp("blocker")
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ, TRITON_INTERPRET="")  # the test suite sets it; a user does not
    env["PYTHONPATH"] = os.pathsep.join([str(site), *sys.path])
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(tiny_chat_model(tmp_path_factory.mktemp("tiny_chat")))


def test_imports_are_blocked(env) -> None:
    probe = subprocess.run([sys.executable, "-c", "import triton"], env=env,
                           capture_output=True, text=True)
    assert probe.returncode != 0 and "No module named 'triton'" in probe.stderr


@pytest.mark.slow  # the serve test below imports and runs the same engine without them
def test_generate_without_gpu_packages(env, model_dir) -> None:
    out = subprocess.run([sys.executable, "-m", "pagedserve", "generate", "--model", model_dir,
                          "--prompt", "hi", "--max-tokens", "4", "--temperature", "0"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    listing = subprocess.run([sys.executable, "-m", "pagedserve", "backends"], env=env,
                             capture_output=True, text=True, timeout=120)
    assert listing.returncode == 0, listing.stderr[-2000:]
    assert any(line.startswith("CPU ") for line in listing.stdout.splitlines())
    # Backends that need triton say why they cannot run, not that their module failed.
    assert "import failed" not in listing.stdout and "?" not in listing.stdout


def test_serve_without_gpu_packages(env, model_dir, tmp_path) -> None:
    server = ServerProcess(["--model", model_dir, "--served-model-name", "tiny"],
                           tmp_path / "server.log", env=env)
    try:
        reply = httpx.post(server.url + "/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": "hi", "max_tokens": 4,
                                 "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
        chat = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                          json={"model": "tiny", "max_tokens": 4, "temperature": 0,
                                "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200, chat.text
    finally:
        server.stop()
    assert "Traceback" not in server.log()
