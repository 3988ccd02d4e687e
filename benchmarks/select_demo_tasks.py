"""Pick a demo RL task mix: greedy accuracy of the REAL embedded model on reasoning-gym tasks.

For each candidate task/config (and each candidate instruction wording) this generates
``--n`` held-out style problems with :func:`klear.data.rl_data.make_reasoning_gym_dataset`,
decodes them greedily with the embedded SmolLM2-135M-Instruct
(:func:`klear.eval.heldout.generate`) and prints:

* ``acc``: strict accuracy, what the RL reward checks: ``klear.rewards.compute_scores`` == 1.0
  when that module is importable, else the LAST ``\\boxed{...}`` (non-empty) parsed with
  math-verify equals the ground truth;
* ``boxed``: fraction of completions with a non-empty ``\\boxed{...}``;
* ``empty``: fraction whose last ``\\boxed{}`` is empty (the model states an answer and then
  writes ``\\boxed{}``);
* ``loose``: the last number in the completion (boxed or not) is right: an upper bound of
  what a format-only improvement could reach, i.e. how learnable the task is for RL;
* ``len``: mean completion length in tokens; ``sec``: wall time.

A good demo task starts at roughly 15-50 % ``acc`` with a clearly higher ``loose``.

Phase ``instructions`` compares instruction wordings, each without and with the one-shot
demonstration turn (:data:`klear.data.rl_data.DEFAULT_FEW_SHOT`), on one-digit arithmetic;
phase ``tasks`` runs every candidate task with the best variant of phase 1 (or
``--instruction`` [``--no-few-shot``]).

Usage (2 CPU cores; wall times grow a lot when other jobs share the cores)::

    # what produced the table in the report (~20 min):
    python benchmarks/select_demo_tasks.py --instructions plain format_line --instr-n 32 \\
        --max-new-tokens 96 --json-out /tmp/sel.json
    python benchmarks/select_demo_tasks.py --phase tasks --instruction plain --n 32   # tasks only

``loose``/``boxed``/``empty`` always use math-verify and the helpers below directly.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

INSTRUCTIONS = {
    "plain": "Put your final answer within \\boxed{}.",
    "r1": "Please reason step by step, and put your final answer within \\boxed{}.",
    "example42": (
        "Solve it step by step. At the end, write the final answer as a number inside \\boxed{}, "
        "for example \\boxed{42}."
    ),
    "fill": "Write the final answer in the form \\boxed{answer}, replacing answer with the number.",
    "end_with": "Think briefly, then end your reply with: The answer is \\boxed{N}, where N is the final number.",
    "format_line": (
        "Answer format: first show the calculation, then write \\boxed{} with the result inside it, like \\boxed{5}."
    ),
    "answer_is": (
        "Answer format: show the calculation, then write: The answer is \\boxed{N}, with the result in "
        "place of N, like \\boxed{5}."
    ),
}

ARITH_NOPAREN = {"allow_parentheses": False, "allow_negation": False}

CANDIDATES = [
    (
        "basic_arith +- 2x2d",
        "basic_arithmetic",
        {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+", "-"], **ARITH_NOPAREN},
    ),
    (
        "basic_arith +-* 2x1d",
        "basic_arithmetic",
        {
            "min_terms": 2,
            "max_terms": 2,
            "min_digits": 1,
            "max_digits": 1,
            "operators": ["+", "-", "*"],
            **ARITH_NOPAREN,
        },
    ),
    (
        "basic_arith +- 3x1d",
        "basic_arithmetic",
        {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1, "operators": ["+", "-"], **ARITH_NOPAREN},
    ),
    ("chain_sum 2-3x1-2d", "chain_sum", {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}),
    ("products 1-2d", "products", {"min_digits": 1, "max_digits": 2}),
    ("leg_counting 1-2 animals", "leg_counting", {"min_animals": 1, "max_animals": 2, "max_instances": 5}),
    ("gcd <=50", "gcd", {"max_value": 50}),
    ("lcm <=20", "lcm", {"max_value": 20}),
    ("simple_equations 2 terms", "simple_equations", {"min_terms": 2, "max_terms": 2, "max_value": 20}),
]
INSTRUCTION_PHASE_TASKS = ("basic_arith +-* 2x1d",)

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def _box_at(text: str, start: int) -> str | None:
    """Content of the ``\\boxed{...}`` starting at ``start`` (brace-matched), None if unclosed."""
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, or None if there is none (or it is unclosed)."""
    start = text.rfind("\\boxed{")
    return None if start < 0 else _box_at(text, start)


