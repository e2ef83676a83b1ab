"""StructuredMatcher on the default model's vocabulary: masks, accept, rollback, draft masks and triggers."""

from __future__ import annotations

import torch

from deepserve.structured import bitmask as bm
from deepserve.structured.matcher import StructuredMatcher
from deepserve.structured.spec import GrammarSpec, from_so_args


def matcher(compiler, spec: GrammarSpec, **kwargs) -> StructuredMatcher:
    return StructuredMatcher(compiler.compile(spec), compiler.vocab_size, spec.trigger_token_ids,
                             spec.bound_token_id, **kwargs)


def allowed(m: StructuredMatcher, vocab: int) -> torch.Tensor:
    mask = bm.allocate(1, vocab)
    m.fill_bitmask(mask, 0)
    return bm.allowed_tokens(mask, vocab)[0]


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_the_mask_allows_what_the_regex_allows_and_eos_only_at_the_end(compiler, tokenizer, eos):
    m = matcher(compiler, GrammarSpec("regex", "ab[0-9]"))
    v = compiler.vocab_size
    first = allowed(m, v)
    assert first[encode(tokenizer, "a")[0]] and not first[encode(tokenizer, "b")[0]] and not first[eos]
    for t in encode(tokenizer, "ab"):
        assert m.accept(t)
    digit = encode(tokenizer, "7")[0]
    assert not m.accept(encode(tokenizer, "x")[0])         # refused, and nothing changed:
    assert m.accept(digit)
    assert allowed(m, v).nonzero().flatten().tolist() == [eos]     # complete: EOS alone
    assert not m.is_terminated and m.accept(eos) and m.is_terminated


def test_rollback_restores_the_mask(compiler, tokenizer):
    m = matcher(compiler, GrammarSpec("json", '{"type":"object","properties":{"n":{"type":"integer"}},'
                                               '"required":["n"]}'))
    v = compiler.vocab_size
    tokens = encode(tokenizer, '{"n": 12')
    masks = [allowed(m, v)]
    for t in tokens:
        assert m.accept(t)
        masks.append(allowed(m, v))
    m.rollback(3)
    assert torch.equal(allowed(m, v), masks[len(tokens) - 3])
    m.rollback(len(tokens) - 3)
    assert torch.equal(allowed(m, v), masks[0]) and m.num_accepted == 0


def test_draft_masks_follow_the_drafts_until_the_grammar_refuses_one(compiler, tokenizer):
    spec = GrammarSpec("choice", '["red apple", "green pear"]')
    m = matcher(compiler, spec)
    v = compiler.vocab_size
    good = encode(tokenizer, "red apple")
    drafts = good[:2] + encode(tokenizer, " pear")[:1] + good[2:]
    before = allowed(m, v)
    rows, accepted = m.fill_bitmask_for_drafts(drafts)
    assert accepted == 2 and rows.shape == (len(drafts) + 1, bm.num_words(v))
    step = matcher(compiler, spec)                           # the same rows, token by token
    for k in range(accepted + 1):
        assert torch.equal(bm.allowed_tokens(rows[k:k + 1], v)[0], allowed(step, v))
        if k < accepted:
            step.accept(drafts[k])
    assert not bm.allowed_tokens(rows[2:3], v)[0, drafts[2]]      # the refused draft is masked in its row
    assert bm.allowed_tokens(rows[3:], v).all()                   # rows past it are never read
    assert torch.equal(allowed(m, v), before) and m.num_accepted == 0     # rolled back


def test_rollback_beyond_capacity_is_refused(compiler, tokenizer):
    m = matcher(compiler, GrammarSpec("regex", "[a-z ]+"), rollback_capacity=2)
    for t in encode(tokenizer, "abc def ghi"):
        assert m.accept(t)
    try:
        m.rollback(3)
    except ValueError as e:
        assert "capacity 2" in str(e)
    else:
        raise AssertionError("rolled back past the capacity")


def test_triggers_free_then_forced_then_grammar(compiler, tokenizer):
    trigger = encode(tokenizer, "<json>")
    bound = encode(tokenizer, " answer")[0]
    spec = from_so_args({"schema_type": "regex", "schema": "[0-9]+", "trigger_token_ids": trigger,
                         "bound_token_id": bound})
    m = matcher(compiler, spec)
    v = compiler.vocab_size
    assert allowed(m, v).all()
    assert m.accept(encode(tokenizer, "Hello")[0]) and allowed(m, v).all()     # free text
    assert m.accept(bound)
    for t in trigger:                                          # the trigger is forced one token at a time
        assert allowed(m, v).nonzero().flatten().tolist() == [t]
        assert m.accept(t)
    assert m.in_grammar and not allowed(m, v)[encode(tokenizer, "Hello")[0]]
    assert m.accept(encode(tokenizer, "4")[0])
    m.rollback(2 + len(trigger))                               # back across the trigger into free text
    assert not m.in_grammar and allowed(m, v).all()


def test_trigger_appearing_in_free_text_starts_the_grammar(compiler, tokenizer):
    trigger = encode(tokenizer, "<json>")
    m = matcher(compiler, from_so_args({"schema_type": "regex", "schema": "x", "trigger_token_ids": trigger}))
    for t in encode(tokenizer, "some text ") + trigger:
        assert m.accept(t)
    assert m.in_grammar
    assert allowed(m, compiler.vocab_size).nonzero().flatten().tolist() == encode(tokenizer, "x")
