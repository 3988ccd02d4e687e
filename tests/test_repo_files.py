"""The repository's front page and tool configs agree with each other."""

import re
from pathlib import Path

import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _pins(extra: str) -> dict[str, str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][extra]
    return dict(d.split("==") for d in deps if "==" in d)


def test_pre_commit_runs_the_lint_extra_s_ruff_and_mypy():
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    ruff = next(r for r in config["repos"] if r["repo"].endswith("/ruff-pre-commit"))
    assert ruff["rev"] == "v" + _pins("lint")["ruff"]
    local = [h for r in config["repos"] if r["repo"] == "local" for h in r["hooks"]]
    assert [h["entry"] for h in local if h["id"] == "mypy"] == [".venv/bin/mypy"]  # the venv's: pinned by lint


def test_readme_is_a_front_page_whose_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    targets = re.findall(r"\]\(([^)#]+)\)", text)
    assert targets
    missing = [t for t in targets if not t.startswith("http") and not (ROOT / t).exists()]
    assert not missing, missing
