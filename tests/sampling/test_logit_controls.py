"""Token-level controls applied before sampling: the grammar bitmask, allowed_token_ids,
bad_words, logit_bias; and the engine's checks of them."""
import numpy as np
import pytest
import torch

from runtime.llm import LLM
from runtime.plugins.manager import get_plugin_manager, reset_plugin_manager
from runtime.plugins.hookspecs import hookimpl
from runtime.sampling import Sampler, SamplingBatch
from runtime.sampling.penalties import apply_penalties
from runtime.sampling_params import SamplingParams
from runtime.structured_output.bitmask import (_unpack_torch, apply_token_bitmask_, pack_token_ids,
                                               unpack_bitmask)

CPU = torch.device("cpu")
V = 70  # more than two 32-bit words, with a partial last one
LOGITS = torch.linspace(0, 1, V).repeat(3, 1)  # the last token is the argmax


def build(params, outputs=None, bitmasks=None):
    n = len(params)
    return SamplingBatch.build(params, [[]] * n, outputs or [[]] * n, [None] * n, CPU, V,
                               bitmasks)


def bitmask(allowed: list[int]) -> np.ndarray:
    words = np.zeros(-(-V // 32), dtype=np.uint32)
    for t in allowed:
        words[t // 32] |= np.uint32(1 << (t % 32))
    return words.view(np.int32)


def test_grammar_bitmask_keeps_only_allowed_tokens_per_row():
    greedy = SamplingParams(temperature=0)
    batch = build([greedy] * 3, bitmasks=[bitmask([3, 33, 64]), None, bitmask([31])])
    masked = apply_penalties(LOGITS, batch)
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [3, 33, 64]
    assert torch.isfinite(masked[1]).all()
    assert Sampler()(LOGITS, batch).sampled_token_ids.tolist() == [64, V - 1, 31]
    # random rows draw only allowed tokens too
    random = SamplingParams(temperature=1.0, seed=0)
    rows = build([random] * 3, bitmasks=[bitmask([5, 40])] * 3)
    for _ in range(20):
        assert set(Sampler()(LOGITS, rows).sampled_token_ids.tolist()) <= {5, 40}


def test_the_bitmask_masks_as_xgrammars_kernel_does():
    xgr = pytest.importorskip("xgrammar")
    words = torch.from_numpy(np.random.default_rng(0).integers(
        -2**31, 2**31, size=(6, -(-V // 32))).astype(np.int32))
    logits = torch.randn(6, V)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, words, indices=[1, 2, 5])
    ours = logits.clone()
    apply_token_bitmask_(ours, words[[1, 2, 5]], torch.tensor([1, 2, 5]))
    assert torch.equal(ours, expected)
    apply_token_bitmask_(logits, words)
    xgr.apply_token_bitmask_inplace(expected, words)
    assert torch.equal(logits, expected)
    # the unpacking for other devices (torch's shifts) agrees with the host's (numpy's)
    assert torch.equal(_unpack_torch(words, V), unpack_bitmask(words, V))
    assert torch.equal(unpack_bitmask(torch.from_numpy(pack_token_ids([0, 31, 32, 69], V))[None],
                                      V).nonzero()[:, 1], torch.tensor([0, 31, 32, 69]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masking_leaves_the_callers_logits_untouched(dtype):
    logits = LOGITS.to(dtype)
    before = logits.clone()
    params = [SamplingParams(temperature=0, logit_bias={5: 50.0})] * 3
    batch = build(params, bitmasks=[bitmask([3, 5]), None, bitmask([31])])
    assert Sampler()(logits, batch).sampled_token_ids.tolist() == [5, 5, 31]
    assert torch.equal(logits, before)
    adjusted = Sampler().adjust(logits.float(), batch)  # as speculative verification calls it
    assert torch.equal(logits, before) and torch.isinf(adjusted[0, 4])


def test_allowed_token_ids_and_grammar_combine():
    params = SamplingParams(temperature=0, allowed_token_ids=[2, 10, 50])
    batch = build([params], bitmasks=[bitmask([10, 11, 50, 51])])
    assert torch.isfinite(apply_penalties(LOGITS[:1], batch)[0]).nonzero().flatten().tolist() == \
        [10, 50]


def test_logit_bias_moves_the_argmax():
    params = SamplingParams(temperature=0, logit_bias={7: 100.0, V - 1: -100.0})
    assert Sampler()(LOGITS[:1], build([params])).sampled_token_ids.tolist() == [7]


def test_bad_words_ban_the_last_token_after_the_rest():
    params = SamplingParams(temperature=0).clone(_bad_words_token_ids=[[V - 1], [4, V - 2]])
    banned = apply_penalties(LOGITS[:2], build([params, params], outputs=[[1], [4]]))
    assert banned[0, V - 1] == float("-inf") and torch.isfinite(banned[0, V - 2])
    assert banned[1, V - 1] == float("-inf") and banned[1, V - 2] == float("-inf")


def test_invalid_controls_are_refused():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 200.0})
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=[" "])


class BanToken:
    """A plugin whose logits processor bans one token on every row."""

    def __init__(self, token_id: int) -> None:
        self.token_id = token_id
        self.calls = 0

    @hookimpl
    def runtime_logits_processors(self):
        def ban(logits, batch):
            self.calls += 1
            logits[:, self.token_id] = float("-inf")
            return logits
        return [ban]


def test_a_plugins_logits_processor_runs_on_every_step(tiny_model_factory):
    path = tiny_model_factory()
    first = LLM(path, dtype="float32", kv_cache_memory="16MiB").generate(
        ["a b c"], SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].token_ids[0]
    reset_plugin_manager()
    plugin = BanToken(first)
    get_plugin_manager().register(plugin, name="ban_token")
    try:
        llm = LLM(path, dtype="float32", kv_cache_memory="16MiB")
    finally:
        reset_plugin_manager()
    out = llm.generate(["a b c"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert first not in out[0].outputs[0].token_ids and plugin.calls == 4
