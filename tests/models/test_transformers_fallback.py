"""The transformers fallback: architectures with no native class run transformers' own modules
on our paged KV cache, and match transformers' generate (greedy tokens and logprobs) with chunked
prefill, prefix caching and preemption in play."""
from __future__ import annotations

import os
import re
import shutil

import pytest
import torch
import transformers
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from runtime import LLM, SamplingParams
from runtime.layers.layernorm import RMSNorm
from runtime.models.registry import choose_model
from runtime.models.transformers_fallback import PlatformLinear, computes_as_llama_rms_norm
from tests.parity import PROMPTS, assert_matches_hf, hf_greedy

MAX_NEW = 8
BLOCK_SIZE = 4
# One long prompt fits (98 tokens), the whole batch does not: requests get preempted.
NUM_BLOCKS = 40
# The last prompt repeats the second one's 37 tokens: its first blocks come from the prefix cache.
FALLBACK_PROMPTS = PROMPTS + [PROMPTS[1] + [5, 6, 7]]

# Tiny configs of architectures without a native class; heads untied, weights far from zero.
CASES = {
    "gpt2": ("GPT2LMHeadModel", dict(n_embd=64, n_layer=2, n_head=4, n_positions=256)),
    "opt": ("OPTForCausalLM", dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                   num_attention_heads=4, max_position_embeddings=256,
                                   word_embed_proj_dim=64, init_std=0.2)),
    "gpt-neox": ("GPTNeoXForCausalLM", dict(hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4,
                                            rotary_pct=0.5, max_position_embeddings=256)),
    "gpt-j": ("GPTJForCausalLM", dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                                      n_positions=256)),
    "olmo2": ("Olmo2ForCausalLM", dict(hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=256)),
    "phi": ("PhiForCausalLM", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, partial_rotary_factor=0.5,
                                   max_position_embeddings=256)),
    # logits / logits_scaling after the head: a fallback that skips it is ~4 nats off
    "granite": ("GraniteForCausalLM", dict(hidden_size=64, intermediate_size=128,
                                           num_hidden_layers=2, num_attention_heads=4,
                                           num_key_value_heads=2, max_position_embeddings=256,
                                           logits_scaling=8.0, residual_multiplier=0.5,
                                           embedding_multiplier=2.0, attention_multiplier=0.1)),
    # rope on every layer, no chunks: nothing reads the cache length (the NoPE layers'
    # temperature tuning does)
    "llama4-rope-only": ("Llama4ForCausalLM", dict(
        hidden_size=64, intermediate_size=32, intermediate_size_mlp=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        no_rope_layers=[1, 1], attention_chunk_size=None, moe_layers=[1], num_local_experts=4,
        num_experts_per_tok=1)),
    "starcoder2-sliding": ("Starcoder2ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, sliding_window=16)),
}


@pytest.fixture(scope="module")
def fallback_model(tmp_path_factory, tokenizer_dir):
    """case -> (folder, the transformers model it was saved from)."""
    root = tmp_path_factory.mktemp("fallback")
    built: dict[str, tuple[str, torch.nn.Module]] = {}

    def make(case: str):
        if case not in built:
            arch, overrides = CASES[case]
            cls = getattr(transformers, arch)
            config = cls.config_class(vocab_size=49152, initializer_range=0.2,
                                      tie_word_embeddings=False, bos_token_id=1,
                                      eos_token_id=2, **overrides)
            torch.manual_seed(0)
            model = cls(config).eval()
            path = str(root / case)
            model.save_pretrained(path)
            for name in os.listdir(tokenizer_dir):
                shutil.copy(os.path.join(tokenizer_dir, name), path)
            built[case] = path, model
        return built[case]

    return make


def _kv_bytes(config) -> int:
    text = config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_size = text.hidden_size // heads
    return NUM_BLOCKS * 2 * text.num_hidden_layers * BLOCK_SIZE * kv_heads * head_size * 4


@pytest.mark.parametrize("case", sorted(CASES))
def test_fallback_matches_transformers(case, fallback_model):
    path, hf = fallback_model(case)
    assert choose_model(hf.config.architectures, "transformers").impl == "transformers"
    references = [hf_greedy(hf, p, MAX_NEW) for p in FALLBACK_PROMPTS]
    # model_impl="transformers": Granite has a native class too
    llm = LLM(path, dtype="float32", block_size=BLOCK_SIZE, kv_cache_memory=_kv_bytes(hf.config),
              max_num_batched_tokens=32, max_model_len=128, model_impl="transformers")
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    assert_matches_hf(llm.generate(FALLBACK_PROMPTS, params), references)
    core = llm.engine.core
    assert core.scheduler.num_preemptions > 0, "the cache was meant to be too small"
    assert core.kv.num_cache_hits > 0, "the shared prefix was meant to hit"


def test_transformers_impl_runs_a_native_architecture(tiny_llama):
    """model_impl="transformers" takes the fallback even where a native class exists, and
    both give transformers' tokens."""
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    references = [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory="8MiB", model_impl="transformers")
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    assert_matches_hf(llm.generate(PROMPTS, params), references)
    # ... with every linear layer and norm on the platform's ops (the LM head included)
    model = llm.engine.core.executor.worker.runner.model.hf
    kinds = {type(m) for m in model.modules()}
    assert PlatformLinear in kinds and RMSNorm in kinds
    assert not kinds & {torch.nn.Linear, LlamaRMSNorm}


