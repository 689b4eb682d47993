"""LoRA through the HTTP server (one server start): `model` picks the adapter, /v1/models
lists adapters with their parent, and adapters loaded and unloaded at run time, bad input
answered 400 in OpenAI's error shape."""

from __future__ import annotations

import copy
import json
import re

import httpx
import pytest
import torch

from pagedserve.cli import main
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.server.cli import DrainingServer
from tests.lora.adapters import save_adapter, save_base
from tests.utils.server import app_in_thread

PROMPT = [5, 17, 33, 80, 9, 41, 2, 77]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_server")
    base = save_base(root / "base")
    refs = {"r8": save_adapter(base, root / "r8", 8, 16, False, seed=1),
            "r16": save_adapter(base, root / "r16", 16, 8, True, seed=2)}
    engine = LLMEngine.from_kwargs(model=str(root / "base"), dtype="float32", device="cpu",
                                   kv_cache_memory="16MiB", enable_lora=True, max_loras=2,
                                   max_lora_rank=16, lora_modules=[f"r8={root / 'r8'}"])
    with app_in_thread(AsyncLLM(engine), "base", allow_runtime_lora_updating=True) as url:
        yield url, root, base, refs


def _greedy(model, n=4):
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def _complete(url, model):
    return httpx.post(url + "/v1/completions", timeout=60, json={
        "model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})


def test_model_name_picks_the_adapter(served):
    url, root, base, refs = served
    models = httpx.get(url + "/v1/models").json()["data"]
    assert [(m["id"], m["parent"]) for m in models] == [("base", None), ("r8", "base")]
    for name, ref in (("base", base), ("r8", refs["r8"])):
        response = _complete(url, name)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["token_ids"] == _greedy(ref), name
        assert response.json()["model"] == name
    missing = _complete(url, "r16")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    assert "serves `base` and its LoRA adapters `r8`" in missing.json()["error"]["message"]

    # loaded at run time: served as its PeftModel; unloaded: unknown again
    load = httpx.post(url + "/v1/load_lora_adapter",
                      json={"lora_name": "r16", "lora_path": str(root / "r16")})
    assert load.status_code == 200, load.text
    assert _complete(url, "r16").json()["choices"][0]["token_ids"] == _greedy(refs["r16"])
    assert "r16" in [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
    assert httpx.post(url + "/v1/unload_lora_adapter",
                      json={"lora_name": "r16"}).status_code == 200
    assert _complete(url, "r16").status_code == 404


@pytest.mark.parametrize("path, body, message", [
    ("load", {"lora_name": "r8", "lora_path": "/x"}, "already loaded"),
    ("load", {"lora_name": "new", "lora_path": "/nowhere"}, "no directory /nowhere"),
    ("load", {"lora_name": "new"}, "lora_path"),
    ("unload", {"lora_name": "never"}, "no LoRA adapter named 'never'"),
    # an adapter under the served model's name would hide the base model from every request
    ("load", {"lora_name": "base", "lora_path": "/x"}, "the served model's own name"),
])
def test_bad_lora_updates_get_400(served, path, body, message):
    url, *_ = served
    response = httpx.post(f"{url}/v1/{path}_lora_adapter", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"


def test_an_adapter_the_engine_cannot_run_is_refused_when_loaded(served, tmp_path):
    """An embedding adapter (its tensors are no lora_A/lora_B pairs) or a damaged weights
    file: a 400 naming the problem at load time (it was a 200, then a 400 on every request
    naming it); a taken name is `lora_name`'s fault, the files `lora_path`'s."""
    url, root, base, _ = served
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=8, target_modules=["q_proj", "embed_tokens"], init_lora_weights=False)
    get_peft_model(copy.deepcopy(base), config).save_pretrained(tmp_path / "embed")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text((root / "r8" / "adapter_config.json").read_text())
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    for name, message in (("embed", "is not a LoRA factor"),
                          ("broken", "is not a readable safetensors file")):
        response = httpx.post(url + "/v1/load_lora_adapter",
                              json={"lora_name": name, "lora_path": str(tmp_path / name)})
        assert response.status_code == 400, response.text
        assert message in response.json()["error"]["message"]
        assert response.json()["error"]["param"] == "lora_path"
    assert name not in [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
    taken = httpx.post(url + "/v1/load_lora_adapter",
                       json={"lora_name": "r8", "lora_path": str(root / "r8")})
    assert taken.status_code == 400 and taken.json()["error"]["param"] == "lora_name"


def test_an_adapter_named_as_the_served_model_is_refused_at_start_up(served, monkeypatch):
    url, root, *_ = served
    monkeypatch.setattr(DrainingServer, "run", lambda self: pytest.fail("the server started"))
    with pytest.raises(SystemExit, match="'base' is the served model's own name"):
        main(["serve", str(root / "base"), "--dtype", "float32", "--device", "cpu",
              "--kv-cache-memory", "8MiB", "--enable-lora", "--lora-modules",
              f"base={root / 'r8'}"])



def test_responses_and_messages_name_the_adapter_they_ran(tmp_path):
    """The chat-shaped APIs run the adapter `model` names, and say so, whole or streamed."""
    from transformers import AutoModelForCausalLM

    from tests.utils.paged import tiny_chat_model

    base = AutoModelForCausalLM.from_pretrained(tiny_chat_model(tmp_path / "base"))
    save_adapter(base, tmp_path / "r8", 8, 16, False, seed=1)
    engine = LLMEngine.from_kwargs(model=str(tmp_path / "base"), dtype="float32", device="cpu",
                                   kv_cache_memory="16MiB", enable_lora=True,
                                   lora_modules=[f"r8={tmp_path / 'r8'}"])
    bodies = {"/v1/responses": {"model": "r8", "input": "hi", "max_output_tokens": 2},
              "/v1/messages": {"model": "r8", "max_tokens": 2,
                               "messages": [{"role": "user", "content": "hi"}]}}
    with app_in_thread(AsyncLLM(engine), "base") as url:
        for path, body in bodies.items():
            reply = httpx.post(url + path, json=body, timeout=60)
            assert reply.status_code == 200 and reply.json()["model"] == "r8", reply.text
            streamed = httpx.post(url + path, json={**body, "stream": True}, timeout=60).text
            named = re.findall(r'"model": ?"([^"]*)"', streamed)
            assert named and set(named) == {"r8"}, (path, streamed[:400])


DROP = object()  # a key left out of the config


@pytest.mark.parametrize("edit, message", [
    ("[8]", "adapter_config.json must be a JSON object"),
    ("{", "adapter_config.json is not valid JSON"),
    ('{"r": ' + "[" * 5000, "adapter_config.json is not valid JSON"),
    ({"r": DROP}, "needs r"),
    ({"r": None}, "r must be an integer >= 1, got None"),
    ({"r": 0}, "r must be an integer >= 1, got 0"),
    ({"r": -4}, "r must be an integer >= 1, got -4"),
    ({"r": 8.5}, "r must be an integer >= 1, got 8.5"),
    ({"r": True}, "r must be an integer >= 1, got True"),
    ({"lora_alpha": "16"}, "lora_alpha must be a finite number, got '16'"),
    ({"lora_alpha": float("inf")}, "lora_alpha must be a finite number, got inf"),
])
def test_an_adapter_config_the_engine_cannot_use_is_a_400_at_load(served, tmp_path, edit,
                                                                   message):
    """Each was a 500 at load (a list, no r, r null, nested too deep), or taken and then a
    500 on every request naming the adapter (r 0, a string alpha), or ran with a nonsense
    scale (r negative or fractional)."""
    url, root, *_ = served
    path = tmp_path / "adapter"
    path.mkdir()
    (path / "adapter_model.safetensors").write_bytes(
        (root / "r8" / "adapter_model.safetensors").read_bytes())
    if isinstance(edit, dict):
        config = {**json.loads((root / "r8" / "adapter_config.json").read_text()), **edit}
        edit = json.dumps({k: v for k, v in config.items() if v is not DROP})
    (path / "adapter_config.json").write_text(edit)
    response = httpx.post(url + "/v1/load_lora_adapter",
                          json={"lora_name": "hostile", "lora_path": str(path)})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == "lora_path", error
    assert "hostile" not in [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
    assert _complete(url, "base").status_code == 200
