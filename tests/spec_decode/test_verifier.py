"""The acceptance rule: greedy rows emit exactly the argmax path; sampled rows emit the target's distribution."""

from __future__ import annotations

import math

import torch

from deepserve.sampling_params import SamplingParams
from deepserve.spec_decode.verifier import VerifyGroup, verify

GREEDY = SamplingParams(temperature=0.0)


def chi_square_limit(df: int, z: float = 3.09) -> float:
    """The 99.9% quantile of chi-square(df) (Wilson-Hilferty; exact to ~1% for df >= 3)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Statistic and degrees of freedom over the cells expected to hold >= 5 samples (the rest pooled)."""
    n = counts.sum().item()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].sum().double()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = (((obs - exp) ** 2)[keep] / exp[keep]).sum().item()
    return stat, int(keep.sum().item()) - 1


def test_greedy_accepts_the_argmax_prefix_and_emits_the_argmax_at_the_first_miss():
    torch.manual_seed(0)
    logits = torch.randn(4, 20)
    argmax = logits.argmax(-1).tolist()
    wrong = (argmax[2] + 1) % 20
    result = verify(logits, [VerifyGroup(GREEDY, 0, 10, [argmax[0], argmax[1], wrong])])
    assert result.num_accepted == [2]
    assert result.emitted == [[argmax[0], argmax[1], argmax[2]]]
    full = verify(logits, [VerifyGroup(GREEDY, 0, 10, argmax[:3])])
    assert full.num_accepted == [3] and full.emitted == [argmax]        # all accepted: the fresh row's argmax too


def test_a_group_gives_the_same_tokens_alone_and_anywhere_in_a_batch():
    torch.manual_seed(1)
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=7)
    groups = [VerifyGroup(params, 100 + i, 50, [3, 4]) for i in range(6)]
    logits = torch.randn(18, 16)
    batch = verify(logits, groups)
    for i in range(6):
        alone = verify(logits[3 * i:3 * i + 3], [groups[i]])
        assert alone.emitted[0] == batch.emitted[i]
    again = verify(logits, groups)
    assert again.emitted == batch.emitted


def sampled_emissions(row_logits: torch.Tensor, params: SamplingParams, drafts: list[int], samples: int):
    groups = [VerifyGroup(params, seed, 1000, drafts) for seed in range(samples)]
    logits = row_logits.repeat(samples, 1)
    return verify(logits, groups).emitted


