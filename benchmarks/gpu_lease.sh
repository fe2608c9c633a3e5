#!/usr/bin/env bash
# benchmarks/gpu_suite.py on a lent GPU machine, inside a lease (docs/gpu-suite.md).
#
#   benchmarks/gpu_lease.sh wheels             here, before the lease: the packages the GPU
#                                              machine's image lacks, as wheels in .whl/
#   benchmarks/gpu_lease.sh run [SUITE ARGS]   there: install .whl/ into /tmp/site, run the
#                                              suite from src/, write results and log to $OUT
#
# The image has torch, transformers, safetensors, tokenizers, pytest and no network; onegpu runs
# from src/ (no install), and what it needs beyond the image travels as wheels.
set -euo pipefail
cd "$(dirname "$0")/.."

# torchao: 8-bit / 4-bit states; pytorch-optimizer: lamb, lars, apollo. (cmeel-mimalloc, the
# host allocator onegpu preloads on CPUs, is left alone where a GPU is: perf/allocator.py.)
# The image's Python is 3.12: the wheels are fetched for it.
WHEELS=(torchao==0.18.0 pytorch-optimizer==4.1.0)

case "${1:-}" in
wheels)
    platforms=()
    for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
        manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
        platforms+=(--platform "$p")
    done
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" -d .whl "${WHEELS[@]}"
    ;;
run)
    shift
    if compgen -G ".whl/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl
    fi
    export PYTHONPATH="$PWD/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    out="${OUT:-benchmarks/results}"
    mkdir -p "$out"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    python3 benchmarks/gpu_suite.py --out "$out" "$@" 2>&1 | tee "$out/gpu-suite.log"
    ;;
*)
    echo "usage: benchmarks/gpu_lease.sh wheels | run [gpu_suite.py arguments]" >&2
    exit 2
    ;;
esac
