"""The ``deepcompile-canonical-graph-ids`` patch: DeepCompile's graphs reach inductor with graph ids
that do not depend on the run.

Unit level: the rewrite of an FX graph holding DeepCompile's dc calls, and the canonical ids the
live runtime hands out. End to end (tests/test_deepcompile_cpu_warm_start.py): a second CPU DeepCompile run
with the same inductor cache directory is served by inductor's FX-graph cache.
"""

from __future__ import annotations

import ast
import importlib
import logging
import re
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

import pytest
import torch
import torch.fx as fx
from packaging.version import Version

import ds_z3native
from ds_z3native.compat import deepcompile_graph_ids as gid
from ds_z3native.compat.contract import deepspeed_root
from ds_z3native.dc_ops import DC_OPS
from helpers.native_rt import live_runtime, local_group

DS_GRAPH = 139_872_412_000_016  # what id(gm.graph) looks like


def _dc_graph(graph_id: int) -> fx.GraphModule:
    """A graph shaped like DeepCompile's: gather, use, release, reduce, end_backward, an
    activation offload pair, and an int that is not a graph id (the value id)."""
    g = fx.Graph()
    x = g.placeholder("x")
    w = g.placeholder("w")
    dc = torch.ops.dc
    g.call_function(dc.prefetch_params_fused.default, (graph_id, [w], [1]))
    full = g.call_function(dc.allgather_param.default, (w, graph_id, 1))
    full = g.call_function(dc.wait_allgather.default, (full, graph_id, 1))
    y = g.call_function(torch.ops.aten.mul.Tensor, (x, full))
    rel = g.call_function(dc.release_param.default, (full, graph_id, 1, 1))
    red = g.call_function(dc.reduce_grad.default, (y,), {"graph_id": graph_id, "id": 1})
    off = g.call_function(dc.offload_tensor.default, (y, graph_id, graph_id))
    g.call_function(dc.end_backward.default, ([rel, red, off], graph_id))
    g.output(y)
    return fx.GraphModule(torch.nn.Module(), g)


def _graph_ids(gm: fx.GraphModule) -> list:
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "dc":
            name = n.target._schema.name.split("::")[-1]
            pos = gid.GRAPH_ID_ARG[name]
            out.append((name, n.args[pos] if len(n.args) > pos else n.kwargs["graph_id"]))
    return out


def test_graph_id_positions_match_the_native_schemas() -> None:
    ds_z3native.native()  # registers torch.ops.dc
    for name, pos in gid.GRAPH_ID_ARG.items():
        args = getattr(torch.ops.dc, name).default._schema.arguments
        assert str(args[pos].type) == "int", (name, str(args[pos].type))
        assert args[pos].name in ("graph_id", "id"), name
    # Every op of the list taking an int named graph_id is listed at that position.
    for op in DC_OPS:
        named = [i for i, a in enumerate(op.arguments) if a.name == "graph_id"]
        assert named == ([gid.GRAPH_ID_ARG[op.name]] if named else []), op.name


# ---- where DeepSpeed's passes put the graph id --------------------------------------------------

# DeepSpeed's helpers that insert a node calling `fn` on (the node, *extra_args).
_EXTRA_ARGS_HELPERS = {"add_postprocess", "add_args_process"}


def _dc_op_name(node: ast.AST) -> Optional[str]:
    """``name`` for the expression ``torch.ops.dc.name`` or ``torch.ops.dc.name.default``."""
    if isinstance(node, ast.Attribute) and node.attr == "default":
        node = node.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
            and node.value.attr == "dc" and isinstance(node.value.value, ast.Attribute) \
            and node.value.value.attr == "ops":
        return node.attr
    return None


