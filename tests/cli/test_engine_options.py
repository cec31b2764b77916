"""Every engine option is declared once, as an `EngineConfig` field: its flag, its default and
its way into the engine core all follow from that declaration."""
from __future__ import annotations

import argparse
import pickle
import shlex
from dataclasses import fields

import pytest

from runtime import LLM
from runtime.cli.engine_args import add_engine_args, engine_kwargs
from runtime.config import EngineConfig, flag_of, load_options_file

# Set by the engine for each data-parallel replica, never by a user.
INTERNAL = {"data_parallel_rank", "data_parallel_size_local"}

# For every field: a value other than the default, as flags spell it and as EngineConfig
# holds it. A new field without a row here fails the walk below.
VALUES = {
    "model": ("--model m", "m"),
    "tokenizer": ("--tokenizer t", "t"),
    "model_impl": ("--model-impl native", "native"),
    "runner": ("--runner generate", "generate"),
    "device": ("--device cpu", "cpu"),
    "dtype": ("--dtype float32", "float32"),
    "kv_cache_memory": ("--kv-cache-memory-bytes 16MiB", 16 << 20),
    "kv_cache_dtype": ("--kv-cache-dtype fp8", "fp8"),
    "calculate_kv_scales": ("--calculate-kv-scales", True),
    "gpu_memory_utilization": ("--gpu-memory-utilization 0.5", 0.5),
    "block_size": ("--block-size 32", 32),
    "max_num_seqs": ("--max-num-seqs 8", 8),
    "max_num_batched_tokens": ("--max-num-batched-tokens 512", 512),
    "max_model_len": ("--max-model-len 256", 256),
    "max_num_encoder_input_tokens": ("--max-num-encoder-input-tokens 64", 64),
    "encoder_cache_size": ("--encoder-cache-size 128", 128),
    "limit_mm_per_prompt": ('--limit-mm-per-prompt {"image":2}', '{"image":2}'),
    "allowed_media_domains": ("--allowed-media-domains example.com", "example.com"),
    "allowed_local_media_path": ("--allowed-local-media-path /nowhere", "/nowhere"),
    "enable_prefix_caching": ("--no-enable-prefix-caching", False),
    "mamba_cache_mode": ("--mamba-cache-mode none", "none"),
    "mamba_checkpoint_interval": ("--mamba-checkpoint-interval 4", 4),
    "mamba_checkpoint_memory": ("--mamba-checkpoint-memory 64MiB", 64 << 20),
    "enable_chunked_prefill": ("--no-chunked-prefill", False),
    "max_num_partial_prefills": ("--max-num-partial-prefills 2", 2),
    "max_long_partial_prefills": ("--max-long-partial-prefills 2", 2),
    "long_prefill_token_threshold": ("--long-prefill-token-threshold 64", 64),
    "scheduling_policy": ("--scheduling-policy priority", "priority"),
    "attention_backend": ("--attention-backend torch_paged", "torch_paged"),
    "enforce_eager": ("--enforce-eager", True),
    "num_threads": ("--num-threads 1", 1),
    "seed": ("--seed 3", 3),
    "revision": ("--revision v1", "v1"),
    "download_dir": ("--download-dir /nowhere", "/nowhere"),
    "trust_remote_code": ("--trust-remote-code", True),
    "enable_prompt_embeds": ("--enable-prompt-embeds", True),
    "enable_mm_embeds": ("--enable-mm-embeds", True),
    "max_logprobs": ("--max-logprobs 5", 5),
    "generation_config": ("--generation-config vllm", "vllm"),
    "engine_stall_timeout": ("--engine-stall-timeout 5", 5.0),
    "disable_log_stats": ("--disable-log-stats", True),
    "enable_sleep_mode": ("--enable-sleep-mode", True),
    "quantization": ("-q int8", "int8"),
    "speculative_config": ('--speculative-config {"method":"ngram","num_speculative_tokens":2}',
                           '{"method":"ngram","num_speculative_tokens":2}'),
    "structured_outputs_config": ('--structured-outputs-config {"backend":"xgrammar"}',
                                  '{"backend":"xgrammar"}'),
    "enable_lora": ("--enable-lora", True),
    "max_loras": ("--max-loras 2", 2),
    "max_lora_rank": ("--max-lora-rank 8", 8),
    "max_cpu_loras": ("--max-cpu-loras 3", 3),
    "tensor_parallel_size": ("-tp 2", 2),
    "pipeline_parallel_size": ("-pp 2", 2),
    "enable_expert_parallel": ("-ep", True),
    "data_parallel_size": ("-dp 2", 2),
    "decode_context_parallel_size": ("-dcp 2", 2),
    "cp_kv_cache_interleave_size": ("--cp-kv-cache-interleave-size 4", 4),
    "distributed_executor_backend": ("--distributed-executor-backend uniproc", "uniproc"),
    "ray_address": ("--ray-address auto", "auto"),
    "kv_transfer_config": ('--kv-transfer-config {"kv_connector":"OffloadingConnector"}',
                           '{"kv_connector":"OffloadingConnector"}'),
    "kv_offloading_size": ("--kv-offloading-size 0.5", 0.5),
    "kv_offloading_disk_path": ("--kv-offloading-disk-path /tmp/kv", "/tmp/kv"),
    "kv_offloading_disk_size": ("--kv-offloading-disk-size 2", 2.0),
}
# Options that need another one set with them.
TOGETHER = {"max_long_partial_prefills": {"max_num_partial_prefills": 2},
            "kv_offloading_disk_size": {"kv_offloading_disk_path": "/tmp/kv"},
            "decode_context_parallel_size": {"tensor_parallel_size": 2}}
