#!/usr/bin/env bash
# Records the fingerprints of every patch target (python/ds_z3native/compat/fingerprints.json) for
# each supported DeepSpeed release, and for the torch and transformers installed here. Run it
# after adding a patch or changing a patch's targets, and commit the table.
# Each release is fetched once into .cache/ds-X with pip --target (no deps), as
# scripts/run_tests.sh does; DSZ_FINGERPRINT_RELEASES="0.19.7 0.19.8" picks the releases.
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
releases=(${DSZ_FINGERPRINT_RELEASES:-0.19.0 0.19.1 0.19.2 0.19.3 0.19.4 0.19.5 0.19.6 0.19.7 0.19.8})
mkdir -p .cache
for v in "${releases[@]}"; do
  dir=${DSZ_DEEPSPEED_DIR_PREFIX:-.cache/ds-}$v
  if [ ! -f "$dir/deepspeed/__init__.py" ]; then
    echo "== fetching DeepSpeed $v into $dir (pip --target, no deps)"
    python -m pip install -q --no-deps --target "$dir" "deepspeed==$v"
  fi
  dir=$(cd "$dir" && pwd)
  PYTHONPATH="$dir:$PWD/python${PYTHONPATH:+:$PYTHONPATH}" \
    python -m ds_z3native.compat.fingerprints --write
done
