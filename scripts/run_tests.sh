#!/usr/bin/env bash
# The project's test command (README, .ci/run): native gtest suite through CMake/ctest, then the
# pytest suite with the installed DeepSpeed, then the DeepSpeed-driving tests again on DeepSpeed
# 0.19.2, then the release matrix: the tests marked release_matrix on every other supported
# release (0.19.0, 0.19.1, 0.19.3 - 0.19.7). Each release is fetched once into .cache/ds-X with
# pip --target (no deps; nothing else is installed); so is transformers 5.17.0, with the
# huggingface-hub 1.x and httpx it needs, into .cache/tf-5.17.0 (DSZ_TRANSFORMERS_OLD_DIR), for
# the tests of the patches that change what it does (tests/helpers/old_transformers.py). Last,
# the newest torch pip installs, in a venv under .cache/newest-torch (DSZ_NEWEST_TORCH=off skips
# it).
# Needs: torch, DeepSpeed 0.19.x, `pip install --no-build-isolation -e ".[test]"`, libgtest-dev.
#
# The pytest suites run on one pytest-xdist worker per core (at most 4; a test file stays on one
# worker); the matrix runs as many releases at a time, those with slow tests first. The matrix
# runs the subset's fast tests and those marked every_release (DeepCompile training a frozen
# layer on the CPU past its re-plan, from 0.19.4) on every release, and its other slow ones (the
# eager-recompute minimal reproductions, demo, DeepCompile's registration, the LoRA Llama under
# DeepCompile) on one release a day, chosen by the day of the year (each release once a week).
# DSZ_MATRIX_FULL="0.19.0 0.19.5" picks the releases that get the slow tests too ("all": every
# one), DSZ_MATRIX=off skips the matrix.
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
jobs=$(nproc 2>/dev/null || echo 2)
t0=$(date +%s)
summary=()  # one line per phase, printed at the end

# pytest workers (pytest-xdist, one test file per worker at a time: a file's fixtures are shared
# by its tests): one per core, at most 4; DSZ_PYTEST_WORKERS=1 runs the suites in one process.
workers=${DSZ_PYTEST_WORKERS:-$(( jobs < 4 ? jobs : 4 ))}
par=()
if [ "$workers" -gt 1 ]; then
  if python -c "import xdist" 2>/dev/null; then
    par=(-n "$workers" --dist loadfile)
  else
    echo "   (pytest-xdist is not installed: one pytest process; pip install -e '.[test]' adds it)"
  fi
fi

fetch_deepspeed() {  # version, directory
  if [ ! -f "$2/deepspeed/__init__.py" ]; then
    echo "== fetching DeepSpeed $1 into $2 (pip --target, no deps)"
    python -m pip install -q --no-deps --target "$2" "deepspeed==$1"
  fi
}
with_deepspeed() {  # directory, command...: the command with that DeepSpeed first on the path
  local dir; dir=$(cd "$1" && pwd); shift
  PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" "$@"
}

build_deepspeed_ops() {  # python...: DeepSpeed's CPU shared-memory comm op, which DeepSpeed
  # JIT-builds at its first init on a release (one torch extensions directory for all: rebuilt when
  # the release changes), built before the tests: a test that stops its ranks while one of them
  # builds it leaves the build's lock behind, and every later DeepSpeed init waits on it.
  local log rc=0; log=$(mktemp)
  "$@" -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >"$log" 2>&1 || rc=$?
  [ "$rc" = 0 ] || cat "$log"
  rm -f "$log"
  return "$rc"
}

fetch_transformers() {  # version, directory: that release with the huggingface-hub 1.x and
  # httpx that transformers 5.17 needs (the installed hub may be newer), pip --target, no deps
  if [ ! -f "$2/transformers/__init__.py" ] || [ ! -f "$2/huggingface_hub/__init__.py" ] ||
     [ ! -f "$2/httpx/__init__.py" ]; then
    echo "== fetching transformers $1 into $2 (pip --target, no deps)"
    python -m pip install -q --no-deps --upgrade --target "$2" "transformers==$1" \
      "huggingface-hub>=1.5,<2" "httpx>=0.23,<1" "httpcore==1.*"
  fi
}

# transformers 5.17.0 is fetched in the background while the native suite builds and runs.
tf_old=${DSZ_TRANSFORMERS_OLD_DIR:-.cache/tf-5.17.0}
mkdir -p .cache
fetch_transformers 5.17.0 "$tf_old" >.cache/fetch-transformers.log 2>&1 &
fetching_tf=$!

# The matrix's releases are fetched in the background while the suites before it run.
releases=(0.19.0 0.19.1 0.19.3 0.19.4 0.19.5 0.19.6 0.19.7)
if [ "${DSZ_MATRIX:-on}" != off ]; then
  mkdir -p .cache
  (for v in "${releases[@]}"; do fetch_deepspeed "$v" ".cache/ds-$v"; done) >.cache/fetch.log 2>&1 &
  fetching=$!
fi

