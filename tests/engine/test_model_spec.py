"""The model is resolved once, and every process serves that one snapshot: `runtime serve
org/tiny --download-dir D --revision v2`, with the model only in D, reads v2's tokenizer in the
API process and v2's config and weights in the core process."""
from __future__ import annotations

import asyncio
import shutil

import pytest

from runtime import LLM, SamplingParams
from runtime.cli.engine_args import engine_kwargs
from runtime.cli.main import build_parser
from runtime.cli.serve import resolve_options
from runtime.config import EngineConfig
from runtime.engine.async_llm import AsyncLLM
from runtime.model_spec import ModelSpec

COMMITS = {"v1": "1" * 40, "v2": "2" * 40}
EXTRA_TOKEN = "<only-in-v2>"
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
ENGINE = ("--dtype", "float32", "--kv-cache-memory", "16MiB", "--num-threads", "1")


@pytest.fixture(scope="module")
def snapshots(tiny_model_factory, tmp_path_factory):
    """A Hugging Face cache folder holding org/tiny at two revisions that differ in weights,
    config (max_position_embeddings) and tokenizer (v2 has one more token)."""
    from transformers import AutoTokenizer
    root = tmp_path_factory.mktemp("download_dir")
    repo = root / "models--org--tiny"
    folders = {"v1": tiny_model_factory("LlamaForCausalLM", seed=0, max_position_embeddings=512),
               "v2": tiny_model_factory("LlamaForCausalLM", seed=1, max_position_embeddings=768)}
    (repo / "refs").mkdir(parents=True)
    for revision, folder in folders.items():
        snapshot = repo / "snapshots" / COMMITS[revision]
        shutil.copytree(folder, snapshot)
        (repo / "refs" / revision).write_text(COMMITS[revision])
    (repo / "refs" / "main").write_text(COMMITS["v1"])
    tokenizer = AutoTokenizer.from_pretrained(repo / "snapshots" / COMMITS["v2"])
    tokenizer.add_tokens([EXTRA_TOKEN])
    tokenizer.save_pretrained(repo / "snapshots" / COMMITS["v2"])
    return str(root), folders


@pytest.fixture
def empty_default_cache(tmp_path, monkeypatch):
    """The default HF cache holds nothing (the core process inherits the variable)."""
    import huggingface_hub.constants as constants
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))


def serve_config(*argv: str) -> EngineConfig:
    """The engine config `runtime serve ARGV` starts."""
    args = resolve_options(build_parser().parse_args(["serve", *argv]))
    return EngineConfig.from_kwargs(**{**engine_kwargs(args), "model": args.model_tag})


def test_the_spec_names_one_snapshot(snapshots, empty_default_cache):
    download_dir, _ = snapshots
    for revision in ("v1", "v2"):
        spec = ModelSpec.resolve(serve_config("org/tiny", "--download-dir", download_dir,
                                              "--revision", revision, *ENGINE))
        assert spec.source.path.endswith(COMMITS[revision])
        assert spec.model_config.max_model_len == {"v1": 512, "v2": 768}[revision]
    default = ModelSpec.resolve(serve_config("org/tiny", "--download-dir", download_dir))
    assert default.source.path.endswith(COMMITS["v1"])
    with pytest.raises(ValueError, match="neither a .gguf file nor a folder"):
        ModelSpec.resolve(serve_config("org/tiny"))  # not in the default cache


def test_serve_runs_the_revision_in_both_processes(snapshots, empty_default_cache):
    download_dir, folders = snapshots
    config = serve_config("org/tiny", "--download-dir", download_dir, "--revision", "v2",
                          *ENGINE)
    expected = LLM(folders["v2"], dtype="float32", kv_cache_memory="16MiB", num_threads=1)
    other = LLM(folders["v1"], dtype="float32", kv_cache_memory="16MiB", num_threads=1)
    prompt = [1, 2, 3, 4]
    want = expected.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert other.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids != want

    async def serve() -> tuple[list[int], int, list[int]]:
        engine = AsyncLLM(config)
        await engine.start()
        try:
            stream = engine.add_request("r", {"prompt_token_ids": prompt}, GREEDY)
            outputs = [o async for o in stream]
            ids = engine.tokenizer.encode(EXTRA_TOKEN, add_special_tokens=False)
            return outputs[-1].outputs[0].token_ids, engine.max_model_len, ids
        finally:
            await engine.shutdown()

    tokens, max_model_len, extra_ids = asyncio.run(serve())
    assert tokens == want  # the core ran v2's weights
    assert max_model_len == 768  # from v2's config, which the core reported back
    assert len(extra_ids) == 1  # the API process tokenizes with v2's tokenizer
