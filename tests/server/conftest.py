import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """A test module's CORE_PROCESS_SLOW names tests whose run against the core-process server
    only adds time (the in-process run and the core's own tests cover what they check): that
    variant is marked slow, so the default run deselects it and `-m slow` keeps it."""
    for item in items:
        slow = getattr(getattr(item, "module", None), "CORE_PROCESS_SLOW", ())
        if item.nodeid.endswith("[core-process]") and getattr(item, "originalname", "") in slow:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def agent_server(tmp_path_factory):
    """One `pagedserve serve` of a tiny random chat model for the agent-facing APIs (Responses,
    Messages) and the chat page: hermes tool calls, prefix caching on (the default), an API key
    and room for a 10-turn conversation."""
    from tests.server.agent_conversation import KEY, MODEL
    from tests.utils.paged import tiny_chat_model
    from tests.utils.server import ServerProcess

    model = tiny_chat_model(tmp_path_factory.mktemp("agent_model"), max_positions=2048)
    proc = ServerProcess(["--model", str(model), "--device", "cpu", "--dtype", "float32",
                          "--kv-cache-memory", "64MiB", "--served-model-name", MODEL,
                          "--tool-call-parser", "hermes", "--api-key", KEY,
                          "--responses-store-size", "8"],
                         tmp_path_factory.mktemp("agent_log") / "server.log")
    yield proc
    proc.stop()
