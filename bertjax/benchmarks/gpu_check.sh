#!/usr/bin/env bash
# The accelerator benchmark on a machine that has Python and JAX but not bertjax's install (a
# GPU image: JAX with CUDA, torch, transformers; no TensorFlow, perhaps no ml-collections):
#
#   bertjax/benchmarks/gpu_check.sh OUT_DIR [WHEELS_DIR] [-- BENCHMARK FLAGS]
#
# Runs from this source tree (PYTHONPATH), installs what the image lacks of bertjax's
# TensorFlow-free needs from WHEELS_DIR (pip --no-index; without it, from the package index),
# then `python -m bertjax.benchmarks.accelerator` under a timeout (BERTJAX_CHECK_TIMEOUT
# seconds, default 540), writing accelerator.md, accelerator.json, the log and the versions
# to OUT_DIR. PYTHON picks the interpreter (default python3).
set -uo pipefail

root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${1:?usage: gpu_check.sh OUT_DIR [WHEELS_DIR] [-- BENCHMARK FLAGS]}"
shift
wheels=""
if [[ $# -gt 0 && "$1" != "--" ]]; then
  wheels="$1"
  shift
fi
[[ "${1:-}" == "--" ]] && shift
python="${PYTHON:-python3}"
mkdir -p "$out"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"

# module → requirement, for what the benchmark imports beyond JAX itself.
missing=$("$python" - <<'EOF'
import importlib

NEEDS = {"absl": "absl-py", "etils.epath": "etils[epath]", "flax": "flax", "optax": "optax",
         "orbax.checkpoint": "orbax-checkpoint", "ml_collections": "ml-collections",
         "safetensors": "safetensors", "google_crc32c": "google-crc32c"}
lacking = []
for module, requirement in NEEDS.items():
    try:
        importlib.import_module(module)
    except ImportError:
        lacking.append(requirement)
print(" ".join(lacking))
EOF
)
if [[ -n "$missing" ]]; then
  echo "installing: $missing" | tee "$out/install.log"
  if [[ -n "$wheels" ]]; then
    "$python" -m pip install --no-index --find-links "$wheels" $missing >>"$out/install.log" 2>&1
  else
    "$python" -m pip install $missing >>"$out/install.log" 2>&1
  fi || { echo "error: could not install $missing (see $out/install.log)"; exit 1; }
fi

"$python" - >"$out/versions.txt" 2>&1 <<'EOF'
import importlib.metadata as m
import jax

for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "torch", "transformers"):
    try:
        print(name, m.version(name))
    except m.PackageNotFoundError:
        print(name, "absent")
print("devices", jax.devices())
EOF
cat "$out/versions.txt"

cd "$root" || exit 1
timeout "${BERTJAX_CHECK_TIMEOUT:-540}" "$python" -m bertjax.benchmarks.accelerator \
  --output="$out" "$@" 2>&1 | tee "$out/benchmark.log"
status=${PIPESTATUS[0]}
[[ $status -eq 124 ]] && echo "error: the benchmark ran past ${BERTJAX_CHECK_TIMEOUT:-540} s"
exit "$status"
