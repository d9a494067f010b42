"""transformers 5.17.0 beside the installed one, for the tests of patches that change what it
does (``hf-grouped-mm-fallback-backward``): ``scripts/run_tests.sh`` fetches it, with the
huggingface-hub and httpx it needs, into ``.cache/tf-5.17.0`` (``pip install --no-deps
--target``; nothing is installed) and names that directory in ``DSZ_TRANSFORMERS_OLD_DIR``. A test
puts it first on a subprocess's ``PYTHONPATH`` (:func:`old_transformers_env`).

Where it is absent a test is skipped with the reason, except in CI (``CI=true``), where the
absence fails the test: CI always fetches it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Mapping, Optional

__all__ = ["OLD_TRANSFORMERS_ENV", "OLD_TRANSFORMERS_VERSION", "old_transformers_dir",
           "old_transformers_env"]

ROOT = Path(__file__).resolve().parents[2]
OLD_TRANSFORMERS_ENV = "DSZ_TRANSFORMERS_OLD_DIR"
OLD_TRANSFORMERS_VERSION = "5.17.0"


def old_transformers_dir() -> Path:
    """The directory holding transformers 5.17.0 (``$DSZ_TRANSFORMERS_OLD_DIR``, default
    ``.cache/tf-5.17.0``); skips the calling test where it is absent (fails it in CI)."""
    import pytest

    path = Path(os.environ.get(OLD_TRANSFORMERS_ENV) or ROOT / ".cache" /
                f"tf-{OLD_TRANSFORMERS_VERSION}")
    if (path / "transformers" / "__init__.py").is_file():
        return path.resolve()
    reason = (f"transformers {OLD_TRANSFORMERS_VERSION} is not in {path} (scripts/run_tests.sh "
              f"fetches it there; {OLD_TRANSFORMERS_ENV} names another directory)")
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason}; CI must run these tests")
    pytest.skip(reason)


def old_transformers_env(env: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """``env`` plus a ``PYTHONPATH`` with transformers 5.17.0 first (then this process's own
    ``PYTHONPATH``: a DeepSpeed release put there stays)."""
    out = dict(env or {})
    rest = os.environ.get("PYTHONPATH", "")
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(old_transformers_dir()), rest) if p)
    return out
