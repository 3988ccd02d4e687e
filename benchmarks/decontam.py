"""Benchmark of ``klear data decontaminate`` against a plain-Python set-of-tuples baseline.

Generates (deterministically, from --seed) synthetic benchmark sets sized like AIME 2024 (30),
HMMT Feb 2025 (30), MATH-500 (500) and GSM8K test (1319) and --rows synthetic training prompts
in the verl RL layout (JSONL; Zipf-distributed words, inline LaTeX, klear's boxed instruction).
0.5 % of the prompts carry a planted 12-token span of a benchmark problem (re-wrapped across a
line break, upper-cased, with ``$...$`` delimiters), 0.05 % are exact copies of short problems.

Then runs, each in a fresh Python process on the same files:

* ``ours``: :func:`klear.data.decontam.decontaminate_file` (``--workers`` processes);
* ``baseline``: the same reading, text rule and tokenisation, with the benchmark n-grams in a
  Python ``set`` of token tuples and ``not set.isdisjoint(zip(...))`` per prompt, one process.

It checks both keep exactly the same rows (and every planted one is removed), and prints
rows/s, wall time, CPU seconds of the run (workers included), peak memory (max RSS of the
process, and of its worker processes) and the ratios (wall clock and per CPU second). Usage::

    .venv/bin/python benchmarks/decontam.py                 # 200K prompts, 2 workers
    .venv/bin/python benchmarks/decontam.py --rows 20000 --workers 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

INSTRUCTION = "Put your final answer within \\boxed{}."
BENCH_SIZES = {"aime24": 30, "hmmt25": 30, "math500": 500, "gsm8k": 1319}
BENCH_WORDS = {"aime24": (60, 160), "hmmt25": (40, 140), "math500": (4, 120), "gsm8k": (30, 110)}


def _vocab(rng: np.random.Generator, size: int = 30000) -> list[str]:
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = set()
    while len(words) < size:
        k = int(rng.integers(2, 10))
        words.add("".join(rng.choice(letters, k)))
    return sorted(words)


def _text(rng: np.random.Generator, vocab: list[str], cdf: np.ndarray, k: int) -> str:
    idx = np.searchsorted(cdf, rng.random(k))
    parts = []
    for j, i in enumerate(idx.tolist()):
        w = vocab[i]
        r = (i * 7 + j) % 97
        if r == 0:
            w = f"${w}^{{{j % 9 + 1}}}$"
        elif r == 1:
            w = f"\\frac{{{j % 13}}}{{{w}}}"
        elif r == 2:
            w = w + ","
        elif r == 3:
            w = w.capitalize() + "."
        parts.append(w)
    return " ".join(parts)


def generate(folder: Path, rows: int, seed: int) -> dict:
    """Write the benchmark files and the training file; return their paths and the planted rows."""
    rng = np.random.default_rng(seed)
    vocab = _vocab(rng)
    weights = 1.0 / np.arange(1, len(vocab) + 1) ** 1.05
    cdf = np.cumsum(weights / weights.sum())
    bench_files, problems = [], []
    for name, size in BENCH_SIZES.items():
        path = folder / f"{name}.jsonl"
        lo, hi = BENCH_WORDS[name]
        with open(path, "w") as fh:
            for i in range(size):
                text = _text(rng, vocab, cdf, int(rng.integers(lo, hi)))
                problems.append(text)
                fh.write(json.dumps({"problem": text, "id": f"{name}-{i}"}) + "\n")
        bench_files.append(str(path))
    from klear.data.text import ngram_tokens

    short = [p for p in problems if len(ngram_tokens(p)) < 9]
    train = folder / "train.jsonl"
    planted = []
    with open(train, "w") as fh:
        for r in range(rows):
            text = _text(rng, vocab, cdf, int(rng.integers(40, 200)))
            u = rng.random()
            if u < 0.005:  # a 12-token span of a benchmark problem, re-wrapped and re-cased
                src = problems[int(rng.integers(len(problems)))].split()
                if len(src) >= 14:
                    a = int(rng.integers(0, len(src) - 12))
                    span = src[a : a + 12]
                    span = " ".join(span[:5]).upper() + "\n   " + "  ".join(span[5:])
                    words = text.split(" ")
                    cut = len(words) // 2
                    text = " ".join(words[:cut]) + " $" + span + "$ " + " ".join(words[cut:])
                    planted.append(r)
            elif u < 0.0055 and short:
                text = short[int(rng.integers(len(short)))].upper()
                planted.append(r)
            row = {
                "prompt": [{"role": "user", "content": text + "\n\n" + INSTRUCTION}],
                "data_source": "math_synthetic",
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(r % 1000)},
                "extra_info": {"index": r, "split": "train"},
            }
            fh.write(json.dumps(row) + "\n")
    return {"train": str(train), "bench": bench_files, "planted": planted, "bench_problems": len(problems)}


def _peak_mib() -> tuple[float, float]:
    self_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    child_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return self_kib / 1024, child_kib / 1024


def _cpu_seconds() -> float:
    """CPU seconds of this process and its waited-for children (user + system)."""
    return sum(
        r.ru_utime + r.ru_stime
        for r in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
    )


def run_ours(train: str, out: str, bench: list[str], n: int, workers: int) -> dict:
    from klear.data.decontam import decontaminate_file

    cpu0 = _cpu_seconds()
    t = time.perf_counter()
    report = decontaminate_file(train, out, bench, n=n, workers=workers, progress=False, quiet=True)
    seconds = time.perf_counter() - t
    main, children = _peak_mib()
    return {
        "seconds": seconds,
        "rows": report["rows_in"],
        "kept": report["rows_out"],
        "peak_mib": main,
        "workers_peak_mib": children,
        "index_seconds": report["index_seconds"],
        "cpu_seconds": _cpu_seconds() - cpu0,
    }


def run_baseline(train: str, out: str, bench: list[str], n: int) -> dict:
    from klear.data.decontam import DEFAULT_IGNORE_PHRASES
    from klear.data.text import ngram_tokens, row_text

    cpu0 = _cpu_seconds()
    t = time.perf_counter()
    grams: set[tuple[str, ...]] = set()
    exact: set[tuple[str, ...]] = set()
    for path in bench:
        with open(path) as fh:
            for r, line in enumerate(fh):
                toks = ngram_tokens(row_text(json.loads(line), f"{path}: row {r}"))
                grams.update(zip(*(toks[i:] for i in range(n))))
                if 0 < len(toks) < n:
                    exact.add(tuple(toks))
    index_seconds = time.perf_counter() - t
    phrases = [" ".join(ngram_tokens(p)) for p in DEFAULT_IGNORE_PHRASES]
    limit = n + sum(len(p.split()) for p in phrases)
    rows = kept = 0
    with open(train) as fh, open(out, "w") as fo:
        for line in fh:
            rec = json.loads(line)
            toks = ngram_tokens(row_text(rec, f"{train}: row {rows}"))
            rows += 1
            if not grams.isdisjoint(zip(*(toks[i:] for i in range(n)))):
                continue
            if len(toks) < limit:
                s = " " + " ".join(toks) + " "
                for p in phrases:
                    s = s.replace(" " + p + " ", " ")
                if tuple(s.split()) in exact:
                    continue
            fo.write(line)
            kept += 1
    seconds = time.perf_counter() - t
    main, children = _peak_mib()
    return {
        "seconds": seconds,
        "rows": rows,
        "kept": kept,
        "peak_mib": main,
        "workers_peak_mib": children,
        "index_seconds": index_seconds,
        "cpu_seconds": _cpu_seconds() - cpu0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--n", type=int, default=9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-dir", default=None, help="write the files here (kept) instead of a temp folder")
    ap.add_argument("--_impl", choices=["ours", "baseline"], help=argparse.SUPPRESS)
    ap.add_argument("--_args", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns._impl:  # child process: one implementation
        a = json.loads(ns._args)
        res = (
            run_ours(a["train"], a["out"], a["bench"], ns.n, ns.workers)
            if ns._impl == "ours"
            else run_baseline(a["train"], a["out"], a["bench"], ns.n)
        )
        print(json.dumps(res))
        return 0

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(ns.keep_dir or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        data = generate(folder, ns.rows, ns.seed)
        print(
            f"generated {ns.rows} training prompts and {data['bench_problems']} benchmark problems "
            f"({', '.join(f'{k} {v}' for k, v in BENCH_SIZES.items())}) in {time.perf_counter() - t:.1f} s; "
            f"{len(data['planted'])} planted contaminations",
            flush=True,
        )
        load_before = os.getloadavg()[0]
        results = {}
        for impl in ("ours", "baseline"):
            out = str(folder / f"kept_{impl}.jsonl")
            args = json.dumps({"train": data["train"], "out": out, "bench": data["bench"]})
            proc = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--_impl",
                    impl,
                    "--_args",
                    args,
                    "--n",
                    str(ns.n),
                    "--workers",
                    str(ns.workers),
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            if proc.returncode != 0:
                print(proc.stdout, proc.stderr, file=sys.stderr)
                return 1
            results[impl] = json.loads(proc.stdout.strip().splitlines()[-1])
            results[impl]["out"] = out
        same = Path(results["ours"]["out"]).read_bytes() == Path(results["baseline"]["out"]).read_bytes()
        kept_ids = {json.loads(line)["extra_info"]["index"] for line in open(results["ours"]["out"])}
        planted_left = [r for r in data["planted"] if r in kept_ids]
        print(
            f"machine: {os.cpu_count()} CPUs, 1-min load average {load_before:.2f} before the runs, "
            f"{os.getloadavg()[0]:.2f} after; workers={ns.workers}, n={ns.n}"
        )
        print(
            f"{'impl':10s} {'rows/s':>10s} {'seconds':>8s} {'index s':>8s} {'CPU s':>7s} {'kept':>8s} "
            f"{'peak MiB':>9s} {'workers MiB':>12s}"
        )
        for impl, r in results.items():
            print(
                f"{impl:10s} {r['rows'] / r['seconds']:10.0f} {r['seconds']:8.2f} {r['index_seconds']:8.2f} "
                f"{r['cpu_seconds']:7.2f} {r['kept']:8d} {r['peak_mib']:9.1f} {r['workers_peak_mib']:12.1f}"
            )
        ratio = results["baseline"]["seconds"] / results["ours"]["seconds"]
        cpu_ratio = results["baseline"]["cpu_seconds"] / results["ours"]["cpu_seconds"]
        print(
            f"ratio (ours / baseline rows/s): {ratio:.2f}x wall clock, {cpu_ratio:.2f}x per CPU second; "
            f"identical kept rows: {same}; planted contaminations left: {len(planted_left)} of "
            f"{len(data['planted'])}"
        )
        return 0 if same and not planted_left else 1


if __name__ == "__main__":
    sys.exit(main())
