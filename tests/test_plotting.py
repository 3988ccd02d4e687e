import json

import pytest

from klear.utils.plotting import plot_training_curves, read_metrics


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_plot_writes_png(tmp_path):
    rows = [
        {
            "step": s,
            "reward": -1 + 0.2 * s,
            "klear/accuracy": 0.1 * s,
            "klear/clip_frac_high": 0.01,
            "klear/clip_frac_low": 0.02,
            "entropy": 1.0 - 0.05 * s,
            "grad_norm": 0.07,
            "lr": 1e-6,
        }
        for s in range(1, 6)
    ]
    lines = [json.dumps(r) for r in rows]
    lines += [
        "",
        "not json",
        json.dumps({"reward": 5.0}),
        json.dumps({"step": 6, "reward": "nan?"}),
        json.dumps([1, 2]),
    ]
    f = _write(tmp_path / "metrics.jsonl", lines)
    series = read_metrics(f)
    assert [s for s, _ in series["reward"]] == [1, 2, 3, 4, 5]  # line without step / string value skipped
    out = plot_training_curves(f, tmp_path / "sub" / "curves.png", title="demo")
    assert out == tmp_path / "sub" / "curves.png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_plot_single_metric(tmp_path):
    f = _write(tmp_path / "m.jsonl", [json.dumps({"step": 1, "grad_norm": 0.1})])
    assert plot_training_curves(f, tmp_path / "g.png").is_file()


def test_plot_errors(tmp_path):
    empty = _write(tmp_path / "empty.jsonl", [""])
    with pytest.raises(ValueError, match="empty.jsonl: no plottable rows"):
        plot_training_curves(empty, tmp_path / "x.png")
    unknown = _write(tmp_path / "other.jsonl", [json.dumps({"step": 1, "lr": 1e-6}), json.dumps({"reward": 1})])
    with pytest.raises(ValueError, match="other.jsonl"):
        plot_training_curves(unknown, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
    with pytest.raises(FileNotFoundError, match=r"No such file or directory: .*missing\.jsonl"):
        plot_training_curves(tmp_path / "missing.jsonl", tmp_path / "x.png")