# The newest torch's venv is made and that torch installed (a download of gigabytes, mostly
# waiting on the network and the disk) in the background while the suites before it run.
newest_venv=$PWD/.cache/newest-torch
install_newest_torch() {
  { [ -x "$newest_venv/bin/python" ] || python -m venv --system-site-packages "$newest_venv"; } &&
  # --system-site-packages shows the base interpreter's packages only: run from a virtualenv, this
  # environment's packages (DeepSpeed, transformers, pytest...) live in its own site-packages, so
  # a .pth adds those after the venv's own (its torch first).
  python tests/helpers/venv_site.py "$newest_venv/bin/python" &&
  "$newest_venv/bin/python" -m pip install -q --upgrade "${DSZ_NEWEST_TORCH:-torch}"
}
if [ "${DSZ_NEWEST_TORCH:-torch}" != off ]; then
  mkdir -p .cache
  rm -f .cache/newest-torch-install.rc
  # Not a job of this shell (the release matrix's `wait -n` and `wait` are for its own lanes):
  # its exit status goes to a file, read at the newest torch's phase.
  ( (rc=0; install_newest_torch >.cache/newest-torch-install.log 2>&1 || rc=$?
     echo "$rc" >.cache/newest-torch-install.rc) & )
fi

echo "== native core: gtest via CMake + ctest"
build=${DSZ_CMAKE_BUILD:-build/cmake}
prefix=$(python -c "import torch; print(torch.utils.cmake_prefix_path)")
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$build" -j "$jobs"
ctest --test-dir "$build" --output-on-failure --no-tests=error -j "$jobs" | tee .cache/phase-native.log
summary+=("native (ctest): $(grep -E 'tests passed|tests failed' .cache/phase-native.log | tail -1)")
echo "   ($(( $(date +%s) - t0 )) s so far)"

if ! wait "$fetching_tf"; then
  cat .cache/fetch-transformers.log
  exit 1
fi
DSZ_TRANSFORMERS_OLD_DIR=$(cd "$tf_old" && pwd)
export DSZ_TRANSFORMERS_OLD_DIR
installed=$(python -c 'import deepspeed; print(deepspeed.__version__.split("+")[0])' 2>/dev/null | tail -1)
echo "== pytest (DeepSpeed $installed)"
build_deepspeed_ops python
DSZ_EXPECT_DEEPSPEED=$installed python -m pytest tests -q -m "not gpu" -p no:cacheprovider \
  "${par[@]}" | tee .cache/phase-main.log
summary+=("pytest -m 'not gpu' (DeepSpeed $installed): $(tail -1 .cache/phase-main.log)")
echo "   ($(( $(date +%s) - t0 )) s so far)"

ds_old=${DSZ_DEEPSPEED_OLD_DIR:-.cache/ds-0.19.2}
fetch_deepspeed 0.19.2 "$ds_old"
echo "== pytest -m deepspeed (DeepSpeed 0.19.2 from $ds_old)"
with_deepspeed "$ds_old" build_deepspeed_ops python
DSZ_EXPECT_DEEPSPEED=0.19.2 with_deepspeed "$ds_old" python -m pytest tests -q \
  -m "deepspeed and not gpu" -p no:cacheprovider "${par[@]}" | tee .cache/phase-0.19.2.log
summary+=("pytest -m 'deepspeed and not gpu' (DeepSpeed 0.19.2): $(tail -1 .cache/phase-0.19.2.log)")
echo "   ($(( $(date +%s) - t0 )) s so far)"

