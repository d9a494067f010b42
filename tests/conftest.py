import os
import sys

import pytest

# tests/helpers is imported as `helpers` by the test modules and by spawned ranks.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    # A lane of scripts/run_tests.sh that means one DeepSpeed release says which
    # (DSZ_EXPECT_DEEPSPEED): a path that put another one first would test the wrong release.
    expected = os.environ.get("DSZ_EXPECT_DEEPSPEED")
    if expected:
        import deepspeed

        got = deepspeed.__version__.split("+")[0]
        if got != expected:
            raise pytest.UsageError(f"DSZ_EXPECT_DEEPSPEED={expected}, but DeepSpeed {got} was "
                                    f"imported (from {deepspeed.__file__})")


def pytest_collection_modifyitems(config, items):
    # Modules with the most slow tests first (stable otherwise): under pytest-xdist's loadfile
    # distribution (scripts/run_tests.sh) the longest files start first and the workers end
    # together instead of one running the heaviest file alone at the end.
    slow = {}
    for item in items:
        slow[item.module.__name__] = slow.get(item.module.__name__, 0) + ("slow" in item.keywords)
    items.sort(key=lambda item: -slow[item.module.__name__])

    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on a CUDA machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture()
def clean_settings():
    """ds_z3native's settings all unset for the test (whatever the environment says), and the
    process's own settings back afterwards (the native module's default follows both)."""
    from ds_z3native import settings

    previous = settings.use(settings.Settings())
    yield settings
    settings.use(previous)
