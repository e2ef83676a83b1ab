"""Speculative decoding: drafters propose tokens, the target model verifies them in one step.

  drafts.py          what a drafter hands over (tokens + per-draft confidence) and the Drafter protocol
  ngram.py           prompt lookup (any model) and its acceptance estimate by match length
  length_policy.py   how many drafts each sequence verifies: expected accepted tokens per unit of step time
  verifier.py        DeepInfer's acceptance rule (exact for greedy; the target's distribution when sampling)
  speculator.py      the engine's side: propose before scheduling, record what was accepted after the step
"""
