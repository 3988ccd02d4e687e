"""End to end on the real embedded model: `klear eval` on the 30 AIME 2024 problems, n = 2, CPU."""

from __future__ import annotations

import json

import pytest

from conftest import shared_file
from klear.cli import main


@pytest.mark.slow
def test_embedded_model_aime24_n2(tmp_path, embedded_path):
    aime = shared_file("math", "aime24.qs.jsonl")
    out = tmp_path / "aime24"
    args = [
        "eval",
        "--model",
        "embedded",
        "--benchmark",
        str(aime),
        "--n",
        "2",
        "--max-tokens",
        "48",
        "--backend",
        "hf",
        "--no-progress",
        "--maj",
        "--cpu-threads",
        "1",
        "--output",
        str(out),
    ]
    assert main(args) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["n"] == 2 and s["n_problems"] == 30 and s["n_samples"] == 60
    assert 0.0 <= s["avg_at_n"]["mean"] <= 1.0 and set(s["pass_at_k"]) == {"1", "2"}
    assert s["sampling"] == {"temperature": 0.6, "top_p": 0.95, "max_tokens": 48}
    assert s["rope"]["plan"]["source"] == "none" and s["rope"]["loaded"]["rope_type"] == "default"
    recs = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(recs) == 60 and all(0 < r["n_tokens"] <= 48 for r in recs)
    assert s["truncation_rate"] == pytest.approx(sum(r["finish_reason"] == "length" for r in recs) / 60)
    # a second invocation finds everything done and reproduces the summary
    assert main(args) == 0
    assert json.loads((out / "summary.json").read_text()) == s