# The values above that one CPU engine runs with, all at once.
RUNNABLE = ("tokenizer", "model_impl", "runner", "device", "dtype", "kv_cache_memory",
            "gpu_memory_utilization", "block_size", "max_num_seqs", "max_num_batched_tokens",
            "max_model_len", "enable_prefix_caching", "enable_chunked_prefill",
            "scheduling_policy", "attention_backend", "enforce_eager", "num_threads", "seed",
            "download_dir", "trust_remote_code", "max_logprobs", "generation_config",
            "engine_stall_timeout", "disable_log_stats", "enable_sleep_mode", "speculative_config",
            "structured_outputs_config", "distributed_executor_backend", "ray_address")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p


def test_every_field_has_a_flag_with_the_fields_default():
    options = {f.name for f in fields(EngineConfig)} - INTERNAL
    assert {f.name for f in fields(EngineConfig) if flag_of(f) is None} == INTERNAL
    assert set(VALUES) == options, "give each new field a row in VALUES"
    defaults = parser().parse_args([])
    assert engine_kwargs(defaults) == {f.name: f.default for f in fields(EngineConfig)
                                       if f.name in options}
    flags = {s: a.dest for a in parser()._actions for s in a.option_strings}
    for name in options:
        assert flags["--" + name.replace("_", "-")] == name


@pytest.mark.parametrize("name", sorted(VALUES))
def test_a_flag_sets_its_field(name):
    argv, value = VALUES[name]
    others = TOGETHER.get(name, {})
    argv += "".join(f" {VALUES[k][0]}" for k in others)
    kwargs = engine_kwargs(parser().parse_args(shlex.split(argv.replace('"', '\\"'))))
    given = {k: v for k, v in kwargs.items() if v != parser().get_default(k)}
    assert given == {name: value, **others}
    config = EngineConfig.from_kwargs(**kwargs)
    assert config == EngineConfig.from_kwargs(**given)
    assert pickle.loads(pickle.dumps(config)) == config  # as it crosses to a core process


def test_llm_keywords_reach_the_core(tiny_llama):
    kwargs = {name: VALUES[name][1] for name in RUNNABLE}
    kwargs["tokenizer"] = tiny_llama
    llm = LLM(tiny_llama, **kwargs)
    expected = EngineConfig.from_kwargs(model=tiny_llama, **kwargs)
    assert llm.engine.core.config == expected
    for name in RUNNABLE:
        assert getattr(llm.engine.core.config, name) == getattr(expected, name), name
    assert llm.engine.core.scheduler.config.max_num_seqs == 8


def test_one_yaml_reader_for_llm_and_serve(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("max-num-seqs: 3\nblock_size: 8\n")
    assert load_options_file(str(path)) == {"max_num_seqs": 3, "block_size": 8}
    assert EngineConfig.from_yaml(str(path), block_size=32).block_size == 32
    path.write_text("- a list\n")
    with pytest.raises(ValueError, match="must map option names to values, got a list"):
        load_options_file(str(path))
    path.write_text("a: [\n")
    with pytest.raises(ValueError, match="is not valid YAML"):
        EngineConfig.from_yaml(str(path))
