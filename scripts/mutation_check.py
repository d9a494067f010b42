#!/usr/bin/env python
"""Mutation check: break the code on purpose, one break at a time, and see the tests fail.

Each mutation edits the source text of a copy of the package (``python/`` and ``csrc/`` with the
build files, copied into a work directory outside the repository), rebuilds the native extension
there when it changed C++ (ninja rebuilds only the edited file), and runs the tests named for it
against that copy (``PYTHONPATH`` puts the copy first, also for the ranks and training runs the
tests start). Every named test must fail; a mutation under which one passes survived, and the
check fails. The unmutated copy runs the same tests first and must pass them all (the baseline:
a test that fails without a break proves nothing).

    python scripts/mutation_check.py                 # baseline, then every mutation
    python scripts/mutation_check.py --list          # the mutations and their tests
    python scripts/mutation_check.py --only skip-reduce-collective --no-baseline

The repository itself is never edited. The work directory (default: a fixed folder under the
system's temporary directory) is kept between runs so that later builds are incremental; a first
build takes a few minutes on two cores. See docs/testing.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import filecmp
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
# What a build of the package needs, copied into the work directory.
COPIED = ("python", "csrc", "build_support", "setup.py", "pyproject.toml", "MANIFEST.in",
          "README.md", "LICENSE")
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.egg-info")


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    targets: str          # what the break does, and what a test must notice
    path: str             # file of the package, relative to the repository root
    old: str              # text that must occur exactly once in it
    new: str
    tests: Tuple[str, ...]  # pytest node ids, every one of which must fail

    @property
    def native(self) -> bool:
        return self.path.startswith("csrc/")


MUTATIONS: Tuple[Mutation, ...] = (
    Mutation(
        name="skip-reduce-collective",
        targets="the gradient reduction skips its reduce-scatter: each rank keeps its own chunk "
                "of its own gradient (divided by the world size, as before the collective), so "
                "the ranks' gradients are never summed",
        path="csrc/core/grad_reducer.cpp",
        old="comm_.reduceScatterSum(slot, recv[i], params[i]->ds_id);",
        new="recv[i].copy_(slot.narrow(0, comm_.rank() * recv[i].numel(), recv[i].numel()));",
        tests=(
            "tests/test_native_gloo.py::test_reduce_with_accumulation_equals_all_reduce_mean",
            "tests/test_native_gloo.py::test_reduce_grads_equals_reduce_scatter_of_the_mean",
        ),
    ),
    Mutation(
        name="keep-frozen-gathered",
        targets="release_param drops the release of a frozen param: its gathered copy stays "
                "after its last user (memory held for the rest of training)",
        path="csrc/runtime.cpp",
        old="if (ex.releaseUse(ds_id, n_users, op) && !p.persistent) { gatherer_.free(p, op); }",
        new="if (ex.releaseUse(ds_id, n_users, op) && !p.persistent && !p.frozen) "
            "{ gatherer_.free(p, op); }",
        tests=(
            "tests/test_native_gloo.py::test_release_frees_every_param_but_the_persistent_ones",
        ),
    ),
    Mutation(
        name="stale-kept-copy",
        targets="an optimizer step no longer invalidates the gathered copies of the graph's "
                "trainable params: a param kept gathered is handed out with its values from "
                "before the step (on one rank the kept copy is the shard's own memory, so only "
                "several ranks show it)",
        path="csrc/core/gatherer.cpp",
        old="if (!p.frozen) { p.valid = false; }",
        new="(void)p;",
        tests=(
            "tests/test_native_gloo.py::test_gather_persistent_equals_all_gather_after_a_step",
            "tests/test_native_gloo.py::test_persistent_params_after_a_step",
        ),
    ),
    Mutation(
        name="misaligned-gather",
        targets="the full view of a gathered buffer starts after the padding instead of at "
                "element 0: every value shifted where the param's size does not divide by the "
                "world size (never on one rank, which has no padding)",
        path="csrc/core/gatherer.cpp",
        old="return flat.narrow(0, 0, p.numel).view(p.shape);",
        new="return flat.narrow(0, flat.numel() - p.numel, p.numel).view(p.shape);",
        tests=(
            "tests/test_native_gloo.py::test_allgather_equals_torch_distributed",
            "tests/test_native_gloo.py::test_gather_persistent_equals_all_gather_after_a_step",
        ),
    ),
)


def _sync_tree(work: Path) -> None:
    """The repository's package and build files copied into ``work``; a file whose content did
    not change keeps its modification time (the native build then stays incremental)."""
    work.mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        src = ROOT / name
        if not src.exists():
            continue
        dst = work / name
        if src.is_file():
            if not dst.exists() or not filecmp.cmp(src, dst, shallow=False):
                shutil.copy2(src, dst)
            continue
        with tempfile.TemporaryDirectory(dir=work) as fresh:
            staged = Path(fresh) / name
            shutil.copytree(src, staged, ignore=IGNORED)
            for path in staged.rglob("*"):
                if path.is_dir():
                    continue
                rel = path.relative_to(staged)
                target = dst / rel
                if not target.exists() or not filecmp.cmp(path, target, shallow=False):
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(path, target)
            for target in list(dst.rglob("*")) if dst.exists() else []:
                if target.is_file() and not target.suffix == ".so" and "__pycache__" not in \
                        target.parts and not (staged / target.relative_to(dst)).exists():
                    target.unlink()


def _apply(work: Path, mutation: Mutation) -> str:
    """Writes the mutation into the work copy; returns the original text."""
    path = work / mutation.path
    text = path.read_text()
    count = text.count(mutation.old)
    if count != 1:
        raise SystemExit(f"mutation {mutation.name}: {mutation.path} holds the text to replace "
                         f"{count} times, expected once (the source changed: update "
                         f"scripts/mutation_check.py): {mutation.old!r}")
    path.write_text(text.replace(mutation.old, mutation.new))
    return text


def _build(work: Path, log: Path) -> float:
    """``setup.py build_ext --inplace`` in the work copy; its seconds. A failed build stops the
    check (a mutation must compile to prove anything)."""
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                              cwd=work, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"the build in {work} failed (rc {proc.returncode}); log: {log}")
    return time.perf_counter() - start


def _run_tests(work: Path, tests: Sequence[str], xml: Path, log: Path,
               timeout: float) -> Dict[str, str]:
    """The named tests against the work copy: node id -> passed, failed, error or skipped."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(work / "python"),
                                                     env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("DS_ACCELERATOR", "cpu")
    probe = subprocess.run([sys.executable, "-c", "import ds_z3native; print(ds_z3native.__file__)"],
                           env=env, cwd=ROOT, capture_output=True, text=True)
    where = Path(probe.stdout.strip() or "?").resolve()
    if work.resolve() not in where.parents:
        raise SystemExit(f"ds_z3native imports from {where}, not from the work copy {work} "
                         f"({probe.stderr[-500:]})")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
           f"--junitxml={xml}", *tests]
    with open(log, "w") as out:
        try:
            subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                           timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    outcome = {t: "not run" for t in tests}
    if not xml.exists():
        return outcome
    for case in ET.parse(xml).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        node = classname.replace(".", "/") + ".py::" + name
        kinds = {child.tag for child in case}
        state = ("failed" if "failure" in kinds else "error" if "error" in kinds
                 else "skipped" if "skipped" in kinds else "passed")
        for test in tests:
            if node == test or node.startswith(test + "["):
                # A parametrized test fails when any of its cases fails.
                previous = outcome[test]
                if previous in ("not run", "passed") or state in ("failed", "error"):
                    outcome[test] = state if previous != "failed" else previous
    return outcome


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", default=[], metavar="NAME",
                        help="run this mutation only (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the unmutated run of the named tests")
    parser.add_argument("--workdir", type=Path,
                        default=Path(tempfile.gettempdir()) / "ds_z3native-mutation-check",
                        help="where the copy is built (kept for incremental builds)")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds the tests of one mutation may take")
    args = parser.parse_args(argv)
    known = {m.name: m for m in MUTATIONS}
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name} ({m.path}): {m.targets}")
            for t in m.tests:
                print(f"    {t}")
        return 0
    unknown = sorted(set(args.only) - set(known))
    if unknown:
        parser.error(f"--only {', '.join(unknown)}: no such mutation (known: "
                     f"{', '.join(known)})")
    chosen = [known[n] for n in args.only] if args.only else list(MUTATIONS)
    work = args.workdir.resolve()
    if ROOT in work.parents or work == ROOT:
        parser.error(f"--workdir {work} lies inside the repository")
    logs = work / "logs"
    _sync_tree(work)
    logs.mkdir(parents=True, exist_ok=True)
    print(f"work copy: {work} (logs in {logs})", flush=True)

    built_native = False
    survived: List[str] = []
    if not args.no_baseline:
        tests = sorted({t for m in chosen for t in m.tests})
        seconds = _build(work, logs / "baseline-build.log")
        built_native = True
        print(f"baseline: built in {seconds:.0f} s, running {len(tests)} tests", flush=True)
        outcome = _run_tests(work, tests, logs / "baseline.xml", logs / "baseline.log",
                             args.timeout)
        bad = {t: s for t, s in outcome.items() if s != "passed"}
        for t, s in outcome.items():
            print(f"  {s:8} {t}")
        if bad:
            print(f"baseline: {len(bad)} named tests do not pass without a mutation "
                  f"(log: {logs / 'baseline.log'})")
            return 1
    for m in chosen:
        original = _apply(work, m)
        try:
            seconds = _build(work, logs / f"{m.name}-build.log") if m.native or not built_native \
                else 0.0
            built_native = built_native or m.native
            start = time.perf_counter()
            outcome = _run_tests(work, m.tests, logs / f"{m.name}.xml", logs / f"{m.name}.log",
                                 args.timeout)
        finally:
            (work / m.path).write_text(original)
        caught = all(s in ("failed", "error") for s in outcome.values())
        print(f"{m.name}: {'caught' if caught else 'SURVIVED'} (build {seconds:.0f} s, tests "
              f"{time.perf_counter() - start:.0f} s; log: {logs / (m.name + '.log')})", flush=True)
        for t, s in outcome.items():
            print(f"  {s:8} {t}")
        if not caught:
            survived.append(m.name)
    # Leave the copy built from unmutated sources.
    if any(m.native for m in chosen):
        _build(work, logs / "restore-build.log")
    if survived:
        print(f"survived: {', '.join(survived)}")
        return 1
    print(f"every mutation was caught ({len(chosen)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
