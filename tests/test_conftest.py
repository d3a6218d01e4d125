"""The suite's own fixtures leave global state as they found it, so tests pass in any order."""

import torch


def test_inductor_cache_off_restores_the_config():
    """The fixture that turns Inductor's caches off leaves every attribute as it was (pytest's
    monkeypatch deleted torch config attributes on undo, failing every later test that read them)."""
    from conftest import inductor_cache_off
    from torch._inductor import config as inductor_config

    before = (inductor_config.fx_graph_cache, inductor_config.autotune_local_cache)
    with inductor_cache_off():
        assert inductor_config.fx_graph_cache is False and inductor_config.autotune_local_cache is False
    assert (inductor_config.fx_graph_cache, inductor_config.autotune_local_cache) == before
    if hasattr(torch._functorch.config, "enable_autograd_cache"):
        assert isinstance(torch._functorch.config.enable_autograd_cache, bool)
