#!/usr/bin/env bash
# Records the fingerprints of every patch target (python/ds_z3native/compat/fingerprints.json) for
# each supported DeepSpeed release, for the torch and transformers installed here, and for
# transformers 5.17.0. Run it after adding a patch or changing a patch's targets, and commit the
# table.
# Each release is fetched once into .cache/ds-X with pip --target (no deps), as
# scripts/run_tests.sh does; DSZ_FINGERPRINT_RELEASES="0.19.7 0.19.8" picks the releases.
# transformers 5.17.0 is read from .cache/tf-5.17.0 (DSZ_TRANSFORMERS_OLD_DIR), fetched there as
# scripts/run_tests.sh fetches it.
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
tf_old=${DSZ_TRANSFORMERS_OLD_DIR:-.cache/tf-5.17.0}
if [ ! -f "$tf_old/transformers/__init__.py" ]; then
  echo "== fetching transformers 5.17.0 into $tf_old (pip --target, no deps)"
  python -m pip install -q --no-deps --upgrade --target "$tf_old" "transformers==5.17.0" \
    "huggingface-hub>=1.5,<2" "httpx>=0.23,<1" "httpcore==1.*"
fi
tf_old=$(cd "$tf_old" && pwd)
PYTHONPATH="$tf_old:$PWD/python${PYTHONPATH:+:$PYTHONPATH}" \
  python -m ds_z3native.compat.fingerprints --write --package transformers
