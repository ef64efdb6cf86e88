#!/usr/bin/env bash
# The GPU tier on an offline node, from the bundles (docs/gpu.md, "Running the GPU tier").
#
#   tests/gpu/run_tier.sh BUNDLE_DIR [engine|all]
#
# Installs every `*.tar.xz` of BUNDLE_DIR (checked against its manifest.json) under $MEGAGRPO_SITE (default
# /tmp/megagrpo-site), sources their env files (bundles installed by an earlier call on the same node are
# used too), reports what loads, then runs:
#   (both)  the smoke check: megagrpo's engine path on a tiny model from the bundle;
#   engine  tests/gpu/test_gpu_engine.py;
#   all     the whole of tests/gpu, then tools/bench_step.py on the GPU.
# Both bundles of torch 2.11.0+cu130/sm_90 (52 MiB) travel in one device call with the repository:
#   carry [".bundles"], command: tests/gpu/run_tier.sh .bundles all   (about 6 minutes on an H200)
# MEGAGRPO_GPU_PYTEST_ARGS adds pytest arguments (e.g. --ignore a file an earlier call ran);
# MEGAGRPO_GPU_TESTS replaces `tests/gpu` (files in the order to run them: what matters most first, when a
# call may end before the last); MEGAGRPO_GPU_SMOKE_ENGINE=0 leaves out the smoke engine (a minute of
# SGLang start-up that the tier's own engine tests repeat); MEGAGRPO_GPU_BENCH=0 leaves out bench_step.
# Logs and figures go to $OUT (default /tmp/megagrpo-gpu-out). The exit status is pytest's.
set -uo pipefail
bundles=${1:?usage: tests/gpu/run_tier.sh BUNDLE_DIR [engine|all]}
stage=${2:-all}
site=${MEGAGRPO_SITE:-/tmp/megagrpo-site}
out=${OUT:-/tmp/megagrpo-gpu-out}
py=${PYTHON:-python3}
mkdir -p "$out" "$site"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
{ ldd --version | head -1; $py -c 'import sys, torch; print(sys.version.split()[0], torch.__version__)'; } | tee -a "$out/device.txt"

for b in "$bundles"/*.tar.xz; do
  [ -e "$b" ] || continue
  name=$(basename "$b" .tar.xz)
  t0=$SECONDS
  $py -m megagrpo.bundle.install "$b" --manifest "$bundles/manifest.json" --into "$site/$name" || exit 2
  echo "installed $name in $((SECONDS - t0)) s"
done
for env in "$site"/*/megagrpo-bundle.env; do
  [ -e "$env" ] || continue
  # shellcheck disable=SC1090
  source "$env"
done

smoke_modules=$($py - "$bundles/manifest.json" "$site" <<'EOF'
import json, os, sys
m = json.load(open(sys.argv[1]))
print(" ".join(x for b in m["bundles"] if os.path.isdir(os.path.join(sys.argv[2], b["name"])) for x in b.get("smoke", [])))
EOF
)
$py -m megagrpo.bundle.smoke imports $smoke_modules | tee "$out/smoke-imports-$stage.json"

rc=0
if [ "${MEGAGRPO_GPU_SMOKE_ENGINE:-1}" != 0 ]; then
  $py -m megagrpo.bundle.smoke engine | tee "$out/smoke-engine.json" || rc=1
fi
if [ "$stage" = engine ]; then
  $py -m pytest tests/gpu/test_gpu_engine.py -m gpu -p no:cacheprovider -x -s -q --durations=0 \
    --timeout 300 2>&1 | tee "$out/pytest-engine.log"
  rc=$(( rc | ${PIPESTATUS[0]} ))
else
  # shellcheck disable=SC2086
  $py -m pytest ${MEGAGRPO_GPU_TESTS:-tests/gpu} -m gpu -p no:cacheprovider -s -q -rfEs --durations=0 --timeout 240 ${MEGAGRPO_GPU_PYTEST_ARGS:-} \
    --junitxml "$out/junit.xml" 2>&1 | tee "$out/pytest-all.log"
  rc=$(( rc | ${PIPESTATUS[0]} ))
  [ "${MEGAGRPO_GPU_BENCH:-1}" = 0 ] && exit $rc
  timeout 150 $py tools/bench_step.py --steps 4 --warmup 1 --out "$out/bench_step.json" 2>&1 | tail -n 40 \
    | tee "$out/bench_step.log"
fi
exit $rc
