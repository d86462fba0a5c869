#!/usr/bin/env bash
# The GPU check, prepared to run in one go on a lent CUDA machine (which has
# its own torch and triton, and no fastapi, uvicorn or xgrammar):
#
#   bash benchmark/gpu_check.sh OUTDIR            # from a plain checkout, no install
#   bash benchmark/gpu_check.sh OUTDIR --dry-run  # print the stages only
#
# Stages, each under its own timeout so one hang cannot eat the rest: the
# versions, the gpu-marked tests (kernels at full vocab, paged attention at
# Qwen3-8B shapes, the engine in bf16 on the demo, CUDA graphs against eager
# steps, a Qwen3-8B-shaped model under load), bench_kernels.py,
# bench_cuda_graph.py and bench_spec.py on the demo, and the gpu stage:
# tensor parallelism over NCCL (TP=2 == TP=1; skipped with a message on a
# machine with one device). Everything
# goes to OUTDIR: gpu_check.log and a few JSON files (at most 8 files).
# The timeouts add up to under 9 minutes (10.5 where the gpu stage runs). Exits 1 if any stage failed. On a
# machine without CUDA the tests skip in seconds and the benchmarks are left out.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash benchmark/gpu_check.sh OUTDIR [--dry-run]}
dry=${2:-}
mkdir -p "$out"
log="$out/gpu_check.log"
: >"$log"
export PYTHONPATH="python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export SPECSERVE_GPU_RESULTS="$out"  # the gpu tests write their figures here
failed=()

stage() {  # stage NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*" | tee -a "$log"
    [ -n "$dry" ] && return 0
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - start))s" | tee -a "$log"
    [ "$rc" -eq 0 ] || failed+=("$name")
}

stage versions 30 python -c '
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import triton
    print("triton", triton.__version__)
except ImportError:
    print("triton: not installed")
print("device:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA")
import specserve
print("specserve", specserve.__version__, "from", specserve.__file__)
'
stage gpu-tests 240 python -m pytest -m gpu -p no:cacheprovider -q -rs \
    test/kernels test/layers test/engine/test_cuda_engine.py test/engine/test_engine.py \
    test/models/test_deepseek_v4.py
if [ -z "$dry" ] && ! python -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    echo "gpu_check: no CUDA device: the gpu tests skipped, the benchmarks are left out" | tee -a "$log"
else
    stage bench-kernels 70 python benchmark/bench_kernels.py --output-json "$out/bench_kernels.json"
    stage bench-cuda-graph 90 python benchmark/bench_cuda_graph.py \
        --output-json "$out/bench_cuda_graph.json"
    stage bench-spec 100 python benchmark/bench_spec.py --demo --dataset held-in \
        --algorithms DSPARK --batch-sizes 1 8 32 --num-prompts 32 --input-len 64 \
        --output-len 64 --repeats 2 --output-json "$out/bench_spec.json"
fi

if [ -n "$dry" ] || python -c 'import sys, torch; sys.exit(torch.cuda.device_count() < 2)'; then
    stage gpu 90 python -m pytest -m gpu -p no:cacheprovider -q -rs test/distributed/test_nccl.py
else
    echo "gpu_check: gpu stage skipped: TP=2 over NCCL needs 2 CUDA devices, this machine has fewer" \
        | tee -a "$log"
fi

if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu_check: failed stages: ${failed[*]}" | tee -a "$log"
    exit 1
fi
echo "gpu_check: every stage passed" | tee -a "$log"
