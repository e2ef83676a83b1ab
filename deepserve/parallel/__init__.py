"""Multi-rank pieces (torch.distributed): the data-parallel step-type votes so far (step_vote.py)."""
