#!/usr/bin/env bash
# One call on a GPU machine (the lent H200 box; offline, torch preinstalled): build, run every
# test suite, then the measurements named in $GPU_CHECK_STEPS. Logs and JSON go to $OUT
# (default ./gpu-out). Usage: bash .ci/gpu_check.sh [steps...]   steps: build cpp pytest gpu
# gpu: the GPU suite (`make test-gpu` without the venv: python3's torch, transformers, and DeepSpeed
# when it imports from PYTHONPATH); its pytest summary line is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
steps=${*:-build cpp pytest}
status=0
ran_gpu=
run() {  # name, command...
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$(date +%s)
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $(( $(date +%s) - t0 )) s"
  tail -n 25 "$OUT/$name.log"
  [ $rc -eq 0 ] || status=1
  return $rc
}
for s in $steps; do
  case $s in
    build)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      run build env PYINFINITY_WERROR=1 $PY -m pip install --no-build-isolation --no-deps -e . \
        && $PY -c "import pyinfinity._C as C; print(C.build_info()); print('devices', C.cuda_device_count(), C.cuda_status())" && ldd pyinfinity/_C*.so ;;
    cpp)
      run cpp bash -c "cmake -S . -B build-tests -G Ninja -DPYINFINITY_PYTHON=OFF -DPYINFINITY_TESTS=ON -DPYINFINITY_WERROR=ON >/dev/null && cmake --build build-tests -j && cd build-tests && ctest --output-on-failure" ;;
    pytest)
      run pytest $PY -m pytest -q -p no:cacheprovider -rs ${PYTEST_PATHS:-tests/python} ${PYTEST_ARGS:-} ;;
    gpu)
      ran_gpu=1
      run gpu $PY -m pytest -q -p no:cacheprovider -rs -m gpu tests/python ${PYTEST_ARGS:-} ;;
    *)
      echo "unknown step $s"; status=1 ;;
  esac
done
if [ -n "${ran_gpu:-}" ]; then
  echo "gpu suite: $(grep -E '[0-9]+ (passed|failed|errors?|skipped)' "$OUT/gpu.log" | tail -n 1 | tr -d '=' | xargs)"
fi
exit $status
