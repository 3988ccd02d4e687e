"""klear's contact with TRL's private API (klear.rl.trl_surface.TRL_SURFACE) against the INSTALLED TRL/transformers.

A TRL upgrade that renames a hook, changes its parameters, stops setting an attribute or stops making the call a
patch intercepts fails ``test_contact_holds[<owner.name>]``; an override, private attribute or patch added to klear
without a table entry fails one of the ``test_every_*`` tests (they read klear's source with ``ast``).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from klear.rl.trl_surface import ATTRIBUTE, HOOK, KINDS, PATCH, TRL_SURFACE, TRLContact

SRC = Path(__file__).resolve().parents[1] / "src"
TRL_ROOTS = ("trl", "transformers", "accelerate")
BY_NAME: dict[str, list[TRLContact]] = {}
for _entry in TRL_SURFACE:
    BY_NAME.setdefault(_entry.name, []).append(_entry)

# Attribute stores on objects other than ``self`` in the modules that import TRL/transformers/accelerate that are NOT
# patches of TRL (public settings, klear's own objects). A store of any other name must be a table entry.
NOT_PATCHES = {
    "_klear_time": "klear's own timer state on GPPOTrainer (klear.rl.trainer:_PhaseTimer)",
    "save_total_limit": "public TrainingArguments field, held off during a save (klear.lifecycle)",
    "should_training_stop": "public TrainerControl flag (klear.lifecycle)",
    "max_position_embeddings": "a model config's public field (YaRN override, klear.eval.backends)",
    "pad_token": "a tokenizer's public field",
    "pre_tokenizer": "a `tokenizers` Tokenizer's public field (the bench's new tokenizer, klear.experiment.bench)",
    "decoder": "a `tokenizers` Tokenizer's public field, set on the bench's new tokenizer (klear.experiment.bench)",
    "chat_template": "a tokenizer's public field, set on the bench's new tokenizer (klear.experiment.bench)",
    "generation_config": "a model's public field (klear.models.embedded)",
    "eos_token_id": "a generation config's public field (klear.models.embedded)",
    "pad_token_id": "a generation config's public field (klear.models.embedded)",
    "quantization_config": "a model config's public field (klear.models.embedded)",
    "memory_plan": "klear's RunSetup",
    "model_path": "klear's RunSetup",
    "model_config": "klear's RunSetup",
    "_attn_implementation": "a model config's attention implementation, klear's registered AttentionInterface function "
    "during klear.generation.decode.grouped_decode, restored afterwards",
}


def resolve(path: str):
    """The object at a dotted path (``"trl.GRPOTrainer._prepare_inputs"``): the longest importable module prefix,
    then attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(path)


def param_names(fn) -> tuple[str, ...]:
    names = list(inspect.signature(fn).parameters)
    return tuple(names[1:] if names and names[0] == "self" else names)


# ------------------------------------------------------------------------------------------------ the table itself
def test_table_is_well_formed():
    seen = set()
    for e in TRL_SURFACE:
        assert e.kind in KINDS, e
        assert e.qualname not in seen, f"{e.qualname} listed twice"
        seen.add(e.qualname)
        assert e.owner.split(".")[0] in TRL_ROOTS, e.qualname
        assert e.why and "\n" not in e.why and len(e.why) <= 120, f"{e.qualname}: why must be one short line"
        assert e.used_in and all(re.fullmatch(r"klear(\.\w+)+:\w+(\.\w+)*", u) for u in e.used_in), e.qualname
        assert e.params is None or all(isinstance(p, str) for p in e.params), e.qualname
        if e.kind == HOOK:
            assert e.params is not None and e.evidence, f"{e.qualname}: a hook needs its parameters and its caller"
    assert {e.kind for e in TRL_SURFACE} == set(KINDS)


