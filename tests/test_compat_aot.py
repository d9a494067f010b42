"""The ``deepcompile-aot-partial-constructions`` patch (DeepSpeed 0.19.0): AotAutograd objects
built without DeepCompile's compilers while its constructor patch is in place."""

from __future__ import annotations

import importlib
from typing import Any, Dict, Iterator, List

import pytest
from packaging.version import Version

from ds_z3native.compat import deepcompile_aot as aot
from ds_z3native.compat import deepspeed_version

pytestmark = pytest.mark.deepspeed


def test_the_tolerant_constructor_routes_by_what_is_given() -> None:
    calls: List[Any] = []

    def deepspeeds(self: Any, **kwargs: Any) -> None:
        calls.append(("deepspeed", dict(kwargs)))

    def original(self: Any, **kwargs: Any) -> None:
        calls.append(("original", dict(kwargs)))

    init = aot._tolerant(deepspeeds, original)
    fw, part = object(), object()
    init(None, fw_compiler=fw)  # torchxla's backend at import: fw_compiler only
    init(None, fw_compiler=fw, partition_fn=part)
    init(None, fw_compiler=fw, bw_compiler=part, partition_fn=part)
    assert calls == [("original", {"fw_compiler": fw}),
                     ("deepspeed", {"fw_compiler": fw, "partition_fn": part, "bw_compiler": fw}),
                     ("deepspeed", {"fw_compiler": fw, "bw_compiler": part, "partition_fn": part})]


@pytest.fixture
def deepspeeds_constructor_patch() -> Iterator[Any]:
    """DeepSpeed's own patch_create_aot_dispatcher_function, as its backend calls it; undone
    afterwards (it is process-wide)."""
    from torch._dynamo.backends.common import AotAutograd

    original_init = AotAutograd.__init__

    def install() -> None:
        importlib.import_module(aot.BACKEND_MODULE).patch_create_aot_dispatcher_function(
            1234, False, lambda gm, inputs: gm.graph, lambda gm, inputs: gm.graph, [], [], {}, 0,
            set())

    try:
        yield install, AotAutograd
    finally:
        AotAutograd.__init__ = original_init
        if "__original_init" in vars(AotAutograd):
            delattr(AotAutograd, "__original_init")


only_0_19_0 = pytest.mark.skipif(
    not aot.DEEPCOMPILE_AOT_PARTIAL_CONSTRUCTIONS.targets(deepspeed_version()),
    reason="DeepSpeed 0.19.1 and later wrap only the compilers an AotAutograd is given; CI's "
           "release matrix runs this on 0.19.0")


@only_0_19_0
@pytest.mark.release_matrix
@pytest.mark.parametrize("patched", [False, True], ids=["deepspeed-alone", "patched"])
def test_an_aot_autograd_without_bw_compiler_during_deepcompile(
        deepspeeds_constructor_patch: Any, patched: bool) -> None:
    install, AotAutograd = deepspeeds_constructor_patch
    undo = aot.patch_aot_partial_constructions() if patched else (lambda: None)
    try:
        install()
        fw = object()
        if not patched:  # the weak behaviour: torch's lazily imported backends fail to import
            with pytest.raises(KeyError, match="bw_compiler"):
                AotAutograd(fw_compiler=fw)
            return
        assert AotAutograd(fw_compiler=fw).kwargs == {"fw_compiler": fw}
        kwargs: Dict[str, Any] = AotAutograd(fw_compiler=fw, partition_fn=lambda *a, **k: None).kwargs
        assert kwargs["fw_compiler"] is not fw and kwargs["bw_compiler"] is not fw  # DeepSpeed's
    finally:
        undo()


def test_the_patch_targets_only_the_release_with_the_fault() -> None:
    targets = [v for v in ("0.19.0", "0.19.1", "0.19.2", "0.19.8")
               if aot.DEEPCOMPILE_AOT_PARTIAL_CONSTRUCTIONS.targets(Version(v))]
    assert targets == ["0.19.0"]
