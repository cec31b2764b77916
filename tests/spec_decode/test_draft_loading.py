"""The draft model loads through the worker's own path, as the target does."""
from runtime import LLM
from runtime.plugins.hookspecs import hookimpl
from runtime.plugins.manager import get_plugin_manager, reset_plugin_manager


class CountingLinear:
    """A plugin's dense kernel that records each weight it prepares (after loading)."""

    def __init__(self) -> None:
        self.prepared: list[tuple[int, ...]] = []

    @hookimpl(tryfirst=True)
    def runtime_custom_op(self, name: str):
        if name != "linear":
            return None

        def prepare(weight):
            self.prepared.append(tuple(weight.shape))
            return lambda x, bias: x @ weight.t() + (0 if bias is None else bias)
        return prepare


def test_the_draft_models_layers_are_processed_after_loading(target, random_draft):
    reset_plugin_manager()
    counting = CountingLinear()
    get_plugin_manager().register(counting, name="counting_linear")
    try:
        llm = LLM(target, dtype="float32", kv_cache_memory="16MiB",
                  speculative_config={"method": "draft_model", "model": random_draft,
                                      "num_speculative_tokens": 2})
    finally:
        reset_plugin_manager()
    draft = llm.engine.core.executor.worker.runner.proposer.model
    dense = [m for m in draft.modules() if hasattr(m, "weight") and hasattr(m, "method")]
    assert dense and all(m.dense is not None for m in dense)
    hidden = 32  # random_draft's hidden size; the target's is 64
    assert any(shape[1] == hidden for shape in counting.prepared)