def test_module_is_data_only():
    code = (
        "import sys\n"
        "for m in ('torch', 'trl', 'transformers', 'accelerate', 'vllm'): sys.modules[m] = None\n"
        "import klear.rl.trl_surface as s; assert s.TRL_SURFACE\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr.strip().splitlines()[-1]


def _klear_qualnames(module: str) -> set[str]:
    path = SRC / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = SRC / module.replace(".", "/") / "__init__.py"
    found: set[str] = set()

    def walk(body, prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                found.add(prefix + node.name)
                if isinstance(node, ast.ClassDef):
                    walk(node.body, prefix + node.name + ".")

    walk(ast.parse(path.read_text()).body, "")
    return found


def test_used_in_names_klear_code_that_exists():
    missing = []
    for e in TRL_SURFACE:
        for where in e.used_in:
            module, qualname = where.split(":")
            if qualname not in _klear_qualnames(module):
                missing.append(f"{e.qualname}: {where}")
    assert not missing, "used_in names no klear function:\n" + "\n".join(missing)


# ------------------------------------------------------------------------------------------------ against TRL
@pytest.mark.parametrize("entry", TRL_SURFACE, ids=lambda e: e.qualname)
def test_contact_holds(entry: TRLContact):
    where = ", ".join(entry.used_in)
    owner = resolve(entry.owner)
    if inspect.ismodule(owner) and not hasattr(owner, entry.name):
        # a module global imported only when an optional dependency is there (vllm's LLM): TRL must still import it
        tree = ast.parse(inspect.getsource(owner))
        imported = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        assert entry.name in imported, f"{entry.owner} no longer has {entry.name} (klear: {where})"
    elif entry.params is not None or entry.kind != ATTRIBUTE or not entry.evidence:
        assert hasattr(owner, entry.name), f"{entry.owner} no longer has {entry.name} (klear: {where})"
    if entry.params is not None:
        got = param_names(getattr(owner, entry.name))
        assert got == entry.params, (
            f"{entry.qualname} parameters changed: installed {got}, klear expects {entry.params} (klear: {where})"
        )
    for fn, text in entry.evidence:
        source = inspect.getsource(resolve(fn))
        assert text in source, f"{entry.qualname}: {fn} no longer contains {text!r} (klear: {where}: {entry.why})"


# ------------------------------------------------------------------------------------------------ completeness
def _klear_modules() -> Iterator[tuple[str, ast.Module, set[str]]]:
    """(module name, tree, the top-level packages it imports) of every klear module."""
    for path in sorted(SRC.rglob("*.py")):
        module = ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text(), str(path))
        roots = set()
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                roots |= {a.name.split(".")[0] for a in n.names}
            elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
                roots.add(n.module.split(".")[0])
        yield module, tree, roots


def _import_map(tree: ast.Module) -> dict[str, str]:
    names = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module and not n.level:
            names |= {a.asname or a.name: f"{n.module}.{a.name}" for a in n.names}
        elif isinstance(n, ast.Import):
            names |= {a.asname or a.name.split(".")[0]: a.name if a.asname else a.name.split(".")[0] for a in n.names}
    return names


def _klear_classes() -> dict[str, tuple[list[str], ast.ClassDef]]:
    """``"klear.mod.Class"`` -> (its bases as dotted paths, its node), for every class of klear."""
    classes = {}
    for module, tree, _ in _klear_modules():
        imports = _import_map(tree)
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                bases = []
                for b in node.bases:
                    text = ast.unparse(b)
                    head, _, rest = text.partition(".")
                    full = imports.get(head, f"{module}.{head}")
                    bases.append(full + (f".{rest}" if rest else ""))
                classes[f"{module}.{node.name}"] = (bases, node)
    return classes


def _trl_bases(classes) -> dict[str, list[type]]:
    """Each klear class with a TRL/transformers class among its bases (its own, a klear base's, or, for a mixin,
    the classes it is mixed into) -> those TRL/transformers classes."""

    def own(name: str) -> list[str]:
        bases, _ = classes[name]
        out = []
        for b in bases:
            if b in classes:
                out += own(b)
            elif b.split(".")[0] in TRL_ROOTS:
                out.append(b)
        return out

    found = {name: own(name) for name in classes}
    mixins = {name for name, trl in found.items() if not trl}
    for name, (bases, _) in classes.items():  # a mixin: the TRL bases of the classes it is mixed into
        for b in bases:
            if b in mixins:
                found[b] += [t for t in found[name] if t not in found[b]]
    return {name: [resolve(b) for b in trl] for name, trl in found.items() if trl}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_every_override_of_a_private_trl_method_is_listed():
    classes = _klear_classes()
    problems = []
    for name, trl_bases in _trl_bases(classes).items():
        _, node = classes[name]
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and _private(item.name):
                overridden = [b for b in trl_bases if hasattr(b, item.name)]
                if not overridden:
                    continue
                entries = [e for e in BY_NAME.get(item.name, []) if e.kind == HOOK]
                owners = [e for e in entries if all(issubclass(b, resolve(e.owner)) for b in overridden)]
                if not owners:
                    problems.append(f"{name}.{item.name} overrides {overridden[0].__name__}.{item.name}: no hook entry")
                    continue
                entry = owners[0]
                for b in overridden:  # the method klear's override replaces (a TRL class may redefine it)
                    got = param_names(getattr(b, item.name))
                    if got != entry.params:
                        problems.append(f"{b.__name__}.{item.name} takes {got}, the table says {entry.params}")
                a = item.args
                ours = tuple(x.arg for x in a.posonlyargs + a.args + a.kwonlyargs)[1:]
                if not (a.vararg and a.kwarg and not ours) and ours != entry.params:
                    problems.append(f"{name}.{item.name} takes {ours}, the table says {entry.params}")
            elif isinstance(item, (ast.Assign, ast.AnnAssign)):  # class attributes: _tag_names, _name
                targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                for t in targets:
                    if isinstance(t, ast.Name) and _private(t.id) and any(hasattr(b, t.id) for b in trl_bases):
                        if not any(e.kind == ATTRIBUTE for e in BY_NAME.get(t.id, [])):
                            problems.append(f"{name}.{t.id} sets a private TRL class attribute: no entry")
    assert not problems, "klear.rl.trl_surface.TRL_SURFACE is missing or wrong:\n" + "\n".join(problems)


def _trl_private_names() -> set[str]:
    """Private names used as ``self._x`` in TRL's trainers (their whole MRO, transformers' Trainer included) and in
    TRL's vLLM generation, plus their private class attributes."""
    import trl
    from trl.generation.vllm_generation import VLLMGeneration

    names: set[str] = set()
    for top in (trl.GRPOTrainer, trl.SFTTrainer, VLLMGeneration):
        for cls in top.__mro__:
            if cls.__module__.split(".")[0] not in TRL_ROOTS:
                continue
            names |= {n for n in vars(cls) if _private(n)}
            names |= set(re.findall(r"self\.(_[A-Za-z0-9]\w*)", inspect.getsource(cls)))
    return {n for n in names if _private(n)}


def test_every_private_trl_attribute_klear_touches_is_listed():
    trl_names = _trl_private_names()
    problems = []
    for module, tree, roots in _klear_modules():
        if not roots & set(TRL_ROOTS):
            continue
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and n.attr in trl_names and n.attr not in BY_NAME:
                problems.append(f"{module}:{n.lineno} {ast.unparse(n)}")
    assert not problems, "private TRL names klear uses without an entry in TRL_SURFACE:\n" + "\n".join(problems)


def test_every_runtime_patch_is_listed():
    problems, allowed_seen = [], set()
    for module, tree, roots in _klear_modules():
        if not roots & set(TRL_ROOTS):
            continue
        for n in ast.walk(tree):
            name = None
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, (ast.Store, ast.Del)):
                # self/cls: the class's own state; job: klear.runs.Job, what a stage carries through run_job
                if not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls", "job")):
                    name = n.attr
            elif isinstance(n, ast.Call) and ast.unparse(n.func) in ("setattr", "delattr") and len(n.args) >= 2:
                if isinstance(n.args[1], ast.Constant):
                    name = n.args[1].value
            if name is None:
                continue
            if name in NOT_PATCHES:
                allowed_seen.add(name)
            elif not any(e.kind in (PATCH, ATTRIBUTE) for e in BY_NAME.get(name, [])):
                problems.append(f"{module}:{n.lineno} {ast.unparse(n)}")
    assert not problems, "attribute stores on other objects, neither in TRL_SURFACE nor NOT_PATCHES:\n" + "\n".join(
        problems
    )
    assert allowed_seen == set(NOT_PATCHES), f"NOT_PATCHES entries no longer used: {set(NOT_PATCHES) - allowed_seen}"
