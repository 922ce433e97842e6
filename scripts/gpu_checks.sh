#!/usr/bin/env bash
# The GPU checks, in one run on a machine with one NVIDIA GPU (not run by the tests or CI):
#   1. scripts/gpu_attention.py: cuDNN flash attention against zshard's tiled path (docs/long-sequences.md);
#   2. rows: llama-3.2-1b (4 x 4096 tokens) and the toy GPT (16 x 1024), each zshard FULL_SHARD 1x1 against
#      the plain jax.jit step of the same code (same remat, bf16 compute, fp32 masters, the same XLA options):
#      tokens/s, MFU (6N + 12 L H Q T per token, PaLM appendix B), peak HBM (python -m train.bench.gpu;
#      docs/performance.md), in at most 8 minutes; the JSON is rewritten after each row;
#   3. python -m train.bench --offload: HBM saved and step-time overhead of host offload (docs/offload.md).
# Each part runs on whatever the previous one left; a failing part is named at the end and the next one
# runs. Exit status: 0 when every chosen part passed, 1 when one failed or JAX sees no GPU (checked first).
# Output: OUT/attention.txt, OUT/gpu_rows.txt with OUT/gpu_rows.json (written once a row is measured),
# OUT/offload.txt (OUT: $OUT, else runs/gpu).
#
#   bash scripts/gpu_checks.sh                  # with jax[cuda] and the project's dependencies installed
#   PYTHON=.venv/bin/python bash scripts/gpu_checks.sh  # the interpreter to use (default: python3)
#   WHEELS=.whl bash scripts/gpu_checks.sh      # a machine without them: pip-installs the wheels in .whl first
#   PARTS="rows" bash scripts/gpu_checks.sh     # some of the parts: attention, rows, offload
#   TINY=1 PARTS=rows bash scripts/gpu_checks.sh  # the rows' code on tiny shapes (any backend: the GPU check is skipped)
#
# Run 2026-12-04 on one H200 (jax 0.11.2, flax 0.12.10 of the machine's image) with WHEELS=.whl holding
# what the image lacks: grain, array_record, portpicker, tensorboardX, tomli_w (`pip download --no-deps
# --only-binary=:all: --python-version 3.12 ...`). Do not carry flax, optax or orbax for such an image:
# flax 0.12.8 did not import under jax 0.11.2 (jax.experimental.hijax has no HiPrimitive there).
# The numbers: docs/long-sequences.md, docs/benchmarks.md and docs/offload.md, "Measured on a GPU".
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/gpu}"
PARTS="${PARTS:-attention rows offload}"
part() { [[ " $PARTS " == *" $1 "* ]]; }
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
if [ -n "${WHEELS:-}" ]; then
    rm -rf /tmp/site
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl || exit 1
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
if [ -z "${TINY:-}" ] && ! "$PY" -c "
import jax, flax, optax
print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())
assert jax.default_backend() == 'gpu', 'JAX sees ' + jax.default_backend() + ', not a GPU'"; then
    echo "gpu_checks.sh: $PY cannot run the checks (above): it needs jax[cuda] with a GPU it can see, and flax and optax" \
         "(set PYTHON=... to another interpreter, or WHEELS=... for missing packages)" >&2
    exit 1
fi

FAILED=()
# run NAME LOG CMD...: CMD's output to the terminal and LOG; NAME joins FAILED when CMD fails
run() {
    local name=$1 log=$2; shift 2
    part "$name" || return 0
    "$@" 2>&1 | tee "$log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || FAILED+=("$name")
}

echo "== 1. attention: cuDNN against the tiled path"
run attention "$OUT/attention.txt" timeout 150 "$PY" scripts/gpu_attention.py --lengths 4096,8192,16384,32768

echo "== 2. rows: llama-3.2-1b and the toy GPT, zshard against the plain jax.jit step of the same code"
run rows "$OUT/gpu_rows.txt" timeout 480 "$PY" -m train.bench.gpu --steps 10 --out "$OUT/gpu_rows.json" ${TINY:+--tiny}

echo "== 3. host offload"
run offload "$OUT/offload.txt" timeout 200 "$PY" -m train.bench --offload --out "$OUT/offload"

if [ ${#FAILED[@]} -gt 0 ]; then
    echo "gpu_checks.sh: failed: ${FAILED[*]} (their output: $OUT)" >&2
    exit 1
fi
echo "gpu_checks.sh: passed: $PARTS"