def _built_tuple(function: ast.AST, name: str, before: int) -> Optional[List[ast.expr]]:
    """The elements of the tuple that ``function`` builds in the variable ``name`` before line
    ``before``: ``name = (...)``, then ``name += (...)``, or ``for a in [...]: name += (a, )``
    (one element per item of the literal)."""
    elements: Optional[List[ast.expr]] = None
    looped: Set[ast.AST] = set()
    statements = sorted((n for n in ast.walk(function)
                         if isinstance(n, (ast.Assign, ast.AugAssign, ast.For))
                         and n.lineno < before), key=lambda n: n.lineno)
    for stmt in statements:
        targets = [getattr(t, "id", None) for t in getattr(stmt, "targets", ())]
        if isinstance(stmt, ast.Assign) and targets == [name]:
            elements = list(stmt.value.elts) if isinstance(stmt.value, ast.Tuple) else None
        elif isinstance(stmt, ast.For) and isinstance(stmt.iter, (ast.List, ast.Tuple)) \
                and elements is not None:
            for inner in stmt.body:
                if isinstance(inner, ast.AugAssign) and getattr(inner.target, "id", None) == name:
                    looped.add(inner)
                    elements += list(stmt.iter.elts)
        elif isinstance(stmt, ast.AugAssign) and stmt not in looped and elements is not None \
                and getattr(stmt.target, "id", None) == name:
            if not isinstance(stmt.value, ast.Tuple):
                return None
            elements += list(stmt.value.elts)
    return elements


def _node_arguments(call: ast.Call, function: ast.AST) -> Optional[Tuple[str, List[ast.expr]]]:
    """(dc op, argument expressions) of a call that inserts a dc op node into an FX graph
    (``create_node``, ``call_function``, DeepSpeed's extra-args helpers), or None for any other
    call; the argument list is empty where it cannot be read."""
    method = getattr(call.func, "attr", getattr(call.func, "id", None))
    positional = list(call.args)
    op = next((name for name in map(_dc_op_name, positional) if name is not None), None)
    if op is None or method not in {"create_node", "call_function"} | _EXTRA_ARGS_HELPERS:
        return None
    keywords = {k.arg: k.value for k in call.keywords if k.arg}
    if method in _EXTRA_ARGS_HELPERS:
        extra = keywords.get("extra_args")
        elts = list(extra.elts) if isinstance(extra, (ast.List, ast.Tuple)) else []
        return op, [ast.Name("<the node>")] + elts if elts else []
    after = positional[[_dc_op_name(a) for a in positional].index(op) + 1:]
    given = keywords.get("args", after[0] if after else None)
    if isinstance(given, ast.Tuple):
        return op, list(given.elts)
    if isinstance(given, ast.Name):
        return op, _built_tuple(function, given.id, call.lineno) or []
    return op, []


