"""vLLM's names for engine flags and `LLM` keywords, and what they do here."""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil

import pytest

from runtime import LLM, SamplingParams
from runtime.cli.main import build_parser, main
from runtime.config import EngineConfig
from runtime.model_loader.source import resolve_model

TINY_ENGINE = dict(dtype="float32", kv_cache_memory="16MiB", num_threads=1)


def parse(*argv: str):
    return build_parser().parse_args(["generate", "x", *argv])


def test_boolean_flags_take_vllm_names_and_keep_ours():
    assert parse().enable_prefix_caching and parse().enable_chunked_prefill
    for flag in ("--no-enable-prefix-caching", "--no-prefix-caching"):
        assert parse(flag).enable_prefix_caching is False
    for flag in ("--no-enable-chunked-prefill", "--no-chunked-prefill"):
        assert parse(flag).enable_chunked_prefill is False
    assert parse("--enable-prefix-caching").enable_prefix_caching is True
    args = parse("--trust-remote-code", "--kv-cache-memory-bytes", "1GiB", "--max-logprobs",
                 "5", "--revision", "main", "--generation-config", "vllm",
                 "--disable-log-stats", "--distributed-executor-backend", "uni")
    assert (args.trust_remote_code, args.kv_cache_memory, args.max_logprobs, args.revision,
            args.generation_config, args.disable_log_stats) == (True, 1 << 30, 5, "main", "vllm",
                                                                True)
    assert EngineConfig(distributed_executor_backend="uni").distributed_executor_backend == \
        "uniproc"


def test_log_level_before_or_after_the_subcommand():
    assert build_parser().parse_args(["--log-level", "warning", "plugins"]).log_level == "WARNING"
    assert build_parser().parse_args(["plugins", "--log-level", "ERROR"]).log_level == "ERROR"
    assert build_parser().parse_args(
        ["bench", "latency", "--log-level", "debug"]).log_level == "DEBUG"


def test_user_mistakes_exit_with_a_message_not_a_traceback(capsys):
    assert main(["generate", "hi", "--model", "/no/such/model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model '/no/such/model'") and "Traceback" not in err
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "hi", "--log-level", "LOUD"])
    assert exit_info.value.code == 2


def test_llm_keywords_as_vllm_names(tiny_llama):
    assert EngineConfig.from_kwargs(kv_cache_memory_bytes=1 << 20).kv_cache_memory == 1 << 20
    with pytest.raises(TypeError, match="not both"):
        EngineConfig.from_kwargs(kv_cache_memory_bytes=1, kv_cache_memory=2)
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory_bytes=16 << 20, num_threads=1,
              enable_prefix_caching=False, max_logprobs=2)
    assert llm.engine.config.disable_log_stats is True  # vLLM's LLM default
    assert llm.engine.config.enable_prefix_caching is False
    out = llm.generate("Hello", SamplingParams(max_tokens=2, logprobs=2), use_tqdm=False)
    assert len(out[0].outputs[0].logprobs[0]) >= 2
    with pytest.raises(ValueError, match=r"logprobs asks for 3 logprobs, but this engine "
                                         r"returns at most 2 \(--max-logprobs\)"):
        llm.generate("Hello", SamplingParams(max_tokens=2, logprobs=3))
    with pytest.raises(ValueError, match="prompt_logprobs asks for 5"):
        llm.generate("Hello", SamplingParams(max_tokens=2, prompt_logprobs=5))
    with pytest.raises(ValueError, match=r"max_logprobs must be in \[0, 20\]"):
        EngineConfig(max_logprobs=21)


@pytest.fixture(scope="module")
def model_with_generation_config(tiny_llama, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("genconfig") / "model")
    shutil.copytree(tiny_llama, path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.6, "top_p": 0.9,
                   "top_k": 20, "repetition_penalty": 1.1, "max_new_tokens": 7,
                   "do_sample": True}, f)
    return path