def last_nonempty_boxed(text: str) -> str | None:
    """Content of the last NON-EMPTY ``\\boxed{...}``."""
    found = None
    for m in re.finditer(r"\\boxed\{", text):
        content = _box_at(text, m.start())
        if content is not None and content.strip():
            found = content
    return found


def _verify(gold: str, pred: str) -> bool:
    from math_verify import parse, verify

    try:
        g = parse(f"${gold}$")
        p = parse(f"${pred}$")
        return bool(g) and bool(p) and bool(verify(g, p))
    except Exception:
        return False


def score(completion: str, gold: str) -> dict:
    boxed = last_nonempty_boxed(completion)
    last = last_boxed(completion)
    numbers = _NUMBER.findall(completion.replace(",", ""))
    strict = last is not None and last.strip() != "" and _verify(gold, last)
    loose = strict or (bool(numbers) and _verify(gold, numbers[-1]))
    return {
        "strict": strict,
        "boxed": boxed is not None,
        "empty": last is not None and not last.strip(),
        "loose": loose,
    }


def _reward_fn():
    """``klear.rewards.compute_scores`` if importable, else None (local math-verify scoring)."""
    try:
        from klear.rewards import compute_scores
    except ImportError:
        return None
    return compute_scores


def run_config(
    model,
    tokenizer,
    label,
    name,
    config,
    instruction,
    n,
    max_new_tokens,
    batch_size,
    seed,
    show_examples,
    few_shot=True,
):
    from klear.data.rl_data import DEFAULT_FEW_SHOT, make_reasoning_gym_dataset
    from klear.eval.heldout import generate

    ds = make_reasoning_gym_dataset(
        [{"name": name, "config": config}],
        size=n,
        seed=seed,
        split="test",
        instruction=instruction,
        few_shot=DEFAULT_FEW_SHOT if few_shot else None,
    )
    t0 = time.time()
    completions = generate(
        model, tokenizer, ds["prompt"], max_new_tokens=max_new_tokens, batch_size=batch_size, show_progress=False
    )
    secs = time.time() - t0
    golds = [rm["ground_truth"] for rm in ds["reward_model"]]
    scores = [score(c, g) for c, g in zip(completions, golds)]
    reward_fn = _reward_fn()
    if reward_fn is not None:
        rewards = reward_fn(list(ds["data_source"]), completions, golds, list(ds["extra_info"]))
        for s, r in zip(scores, rewards):
            s["strict"] = r == 1.0
    lengths = [len(tokenizer(c, add_special_tokens=False)["input_ids"]) for c in completions]
    row = {
        "label": label,
        "task": name,
        "config": config,
        "instruction": instruction,
        "few_shot": few_shot,
        "acc": sum(s["strict"] for s in scores) / n,
        "boxed": sum(s["boxed"] for s in scores) / n,
        "empty": sum(s["empty"] for s in scores) / n,
        "loose": sum(s["loose"] for s in scores) / n,
        "len": sum(lengths) / n,
        "truncated": sum(L >= max_new_tokens for L in lengths) / n,
        "sec": secs,
    }
    from collections import Counter

    top = Counter(last_nonempty_boxed(c) for c in completions if last_nonempty_boxed(c) is not None)
    row["top_boxed"] = top.most_common(3)
    if show_examples:
        print(f"    most common boxed contents: {row['top_boxed']}", flush=True)
        for c, g in list(zip(completions, golds))[:show_examples]:
            print(f"    gold={g!r} completion={c[:300]!r}", flush=True)
    return row


def print_row(row, inst_key):
    print(
        f"{row['label']:<28} {inst_key:<16} {row['acc']:>5.2f} {row['boxed']:>6.2f} {row['empty']:>6.2f} "
        f"{row['loose']:>6.2f} {row['len']:>6.1f} {row['truncated']:>6.2f} {row['sec']:>6.1f}",
        flush=True,
    )


