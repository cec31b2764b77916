"""What cannot run is refused in one line that names what is supported, never with a traceback:
configs of non-decoder architectures, and GGUF files of unsupported architectures (refused from
the header, before anything is parsed or cached)."""
from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import transformers

from runtime import LLM
from runtime.cli.main import main

CONFIGS = {
    "falcon-mamba": lambda: transformers.FalconMambaConfig(
        hidden_size=64, num_hidden_layers=2, architectures=["FalconMambaForCausalLM"]),
    "idefics2": lambda: transformers.Idefics2Config(
        architectures=["Idefics2ForConditionalGeneration"]),
    "llava-onevision": lambda: transformers.LlavaOnevisionConfig(
        architectures=["LlavaOnevisionForConditionalGeneration"]),
}


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_unsupported_config_is_one_line(case, tmp_path, capsys):
    CONFIGS[case]().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="is not supported .* native classes: .*LlamaForCausalLM"
                                         ".*transformers fallback"):
        LLM(str(tmp_path), dtype="float32")
    assert main(["generate", "--model", str(tmp_path), "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: model architecture ") and "\n" not in err, err


def _gguf_without_tensors(path: str, arch: str) -> None:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(2)
    writer.add_token_list(["a", "b"])
    writer.add_tensor("token_embd.weight", np.zeros((2, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_gguf_is_refused_from_the_header(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    monkeypatch.setenv("RUNTIME_CACHE_DIR", str(cache))

    def no_parsing(*args, **kwargs):
        raise AssertionError("the file was parsed instead of refused from its header")

    monkeypatch.setattr(gguf, "GGUFReader", no_parsing)
    path = str(tmp_path / "tiny-rwkv7.gguf")
    _gguf_without_tensors(path, "rwkv7")
    with pytest.raises(ValueError, match="GGUF architecture 'rwkv7' is not supported; "
                                         "supported: llama, qwen2, qwen3, phi3, gemma2"):
        LLM(path, dtype="float32")
    assert main(["generate", "--model", path, "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: GGUF architecture 'rwkv7'") and "\n" not in err, err
    assert not cache.exists() or not os.listdir(cache), "a refused file left entries in the cache"


def test_gguf_header_reader_skips_other_keys(tmp_path):
    from runtime.model_loader.gguf_header import gguf_architecture
    path = str(tmp_path / "x.gguf")
    writer = gguf.GGUFWriter(path, "qwen3")
    # keys of every kind before the architecture, as a converter may write them
    writer.kv_data[0] = {"a.array": gguf.GGUFValue([1, 2, 3], gguf.GGUFValueType.ARRAY,
                                                   gguf.GGUFValueType.INT32),
                         "a.strings": gguf.GGUFValue(["x", "yz"], gguf.GGUFValueType.ARRAY,
                                                     gguf.GGUFValueType.STRING),
                         "a.float": gguf.GGUFValue(1.5, gguf.GGUFValueType.FLOAT32),
                         **writer.kv_data[0]}
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert gguf_architecture(path) == "qwen3"
    (tmp_path / "not.gguf").write_bytes(b"GGML1234")
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf_architecture(str(tmp_path / "not.gguf"))
