"""Sleep mode and weight reload on the offline LLM: what each level frees, greedy tokens equal
before and after, a reload equal to a fresh engine on the new folder, and what is refused."""
from __future__ import annotations

import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.engine.core import EngineBusyError
from runtime.layers.attention import Attention

PROMPTS = [list(range(100, 140)), [8, 8, 8, 2000, 31]]  # the first fills prefix-cache blocks
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def model_of(llm: LLM):
    runner = llm.engine.core.executor.worker.runner
    return None if runner is None else runner.model


def kv_bytes(llm: LLM) -> int:
    model = model_of(llm)
    return 0 if model is None else sum(m.kv_cache.numel() * m.kv_cache.element_size()
                                       for m in model.modules() if isinstance(m, Attention))


@pytest.fixture(scope="module")
def folders(tiny_model_factory) -> tuple[str, str]:
    return tiny_model_factory("LlamaForCausalLM"), tiny_model_factory("LlamaForCausalLM", seed=1)


@pytest.fixture(scope="module")
def llm(folders) -> LLM:
    return LLM(folders[0], dtype="float32", kv_cache_memory="16MiB", enable_sleep_mode=True)


def test_level_1_frees_the_kv_cache_and_the_prefix_cache(llm):
    before = tokens(llm)
    assert kv_bytes(llm) > 0 and llm.engine.core.kv.pool.cached
    llm.sleep(1)
    assert llm.is_sleeping() and kv_bytes(llm) == 0
    assert not llm.engine.core.kv.pool.cached  # its blocks' contents are gone
    assert model_of(llm) is not None  # the weights stay
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up()
    assert not llm.is_sleeping() and kv_bytes(llm) > 0
    assert tokens(llm) == before


def test_level_2_frees_the_weights_and_reads_them_again(llm):
    before = tokens(llm)
    llm.sleep(2)
    assert model_of(llm) is None
    with pytest.raises(ValueError, match="wake the weights first"):
        llm.wake_up(["kv_cache"])
    llm.wake_up(["weights"])
    assert llm.is_sleeping() and kv_bytes(llm) == 0
    llm.wake_up(["kv_cache"])
    assert tokens(llm) == before


def test_update_weights_equals_a_fresh_engine_on_the_new_folder(llm, folders):
    old = tokens(llm)
    llm.update_weights(folders[1])
    fresh = LLM(folders[1], dtype="float32", kv_cache_memory="16MiB")
    expected = tokens(fresh)
    assert expected != old  # the two folders' weights differ
    assert tokens(llm) == expected
    llm.update_weights(folders[0])
    assert tokens(llm) == old


def test_update_weights_refuses_another_architecture(llm, tiny_model_factory):
    wider = tiny_model_factory("LlamaForCausalLM", intermediate_size=192)
    before = tokens(llm)
    with pytest.raises(ValueError, match=r"config differs in \['intermediate_size'\]"):
        llm.update_weights(wider)
    with pytest.raises(ValueError, match="neither a .gguf file nor a folder"):
        llm.update_weights("/no/such/folder")
    assert tokens(llm) == before


def test_a_checkpoint_that_fails_to_load_leaves_the_old_weights(llm, folders, tmp_path):
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(folders[1], broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    before = tokens(llm)
    with pytest.raises(ValueError, match="could not be loaded"):
        llm.update_weights(str(broken))
    assert tokens(llm) == before


def test_in_flight_requests_are_refused(llm):
    engine = llm.engine
    engine.add_request(PROMPTS[0], GREEDY)
    with pytest.raises(EngineBusyError, match="1 requests are in flight"):
        llm.sleep(1)
    with pytest.raises(EngineBusyError):
        llm.update_weights(llm.engine.source.path)
    while engine.has_unfinished_requests():
        engine.step()
    with pytest.raises(ValueError, match="sleep level must be 1"):
        llm.sleep(3)
    with pytest.raises(ValueError, match="unknown wake_up tags"):
        llm.wake_up(["everything"])


def test_sleep_mode_must_be_enabled(folders):
    plain = LLM(folders[0], dtype="float32", kv_cache_memory="16MiB")
    with pytest.raises(ValueError, match="enable_sleep_mode=True"):
        plain.sleep(1)
    assert torch.is_tensor(next(model_of(plain).parameters()))


def test_every_tensor_parallel_rank_sleeps_and_reloads(llm, folders):
    """Two worker processes (mp executor): each rank frees and reads back its own shard."""
    llm.update_weights(folders[1])
    new = tokens(llm)
    llm.update_weights(folders[0])
    old = tokens(llm)
    tp = LLM(folders[0], dtype="float32", kv_cache_memory="16MiB", enable_sleep_mode=True,
             tensor_parallel_size=2, num_threads=1)
    try:
        assert tokens(tp) == old
        tp.sleep(2)
        tp.wake_up()
        assert tokens(tp) == old
        tp.update_weights(folders[1])
        assert tokens(tp) == new
    finally:
        tp.engine.core.shutdown()
