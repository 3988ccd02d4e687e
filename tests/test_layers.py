"""klear's layers read top-down: a module imports only from layers below its own (function-level imports
included), and the lowest layers import without torch."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "klear"

# lowest first; a unit is a top-level module or a subpackage of klear
LAYERS = [
    {"stats", "recipe", "utils", "config", "precision", "memory", "lifecycle"},  # plumbing, statistics, torch-free
    {"models", "rewards"},  # the embedded model; the paper's rewards and correctness
    {"data"},  # datasets, filters, selection
    {"generation"},  # vLLM engine support, shared-prompt prefill
    {"eval"},  # benchmarks, backends, the held-out evaluator
    {"callbacks", "runs"},  # what every training stage shares
    {"rl", "sft"},  # the stages
    {"experiment", "integrations"},  # grids of runs; adapters into other frameworks
    {"cli"},
]
LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}
TORCH_FREE = sorted(LAYERS[0] | {"models", "generation"})  # data and above need torch (rewards)


def _unit(module: str) -> str:
    return module.split(".")[1]


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, node.module)]
            if node.module == "klear":  # from klear import stats
                found += [(node.lineno, f"klear.{a.name}") for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}:{node.lineno}: use absolute imports (the layer test reads them)")
    return [(line, name) for line, name in found if name.startswith("klear.")]


def _module_files():
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts != ("__init__",):
            yield path, parts[0]


def test_every_unit_has_a_layer():
    units = {unit for _, unit in _module_files()}
    assert not units - set(LAYER), f"place these in LAYERS: {sorted(units - set(LAYER))}"
    assert not set(LAYER) - units, f"no longer in src/klear: {sorted(set(LAYER) - units)}"


def test_no_import_runs_back_up_the_layers():
    upward = []
    for path, unit in _module_files():
        for line, name in _imports(path):
            target = _unit(name)
            if target != unit and LAYER[target] >= LAYER[unit]:
                upward.append(f"{path.relative_to(SRC.parent)}:{line} ({unit}, layer {LAYER[unit]}) imports {name}")
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("unit", TORCH_FREE)
def test_low_layers_import_without_torch(unit):
    modules = [
        "klear." + ".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        for p, u in _module_files()
        if u == unit
    ]
    code = "import sys; sys.modules['torch'] = None\n" + "".join(f"import {m}\n" for m in modules)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr.strip().splitlines()[-1]
