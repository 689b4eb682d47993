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


# The OpenAI-compatible server of the bundled model (float32) and its offline reference, shared
# by the test_*_api / routes / errors / concurrency modules: one load for all of them.


@pytest.fixture(scope="package")
def ref():
    from tests.server.openai_server import build_reference

    return build_reference()


@pytest.fixture(scope="package")
def server(request, tmp_path_factory):
    from tests.server.openai_server import MODEL
    from tests.utils.server import ServerProcess

    # The reference first, then the server: run beside the server's start, the two processes'
    # thread pools fought over the two cores (12 to 25 s for both, 12.5 s in turn).
    request.getfixturevalue("ref")
    srv = ServerProcess(["--served-model-name", MODEL, "--dtype", "float32",
                         "--kv-cache-memory", "512MiB"],
                        tmp_path_factory.mktemp("server") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="package")
def core_server(request, tmp_path_factory):
    """The same server with its engine core in a process of its own."""
    from tests.server.openai_server import MODEL
    from tests.utils.server import ServerProcess

    request.getfixturevalue("ref")
    srv = ServerProcess(["--served-model-name", MODEL, "--dtype", "float32",
                         "--kv-cache-memory", "512MiB", "--engine-core-process"],
                        tmp_path_factory.mktemp("core_server") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module", params=["in-process", "core-process"])
def any_server(request):
    """The tests that take it (and `client`) run against both: same texts, same answers."""
    return request.getfixturevalue("server" if request.param == "in-process" else "core_server")


@pytest.fixture(scope="module")
def client(any_server):
    import openai

    return openai.OpenAI(base_url=any_server.url + "/v1", api_key="unused", timeout=600,
                         max_retries=0)


@pytest.fixture(scope="package")
def key_server(server, tmp_path_factory):
    """A second server: an API key, one running and one waiting request at most, and async
    scheduling."""
    from tests.server.openai_server import API_KEY
    from tests.utils.server import ServerProcess

    # float32, as the reference its async-scheduling text is compared with (and quicker to
    # start than the CPU's int8 default).
    srv = ServerProcess(["--max-num-seqs", "1", "--max-waiting-requests", "1",
                         "--kv-cache-memory", "512MiB", "--async-scheduling",
                         "--dtype", "float32"],
                        tmp_path_factory.mktemp("key_server") / "server.log",
                        env={"PAGEDSERVE_API_KEY": API_KEY})
    yield srv
    srv.stop()
