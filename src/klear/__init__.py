"""klear: the Klear-Reasoner post-training recipe (long-CoT SFT + GPPO RL)."""

__version__ = "0.1.0"
