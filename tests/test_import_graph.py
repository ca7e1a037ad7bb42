"""The import graph of minite/ (issue 35, DESIGN §6): no circle, and no import from a lower layer to a higher one.

The graph is read from the source (every ``import`` / ``from ... import`` anywhere in a file, a function's lazy
import included), not from what one run happens to load. Importing ``a.b.c`` first imports its packages ``a`` and
``a.b``, so an import of one's own ancestor package (``from . import __doc__``) adds no dependency: not an edge.
The layers, lowest first: foundations (backend, errors, checks, checkpoint files, data), number formats, kernels
(and the ``ops`` facade, ``testing``), layers, the ``nn`` facade, models, parallelism, and the applications on top
(training, sampling, fine-tuning, the grader). A new module must be given its layer here.
"""
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "minite"
LAYERS = [  # (module or package, layer): the longest matching prefix decides
    ("minite._triton", 0), ("minite._validate", 0), ("minite.errors", 0), ("minite.backend", 0),
    ("minite.choices", 0),
    ("minite.compile", 0), ("minite.bytecount", 0), ("minite.checkpoint", 0), ("minite.data", 0),
    ("minite.resources", 0),
    ("minite.formats", 1),
    ("minite.kernels", 2), ("minite.ops", 2), ("minite.testing", 2),
    ("minite.layers", 3),
    ("minite.nn", 4), ("minite.lora", 4),
    ("minite.models", 5),
    ("minite.parallel", 6),
    ("minite", 7),  # the package root and the applications: train, sample, config, finetune, hf, recompute, ...
]


def _modules() -> dict:
    mods = {}
    for f in sorted(ROOT.rglob("*.py")):
        parts = list(f.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


def _imports(name: str, path: Path, mods: dict) -> set:
    """The minite modules `name` imports (a package's name when the imported name is not a module of it)."""
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            out.update(f"{module}.{a.name}" if f"{module}.{a.name}" in mods else module for a in node.names)
    ancestors = {name.rsplit(".", i)[0] for i in range(1, name.count(".") + 1)}
    return {m for m in out if m in mods and m != name and m not in ancestors}


def _graph() -> dict:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def _layer(name: str) -> int:
    return max((p for p in LAYERS if name == p[0] or name.startswith(p[0] + ".")), key=lambda p: len(p[0]))[1]


def _circles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_reader_sees_the_imports():
    # Guards the tests below against passing vacuously: known edges, lazy and relative ones included.
    g = _graph()
    assert "minite.layers.moe" in g["minite.models.gpt"] and "minite.parallel.dims" in g["minite.train"]
    assert "minite.parallel.sequence" in g["minite.parallel.runtime"]  # a lazy import inside a method
    assert "minite.grading.grader" in g["minite.grading.cli"]  # a relative import
    assert "minite.grading" not in g["minite.grading.cli"]  # its own package: no edge
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_circle_in_the_import_graph():
    assert _circles(_graph()) == []


def test_no_import_runs_back_up_the_layers():
    # Layers and models never import parallel/ (parallelism is applied from outside), kernels never import layers...
    g = _graph()
    back = sorted(f"{a} -> {b}" for a, deps in g.items() for b in deps if _layer(b) > _layer(a))
    assert back == []


def test_the_moe_layer_loads_no_parallel_module():
    # issue 35: layers/moe.py imported minite.parallel.expert and minite.parallel.comm (lazily, inside forward: the
    # graph test above is the one that saw it). Imported, and through a training step and the routing stats.
    code = ("import sys, torch, minite.layers.moe as M, minite.models.gpt as G\n"
            "m = G.GPT(G.GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16, backend='torch', "
            "moe_num_experts=4, moe_balance='bias'))\n"
            "x = torch.randint(0, 32, (2, 8)); m(x, x)[1].backward(); M.step_expert_bias(m); m.moe_stats()\n"
            "print(sorted(n for n in sys.modules if n.startswith('minite.parallel')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert eval(out) == []