def test_generation_config_auto_gives_the_default_sampling_params(model_with_generation_config):
    llm = LLM(model_with_generation_config, **TINY_ENGINE)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty,
            params.max_tokens) == (0.6, 0.9, 20, 1.1, 7)
    out = llm.generate("Hello", use_tqdm=False)  # no params: the defaults above
    assert len(out[0].outputs[0].token_ids) == 7
    explicit = llm.generate("Hello", SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(explicit[0].outputs[0].token_ids) == 3  # given params are used as they are


def test_generation_config_vllm_and_folder(model_with_generation_config, tiny_llama):
    vllm_defaults = LLM(model_with_generation_config, generation_config="vllm",
                        **TINY_ENGINE).get_default_sampling_params()
    assert vllm_defaults.temperature == SamplingParams().temperature
    from_folder = LLM(tiny_llama, generation_config=model_with_generation_config,
                      **TINY_ENGINE).get_default_sampling_params()
    assert from_folder.top_k == 20
    with pytest.raises(ValueError, match="a folder holding a generation_config.json"):
        LLM(tiny_llama, generation_config="/nonexistent", **TINY_ENGINE)


def test_revision_takes_a_snapshot_from_the_local_hf_cache(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    import huggingface_hub.constants as constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--org--tiny"
    shutil.copytree(tiny_llama, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "v1").write_text(commit)
    assert resolve_model("org/tiny", revision="v1").path.endswith(commit)
    assert resolve_model("org/tiny", revision=commit).path.endswith(commit)
    with pytest.raises(ValueError, match="revision 'v2' of 'org/tiny' is not in the local"):
        resolve_model("org/tiny", revision="v2")
    with pytest.raises(ValueError, match="applies to a model id"):
        resolve_model(tiny_llama, revision="v1")


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# vLLM's names a user types (issue 13) that have an equivalent here.
MUST_ACCEPT = ("--enable-prefix-caching", "--no-enable-prefix-caching", "--enable-chunked-prefill",
               "--no-enable-chunked-prefill", "--trust-remote-code", "--kv-cache-memory-bytes",
               "--max-logprobs", "--revision", "--generation-config", "--disable-log-stats",
               "-tp", "-pp", "-dp", "-q")


def serve_options() -> dict[str, argparse.Action]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {s: a for a in sub.choices["serve"]._actions for s in a.option_strings}


def kind_of(action: argparse.Action) -> str:
    if isinstance(action, argparse.BooleanOptionalAction):
        return "boolean_optional"
    if isinstance(action, argparse._StoreTrueAction):
        return "store_true"
    return "value"


def default_of(action: argparse.Action):
    return getattr(action.default, "value", action.default)  # serve wraps its defaults


def how_it_differs(ours: argparse.Action, spec: dict) -> str:
    """Empty when our flag means what vLLM's does, else what differs."""
    if kind_of(ours) != spec["kind"]:
        return f"kind {kind_of(ours)} vs vLLM's {spec['kind']}"
    if spec["kind"] == "value" and ours.nargs != spec.get("nargs"):
        return f"nargs {ours.nargs!r} vs vLLM's {spec.get('nargs')!r}"
    if "sample" in spec:
        text, expected = spec["sample"]
        value = getattr(build_parser().parse_args(["serve", ours.option_strings[0], text]),
                        ours.dest)
        if value != expected:
            return f"{text!r} parses to {value!r}, vLLM's to {expected!r}"
    if "choices" in spec and ours.choices is not None:
        missing = [c for c in spec["choices"] if c not in ours.choices]
        if missing:
            return f"lacks vLLM's choices {missing}"
    if default_of(ours) != spec["default"]:
        return f"default {default_of(ours)!r} vs vLLM's {spec['default']!r}"
    return ""


def documented_differences() -> set[str]:
    with open(os.path.join(REPO, "docs", "vllm.md"), encoding="utf-8") as f:
        text = f.read()
    table = text.split("## Flags that differ", 1)[1]
    return set(re.findall(r"^\| `(--[a-z0-9-]+)` \|", table, flags=re.M))


def test_serve_flags_shared_with_vllm_mean_the_same_or_are_documented():
    with open(os.path.join(REPO, "tests", "cli", "vllm_serve_flags.json")) as f:
        vllm = json.load(f)["flags"]
    options = serve_options()
    missing = [name for name in MUST_ACCEPT if name not in options]
    assert not missing, f"vLLM's flags missing from runtime serve: {missing}"
    differences = {name: how_it_differs(options[name], spec)
                   for name, spec in vllm.items() if spec and name in options}
    differences = {name: why for name, why in differences.items() if why}
    documented = documented_differences()
    undocumented = {n: w for n, w in differences.items() if n not in documented}
    assert not undocumented, ("flags shared with vLLM that mean something else; fix them or add "
                              f"them to docs/vllm.md's table: {undocumented}")
    stale = sorted(name for name in documented - set(differences) if name in options)
    assert not stale, f"docs/vllm.md lists differences that are gone: {stale}"