def _deepspeed_dc_nodes(root: Path) -> Iterator[Tuple[str, str, List[ast.expr]]]:
    """(where, dc op, argument expressions) of each dc op node DeepSpeed's compile passes add."""
    for path in sorted((root / "compile").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for call in ast.walk(function):
                found = _node_arguments(call, function) if isinstance(call, ast.Call) else None
                if found is not None:
                    yield f"{path.relative_to(root.parent)}:{call.lineno}", found[0], found[1]


@pytest.mark.deepspeed
def test_graph_id_positions_are_where_deepspeeds_passes_put_the_graph_id() -> None:
    root = deepspeed_root()
    assert root is not None
    listed = {op.name for op in DC_OPS}
    seen: Dict[str, List[str]] = {}
    unread = []
    for where, op, args in _deepspeed_dc_nodes(root):
        if op not in listed:
            continue  # DeepSpeed's own dc ops (optimizer-state offload)
        if not args:
            unread.append(f"{where}: {op}")
            continue
        positions = [i for i, a in enumerate(args)
                     if isinstance(a, ast.Name) and a.id == "graph_id"]
        seen.setdefault(op, []).append(where)
        expected = [gid.GRAPH_ID_ARG[op]] if op in gid.GRAPH_ID_ARG else []
        assert positions == expected, (
            f"{where}: DeepSpeed passes graph_id to dc::{op} at {positions}, GRAPH_ID_ARG "
            f"says {expected}")
    assert not unread, f"dc op nodes whose arguments the test cannot read: {unread}"
    # Every op with a graph id is one DeepSpeed's passes insert (so each position was checked).
    assert sorted(set(gid.GRAPH_ID_ARG) - set(seen)) == [], seen


def test_the_deepspeed_reader_reads_every_form_of_node_insertion() -> None:
    source = """
def passes(graph, gm, node, graph_id, ds_id, value_id, ids):
    graph.create_node("call_function", torch.ops.dc.end_backward.default, ([node], graph_id, True))
    graph.call_function(torch.ops.dc.prefetch_params_fused.default, args=(graph_id, [node], ids))
    add_postprocess(graph, node, torch.ops.dc.reduce_grad.default, extra_args=[graph_id, ds_id])
    args = (node, )
    for a in [graph_id, ds_id]:
        args += (a, )
    gm.graph.create_node("call_function", torch.ops.dc.offload_parameter.default, args, {})
    register_fallback(torch.ops.dc.wait_reload.default, never_reuse_output=True)
    graph.create_node("call_function", torch.ops.dc.free_tensors.default, unknown, {})
"""
    function = ast.parse(source).body[0]
    read = [_node_arguments(call, function) for call in ast.walk(function)
            if isinstance(call, ast.Call)]
    read = [(op, [getattr(a, "id", "...") for a in args]) for op, args in filter(None, read)]
    assert read == [
        ("end_backward", ["...", "graph_id", "..."]),
        ("prefetch_params_fused", ["graph_id", "...", "ids"]),
        ("reduce_grad", ["<the node>", "graph_id", "ds_id"]),
        ("offload_parameter", ["node", "graph_id", "ds_id"]),
        ("free_tensors", []),
    ]


def test_every_graph_id_of_the_graph_is_replaced_and_nothing_else() -> None:
    ds_z3native.native()
    gm = _dc_graph(DS_GRAPH)
    assert gid.canonicalize_graph_ids(gm.graph, DS_GRAPH, -1) == 7
    assert {v for _, v in _graph_ids(gm)} == {-1}
    off = next(n for n in gm.graph.nodes if n.target is torch.ops.dc.offload_tensor.default)
    assert off.args[2] == DS_GRAPH  # the value id that happened to equal it stays
    gm.recompile()
    assert str(DS_GRAPH) not in gm.code.replace(f"-1, {DS_GRAPH})", "")
    # Another graph's id is left alone.
    other = _dc_graph(DS_GRAPH + 16)
    assert gid.canonicalize_graph_ids(other.graph, DS_GRAPH, -1) == 0


def test_canonical_ids_count_from_minus_one_per_runtime_generation() -> None:
    with live_runtime(group=local_group()) as m:
        m.register_z3_param(1, [2], torch.randn(2), torch.zeros(2), False)
        m.register_graph_z3(DS_GRAPH, [1])
        m.register_graph_z3(DS_GRAPH + 16, [1])
        assert gid.canonical_graph_id(m, DS_GRAPH) == -1
        assert gid.canonical_graph_id(m, DS_GRAPH + 16) == -2
        assert gid.canonical_graph_id(m, DS_GRAPH) == -1  # the backward compiler of graph 1
        m.reset()
        m.register_graph_z3(DS_GRAPH + 32, [1])  # re-planned: a new graph, numbered afresh
        assert gid.canonical_graph_id(m, DS_GRAPH + 32) == -1


def test_the_wrapped_compiler_gives_inductor_canonical_ids() -> None:
    # What DeepSpeed's patch_compiler receives as inductor's compiler, wrapped: the compiler sees
    # the canonical id, and running the compiled graph reaches DeepSpeed's graph through it.
    seen = {}

    def inductor_stand_in(gm: fx.GraphModule, example_inputs) -> object:
        seen["ids"] = {v for _, v in _graph_ids(gm)}
        seen["tag"] = torch.compiler.config.cache_key_tag
        return gm

    with live_runtime(group=local_group()) as m:
        w = torch.randn(2)
        m.register_z3_param(1, [2], w, torch.zeros(2), False)
        m.register_graph_z3(DS_GRAPH, [1])
        compiled = gid._canonical_compiler(inductor_stand_in, DS_GRAPH)(_dc_graph(DS_GRAPH), [])
        assert seen["ids"] == {-1}
        assert m.graph_aliases() == {-1: DS_GRAPH}
        import deepspeed

        # Cached code is specific to the DeepSpeed release (its lowering of the dc ops) and ours,
        # down to the bytes: a rebuild of our library at the same version changes the tag.
        versions = f"deepspeed-{deepspeed.__version__}+ds_z3native-{ds_z3native.__version__}"
        assert seen["tag"] == f"{versions}+{gid.build_fingerprint()}"
        assert re.fullmatch(r"[0-9a-f]{16}", gid.build_fingerprint())
        assert torch.compiler.config.cache_key_tag == ""
        m.start_backward(True)  # the graph ends with end_backward: DeepSpeed's prologue first
        x = torch.randn(2)
        assert torch.allclose(compiled(x, torch.empty(0)), x * w)


def test_inductor_cache_bypasses_are_kept_with_inductors_reason(tmp_path, monkeypatch) -> None:
    # A real inductor compile on the CPU: a post-grad pass inductor cannot hash makes it bypass
    # its FX-graph cache (DeepCompile's graphs on an H200 were bypassed, counted but with no
    # reason on record); a plain compile is cacheable and adds nothing.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    bypasses = gid.CacheBypassLog()
    codecache = logging.getLogger(gid.CODECACHE_LOGGER)
    level, floor = codecache.level, codecache.getEffectiveLevel()
    # What reaches the handlers above inductor's cache logger (torch's own print to stderr):
    # listening must add none of the INFO messages that logger did not emit before.
    emitted: list = []
    seen = logging.Handler(logging.DEBUG)
    seen.emit = emitted.append  # type: ignore[method-assign]

    def opaque_pass(graph: fx.Graph) -> None:
        pass

    logging.getLogger("torch._inductor").addHandler(seen)
    try:
        torch._dynamo.reset()
        with bypasses.watching(-3), torch._inductor.config.patch(post_grad_custom_post_pass=opaque_pass):
            torch.compile(lambda x: (x * 2).sin(), backend="inductor")(torch.randn(8))
        assert bypasses.entries() == [(-3, "Unsupported post grad custom pass")]
        torch._dynamo.reset()
        with bypasses.watching(-4):
            torch.compile(lambda x: (x * 3).cos(), backend="inductor")(torch.randn(8))
    finally:
        logging.getLogger("torch._inductor").removeHandler(seen)
    assert bypasses.entries() == [(-3, "Unsupported post grad custom pass")]
    assert codecache.level == level  # restored
    assert [r.getMessage() for r in emitted
            if r.name == gid.CODECACHE_LOGGER and r.levelno < floor] == []


def test_the_wrapped_compiler_watches_inductor_under_the_canonical_id() -> None:
    def bypassing_inductor(gm: fx.GraphModule, example_inputs) -> object:
        torch._dynamo.utils.counters["inductor"]["fxgraph_cache_bypass"] += 1
        logging.getLogger(gid.CODECACHE_LOGGER).info("Bypassing FX Graph Cache because '%s'",
                                                     "a reason")
        return gm

    before = gid.cache_bypasses()
    with live_runtime(group=local_group()) as m:
        m.register_z3_param(1, [2], torch.randn(2), torch.zeros(2), False)
        m.register_graph_z3(DS_GRAPH, [1])
        gid._canonical_compiler(bypassing_inductor, DS_GRAPH)(_dc_graph(DS_GRAPH), [])
    assert gid.cache_bypasses() == before + [(-1, "a reason")]


def test_the_fingerprint_follows_the_bytes(tmp_path) -> None:
    lib, source = tmp_path / "_C.so", tmp_path / "inductor.py"
    lib.write_bytes(b"\x7fELF build 1")
    source.write_text("lowering = 1\n")
    first = gid.fingerprint([lib, source])
    assert gid.fingerprint([lib, source]) == first
    lib.write_bytes(b"\x7fELF build 2")  # rebuilt at the same version
    assert gid.fingerprint([lib, source]) != first


def test_an_unreadable_build_leaves_the_versions_in_the_tag(monkeypatch, caplog) -> None:
    def unreadable(paths) -> str:
        raise OSError("replaced by a reinstall")

    monkeypatch.setattr(gid, "fingerprint", unreadable)
    gid.build_fingerprint.cache_clear()
    try:
        with caplog.at_level("WARNING", logger=gid.log.name):
            assert gid.build_fingerprint() == "unknown-build"
        assert "replaced by a reinstall" in caplog.text
    finally:
        gid.build_fingerprint.cache_clear()


def test_a_graph_without_dc_calls_of_its_own_is_compiled_as_it_is() -> None:
    # A pass schedule that gathers nothing never registers the graph with the runtime.
    def inductor_stand_in(gm: fx.GraphModule, example_inputs) -> object:
        return gm

    with live_runtime(group=local_group()) as m:
        gm = _dc_graph(DS_GRAPH + 16)  # calls of another graph only
        code = gm.code
        gid._canonical_compiler(inductor_stand_in, DS_GRAPH)(gm, [])
        assert gm.code == code and m.graph_aliases() == {}


def test_a_graph_the_runtime_cannot_alias_keeps_deepspeeds_id(caplog) -> None:  # type: ignore[no-untyped-def]
    # The ids are an optimisation: if the runtime refuses the alias, the graph is compiled with
    # DeepSpeed's id (which the runtime knows), and the warning says what is lost.
    def inductor_stand_in(gm: fx.GraphModule, example_inputs) -> object:
        return gm

    with live_runtime(group=local_group()) as m:
        m.register_z3_param(1, [2], torch.randn(2), torch.zeros(2), False)
        m.register_graph_z3(DS_GRAPH, [1])
        m.register_graph_z3(-1, [1])  # -1 taken by a graph: no alias can be -1
        gm = _dc_graph(DS_GRAPH)
        with caplog.at_level("WARNING", logger=gid.__name__):
            gid._canonical_compiler(inductor_stand_in, DS_GRAPH)(gm, [])
        assert {v for _, v in _graph_ids(gm)} == {DS_GRAPH}
        assert "keeps its id" in caplog.text and "is itself a registered graph_id" in caplog.text


@pytest.mark.deepspeed
@pytest.mark.release_matrix
def test_deepspeeds_aot_wiring_hands_inductor_canonical_ids() -> None:
    # Through DeepSpeed's own call site: patch_create_aot_dispatcher_function makes AotAutograd's
    # constructor build the forward, backward and inference compilers with the module's
    # (patched) patch_compiler (0.19.1+ through _patch_deepcompile_aot_kwargs, 0.19.0 inline).
    from torch._dynamo.backends.common import AotAutograd

    inductor = importlib.import_module(gid.INDUCTOR_MODULE)
    original_init = AotAutograd.__init__
    undo = gid.patch_canonical_graph_ids()
    seen = []

    def inductor_stand_in(gm, example_inputs):
        seen.append({v for _, v in _graph_ids(gm)})
        return gm

    try:
        with live_runtime(group=local_group()) as m:
            m.register_z3_param(1, [2], torch.randn(2), torch.zeros(2), False)
            m.register_graph_z3(DS_GRAPH, [1])
            inductor.patch_create_aot_dispatcher_function(
                DS_GRAPH, False, lambda gm, inputs: gm.graph, lambda gm, inputs: gm.graph, [], [],
                {}, 0, set())
            kwargs = AotAutograd(fw_compiler=inductor_stand_in, bw_compiler=inductor_stand_in,
                                 partition_fn=lambda *a, **k: None).kwargs
            assert kwargs["fw_compiler"] is not inductor_stand_in
            kwargs["fw_compiler"](_dc_graph(DS_GRAPH), [])
            kwargs["bw_compiler"](_dc_graph(DS_GRAPH), [])
            assert m.graph_aliases() == {-1: DS_GRAPH}
    finally:
        AotAutograd.__init__ = original_init  # DeepSpeed's constructor patch is process-wide
        if "__original_init" in vars(AotAutograd):
            delattr(AotAutograd, "__original_init")
        undo()
    assert seen == [{-1}, {-1}]


@pytest.mark.deepspeed
def test_patch_wraps_deepspeeds_patch_compiler_and_undoes() -> None:
    inductor = importlib.import_module(gid.INDUCTOR_MODULE)
    original = inductor.patch_compiler
    undo = gid.patch_canonical_graph_ids()
    try:
        assert inductor.patch_compiler is not original
        calls = []

        def inductor_stand_in(gm, example_inputs):
            calls.append({v for _, v in _graph_ids(gm)})
            return gm

        def dc_compiler(gm, example_inputs):  # DeepSpeed's passes have run: the graph is ready
            return gm.graph

        with live_runtime(group=local_group()) as m:
            m.register_z3_param(1, [2], torch.randn(2), torch.zeros(2), False)
            m.register_graph_z3(DS_GRAPH, [1])
            wrapped = inductor.patch_compiler(inductor_stand_in, dc_compiler, False, DS_GRAPH, {},
                                              bwd=False)
            wrapped(_dc_graph(DS_GRAPH), [torch.randn(2), torch.randn(2)])
        assert calls == [{-1}]
    finally:
        undo()
    assert inductor.patch_compiler is original


# -- deepcompile-cache-checkpoint-rng -------------------------------------------------------------

def _rng_node() -> fx.Node:
    """A call of graphsafe_run_with_rng_state as AOTAutograd writes it into a checkpointed graph."""
    g = fx.Graph()
    x = g.placeholder("x")
    node = g.call_function(gid.checkpoint_rng_op(), (torch.ops.aten.relu.default, x))
    g.output(node)
    return node


@pytest.fixture
def torch_without_the_declaration(monkeypatch: pytest.MonkeyPatch) -> None:
    """This torch as a release that does not declare the op cacheable (torch 2.11)."""
    op = gid.checkpoint_rng_op()
    assert op is not None, "this torch has no graphsafe_run_with_rng_state"
    monkeypatch.setattr(op, "_cacheable", False)
    monkeypatch.setattr(torch._inductor.config, "unsafe_marked_cacheable_functions", {})


def test_checkpoint_rng_graphs_are_refused_by_aotautograds_cache_without_the_patch(
        torch_without_the_declaration: None) -> None:
    from torch._functorch._aot_autograd.autograd_cache import (BypassAOTAutogradCache,
                                                               check_node_safe)

    with pytest.raises(BypassAOTAutogradCache):
        check_node_safe(_rng_node())


def test_the_patch_makes_checkpoint_rng_graphs_cacheable_and_undoes(
        torch_without_the_declaration: None) -> None:
    from torch._functorch._aot_autograd.autograd_cache import check_node_safe

    config = torch._inductor.config
    op = gid.checkpoint_rng_op()
    config.unsafe_marked_cacheable_functions = {"torch.ops.user_op": "user-key"}
    undo = gid.mark_checkpoint_rng_cacheable()
    try:
        assert op.cacheable()
        check_node_safe(_rng_node())  # raises BypassAOTAutogradCache where refused
        table = config.unsafe_marked_cacheable_functions
        key = table[f"{op.__module__}.{op.__name__}"]
        # the value is part of inductor's cache key: an upgrade of either side misses
        assert ds_z3native.__version__ in key and torch.__version__ in key
        assert table["torch.ops.user_op"] == "user-key"
        config.unsafe_marked_cacheable_functions = {**table, "torch.ops.later_op": "later-key"}
    finally:
        undo()
    # the undo takes back its own entry only: one added meanwhile stays
    assert config.unsafe_marked_cacheable_functions == {"torch.ops.user_op": "user-key",
                                                        "torch.ops.later_op": "later-key"}
    assert not op.cacheable()


def test_a_torch_that_declares_the_op_cacheable_is_left_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    op = gid.checkpoint_rng_op()
    monkeypatch.setattr(op, "_cacheable", True)
    config = torch._inductor.config
    before = dict(config.unsafe_marked_cacheable_functions)
    undo = gid.mark_checkpoint_rng_cacheable()
    assert config.unsafe_marked_cacheable_functions == before
    undo()
    assert config.unsafe_marked_cacheable_functions == before


def test_install_marks_the_op_on_a_torch_that_does_not_declare_it(
        torch_without_the_declaration: None) -> None:
    names = [p.name for p in gid.PATCHES]
    assert "deepcompile-cache-checkpoint-rng" in names
    patch = gid.PATCHES[names.index("deepcompile-cache-checkpoint-rng")]
    assert patch.targets(Version("0.19.8"))
    assert patch.wraps == ("torch._inductor.config:unsafe_marked_cacheable_functions",)
    undo = patch.apply()
    try:
        assert gid.checkpoint_rng_op().cacheable()
    finally:
        undo()
    assert not gid.checkpoint_rng_op().cacheable()


def _generator_keys(pickler_table_without_generators: bool = False) -> Tuple[bytes, bytes]:
    """How inductor's cache pickler writes one CPU generator before and after a random draw."""
    from torch._inductor.codecache import FxGraphCachePickler

    generator = torch.Generator().manual_seed(7)
    pickler = FxGraphCachePickler(fx.GraphModule(torch.nn.Module(), fx.Graph()))
    if pickler_table_without_generators:
        pickler.dispatch_table.pop(torch.Generator, None)
    before = pickler.dumps(generator)
    torch.rand(4, generator=generator)
    return before, pickler.dumps(generator)


def test_a_generator_is_keyed_by_its_state_without_the_patch() -> None:
    # What torch 2.11 does with the clone of the CUDA generator a checkpointed graph takes.
    before, after = _generator_keys(pickler_table_without_generators=True)
    assert before != after


def test_the_patch_keys_a_generator_by_its_device_and_undoes() -> None:
    from torch._inductor.codecache import FxGraphCachePickler, compiled_fx_graph_hash

    original = FxGraphCachePickler.__dict__["__init__"]
    undo = gid.patch_generator_cache_key()
    try:
        before, after = _generator_keys()
        assert before == after
        assert b"generator_cache_key" in before and b"cpu" in before  # the device, no state
        # The whole key of a graph that takes a generator, as inductor computes it.
        graph = fx.Graph()
        graph.output(graph.placeholder("fwd_rng_state_0"))
        gm = fx.GraphModule(torch.nn.Module(), graph)
        generator = torch.Generator().manual_seed(7)
        key = compiled_fx_graph_hash(gm, [generator], {}, [])[0]
        torch.rand(4, generator=generator)
        assert compiled_fx_graph_hash(gm, [generator], {}, [])[0] == key
    finally:
        undo()
    assert FxGraphCachePickler.__dict__["__init__"] is original


def test_torchs_own_reducer_for_generators_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    import copyreg

    from torch._inductor.codecache import FxGraphCachePickler

    def torchs(generator: torch.Generator) -> Tuple[type, Tuple[str]]:
        return str, ("torch's own",)

    monkeypatch.setitem(copyreg.dispatch_table, torch.Generator, torchs)
    undo = gid.patch_generator_cache_key()
    try:
        pickler = FxGraphCachePickler(fx.GraphModule(torch.nn.Module(), fx.Graph()))
        assert pickler.dispatch_table[torch.Generator] is torchs
    finally:
        undo()


def test_the_generator_key_patch_is_installed_for_every_release() -> None:
    names = [p.name for p in gid.PATCHES]
    patch = gid.PATCHES[names.index("deepcompile-generator-cache-key")]
    assert patch.targets(Version("0.19.0")) and patch.targets(Version("0.19.8"))
    assert patch.wraps == ("torch._inductor.codecache:FxGraphCachePickler.__init__",)
    assert names.index("deepcompile-generator-cache-key") == \
        names.index("deepcompile-cache-checkpoint-rng") + 1
