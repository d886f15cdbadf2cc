"""The package's layering, checked on its source with ``ast``: every import (top-level,
lazy inside functions, or for type checking) points to a lower layer, and no group of
modules imports itself in a circle. A new package must be placed in LAYERS."""
from __future__ import annotations

import pytest
from package_graph import DOC, MODULES, doc_picture, imports, picture  # tools/, on pytest's pythonpath

# lower number = lower layer; a module may import its own unit and units of a lower number
# (units with the same number are independent of each other)
LAYERS: dict[str, float] = {
    "treadle": -1,  # the package root: __version__ and lazy re-exports, imports nothing itself
    "treadle.config": 0,
    "treadle.sampling_params": 1,
    "treadle.envs": 1,  # the registry of environment variables
    "treadle.core": 2,  # scheduler and its policy collaborators, KV block manager, step data: torch-free
    "treadle.kernels": 2,  # C kernels and their ctypes faces
    "treadle.vocab": 2,
    "treadle.sentencepiece_model": 2,  # reads tokenizer.model for the tokenizer
    "treadle.layers": 3,  # linear, norms, RoPE, attention backends, fused decoder layer
    "treadle.tokenizer": 3,
    "treadle.distributed": 3.5,  # process groups, collectives, tensor-parallel sharding rules
    "treadle.kv_transfer": 3.6,  # the KV connector: scheduler side (torch-free) and worker side
    "treadle.quantization": 4,  # linear methods
    "treadle.structured": 4,  # grammar compiler (on the tokenizer) and the runner's token bitmasks
    "treadle.models": 4,  # model files and their layouts
    "treadle.loaders": 5,
    "treadle.predict": 5,  # the output-length predictor (numpy; torch only to train it)
    "treadle.sample": 5.4,  # the sampler and the rejection sampler (worker and spec_decode stand on it)
    "treadle.spec_decode": 5.6,  # proposers, used by the runner
    "treadle.worker": 6,  # model runner, fused-layer planner, CUDA graphs
    "treadle.calibrate": 6,  # treadle quantize: calibration on transformers, compressed-tensors writer
    "treadle.executor": 7,  # drives the workers (in process or in worker processes)
    "treadle.engine": 8,
    "treadle.asgi": 9,  # ASGI plumbing the server and the router share (torch-free)
    "treadle.server": 10,
    "treadle.bench": 10,
    "treadle.router": 10,  # the HTTP front for many instances: speaks HTTP only (torch-free, no engine)
    "treadle.entrypoints": 11,
}
# packages, or single modules, that import neither torch nor numpy
TORCH_FREE = ("treadle.core", "treadle.config", "treadle.sampling_params", "treadle.kv_transfer.scheduler",
              "treadle.kv_transfer.release", "treadle.router")


def unit(module: str) -> str:
    name = module
    while name not in LAYERS or (name == "treadle" and module != "treadle"):
        if "." not in name:
            raise AssertionError(f"{module} belongs to no layer: add its package to LAYERS in {__file__}")
        name = name.rpartition(".")[0]
    return name


def test_every_import_points_down() -> None:
    upward = []
    for module in sorted(MODULES):
        for target in sorted(imports(module)):
            if not target.startswith("treadle"):
                continue
            src, dst = unit(module), unit(target)
            if src != dst and LAYERS[dst] >= LAYERS[src]:
                upward.append(f"{module} -> {target} ({src} {LAYERS[src]} -> {dst} {LAYERS[dst]})")
    assert not upward, "imports that do not point to a lower layer:\n" + "\n".join(upward)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Groups of more than one module that reach each other (Tarjan's strongly connected
    components, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def enter(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)

    for start in graph:
        if start in index:
            continue
        enter(start)
        work = [(start, iter(sorted(graph[start])))]
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    enter(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while not comp or comp[-1] != v:
                    comp.append(stack.pop())
                    on_stack.discard(comp[-1])
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_cycles() -> None:
    graph = {m: {t for t in imports(m) if t in MODULES} for m in MODULES}
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("package", TORCH_FREE)
def test_torch_free_layers(package: str) -> None:
    heavy = {m: sorted(imports(m) & {"torch", "numpy"}) for m in MODULES
             if m == package or m.startswith(package + ".")}
    assert heavy and not any(heavy.values()), heavy


def test_the_docs_show_the_package_graph_the_imports_draw() -> None:
    assert doc_picture(DOC.read_text()) == picture(), "rerun: python tools/package_graph.py --write"
