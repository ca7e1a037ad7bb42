"""The suite's own rules (DESIGN §7), checked on its source: one suite for CPU and GPU.

A test that runs a Triton kernel takes the session ``device`` fixture (CUDA when present, else the CPU with the
interpreter) and makes its inputs there. A CPU tensor with a forced ``backend="triton"`` fails on every GPU
machine ("the tensor is on the CPU and the Triton interpreter is off"): 166 of 391 tests did, on an H100.
"""
import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
# Modules rewritten elsewhere: attention's kernel is not in (its tests run no kernel yet).
NOT_YET: set[str] = set()  # every kernel test takes the device fixture now


def _is_triton_mark(node) -> bool:
    """`pytest.mark.triton` (bare or called)."""
    node = node.func if isinstance(node, ast.Call) else node
    return isinstance(node, ast.Attribute) and node.attr == "triton" and "mark" in ast.unparse(node)


def _triton_tests(tree):
    """Test functions that are triton-marked: by decorator, by a module pytestmark, or by a triton-marked param."""
    assigns = {t.id: ast.unparse(n.value) for n in tree.body if isinstance(n, ast.Assign)
               for t in n.targets if isinstance(t, ast.Name)}
    module_mark = "mark.triton" in assigns.get("pytestmark", "")
    # Distributed tests are exempt: their kernels run inside torchrun workers on CPU/gloo, under the interpreter
    # on a CPU-only machine and on the torch reference ops on a GPU machine (minite.parallel.launch.worker_env).
    module_dist = "mark.distributed" in assigns.get("pytestmark", "")
    # module-level parameter lists holding a triton-marked param, e.g. BACKENDS = ["torch", pytest.param(...)]
    lists = {name for name, src in assigns.items() if "marks=pytest.mark.triton" in src}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            decos = node.decorator_list
            marked = module_mark or any(_is_triton_mark(d) for d in decos) or any(
                "marks=pytest.mark.triton" in ast.unparse(d)
                or any(isinstance(x, ast.Name) and x.id in lists for x in ast.walk(d)) for d in decos)
            gpu_only = any("mark.gpu" in ast.unparse(d) for d in decos)
            distributed = module_dist or any("mark.distributed" in ast.unparse(d) for d in decos)
            if marked and not gpu_only and not distributed:
                yield node


def _modules():
    return sorted(p for p in TESTS.rglob("test_*.py") if p.relative_to(TESTS).as_posix() not in NOT_YET)


def test_rule_checker_sees_the_kernel_tests():
    # Guards the test below against passing vacuously (a checker that finds nothing checks nothing).
    names = {f.name for p in _modules() for f in _triton_tests(ast.parse(p.read_text()))}
    assert {"test_triton_matches_reference", "test_kernel_matches_reference", "test_quantize_triton_bit_exact",
            "test_encode_fp32_values", "test_triton_backend_matches_torch_over_3_training_steps"} <= names


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.relative_to(TESTS).as_posix())
def test_every_triton_test_takes_the_device_fixture(path):
    tree = ast.parse(path.read_text())
    missing = [f.name for f in _triton_tests(tree) if "device" not in {a.arg for a in f.args.args}]
    assert not missing, (f"{path.name}: triton tests without the `device` fixture (they would force Triton on "
                         f"CPU tensors on a GPU machine): {missing}")
    # No module-level device choice either: the session fixture is the one place that decides.
    globals_ = [t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)]
    assert "DEVICE" not in globals_, f"{path.name}: use the session `device` fixture, not a DEVICE global"
