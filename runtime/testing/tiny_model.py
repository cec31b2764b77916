"""A tiny random-weight Llama and a word-level tokenizer, saved as a Hugging Face folder.

Nothing is downloaded: the tokenizer is built in place with `tokenizers`, the weights drawn at
random with `initializer_range` 0.2, so that the top two logits stay far apart and greedy parity
is not a coin toss.
"""
from __future__ import annotations

import torch

VOCAB_SIZE = 512
TINY_LLAMA = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, initializer_range=0.2, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)


def save_tokenizer(path: str) -> None:
    """A word-level tokenizer over VOCAB_SIZE made-up words ("w3" … ), with <unk> <s> </s>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, VOCAB_SIZE)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>", pad_token="<unk>").save_pretrained(path)


def build_tiny_llama(path: str, seed: int = 0, **overrides) -> str:
    """Save a tiny random LlamaForCausalLM with its tokenizer to the folder `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, **overrides})).eval().save_pretrained(path)
    save_tokenizer(path)
    return path
