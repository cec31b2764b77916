"""The cache of what is derived from a GGUF file: hits, invalidation, corruption, races."""
import os

import gguf
import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from runtime.model_loader import gguf_cache, gguf_loader
from runtime.model_loader.gguf_cache import cache_key, cache_root, cached_part
from runtime.model_loader.gguf_loader import iterate_gguf_weights, load_gguf_config, load_gguf_tokenizer
from tests.model_loader.test_gguf_loader import CASES, write_tiny_gguf


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> str:
    path = str(tmp_path / "cache")
    monkeypatch.setenv("RUNTIME_CACHE_DIR", path)
    return path


@pytest.fixture
def tiny_llama(tmp_path) -> str:
    """A llama file with everything the cache keeps: rope_freqs, attention biases, a tokenizer."""
    path = str(tmp_path / "tiny-llama.gguf")
    write_tiny_gguf(path, "llama", CASES["llama"]())
    return path


def load_all(path: str) -> tuple:
    config = load_gguf_config(path)
    return config, load_gguf_tokenizer(path), dict(iterate_gguf_weights(path, config, torch.float32))


def no_parsing(monkeypatch) -> None:
    """Make any parse of a GGUF file (ours or transformers') fail."""
    def fail(*args, **kwargs):
        raise AssertionError("the GGUF file was parsed")

    monkeypatch.setattr(gguf, "GGUFReader", fail)
    monkeypatch.setattr(gguf_loader, "_build_model", fail)
    monkeypatch.setattr(gguf_loader, "_build_tokenizer", fail)


def assert_same_config(a, b) -> None:
    assert {**a.to_dict(), "_name_or_path": None} == {**b.to_dict(), "_name_or_path": None}


def assert_same_tokenizer(a, b) -> None:
    assert type(a) is type(b) and a.get_vocab() == b.get_vocab()
    assert a.special_tokens_map == b.special_tokens_map and a.chat_template == b.chat_template
    for text in ("hello there", " tt<|end|>t", "<|end|>"):
        assert a(text).input_ids == b(text).input_ids, text
    messages = [{"role": "user", "content": "hi"}]
    assert a.apply_chat_template(messages, tokenize=False) == b.apply_chat_template(messages, tokenize=False)


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def test_cache_hit_parses_nothing_and_equals_cold_load(cache_dir, tiny_llama, monkeypatch) -> None:
    cold = load_all(tiny_llama)
    assert os.path.isdir(os.path.join(cache_root(), cache_key(tiny_llama), "model"))
    with monkeypatch.context() as patch:
        no_parsing(patch)
        warm = load_all(tiny_llama)
    assert_same_config(cold[0], warm[0])
    assert_same_tokenizer(cold[1], warm[1])
    assert_same_weights(cold[2], warm[2])


def test_cached_config_and_tokenizer_equal_transformers(cache_dir, tiny_llama) -> None:
    directory, name = os.path.split(tiny_llama)
    config, tokenizer = load_gguf_config(tiny_llama), load_gguf_tokenizer(tiny_llama)
    assert_same_tokenizer(tokenizer, AutoTokenizer.from_pretrained(directory, gguf_file=name))
    # What load_gguf_config completes (see test_gguf_loader), the rest as transformers reads it.
    completed = {"_name_or_path", "architectures", "attention_bias", "rope_parameters"}
    ours = config.to_dict()
    theirs = AutoConfig.from_pretrained(directory, gguf_file=name).to_dict()
    assert ours.keys() == theirs.keys()
    assert all(ours[key] == theirs[key] for key in ours.keys() - completed)
    assert config.architectures == ["LlamaForCausalLM"] and config.attention_bias
    assert config.rope_parameters["rope_type"] == "llama3"


def test_changed_file_gets_a_new_cache_entry(cache_dir, tmp_path) -> None:
    path = str(tmp_path / "tiny.gguf")
    config = CASES["qwen2"]()
    write_tiny_gguf(path, "qwen2", config)
    first_key = cache_key(path)
    assert load_gguf_config(path).max_position_embeddings == 512

    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched: same bytes, new mtime
    assert cache_key(path) != first_key

    config.max_position_embeddings = 1024  # same size, other contents
    write_tiny_gguf(path, "qwen2", config)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2 * 10**9))
    assert os.stat(path).st_size == stat.st_size
    assert load_gguf_config(path).max_position_embeddings == 1024

    config.intermediate_size = 256  # new size, and the mtime of the first version
    expected = write_tiny_gguf(path, "qwen2", config)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    loaded = load_gguf_config(path)
    assert loaded.intermediate_size == 256
    assert_same_weights(dict(iterate_gguf_weights(path, loaded, torch.float32)), expected)


@pytest.mark.parametrize("damage", ["truncate config", "garble index", "delete tokenizer file", "garble manifest"])
def test_corrupt_cache_is_rebuilt(cache_dir, tiny_llama, damage: str) -> None:
    cold = load_all(tiny_llama)
    entry = os.path.join(cache_root(), cache_key(tiny_llama))
    target = {"truncate config": "model/config.json", "garble index": "model/tensors.json",
              "delete tokenizer file": "tokenizer/tokenizer_config.json",
              "garble manifest": "tokenizer/manifest.json"}[damage]
    file = os.path.join(entry, target)
    if damage.startswith("delete"):
        os.remove(file)
    else:
        with open(file, "r+b") as f:
            f.truncate(os.path.getsize(file) // 2)
            if damage.startswith("garble"):
                f.write(b"#")
    warm = load_all(tiny_llama)
    assert_same_config(cold[0], warm[0])
    assert_same_tokenizer(cold[1], warm[1])
    assert_same_weights(cold[2], warm[2])
    assert os.path.isfile(file)
    assert sorted(os.listdir(entry)) == ["model", "tokenizer"]  # nothing left behind


def write_part(path: str, folder: str, text: str = "data") -> None:
    with open(os.path.join(folder, "data.txt"), "w") as f:
        f.write(text)


def read_part(folder: str) -> str:
    with open(os.path.join(folder, "data.txt")) as f:
        return f.read()


def test_concurrent_build_uses_the_copy_published_first(cache_dir, tiny_llama) -> None:
    def build(path: str, folder: str) -> None:
        write_part(path, folder, "ours")
        cached_part(path, "part", lambda p, f: write_part(p, f, "theirs"))  # another process, faster

    folder = cached_part(tiny_llama, "part", build)
    assert read_part(folder) == "theirs"
    assert os.listdir(os.path.dirname(folder)) == ["part"]  # our staging folder is gone
    assert read_part(cached_part(tiny_llama, "part", write_part)) == "theirs"


def test_unwritable_cache_builds_once_per_process(tmp_path, tiny_llama, monkeypatch) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("RUNTIME_CACHE_DIR", str(blocker))
    monkeypatch.setattr(gguf_cache, "_uncached", {})
    calls = []

    def build(path: str, folder: str) -> None:
        calls.append(folder)
        write_part(path, folder)

    folder = cached_part(tiny_llama, "part", build)
    assert cached_part(tiny_llama, "part", build) == folder and calls == [folder]
    assert not folder.startswith(str(blocker))