def test_only_llama_rms_norms_are_replaced():
    """Norms whose code is Llama's run on the rms_norm op; OLMo 2's (the weight applied
    before the cast back) and Gemma's ((1 + w)) keep their own."""
    assert computes_as_llama_rms_norm(LlamaRMSNorm(8))
    assert computes_as_llama_rms_norm(Qwen2RMSNorm(8))
    assert not computes_as_llama_rms_norm(Olmo2RMSNorm(8))
    assert not computes_as_llama_rms_norm(GemmaRMSNorm(8))
    assert not computes_as_llama_rms_norm(torch.nn.LayerNorm(8))


def test_model_impl_choice():
    assert choose_model(["LlamaForCausalLM"]).impl == "native"
    assert choose_model(["LlamaForCausalLM"], "transformers").impl == "transformers"
    assert choose_model(["GPT2LMHeadModel"]).reason == "no native class is registered"
    with pytest.raises(ValueError, match="try --model-impl transformers"):
        choose_model(["GPT2LMHeadModel"], "native")
    with pytest.raises(ValueError, match="model_impl must be one of auto, native, transformers"):
        choose_model(["LlamaForCausalLM"], "fast")
    # Falcon computes its own attention instead of going through AttentionInterface.
    with pytest.raises(ValueError, match="native classes: .*LlamaForCausalLM"):
        choose_model(["FalconForCausalLM"])


def test_fallback_refuses_tensor_parallel(fallback_model):
    path, _ = fallback_model("gpt2")
    with pytest.raises(ValueError, match="tensor and pipeline parallel need a native model"):
        LLM(path, dtype="float32", kv_cache_memory="8MiB", tensor_parallel_size=2)


SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256)
# architecture -> (config, the reason the refusal must give)
REFUSALS = {
    # (the Mamba hybrids, LFM2, gpt-oss, DeepSeek-V2/V3, Gemma 3 vision, Gemma 4 and Llama 4 run
    # natively)
    # DeepSeek-V2/V3 run natively; MiniCPM3 keeps the fallback's MLA refusal
    "MiniCPM3ForCausalLM": (lambda: transformers.MiniCPM3Config(**SMALL),
                            "multi-head latent attention"),
    "PaliGemmaForConditionalGeneration": (lambda: transformers.PaliGemmaConfig(),
                                          "a vision-language model: not supported yet"),
    "DiffLlamaForCausalLM": (lambda: transformers.DiffLlamaConfig(**SMALL),
                             "calls the attention function 2 times"),
    "FalconMambaForCausalLM": (lambda: transformers.FalconMambaConfig(hidden_size=64,
                                                                      num_hidden_layers=2),
                               "needs the recurrent-state cache"),
    "BertLMHeadModel": (lambda: transformers.BertConfig(hidden_size=64, num_hidden_layers=2,
                                                        num_attention_heads=4),
                        "attends both ways"),
}


def test_gemma4_is_refused_by_the_fallback_for_its_head_sizes():
    """Gemma 4 runs natively; forced through the fallback, it is refused for its per-layer
    head sizes."""
    config = transformers.Gemma4TextConfig(**SMALL)
    with pytest.raises(ValueError, match="cannot run it: .*per-layer head sizes"):
        choose_model(["Gemma4ForCausalLM"], "transformers", config)
    assert choose_model(["Gemma4ForCausalLM"], "auto", config).impl == "native"


def test_llama4_refusals_name_what_the_config_uses():
    """The fallback refuses Llama 4 for chunked attention, and for NoPE temperature tuning
    (positions read from the cache length) only where a layer has it."""
    def refusal(**overrides) -> str:
        config = transformers.Llama4TextConfig(**SMALL, head_dim=16, **overrides)
        with pytest.raises(ValueError) as info:
            choose_model(["Llama4ForCausalLM"], "transformers", config)
        return str(info.value)

    assert "chunked attention" in refusal(no_rope_layers=[1, 0])
    assert "reads token positions from its cache" in refusal(
        no_rope_layers=[1, 0], attention_chunk_size=None,
        layer_types=["full_attention", "full_attention"])
    config = transformers.Llama4TextConfig(**SMALL, head_dim=16, no_rope_layers=[1, 0],
                                           attention_chunk_size=None, attn_temperature_tuning=False,
                                           layer_types=["full_attention", "full_attention"])
    assert choose_model(["Llama4ForCausalLM"], "transformers", config).impl == "transformers"


@pytest.mark.parametrize("architecture", sorted(REFUSALS))
def test_refusal_names_the_reason(architecture, tmp_path, capsys):
    """What the fallback would run wrong is refused, saying why; `runtime models --model`
    says the same."""
    make, reason = REFUSALS[architecture]
    config = make()
    config.architectures = [architecture]
    with pytest.raises(ValueError, match=f"cannot run it: .*{reason}"):
        choose_model(config.architectures, "auto", config)
    config.save_pretrained(tmp_path)
    from runtime.cli.main import main
    assert main(["models", "--model", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert re.search(reason, out) and "\n" not in out.strip(), out