HEADER = f"{'task/config':<28} {'instr':<16} {'acc':>5} " + " ".join(
    f"{c:>6}" for c in ("boxed", "empty", "loose", "len", "trunc", "sec")
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=64, help="problems per task/config")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--phase", choices=["all", "instructions", "tasks"], default="all")
    ap.add_argument("--instr-n", type=int, default=None, help="problems per run in the instruction phase (default --n)")
    ap.add_argument(
        "--instructions",
        nargs="*",
        default=None,
        choices=sorted(INSTRUCTIONS),
        help="wordings compared in the instruction phase (default all)",
    )
    ap.add_argument(
        "--instr-tasks",
        nargs="*",
        default=list(INSTRUCTION_PHASE_TASKS),
        help="task labels used in the instruction phase",
    )
    ap.add_argument(
        "--instruction",
        choices=sorted(INSTRUCTIONS),
        default=None,
        help="wording for the task phase (default: best of the instruction phase, else plain)",
    )
    ap.add_argument(
        "--no-few-shot",
        action="store_true",
        help="task phase without the one-shot demo turn (when --instruction is given or phase=tasks)",
    )
    ap.add_argument("--tasks", nargs="*", default=None, help="labels of CANDIDATES to run (default all)")
    ap.add_argument("--show-examples", type=int, default=2)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from klear.models.embedded import embedded_model_path

    torch.manual_seed(0)
    path = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    scorer = "klear.rewards.compute_scores" if _reward_fn() is not None else "local math-verify (last box)"
    print(
        f"model {path}  threads={torch.get_num_threads()}  n={args.n}  max_new_tokens={args.max_new_tokens}"
        f"  acc scorer: {scorer}",
        flush=True,
    )

    by_label = {c[0]: c for c in CANDIDATES}
    results = []
    best = (args.instruction or "plain", not args.no_few_shot)
    if args.phase in ("all", "instructions"):
        print("\n== phase 1: instruction wording, without / with the one-shot demo turn ==\n" + HEADER, flush=True)
        per_variant: dict[tuple[str, bool], list[float]] = {}
        for key in args.instructions or list(INSTRUCTIONS):
            for shot in (False, True):
                for label in args.instr_tasks:
                    _, name, config = by_label[label]
                    row = run_config(
                        model,
                        tokenizer,
                        label,
                        name,
                        config,
                        INSTRUCTIONS[key],
                        args.instr_n or args.n,
                        args.max_new_tokens,
                        args.batch_size,
                        args.seed,
                        args.show_examples,
                        few_shot=shot,
                    )
                    row["instruction_key"] = key
                    row["phase"] = "instructions"
                    results.append(row)
                    per_variant.setdefault((key, shot), []).append(row["acc"])
                    print_row(row, key + ("+shot" if shot else ""))
        if args.instruction is None:
            best = max(per_variant, key=lambda k: sum(per_variant[k]))
        print(
            "mean acc per variant: "
            + ", ".join(f"{k}{'+shot' if sh else ''}={sum(v) / len(v):.2f}" for (k, sh), v in per_variant.items())
        )

    if args.phase in ("all", "tasks"):
        key, shot = best
        print(
            f"\n== phase 2: tasks (instruction {key!r}, one-shot demo {'on' if shot else 'off'}) ==\n" + HEADER,
            flush=True,
        )
        labels = args.tasks or [c[0] for c in CANDIDATES]
        for label in labels:
            _, name, config = by_label[label]
            try:
                row = run_config(
                    model,
                    tokenizer,
                    label,
                    name,
                    config,
                    INSTRUCTIONS[key],
                    args.n,
                    args.max_new_tokens,
                    args.batch_size,
                    args.seed,
                    args.show_examples,
                    few_shot=shot,
                )
            except ValueError as exc:  # e.g. problem space too small for n
                print(f"{label:<28} skipped: {exc}", flush=True)
                continue
            row["instruction_key"] = key
            row["phase"] = "tasks"
            results.append(row)
            print_row(row, key + ("+shot" if shot else ""))

    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(results, fh, indent=1)
        print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
