"""Test helper: every draft a model-based drafter (MTP, DSpark) hands the speculator, recorded as it goes."""

from __future__ import annotations


def recording(llm) -> list[tuple[int, int, list[int], list[float]]]:
    """(seq_id, position, drafts, confidences) of every draft chain or block the engine makes from now on."""
    made = []
    take = llm.engine.speculator.take_model_drafts

    def record(drafts):
        made.extend((seq_id, d.position, d.token_ids, d.confidences) for seq_id, d in drafts.items())
        take(drafts)
    llm.engine.speculator.take_model_drafts = record
    return made
