"""Generation support below every stage that samples: vLLM engine sizing, settings and weight sync
(:mod:`klear.generation.vllm`) and the shared-prompt prefill of HF sampling (:mod:`klear.generation.prefill`).

Used by ``klear eval``, the held-out evaluator and ``klear rl``; imports no stage above it.
"""