if [ "${DSZ_MATRIX:-on}" != off ]; then
  t1=$(date +%s)
  if ! wait "$fetching"; then
    cat .cache/fetch.log
    exit 1
  fi
  if [ -n "${DSZ_MATRIX_FULL:-}" ]; then
    full=" ${DSZ_MATRIX_FULL} "
  else
    day=$((10#$(date -u +%j)))
    full=" ${releases[$(( day % ${#releases[@]} ))]} "
  fi
  echo "== release matrix: slow tests on${full}(day $(date -u +%j) of the year), fast ones on every release"
  # A queue of releases, the ones with slow tests first, run by as many lanes as pytest workers
  # (each release its own pytest process, log and exit status), reported in release order.
  slow_first=()
  for v in "${releases[@]}"; do
    if [ "$full" = " all " ] || [[ "$full" == *" $v "* ]]; then slow_first+=("$v"); fi
  done
  for v in "${releases[@]}"; do
    if ! { [ "$full" = " all " ] || [[ "$full" == *" $v "* ]]; }; then slow_first+=("$v"); fi
  done
  lane() {  # version, selection: that release's pytest run, into .cache/matrix-<version>.log/.rc
    local rc=0
    DSZ_EXPECT_DEEPSPEED=$1 with_deepspeed ".cache/ds-$1" python -m pytest tests -q -m "$2" \
      -p no:cacheprovider >".cache/matrix-$1.log" 2>&1 || rc=$?
    echo "$rc" >".cache/matrix-$1.rc"
  }
  lanes=$(( workers > 1 ? workers : 1 ))
  running=0
  for v in "${slow_first[@]}"; do
    if [ "$running" -ge "$lanes" ]; then
      wait -n || true
      running=$((running - 1))
    fi
    if [ "$full" = " all " ] || [[ "$full" == *" $v "* ]]; then
      select="release_matrix and not gpu"
    else
      select="release_matrix and (not slow or every_release) and not gpu"
    fi
    echo "== pytest -m '$select' (DeepSpeed $v from .cache/ds-$v)"
    rm -f ".cache/matrix-$v.rc"
    lane "$v" "$select" &
    running=$((running + 1))
  done
  wait
  failed=()
  for v in "${releases[@]}"; do
    if [ "$(cat ".cache/matrix-$v.rc" 2>/dev/null)" = 0 ]; then
      echo "   DeepSpeed $v: $(tail -1 ".cache/matrix-$v.log")"
      summary+=("release matrix, DeepSpeed $v$([[ "$full" == *" $v "* || "$full" = " all " ]] && echo ' (slow tests too)' || echo ' (fast tests and every_release)'): $(tail -1 ".cache/matrix-$v.log")")
    else
      cat ".cache/matrix-$v.log"
      failed+=("$v")
    fi
  done
  if [ ${#failed[@]} -gt 0 ]; then
    echo "release matrix failed on DeepSpeed ${failed[*]}"
    exit 1
  fi
  echo "   (release matrix: $(( $(date +%s) - t1 )) s)"
else
  summary+=("release matrix: turned off (DSZ_MATRIX=off)")
fi

# The newest torch pip installs here (DSZ_NEWEST_TORCH: a pip requirement, default "torch", i.e.
# the newest release pip resolves; "off" skips): a venv that sees this environment's packages with
# torch replaced, the extension built for it (CPU flavour) from a copy of the tracked tree (the
# in-place build of the suites above stays as it is), then the native ops, install gate, demo and
# DeepCompile on the CPU.
if [ "${DSZ_NEWEST_TORCH:-torch}" != off ]; then
  t2=$(date +%s)
  venv=$newest_venv
  echo "== newest torch: pip install --upgrade '${DSZ_NEWEST_TORCH:-torch}' in .cache/newest-torch (started in the background)"
  waited=0
  while [ ! -s .cache/newest-torch-install.rc ] && [ "$waited" -lt 3600 ]; do
    sleep 5; waited=$((waited + 5))
  done
  if [ "$(cat .cache/newest-torch-install.rc 2>/dev/null)" != 0 ]; then
    cat .cache/newest-torch-install.log
    echo "installing the newest torch failed or did not end within an hour"
    exit 1
  fi
  rm -rf "$venv/src" && mkdir -p "$venv/src"
  git ls-files -z | xargs -0 tar cf - | tar xf - -C "$venv/src"
  (cd "$venv/src" && DS_Z3NATIVE_CUDA=0 "$venv/bin/python" -m pip install -q --no-build-isolation \
     --no-deps .)
  (cd "$venv/src" && "$venv/bin/python" - <<'PY'
import ds_z3native, torch
info = ds_z3native.build_info()
print(f"   torch {torch.__version__}: ds_z3native's {info['flavour']} flavour, built for "
      f"{info['torch_version']}, from {ds_z3native.__file__}")
assert info["torch_matches_build"] and "site-packages" in ds_z3native.__file__, info
PY
  )
  (cd "$venv/src" && build_deepspeed_ops "$venv/bin/python")
  newest=$("$venv/bin/python" -c 'import torch; print(torch.__version__)')
  (cd "$venv/src" && "$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not gpu" "${par[@]}" \
     tests/test_native_opcheck.py tests/test_native_schemas.py tests/test_native_refusals.py \
     tests/test_native_hardening.py tests/test_native_lifetime.py tests/test_native_functions.py \
     tests/test_native_gloo.py tests/test_native_campaign.py tests/test_install.py tests/test_demo.py \
     tests/test_gathered_buffers.py tests/test_inductor_attention_outputs.py \
     "tests/test_deepcompile_cpu.py::test_frozen_layer_run_eagerly_is_gathered_and_trains_like_eager" \
     "tests/test_deepcompile_cpu_warm_start.py::test_params_kept_gathered_and_gradients_are_reached_by_one_call_per_group_and_train_the_same") \
     | tee .cache/phase-newest-torch.log
  summary+=("newest torch ($newest), the native, install, demo, frozen-layer DeepCompile and grouped-gather DeepCompile tests: $(tail -1 .cache/phase-newest-torch.log)")
  echo "   (newest torch: $(( $(date +%s) - t2 )) s)"
else
  summary+=("newest torch: turned off (DSZ_NEWEST_TORCH=off)")
fi
echo "== summary (each phase's selection; a phase turned off is named)"
for line in "${summary[@]}"; do echo "   $line"; done
echo "== all suites that ran passed in $(( $(date +%s) - t0 )) s"
