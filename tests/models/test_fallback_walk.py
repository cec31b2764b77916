"""Every architecture of transformers' causal-LM mapping, as a tiny random model, through the
transformers fallback: refused with a reason, or accepted and then the same greedy tokens and
logprobs as transformers (chunked prefill in play). An accepted architecture that diverges
fails; one it refuses that a native class runs is skipped as native. docs/models.md's lists
of what the fallback runs and refuses are this walk's outcome (`RUNTIME_UPDATE_DOCS=1`
rewrites them)."""
from __future__ import annotations

import functools
import gc
import os
import shutil

import pytest
import torch
import transformers
from transformers import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from runtime import LLM, SamplingParams
from runtime.models.registry import choose_model
from tests.parity import assert_matches_hf, hf_greedy

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "models.md")
VOCAB = 256
# The shape of every tiny model, where its config has the field (under this name or an alias).
SIZES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=256,
             moe_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4,
             num_experts_per_tok=2, shared_expert_intermediate_size=32, initializer_range=0.2,
             bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
             is_decoder=True)
# The first prompt is longer than a step's token budget (8): its prefill comes in chunks.
PROMPTS = [[1, 17, 42, 99, 3, 250, 7, 8, 64, 12, 5, 31, 77], [1, 17, 42, 99, 3, 200]]
MAX_NEW = 4

# Where a default config lacks what makes the family what it is.
OVERRIDES = {"lfm2": dict(layer_types=["conv", "full_attention"]), "codegen": dict(rotary_dim=8),
             # Llama 4 without chunked attention, one NoPE layer (temperature tuning: refused)
             "llama4_text": dict(attention_chunk_size=None, no_rope_layers=[1, 0],
                                 layer_types=["full_attention", "full_attention"],
                                 floor_scale=2)}


def _model_type(architecture: str) -> str:
    """The model type of the architecture's own config class (several share a class)."""
    config_class = getattr(getattr(transformers, architecture), "config_class", None)
    return getattr(config_class, "model_type", None) or next(
        t for t, a in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if a == architecture)


ARCHITECTURES = sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()))


def _settable(config, name: str) -> bool:
    """Whether the config has the field `name` and takes it (not a derived property)."""
    if isinstance(getattr(type(config), name, None), property):
        return False
    try:
        return hasattr(config, name)
    except RuntimeError:  # a per-layer attribute read globally (Gemma 4's head_dim)
        return True


def tiny_config(model_type: str, architecture: str):
    """The model type's config at SIZES, one layer of each of its layer types."""
    cls = CONFIG_MAPPING[model_type]
    default = cls()
    kwargs = {k: v for k, v in SIZES.items() if _settable(default, k)}
    layer_types = getattr(default, "layer_types", None)
    if isinstance(layer_types, list) and layer_types and _settable(default, "layer_types"):
        distinct = list(dict.fromkeys(layer_types))
        kwargs["layer_types"] = (distinct * 2)[:max(2, len(distinct))]
        kwargs["num_hidden_layers"] = len(kwargs["layer_types"])
    kwargs.update(OVERRIDES.get(model_type, {}))
    if "layer_types" in kwargs:
        kwargs["num_hidden_layers"] = len(kwargs["layer_types"])
    config = cls(**kwargs)
    config.architectures = [architecture]
    return config


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())[:80]


def save_tiny_tokenizer(path: str) -> None:
    """A word-level tokenizer of VOCAB tokens `t0` … (the walk feeds token ids; a small
    tokenizer loads in milliseconds)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", pad_token="t0",
                            bos_token="t1", eos_token="t2").save_pretrained(path)


@functools.cache
def outcome(architecture: str, root: str, tokenizer_dir: str) -> tuple[str, str]:
    """("refused", why) or ("runs", "") after asserting parity with transformers; ("skipped",
    why) for what is not run here (a native class runs it, or no tiny config is possible)."""
    try:
        config = tiny_config(_model_type(architecture), architecture)
    except Exception as e:  # a config class that needs more than sizes: recorded, not run
        return "skipped", f"no tiny config ({type(e).__name__}: {_one_line(e)})"
    try:
        choose_model(config.architectures, "transformers", config)
    except ValueError as e:
        why = " ".join(str(e).split("cannot run it: ", 1)[-1].split())
        if why.startswith("transformers cannot build"):
            return "skipped", why
        try:  # a native class is what users get; its own parity tests cover it
            native = choose_model(config.architectures, "native")
        except ValueError:
            return "refused", why
        return "skipped", f"runs natively (`{native.model_class.__module__}`)"
    if getattr(config.get_text_config(), "hidden_size", 0) > SIZES["hidden_size"]:
        return "skipped", "the tiny sizes do not reach its text config"
    torch.manual_seed(0)
    hf = getattr(transformers, architecture)(config).eval()
    path = os.path.join(root, architecture)
    hf.save_pretrained(path)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), path)
    try:
        references = [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
    except Exception as e:  # transformers' own forward fails on this tiny config
        return "skipped", f"transformers cannot run it ({type(e).__name__}: {_one_line(e)})"
    try:
        llm = LLM(path, dtype="float32", model_impl="transformers", block_size=4,
                  kv_cache_memory="2MiB", max_num_batched_tokens=8, max_model_len=64)
    except ValueError as e:  # refused once built (its first forward passed what we refuse)
        shutil.rmtree(path)
        return "refused", f"at start-up: {e}"
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    try:
        assert_matches_hf(llm.generate(PROMPTS, params), references)
    finally:
        del llm
        gc.collect()
        shutil.rmtree(path)
    return "runs", ""


@pytest.fixture(scope="module")
def walk(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("walk"))
    tokenizer_dir = os.path.join(root, "tokenizer")
    save_tiny_tokenizer(tokenizer_dir)
    return lambda architecture: outcome(architecture, root, tokenizer_dir)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_accepted_means_exact(architecture, walk):
    kind, why = walk(architecture)
    assert kind in ("runs", "refused", "skipped")
    assert kind != "refused" or "\n" not in why and why


def generated_lists(walk) -> str:
    runs, refused = [], []
    for arch in ARCHITECTURES:
        kind, why = walk(arch)
        if kind == "runs":
            runs.append(f"`{arch}`")
        else:
            refused.append(f"| `{arch}` | {kind}: {why} |")
    return ("Tested through the transformers fallback (tiny random models, same greedy tokens "
            "and logprobs as transformers, with chunked prefill): " + ", ".join(runs) + ".\n\n"
            "| Refused architecture | why |\n| --- | --- |\n" + "\n".join(refused))


def test_docs_lists_are_the_walk(walk):
    with open(DOC) as f:
        text = f.read()
    begin = "<!-- generated by tests/models/test_fallback_walk.py -->\n"
    end = "\n<!-- end of the walk -->"
    start, stop = text.index(begin) + len(begin), text.index(end)
    expected = generated_lists(walk)
    if os.environ.get("RUNTIME_UPDATE_DOCS") == "1":
        with open(DOC, "w") as f:
            f.write(text[:start] + expected + text[stop:])
    else:
        assert text[start:stop] == expected, \
            "docs/models.md's fallback lists are stale: rerun with RUNTIME_UPDATE_DOCS=1"
