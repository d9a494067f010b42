"""DeepSpeed's own DeepCompile tests (``tests/unit/v1/compile`` of DeepSpeed's repository) run twice on
this machine, with DeepSpeed's op and with ds_z3native's (``DS_Z3NATIVE=1``), and compared test by
test.

DeepSpeed's tests are not part of this tree: check out DeepSpeed's repository at the tag of the
release under test (or its newest commit) and point ``--tests`` at its ``tests`` folder. Their
distributed classes ask for 2 ranks; ``--world-size 1`` runs them on one GPU (a pytest plugin sets
the class attribute DeepSpeed's ``DistributedTest`` reads). The result is a JSON of outcomes per
test and arm and a Markdown table (``--markdown``), the one in docs/testing.md.

    python tests/gpu/deepspeed_suite.py --tests ../DeepSpeed/tests --world-size 1 \\
        --json out/ds_suite.json --markdown out/ds_suite.md
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict, List, Optional

PLUGIN = '''
import os
def pytest_collection_modifyitems(config, items):
    world_size = int(os.environ["DSZ_DS_WORLD_SIZE"])
    for item in items:
        cls = getattr(item, "cls", None)
        if cls is not None and isinstance(getattr(cls, "world_size", None), int):
            cls.world_size = world_size
'''


def _outcomes(junit: Path) -> Dict[str, Dict[str, str]]:
    """test id -> {"outcome": passed|failed|error|skipped, "message": first line}."""
    out: Dict[str, Dict[str, str]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (el.get("message") or el.text or "").strip().splitlines()[0][:300] \
                    if (el.get("message") or el.text) else ""
                break
        out[name] = {"outcome": outcome, "message": message}
    return out


def _outcomes_from_log(text: str) -> Dict[str, Dict[str, str]]:
    out: Dict[str, Dict[str, str]] = {}
    for m in re.finditer(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)", text, re.M):
        path, *classes, name = m.group(1).split("::")
        classname = ".".join([path[:-3].replace("/", "."), *classes])  # junit's classname
        out[f"{classname}::{name}"] = {"outcome": m.group(2).lower(), "message": ""}
    return out


def run_arm(tests: Path, select: List[str], keyword: Optional[str], ours: bool,
            world_size: int, timeout: int) -> Dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "dsz_world_size.py").write_text(PLUGIN)
        junit = Path(tmp, "junit.xml")
        env = {**os.environ, "DSZ_DS_WORLD_SIZE": str(world_size),
               "PYTHONPATH": os.pathsep.join([tmp, str(tests), os.environ.get("PYTHONPATH", "")])}
        env.pop("DS_Z3NATIVE", None)
        if ours:
            env["DS_Z3NATIVE"] = "1"
        cmd = [sys.executable, "-m", "pytest", "-p", "dsz_world_size", "-q", "-rA", "--color=no",
               f"--junitxml={junit}", *select]
        if keyword:
            cmd += ["-k", keyword]
        t0 = time.time()
        log = Path(tmp, "pytest.log")
        with open(log, "w") as out:
            try:
                returncode = subprocess.run(cmd, cwd=tests, env=env, text=True, stdout=out,
                                            stderr=subprocess.STDOUT, timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                returncode = "timeout"
        text = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text(errors="replace"))
        tail = text[-4000:]
        # The junit file exists once pytest ends; an arm stopped at its time limit has the
        # verbose lines it printed.
        outcomes = _outcomes(junit) if junit.exists() else _outcomes_from_log(text)
    return {"returncode": returncode, "seconds": round(time.time() - t0, 1),
            "tests": outcomes, "log_tail": tail}


def markdown(result: Dict[str, object]) -> str:
    ours, theirs = result["ours"]["tests"], result["deepspeed"]["tests"]
    lines = ["| test | DeepSpeed's op | ds_z3native's op |", "|---|---|---|"]
    for name in sorted(set(ours) | set(theirs)):
        a = theirs.get(name, {}).get("outcome", "not run")
        b = ours.get(name, {}).get("outcome", "not run")
        lines.append(f"| `{name.split('.')[-1]}` | {a} | {b} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tests", type=Path, required=True, help="DeepSpeed's tests folder")
    p.add_argument("--select", nargs="*", default=["unit/v1/compile"])
    p.add_argument("-k", dest="keyword", default=None)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--arms", default="deepspeed,ours")
    p.add_argument("--arm-timeout", type=int, default=3000, help="seconds for each arm")
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--markdown", type=Path)
    args, extra = p.parse_known_args(argv)  # the rest goes to pytest (e.g. --ignore=...)
    import deepspeed
    import torch

    result: Dict[str, object] = {
        "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv),
        "deepspeed": {}, "ours": {},
        "versions": {"deepspeed": deepspeed.__version__, "torch": torch.__version__,
                     "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"},
        "world_size": args.world_size}
    arms = args.arms.split(",")
    # The arms run side by side (each test spawns its own ranks; the models are small).
    with concurrent.futures.ThreadPoolExecutor(len(arms)) as pool:
        futures = {arm: pool.submit(run_arm, args.tests, [*args.select, *extra], args.keyword,
                                    arm == "ours", args.world_size, args.arm_timeout)
                   for arm in arms}
        for arm, future in futures.items():
            result[arm] = future.result()
            print(f"{arm}: rc {result[arm]['returncode']} in {result[arm]['seconds']} s, "
                  f"{len(result[arm]['tests'])} tests", flush=True)
    args.json.write_text(json.dumps(result, indent=1))
    if args.markdown and result["ours"] and result["deepspeed"]:
        args.markdown.write_text(markdown(result))
    regressions = [n for n, o in result.get("deepspeed", {}).get("tests", {}).items()
                   if o["outcome"] == "passed"
                   and result.get("ours", {}).get("tests", {}).get(n, {}).get("outcome") != "passed"]
    print("passes with DeepSpeed's op, not with ours:", regressions or "none")
    return 1 if regressions else 0


if __name__ == "__main__":
    raise SystemExit(main())
