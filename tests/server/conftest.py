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
