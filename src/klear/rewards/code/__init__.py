"""The code reward's parts, one concern per module (the public face is :mod:`klear.rewards.code_reward`).

- :mod:`~klear.rewards.code.extract`: the program in a response (last Python fenced block).
- :mod:`~klear.rewards.code.layouts`: ground-truth layouts (``stdio``, ``call``, ``assert``).
- :mod:`~klear.rewards.code.compare`: whether an output or a returned value is the expected one.
- :mod:`~klear.rewards.code.rpc`: the trusted side of the run channel (proxies, value codec).
- :mod:`~klear.rewards.code.run`: running a program on its tests in the sandbox.
- :mod:`~klear.rewards.code.score`: rewards, the worker pool, canaries, the registered scorers.
- :mod:`~klear.rewards.code.datasets`: ground truths for HumanEval, MBPP and LeetCode records.

The sandbox is :mod:`klear.rewards.sandbox`; its wire protocol :mod:`klear.rewards.sandbox_protocol`.
"""
