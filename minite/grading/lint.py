"""The answer check: each answer is code inside its own block (the solution cell's structure around it unchanged)
that does not reach outside itself (AST rules over the student's answers)."""
from __future__ import annotations

import ast
import copy
import re

from .notebook import regions
from .rewrite import _dotted

_ALLOWED_IMPORTS = {"math", "torch", "triton", "numpy", "functools", "itertools", "operator", "collections",
                    "typing", "dataclasses", "cmath", "statistics", "fractions", "decimal", "struct"}
# Ways out of the answer: the notebook's namespace, code from strings or files, the interpreter's machinery, and
# the getattr-likes that reach attributes by a name built at run time (operator.attrgetter("__glob" "als__")).
_DENIED_NAMES = {"globals", "locals", "vars", "eval", "exec", "compile", "open", "breakpoint", "input",
                 "getattr", "setattr", "delattr", "get_ipython", "exit", "quit", "help", "memoryview",
                 "_minite", "sys", "os", "importlib", "subprocess", "builtins", "inspect", "gc", "ctypes",
                 "signal", "shutil", "pathlib", "pickle", "socket", "threading", "multiprocessing", "minite",
                 "type", "super", "object", "attrgetter", "methodcaller", "get_type_hints"}
_DENIED_ATTRS = {"sys", "os", "modules", "builtins", "importlib", "subprocess", "system", "popen", "f_globals",
                 "f_locals", "f_back", "gi_frame", "cr_frame", "tb_frame", "func_globals", "reload",
                 "import_module", "path_hooks", "meta_path", "attrgetter", "methodcaller", "get_type_hints",
                 "ctypes", "ctypeslib", "cpp_extension", "library", "hub", "f2py"}
# Attributes that read or write files (torch.load runs pickled code): denied except on Triton's `tl`.
_FILE_ATTRS = {"load", "loads", "save", "savez", "savez_compressed", "tofile", "fromfile", "memmap", "savetxt",
               "loadtxt", "genfromtxt", "fromregex", "write_text", "write_bytes", "read_text", "read_bytes"}
_TRITON_LANGUAGE = {"tl", "triton.language"}
_DUNDER = re.compile(r"__\w+__")


def _stmt_lists(node, path=()):
    """Yield (path, list of statements) for every statement list under `node`."""
    for fname, value in ast.iter_fields(node):
        if isinstance(value, list) and value and all(isinstance(v, ast.AST) for v in value):
            if all(isinstance(v, ast.stmt) for v in value):
                yield path + (fname,), value
            for j, child in enumerate(value):
                yield from _stmt_lists(child, path + (fname, j))
        elif isinstance(value, ast.AST):
            yield from _stmt_lists(value, path + (fname,))


def _resolve(tree, path):
    node = tree
    for p in path:
        node = node[p] if isinstance(p, int) else getattr(node, p, None)
        if node is None:
            return None
    return node


def _in(lo, hi, node) -> bool:
    return lo <= node.lineno <= hi


def _region_stmts(tree, lo, hi):
    """(path, statements) of the deepest statement list holding a statement that starts on lines lo..hi and
    whose owner (function, loop, module...) starts before them."""
    best = None
    for path, stmts in _stmt_lists(tree):
        owner = _resolve(tree, path[:-1])
        if getattr(owner, "lineno", 0) >= lo:
            continue
        if any(_in(lo, hi, s) for s in stmts) and (best is None or len(path) > len(best[0])):
            best = (path, stmts)
    return best


def _skeleton(tree, cuts) -> str:
    """ast.dump of `tree` without the statements in `cuts` (path, lo, hi)."""
    tree = copy.deepcopy(tree)
    lists = [(_resolve(tree, path), lo, hi) for path, lo, hi in cuts]
    for stmts, lo, hi in lists:
        stmts[:] = [s for s in stmts if not _in(lo, hi, s)] or [ast.Pass()]
    return ast.dump(tree, include_attributes=False)


def _bound_names(nodes) -> set[str]:
    out = set()
    for n in nodes:
        for sub in ast.walk(n):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, (ast.Store, ast.Del)):
                out.add(sub.id)
            elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(sub.name)
            elif isinstance(sub, ast.arg):
                out.add(sub.arg)
            elif isinstance(sub, (ast.Import, ast.ImportFrom)):
                out.update((a.asname or a.name).split(".")[0] for a in sub.names)
    return out


def _module_names(nodes) -> set[str]:
    """Names bound at module level by `nodes` (not inside the functions, lambdas or classes they define)."""
    out, todo = set(), list(nodes)
    while todo:
        n = todo.pop()
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
            todo += n.decorator_list
            continue
        if isinstance(n, ast.Lambda):
            continue
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            out.add(n.id)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in n.names)
        todo += list(ast.iter_child_nodes(n))
    return out


def _enclosing_function(tree, path):
    node, fn = tree, None
    for p in path:
        node = node[p] if isinstance(p, int) else getattr(node, p)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            fn = node
    return fn


