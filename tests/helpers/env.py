"""Environments for the subprocesses a test starts."""

from __future__ import annotations

import os
from typing import Dict


def without_autoload(**extra: str) -> Dict[str, str]:
    """This process's environment without ``DS_Z3NATIVE`` (a child must not run
    ``ds_z3native.install()`` at ``import deepspeed`` because the caller's shell set it), with
    ``extra`` set on top."""
    env = {k: v for k, v in os.environ.items() if k != "DS_Z3NATIVE"}
    env.update(extra)
    return env
