"""A virtualenv that sees this environment's packages (one helper for the test fixtures and
``scripts/run_tests.sh``'s newest-torch venv).

``python -m venv --system-site-packages`` shows the base interpreter's packages only: run from a
virtualenv (or a conda env), this environment's torch, DeepSpeed and the rest live in its own
site-packages, which the new venv does not see. :func:`see_outer_site` writes a ``.pth`` into
the venv's site-packages adding those directories as site directories (their own ``.pth``
files, editable installs', run too), after the venv's own packages.

Command line: ``python tests/helpers/venv_site.py <venv python>``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Iterable, List, Tuple

__all__ = ["own_site_dirs", "venv_site", "see_outer_site"]


def own_site_dirs() -> List[str]:
    """The site-packages of the environment this interpreter runs in (a virtualenv's own, a
    conda env's, or the system's), where pip put torch, DeepSpeed and ds_z3native."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys(p for p in (paths["purelib"], paths["platlib"]) if os.path.isdir(p)))


def venv_site(python: str) -> Tuple[str, List[str]]:
    """The venv's own site-packages and its ``sys.path``."""
    r = subprocess.run([python, "-c", "import json, site, sys; "
                        "print(json.dumps([site.getsitepackages()[0], sys.path]))"],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"{python} could not list its site-packages:\n{r.stderr[-2000:]}")
    site_dir, path = json.loads(r.stdout)
    return site_dir, path


def see_outer_site(python: str, name: str = "00-outer-environment.pth",
                   path_entries: Iterable[str] = ()) -> List[str]:
    """Writes ``name`` into the venv of ``python``: this environment's site directories that the
    venv does not see yet, then ``path_entries`` (plain ``sys.path`` lines). Returns the site
    directories it added (none when this interpreter is the venv's base)."""
    site_dir, seen = venv_site(python)
    if Path(site_dir, name).exists():  # an earlier run's: what the venv sees without it
        Path(site_dir, name).unlink()
        site_dir, seen = venv_site(python)
    missing = [d for d in own_site_dirs() if d not in seen]
    Path(site_dir, name).write_text(
        "".join(f"import site; site.addsitedir({d!r})\n" for d in missing)
        + "".join(f"{entry}\n" for entry in path_entries))
    return missing


if __name__ == "__main__":
    added = see_outer_site(sys.argv[1])
    if added:
        print(f"   (this environment's packages added to {sys.argv[1]}'s venv: {', '.join(added)})")
