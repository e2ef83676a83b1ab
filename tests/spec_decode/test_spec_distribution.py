"""With sampling, speculation keeps the target model's distribution: 20,000 four-token continuations of one prompt
from a tiny Llama (vocabulary 16), drafted by prompt lookup and verified, against the exact distribution computed with
HF transformers' forward on every prefix. Chi-square on the marginals of the 2nd and 3rd tokens (the ones drafts
can touch: the 1st is sampled by the prefill step), at a 99.9% limit; a 2% shift of mass is detectable at this size
(tests/spec_decode/test_verifier.py shows it on the verifier alone)."""

from __future__ import annotations

import pytest
import torch

from deepserve import LLM, SamplingParams

from test_verifier import chi_square, chi_square_limit

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 16
SEED_TOKENS = list(range(VOCAB))          # every token occurs: prompt lookup always finds a match


@pytest.fixture(scope="module")
def tiny_small_vocab(tmp_path_factory):
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=128, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)     # peaked (drafts accepted ~1 in 3), not deterministic
    path = tmp_path_factory.mktemp("tiny_vocab16")
    model.save_pretrained(str(path))
    # The prompt ends with the model's own greedy continuation, so prompt lookup drafts what the model favours: drafts
    # are accepted often and rejected often, and a verifier biased either way moves the marginals.
    with torch.no_grad():
        ids = model.generate(torch.tensor([SEED_TOKENS]), max_new_tokens=24, do_sample=False).tolist()[0]
    return str(path), model, ids


def exact_marginals(model, prompt: list[int], temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """P(2nd token) and P(3rd token) of a continuation of `prompt`, from next-token distributions of every prefix."""
    def next_probs(prefixes: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits = model(prefixes).logits[:, -1].double()
        return torch.softmax(logits / temperature, dim=-1)
    base = torch.tensor([prompt])
    p1 = next_probs(base)[0]                                                         # [V]
    one = torch.cat([base.repeat(VOCAB, 1), torch.arange(VOCAB)[:, None]], dim=1)
    p2_given_1 = next_probs(one)                                                     # [V(a), V(b)]
    two = torch.cat([one.repeat_interleave(VOCAB, 0), torch.arange(VOCAB).repeat(VOCAB)[:, None]], dim=1)
    p3_given_12 = next_probs(two).view(VOCAB, VOCAB, VOCAB)                          # [a, b, c]
    joint12 = p1[:, None] * p2_given_1
    return joint12.sum(0), (joint12[:, :, None] * p3_given_12).sum((0, 1))


def test_speculative_sampling_keeps_the_target_distribution(tiny_small_vocab):
    path, model, prompt = tiny_small_vocab
    temperature, samples = 1.0, 20000
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", max_num_seqs=1024, max_num_batched_tokens=8192,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    params = SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompt}] * samples, params, use_tqdm=False)
    tokens = torch.tensor([o.outputs[0].token_ids for o in outs])
    assert tokens.shape == (samples, 4)
    stats = llm.engine.get_stats()
    verified, accepted = stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens
    assert verified > samples and 0.2 * verified < accepted < 0.8 * verified     # both outcomes are common
    p2, p3 = exact_marginals(model, prompt, temperature)
    for column, probs in ((1, p2), (2, p3)):
        stat, df = chi_square(torch.bincount(tokens[:, column], minlength=VOCAB), probs)
        assert stat < chi_square_limit(df), (column, stat, df)
