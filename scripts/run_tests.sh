#!/usr/bin/env bash
# The project's test command (README, .ci/run): native gtest suite through CMake/ctest, then the
# pytest suite with the installed DeepSpeed, then the DeepSpeed-driving tests again on DeepSpeed
# 0.19.2 (fetched once into .cache/ds-0.19.2 with pip --target; nothing else is installed).
# Needs: torch, DeepSpeed 0.19.x, `pip install --no-build-isolation -e ".[test]"`, libgtest-dev.
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
jobs=$(nproc 2>/dev/null || echo 2)
t0=$(date +%s)

echo "== native core: gtest via CMake + ctest"
build=${DSZ_CMAKE_BUILD:-build/cmake}
prefix=$(python -c "import torch; print(torch.utils.cmake_prefix_path)")
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$build" -j "$jobs"
ctest --test-dir "$build" --output-on-failure -j "$jobs"
echo "   ($(( $(date +%s) - t0 )) s so far)"

echo "== pytest (DeepSpeed $(python -c 'import deepspeed; print(deepspeed.__version__)' 2>/dev/null | tail -1))"
python -m pytest tests -q -m "not gpu" -p no:cacheprovider
echo "   ($(( $(date +%s) - t0 )) s so far)"

ds_old=${DSZ_DEEPSPEED_OLD_DIR:-.cache/ds-0.19.2}
if [ ! -f "$ds_old/deepspeed/__init__.py" ]; then
  echo "== fetching DeepSpeed 0.19.2 into $ds_old (pip --target, no deps)"
  python -m pip install -q --no-deps --target "$ds_old" deepspeed==0.19.2
fi
echo "== pytest -m deepspeed (DeepSpeed 0.19.2 from $ds_old)"
PYTHONPATH="$(cd "$ds_old" && pwd)${PYTHONPATH:+:$PYTHONPATH}" \
  python -m pytest tests -q -m "deepspeed and not gpu" -p no:cacheprovider
echo "== all suites passed in $(( $(date +%s) - t0 )) s"