def target_probs(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The shaped distribution written out for these tests: temperature, then top-k (no top-p / min-p here)."""
    p = torch.softmax(row.double() / params.temperature, dim=-1)
    if 0 < params.top_k < p.numel():
        cut = p.topk(params.top_k).values[-1]
        p = torch.where(p >= cut, p, torch.zeros_like(p))
    return p / p.sum()


def test_sampled_tokens_follow_the_target_distribution_whatever_the_drafts():
    """20,000 seeded verifications of two point-mass drafts: the first emitted token follows row 0's distribution,
    the second (given the first draft was accepted) row 1's. A 2% shift of probability mass is detected: the same
    statistic against a distribution with 2% moved is above the limit (checked below)."""
    torch.manual_seed(2)
    vocab, samples = 12, 20000
    rows = torch.randn(3, vocab) * 1.5
    params = SamplingParams(temperature=0.8, top_k=9)
    p0, p1 = target_probs(rows[0], params), target_probs(rows[1], params)
    d0 = int(p0.argsort()[-2])          # a likely but not the likeliest token: both outcomes happen often
    d1 = int(p1.argmax())
    emitted = sampled_emissions(rows, params, [d0, d1], samples)
    first = torch.bincount(torch.tensor([e[0] for e in emitted]), minlength=vocab)
    stat, df = chi_square(first, p0)
    assert stat < chi_square_limit(df), (stat, df)
    shifted = p0.clone()
    shifted[d0] += 0.02
    shifted[int(p0.argmax())] -= 0.02
    assert chi_square(first, shifted)[0] > chi_square_limit(df)
    after_accept = [e[1] for e in emitted if e[0] == d0 and len(e) > 1]
    assert len(after_accept) > 2000
    second = torch.bincount(torch.tensor(after_accept), minlength=vocab)
    stat, df = chi_square(second, p1)
    assert stat < chi_square_limit(df), (stat, df)
    # Tokens outside top-k are never emitted, even through the residual.
    assert first[p0 == 0].sum() == 0


def test_sampled_drafts_with_their_distribution_use_the_q_ratio_rule():
    """§6.3 with a drafter's distribution Q: 20,000 seeded verifications of one draft drawn from Q (independently of
    the verifier's uniforms). The emitted token follows the target's P (chi-square; a 2% shift is detected), the
    acceptance rate is sum_i min(P, Q), and that is above what the point-mass rule gives the same drafts
    (E_{d~Q} P(d))."""
    torch.manual_seed(5)
    vocab, samples = 12, 20000
    rows = torch.randn(2, vocab) * 1.5
    params = SamplingParams(temperature=0.8)
    p0 = target_probs(rows[0], params)
    q = torch.softmax(torch.randn(vocab) * 1.5, dim=-1)
    drafts = torch.multinomial(q, samples, replacement=True, generator=torch.Generator().manual_seed(9)).tolist()
    groups = [VerifyGroup(params, seed, 1000, [d], draft_probs=q[None].float()) for seed, d in enumerate(drafts)]
    result = verify(rows.repeat(samples, 1), groups)
    first = torch.bincount(torch.tensor([e[0] for e in result.emitted]), minlength=vocab)
    stat, df = chi_square(first, p0)
    assert stat < chi_square_limit(df), (stat, df)
    shifted = p0.clone()
    shifted[int(p0.argmax())] -= 0.02
    shifted[int(p0.argmin())] += 0.02
    assert chi_square(first, shifted)[0] > chi_square_limit(df)
    rate = sum(result.num_accepted) / samples
    want = torch.minimum(p0, q.double()).sum().item()
    assert abs(rate - want) < 4 * math.sqrt(want * (1 - want) / samples), (rate, want)
    point_mass = verify(rows.repeat(samples, 1), [VerifyGroup(params, seed, 1000, [d]) for seed, d in enumerate(drafts)])
    assert rate > sum(point_mass.num_accepted) / samples + 0.05


def test_logprobs_are_the_raw_model_logprobs_of_each_emitted_token():
    torch.manual_seed(3)
    logits = torch.randn(3, 10)
    argmax = logits.argmax(-1).tolist()
    result = verify(logits, [VerifyGroup(GREEDY, 0, 5, argmax[:2])], max_num_logprobs=2)
    raw = torch.log_softmax(logits, -1)
    entries = result.logprobs[0]
    assert [e[0] for e in entries] == argmax
    for j, (tok, lp, ids, vals) in enumerate(entries):
        assert lp == raw[j, tok].item()
        assert ids == raw[j].topk(2).indices.tolist()


def test_a_grammar_mask_rejects_refused_drafts_and_picks_only_allowed_tokens():
    """Row masks (structured outputs): the argmax draft is refused by row 0's mask, so it is rejected and the
    emitted token is the best allowed one; logprobs stay the model's raw ones."""
    from deepserve.structured import bitmask as bm
    torch.manual_seed(4)
    logits = torch.randn(2, 40)
    top = logits[0].argsort(descending=True).tolist()
    mask = bm.allocate(2, 40)
    words = [0, 0]
    for tok in top[1:4]:                                  # row 0 allows the 2nd..4th best tokens only
        words[tok // 32] |= 1 << (tok % 32)
    mask[0] = torch.tensor(words, dtype=torch.int64).to(torch.int32)     # wraps bit 31 like an int32 word
    assert bm.allowed_tokens(mask, 40)[0].nonzero().flatten().tolist() == sorted(top[1:4])
    result = verify(logits, [VerifyGroup(GREEDY, 0, 5, [top[0]], mask)], max_num_logprobs=0)
    assert result.num_accepted == [0]
    assert result.emitted == [[top[1]]]
    assert result.logprobs[0][0][1] == torch.log_softmax(logits[0], -1)[top[1]].item()
