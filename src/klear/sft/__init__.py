"""Long chain-of-thought SFT, the first stage of the Klear-Reasoner recipe (paper Sec. 3.1, 4.1, 5.1).

* :mod:`klear.sft.trainer`: :class:`KlearSFTTrainer` (TRL ``SFTTrainer``; response-token NLL averaged
  over the optimizer batch) and the cosine-to-floor LR schedule :func:`cosine_to_floor_lr`;
* :mod:`klear.sft.data`: SFT files (``messages`` or ``prompt``/``response``), correctness filtering
  by difficulty, and the embedded teacher set;
* :mod:`klear.sft.teacher`: the procedural arithmetic teacher (worked solutions in ``<think>``);
* :mod:`klear.sft.job` / :mod:`klear.sft.cli`: ``klear sft``.

Heavy imports (torch, TRL) happen in the submodules, not here.
"""
