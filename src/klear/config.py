"""YAML recipes with ``key=value`` overrides.

A recipe is a YAML mapping. ``load_config(path, overrides)`` reads it and applies overrides of the
form ``a.b.c=value`` (the value is parsed as YAML, so ``3``, ``1e-6``, ``true``, ``null`` and
``[1, 2]`` get their natural types). Recipes and overrides are read with YAML 1.2 booleans: only
``true`` / ``false`` are booleans, so ``save_strategy=no`` or ``on`` stay the strings TRL expects
(PyYAML's YAML 1.1 default turns ``yes/no/on/off/y/n`` into booleans). Unknown keys are caught by the code that
consumes each section, which names the file and the key.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


class _Yaml12BoolLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` whose booleans are YAML 1.2's (``true``/``false`` only)."""


def _construct_mapping_once(loader, node, deep=False):
    """``SafeLoader.construct_mapping`` refusing a key given twice in one mapping (PyYAML keeps the last silently);
    keys brought in by ``<<`` merges may be overridden, as YAML intends."""
    seen = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key, (str, int, float, bool)) or key is None:
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice in this mapping", key_node.start_mark
                )
            seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


_Yaml12BoolLoader.construct_mapping = _construct_mapping_once  # type: ignore[method-assign]
_Yaml12BoolLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12BoolLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def load_yaml(text: str) -> Any:
    """Parse YAML text the way every recipe and override is read (YAML 1.2 booleans; a key given twice in one
    mapping is an error, ``yaml.YAMLError`` with its line)."""
    return yaml.load(text, Loader=_Yaml12BoolLoader)  # a SafeLoader subclass


def yaml_error_line(e: yaml.YAMLError) -> str:
    """A YAML error as one line: what is wrong and where (1-based line and column)."""
    mark = getattr(e, "problem_mark", None)
    what = getattr(e, "problem", None) or str(e).splitlines()[0]
    context = getattr(e, "context", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{what}" + (f" ({context})" if context else "")


def find_config(name_or_path: str | Path, directory: Path = CONFIG_DIR, what: str = "config") -> Path:
    """Resolve a config: an existing path, or the name of a file shipped with klear in ``directory``
    (``rl_demo`` in ``configs/``; ``klear experiment`` passes ``configs/experiments``), given bare or under a
    ``configs`` folder as the repository shows it (``configs/rl_demo.yaml`` works from any folder).

    Raises:
        FileNotFoundError: neither exists (a path in any other folder is not taken for a shipped file of the same
            name); lists the shipped names.
    """
    path = Path(name_or_path)
    if path.is_file():
        return path
    if path.parent != Path(".") and "configs" not in path.parent.parts:
        raise FileNotFoundError(f"{what} {str(name_or_path)!r} not found (no such file)")
    for candidate in (directory / path.name, directory / f"{path.name}.yaml"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{what} {str(name_or_path)!r} not found (shipped: {shipped_configs(directory)})")


def shipped_configs(directory: Path = CONFIG_DIR) -> list[str]:
    """The names of the config files shipped with klear in ``directory`` (file stems, sorted)."""
    return sorted(p.stem for p in directory.glob("*.yaml"))


def accelerate_config_file(name: str) -> str:
    """The ``accelerate launch --config_file`` argument for a shipped accelerate config (``zero3``, ``fsdp2``).

    ``configs/accelerate/<name>.yaml`` when that relative path is the shipped file (a git checkout's root, where
    ``configs`` links to ``src/klear/configs``); otherwise the installed file's absolute path (a pip install, or
    any other working directory), so the printed launch line works where it is printed.

    Raises:
        FileNotFoundError: no such shipped config; lists the shipped names.
    """
    shipped = CONFIG_DIR / "accelerate" / f"{name}.yaml"
    if not shipped.is_file():
        names = sorted(p.stem for p in (CONFIG_DIR / "accelerate").glob("*.yaml"))
        raise FileNotFoundError(f"accelerate config {name!r} not found (shipped: {names})")
    relative = Path("configs") / "accelerate" / shipped.name
    if relative.is_file() and relative.resolve() == shipped.resolve():
        return relative.as_posix()
    return str(shipped)


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``"a.b=value"`` into ``(["a", "b"], parsed_value)``.

    Raises:
        ValueError: no ``=``, an empty key, or a value that is not valid YAML.
    """
    if "=" not in text:
        raise ValueError(f"override {text!r} must look like key=value (e.g. trainer.learning_rate=1e-6)")
    key, raw = text.split("=", 1)
    parts = [p for p in key.strip().split(".")]
    if not key.strip() or any(not p for p in parts):
        raise ValueError(f"override {text!r} has an empty key")
    try:
        value = load_yaml(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ValueError(f"override {text!r}: value is not valid YAML ({yaml_error_line(e)})") from None
    return parts, _coerce_numbers(value)


_SCI = re.compile(r"^[+-]?\d+(\.\d*)?[eE][+-]?\d+$")


def _coerce_numbers(obj: Any) -> Any:
    """YAML 1.1 (PyYAML) reads ``1e-6`` (no dot) as a string; turn such scientific-notation strings into floats."""
    if isinstance(obj, str) and _SCI.match(obj.strip()):
        return float(obj)
    if isinstance(obj, dict):
        return {k: _coerce_numbers(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_coerce_numbers(v) for v in obj]
    return obj


def set_key(config: dict[str, Any], parts: list[str], value: Any, where: str) -> None:
    """``config[p0]...[pn] = value`` in place, creating sections: the one rule for every override (``klear rl``'s
    ``key=value``, ``klear experiment``'s arms). A mapping value set on an existing section merges into it key by
    key (recursively), as recipes compose: ``trainer: {loss_mode: ppo_clip}`` changes one key and keeps the rest.

    Raises:
        ValueError: a part that descends into a non-mapping value, or a value other than a mapping or None for an
            existing section (the message starts with ``where``).
    """
    node = config
    for i, part in enumerate(parts[:-1]):
        if node.get(part) is None:
            node[part] = {}
        if not isinstance(node[part], dict):
            raise ValueError(f"{where}: {'.'.join(parts[: i + 1])} is not a section")
        node = node[part]
    last = parts[-1]
    if isinstance(value, dict) and isinstance(node.get(last), dict):
        for key, sub in value.items():
            set_key(node, [last, str(key)], sub, where)
    elif isinstance(node.get(last), dict) and value is not None:
        name = ".".join(parts)
        raise ValueError(
            f"{where}: {name} is a section: give it a mapping or set one of its keys ({name}.KEY), not {value!r}"
        )
    else:
        node[last] = copy.deepcopy(value)


def apply_overrides(config: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a deep copy of ``config`` with each ``key=value`` override applied (:func:`set_key`).

    Overrides apply in order: of a key given twice, the last wins (as with repeated command-line options; scripts
    append to a shared list).

    Raises:
        ValueError: a malformed override, or one that descends into a non-mapping value.
    """
    out = copy.deepcopy(config)
    for text in overrides:
        parts, value = parse_override(text)
        set_key(out, parts, value, f"override {text!r}")
    return out


def load_config(name_or_path: str | Path, overrides: list[str] | None = None) -> tuple[dict[str, Any], Path]:
    """Read a YAML recipe and apply overrides. Returns ``(config, resolved_path)``.

    Raises:
        FileNotFoundError: the recipe does not exist.
        ValueError: the file is not a YAML mapping, or an override is malformed.
    """
    path = find_config(name_or_path)
    try:
        config = load_yaml(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {yaml_error_line(e)}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a YAML mapping at the top level, got {type(config).__name__}")
    return apply_overrides(_coerce_numbers(config), overrides or []), path
