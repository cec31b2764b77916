"""--speculative-config: parsing, the errors bad values get, metrics, and the n-gram lookup."""
from __future__ import annotations

import pytest

from runtime import LLM
from runtime.config import EngineConfig
from runtime.engine.core_proc import CoreStats
from runtime.metrics import Metrics
from runtime.config.speculative import SpeculativeConfig
from runtime.spec_decode.ngram import NgramProposer


def test_json_and_dict_forms():
    text = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
    config = EngineConfig(speculative_config=text).speculative_config
    assert config == SpeculativeConfig("ngram", 4, prompt_lookup_max=4, prompt_lookup_min=1)
    draft = {"method": "draft_model", "model": "/m", "num_speculative_tokens": 2}
    assert EngineConfig(speculative_config=draft).speculative_config.model == "/m"
    assert EngineConfig().speculative_config is None


@pytest.mark.parametrize("value,message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an "
                                                       "integer >= 1, got 0"),
    ({"method": "ngram", "num_speculative_tokens": -1}, "num_speculative_tokens must be"),
    ({"method": "ngram"}, "needs \"method\""),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs \"model\""),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft": 1}, "unknown speculative_config"),
    ("{not json", "must be a JSON object"),
])
def test_bad_configs_say_what_is_allowed(value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=value)


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_llama, tmp_path):
    from runtime.testing.tiny_model import build_tiny_llama
    draft = build_tiny_llama(str(tmp_path / "draft"))  # 512 tokens, the target 49152
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="vocabulary of 512 tokens, the target 49152"):
        LLM(tiny_llama, dtype="float32", kv_cache_memory="16MiB", speculative_config=spec)


def test_ngram_lookup():
    lookup = NgramProposer(SpeculativeConfig("ngram", 3, prompt_lookup_max=3)).lookup
    assert lookup([1, 2, 3, 9, 1, 2]) == [3, 9, 1]  # the longest suffix, first occurrence
    assert lookup([5, 1, 2, 7, 8, 2]) == [7, 8, 2]  # only the 1-token suffix occurs before
    assert lookup([1, 2, 3]) == []
    lookup = NgramProposer(SpeculativeConfig("ngram", 3, prompt_lookup_min=2)).lookup
    assert lookup([5, 1, 2, 7, 8, 2]) == []  # a 1-token match is below the minimum


def test_metrics_export_acceptance():
    metrics = Metrics("m")
    metrics.on_core_stats(CoreStats(num_running=1, num_received=1, kv_cache_usage=0.1,
                                    num_spec_drafts=2, num_spec_draft_tokens=8,
                                    num_spec_accepted_tokens=6))
    text = metrics.render().decode()
    assert 'runtime:spec_decode_num_draft_tokens_total{model_name="m"} 8.0' in text
    assert 'runtime:spec_decode_num_accepted_tokens_total{model_name="m"} 6.0' in text
    assert 'runtime:spec_decode_acceptance_rate{model_name="m"} 0.75' in text
    assert 'runtime:spec_decode_mean_accepted_length{model_name="m"} 4.0' in text
