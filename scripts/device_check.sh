#!/usr/bin/env bash
# The GPU backends' one prepared check (about 5-6 minutes on one H100/H200, at most 8): kernel parity
# (triton, flashmla vs torch_ref), the engine on CUDA vs the CPU engine, CUDA-graphed decode against
# eager (alternated, vs the HBM bound, launches and syncs per step, sync-debug "error"), a sharded load
# (peak GPU and host memory against what the rank holds), decode throughput per backend at
# B = 1 / 64 / 256, speculation, transformers' generate as the peer, kernel bandwidth.
#
# Needs torch with CUDA and Triton (both in the image); FlashMLA comes from a wheel in .whl/ when
# one is there (download it once, elsewhere:
#   pip download sgl-flash-mla==1.0.0 --no-deps --only-binary=:all: -d .whl
# its metadata pins a newer torch, so it is installed with --no-deps). Without it the flashmla
# parts are recorded as unavailable and the others run.
#
#   OUT=/some/folder bash scripts/device_check.sh [extra device_check.py flags]
# writes $OUT/device_check.json (default: ./device_check_out) and prints a summary.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/device_check_out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

shopt -s nullglob
wheels=(.whl/sgl_flash_mla-*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/flash_mla_site \
       "${wheels[0]}" >"$OUT/pip_sgl_flash_mla.log" 2>&1; then
    export PYTHONPATH="$PYTHONPATH:/tmp/flash_mla_site"
    echo "installed ${wheels[0]}"
  else
    echo "installing ${wheels[0]} failed (see $OUT/pip_sgl_flash_mla.log); flashmla parts will say unavailable"
  fi
else
  echo "no .whl/sgl_flash_mla-*.whl: flashmla parts will say unavailable"
fi

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/nvidia_smi.csv" 2>&1 || true
timeout --signal=TERM 470 python3 scripts/device_check.py --out "$OUT" --budget-s 380 "$@"
rc=$?
if [ "$rc" -eq 124 ]; then
  echo "device_check.py ran past 470 s; $OUT/device_check.json holds the parts that finished"
fi
exit "$rc"