def _import_why(n) -> str | None:
    """Why an import statement is not allowed in an answer, or None."""
    mods = [n.module or ""] if isinstance(n, ast.ImportFrom) else [a.name for a in n.names]
    bad = [m for m in mods if m.split(".")[0] not in _ALLOWED_IMPORTS]
    if bad or getattr(n, "level", 0):
        return f"line {n.lineno}: an answer may import only {sorted(_ALLOWED_IMPORTS)}, not {bad}"
    parts = [p for m in mods for p in m.split(".")]
    if isinstance(n, ast.ImportFrom):
        parts += [a.name for a in n.names]
    for p in parts:
        if p.startswith("_") or p in _DENIED_NAMES | _DENIED_ATTRS | _FILE_ATTRS:
            return f"line {n.lineno}: an answer may not import {p!r}"
    return None


def _node_why(n, local: set[str]) -> str | None:
    """Why one AST node of an answer reaches outside the answer, or None."""
    if isinstance(n, (ast.Global, ast.Nonlocal)):
        return f"line {n.lineno}: '{type(n).__name__.lower()}' is not allowed in an answer"
    if isinstance(n, (ast.Import, ast.ImportFrom)):
        return _import_why(n)
    if isinstance(n, ast.Name) and (n.id in _DENIED_NAMES or n.id.startswith("__")):
        return f"line {n.lineno}: an answer may not use {n.id!r}"
    if isinstance(n, ast.Constant) and isinstance(n.value, str) and _DUNDER.search(n.value):
        return f"line {n.lineno}: an answer may not use the string {_DUNDER.search(n.value).group()!r}"
    if isinstance(n, ast.Attribute):
        if n.attr.startswith("_") or n.attr in _DENIED_ATTRS:
            return f"line {n.lineno}: an answer may not use the attribute '.{n.attr}'"
        if n.attr in _FILE_ATTRS and _dotted(n.value) not in _TRITON_LANGUAGE:
            return f"line {n.lineno}: an answer may not use the attribute '.{n.attr}' (it reads or writes files)"
        if isinstance(n.ctx, (ast.Store, ast.Del)):
            return (f"line {n.lineno}: assigning to {ast.unparse(n)!r} changes an object your answer did not create "
                    "(an answer sets no attributes)")
    if isinstance(n, ast.Subscript) and isinstance(n.ctx, (ast.Store, ast.Del)):
        root = n.value
        while isinstance(root, (ast.Attribute, ast.Subscript)):
            root = root.value
        if not (isinstance(root, ast.Name) and root.id in local):
            return f"line {n.lineno}: assigning to {ast.unparse(n)!r} changes an object your answer did not create"
    return None


def _lint(stmts, local: set[str], notebook_names: set[str], top_level: bool) -> str | None:
    """Why an answer reaches outside itself, or None."""
    for st in stmts:
        for n in ast.walk(st):
            why = _node_why(n, local)
            if why:
                return why
        if top_level:
            clash = _module_names([st]) & notebook_names
            if clash:
                return f"line {st.lineno}: an answer may not rebind {sorted(clash)}, which the notebook defines"
    return None


def _verify_answers(solution_src: str, spliced: str, notebook_names: set[str], where: str) -> None:
    """Raise ValueError unless every answer in `spliced` is code inside its own block (the solution cell's
    structure around it unchanged) that does not reach outside itself."""
    try:
        sol_tree = ast.parse(solution_src)
    except SyntaxError as err:
        raise ValueError(f"{where}: the solution cell does not parse: {err}") from None
    try:
        tree = ast.parse(spliced)
    except SyntaxError as err:
        raise ValueError(f"{where}: your answer does not parse: line {err.lineno}: {err.msg}") from None
    sol_cuts, cuts = [], []
    for (sb, se), (b, e) in zip(regions(solution_src, where), regions(spliced, where)):
        found = _region_stmts(sol_tree, sb + 2, se)
        if found is None:
            raise ValueError(f"{where}: a solution region holds no statement")
        sol_cuts.append((found[0], sb + 2, se))
        got = _region_stmts(tree, b + 2, e)
        path = got[0] if got else ()
        mine = [s for s in got[1] if _in(b + 2, e, s)] if got else []
        inside = {id(n) for s in mine for n in ast.walk(s)}
        stray = [s for s in ast.walk(tree) if isinstance(s, ast.stmt) and _in(b + 2, e, s) and id(s) not in inside]
        shape = [type(_resolve(tree, path[:j])).__name__ for j in range(len(path)) if isinstance(path[j], str)]
        sol_shape = [type(_resolve(sol_tree, found[0][:j])).__name__ for j in range(len(found[0]))
                     if isinstance(found[0][j], str)]
        if not mine or stray or shape != sol_shape:
            raise ValueError(f"{where}: your answer (lines {b + 2}-{e}) must be code inside its own block, at the "
                             "indentation of its markers; it leaves that block (a dedent?) or holds no statement")
        cuts.append((path, b + 2, e))
        fn = _enclosing_function(tree, path)
        local = _bound_names(mine) | (_bound_names([fn]) if fn is not None else set())
        why = _lint(mine, local, notebook_names, top_level=fn is None)
        if why:
            raise ValueError(f"{where}: {why}")
    if _skeleton(tree, cuts) != _skeleton(sol_tree, sol_cuts):
        raise ValueError(f"{where}: the code around your answer changed shape (did your answer leave its block?)")
