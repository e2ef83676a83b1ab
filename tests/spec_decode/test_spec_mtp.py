"""DeepSeek-V3 MTP drafting: a tiny V3 checkpoint with an MTP layer (`model.layers.{N}.*`, as V3 releases hold it),
against a plain reference written from the formula in deepserve/models/deepseek_mtp.py with HF transformers' own
modules: the trunk's final hidden states from HF's DeepseekV3 model, the MTP block run by HF's DeepseekV3DecoderLayer.
Every draft the engine makes (paged MTP cache, chunked prefill, verification steps, batching; k = 1, and k = 3 with the
layer applied to its own drafts) equals the reference's argmax at its position with the reference's probability, and
greedy output equals HF's greedy decoding."""

from __future__ import annotations

import pytest
import torch

from deepserve import LLM, SamplingParams
from tests.spec_decode.mtp_checkpoint import CONFIG, LAYERS, bigram_mtp, write_tiny_v3_mtp
from tests.spec_decode.draft_recording import recording

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class Reference:
    """HF's trunk (LAYERS layers) + the MTP layer through HF's decoder layer, whole sequence, no cache."""

    def __init__(self, trunk, block, rotary, mtp: dict[str, torch.Tensor]) -> None:
        self.trunk, self.block, self.rotary, self.w = trunk, block, rotary, mtp

    @torch.no_grad()
    def greedy(self, ids: list[int], steps: int) -> list[int]:
        tokens = list(ids)
        for _ in range(steps):
            tokens.append(int(self.trunk(torch.tensor([tokens])).logits[0, -1].argmax()))
        return tokens[len(ids):]

    def _inputs(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        w = self.w
        return torch.cat([rms(embeds, w["enorm.weight"]), rms(hidden, w["hnorm.weight"])], -1) @ w["eh_proj.weight"].T

    def _head(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder block over rows x (positions 0.., causal) -> (probs, shared_head.norm's output) per row."""
        n = x.shape[0]
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        y = self.block(x[None], attention_mask=mask, position_ids=pos, position_embeddings=self.rotary(x[None], pos))
        y = y[0] if isinstance(y, tuple) else y
        state = rms(y[0], self.w["shared_head.norm.weight"])
        return torch.softmax((state @ self.w["shared_head.head.weight"].T).float(), -1), state

    @torch.no_grad()
    def mtp_probs(self, tokens: list[int]) -> torch.Tensor:
        """Row q: the MTP distribution of token q + 2 given tokens[: q + 2]."""
        ids = torch.tensor([tokens])
        h = self.trunk.model(ids).last_hidden_state[0, :-1]                  # final (normed) hidden, q = 0..L-2
        e = self.trunk.model.embed_tokens(ids)[0, 1:]                         # token q + 1
        return self._head(self._inputs(e, h))[0]

    @torch.no_grad()
    def mtp_chain(self, tokens: list[int], drafts: list[int]) -> list[torch.Tensor]:
        """The MTP distribution of each draft for positions len(tokens).., given the drafts before it: rows 0..L-2 as
        in mtp_probs, then a row more per draft (its input: the last row's shared_head.norm output and that draft),
        the block re-run over every row each time."""
        ids = torch.tensor([tokens])
        x = self._inputs(self.trunk.model.embed_tokens(ids)[0, 1:], self.trunk.model(ids).last_hidden_state[0, :-1])
        out = []
        for d in drafts:
            p, state = self._head(x)
            out.append(p[-1])
            x = torch.cat([x, self._inputs(self.trunk.model.embed_tokens(torch.tensor([d])), state[-1:])])
        return out


def build(path: str, **overrides) -> Reference:
    import transformers
    full, mtp = write_tiny_v3_mtp(path, **overrides)
    trunk_config = transformers.DeepseekV3Config(**{**CONFIG, **overrides}, num_hidden_layers=LAYERS)
    trunk_config._attn_implementation = "eager"
    trunk = transformers.DeepseekV3ForCausalLM(trunk_config).eval()
    trunk.load_state_dict({k: v for k, v in full.state_dict().items() if f"layers.{LAYERS}." not in k})
    return Reference(trunk, full.model.layers[LAYERS], full.model.rotary_emb, mtp)


@pytest.fixture(scope="module")
def tiny_v3_mtp(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("v3_mtp"))
    return path, build(path)


@pytest.fixture(scope="module")
def tiny_v3_mtp_small_vocab(tmp_path_factory):
    """vocab_size <= hidden_size, as mtp_checkpoint.bigram_mtp needs."""
    path = str(tmp_path_factory.mktemp("v3_mtp_small_vocab"))
    return path, build(path, vocab_size=48)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_mtp_drafts_match_the_reference_and_greedy_matches_hf(tiny_v3_mtp, device):
    path, ref = tiny_v3_mtp
    extra = {"kv_cache_memory_bytes": 1 << 26} if device == "cuda" else {}
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=8, max_num_batched_tokens=24, device=device,
              speculative_config={"method": "mtp", "num_speculative_tokens": 1}, **extra)
    drafts: list[tuple[int, int, int, float]] = []          # (seq_id, position, token, confidence)
    take = llm.engine.speculator.take_model_drafts

    def record(made):
        drafts.extend((seq_id, d.position, d.token_ids[0], d.confidences[0]) for seq_id, d in made.items())
        take(made)
    llm.engine.speculator.take_model_drafts = record
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, CONFIG["vocab_size"], (n,), generator=gen).tolist() for n in (13, 30, 7)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for o, p in zip(outs, prompts):
        assert o.outputs[0].token_ids == ref.greedy(p, 20)
    # Drafts by sequence: seq ids are 1, 2, 3 in request order (one sequence each).
    finals = {i + 1: p + o.outputs[0].token_ids for i, (p, o) in enumerate(zip(prompts, outs))}
    checked = 0
    for seq_id, position, token, confidence in drafts:
        tokens = finals[seq_id]
        if position >= len(tokens):
            continue                                  # drafted past the last token kept (max_tokens)
        probs = ref.mtp_probs(tokens[:position])[position - 2]
        assert token == int(probs.argmax()), (seq_id, position)
        assert confidence == pytest.approx(float(probs.max()), abs=1e-4)
        checked += 1
    assert checked >= 40
    stats = llm.engine.get_stats()
    assert stats.spec_decode_num_draft_tokens > 0


def check_chains(ref: Reference, made, finals: dict[int, list[int]], tie: float = 0.0, tol: float = 1e-4) -> int:
    """Every draft chain the engine made is the reference's: each draft an argmax of the reference's distribution
    given the drafts before it (within `tie` of the top probability: GPU rounding may pick either of a near-tie), its
    confidence that probability. Returns how many chains were 3 long."""
    full = 0
    for seq_id, position, tokens, confidences in made:
        if position > len(finals[seq_id]):
            continue                                  # drafted past the last token kept (max_tokens)
        for j, probs in enumerate(ref.mtp_chain(finals[seq_id][:position], tokens)):
            assert float(probs[tokens[j]]) >= float(probs.max()) - tie, (seq_id, position, j)
            assert confidences[j] == pytest.approx(float(probs[tokens[j]]), abs=tol)
        full += len(tokens) == 3
    return full


def chain_prompts(vocab: int) -> list[list[int]]:
    """16 and 15 tokens at block size 8: right after prefill the chain rows are past the sequence's blocks; the
    30-token prompt is chunked."""
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (16, 30, 15, 13)]


CPU_AND_CUDA = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])


def engine_args(device: str) -> dict:
    return {"device": device, **({"kv_cache_memory_bytes": 1 << 26} if device == "cuda" else {})}


def tolerances(device: str) -> dict:
    return {"tie": 1e-3, "tol": 1e-3} if device == "cuda" else {}


@CPU_AND_CUDA
def test_mtp_chain_drafts_match_the_reference(tiny_v3_mtp, device):
    """k = 3: drafts 2 and 3 come from the MTP layer applied again to its own output state and draft, a position
    further each time (reference: mtp_chain, which re-runs the block over every row, no cache). Chain rows right
    after prefill go into the scratch blocks; in decode steps (a random MTP layer: drafts rejected) they land in the
    slots of the drafts just verified."""
    path, ref = tiny_v3_mtp
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=8, max_num_batched_tokens=24,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3}, **engine_args(device))
    made = recording(llm)
    prompts = chain_prompts(CONFIG["vocab_size"])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for o, p in zip(outs, prompts):
        assert o.outputs[0].token_ids == ref.greedy(p, 12)
    finals = {i + 1: p + o.outputs[0].token_ids for i, (p, o) in enumerate(zip(prompts, outs))}
    assert check_chains(ref, made, finals, **tolerances(device)) >= 30
    runner = llm.engine.runner
    scratch = runner.mtp_scratch.first_block
    assert runner.model.mtp_attention().kv_cache[scratch:].abs().sum() > 0, "no chain row went past its blocks"
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@CPU_AND_CUDA
def test_mtp_chain_drafts_match_the_reference_when_accepted(tiny_v3_mtp_small_vocab, device):
    """The same with the MTP layer made a bigram table of the greedy output (mtp_checkpoint.bigram_mtp; the reference
    takes the engine's changed weights): whole chains are accepted, so a decode step re-runs the MTP layer over the
    accepted drafts' positions (overwriting what the chain wrote there a step before) and its own chain rows go
    past the sequence's blocks."""
    path, ref = tiny_v3_mtp_small_vocab
    prompts = chain_prompts(48)
    want = [ref.greedy(p, 16) for p in prompts]
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=8, max_num_batched_tokens=24,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3}, **engine_args(device))
    model = llm.engine.runner.model
    bigram_mtp(model, [p[-1:] + w for p, w in zip(prompts, want)])
    changed = Reference(ref.trunk, ref.block, ref.rotary, {name: p.detach().cpu().clone() for name, p in
                                                           model.mtp.named_parameters() if not name.startswith("block.")})
    made = recording(llm)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    finals = {i + 1: p + w for i, (p, w) in enumerate(zip(prompts, want))}
    assert check_chains(changed, made, finals, **tolerances(device)) >= 20
    stats = llm.engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens >= 10


def test_mtp_needs_an_mtp_checkpoint_and_at_least_one_draft(tiny_v3_mtp, tiny_llama):
    path, _ = tiny_v3_mtp
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(path, skip_tokenizer_init=True, speculative_config={"method": "mtp", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="MTP layers"):
        LLM(tiny_llama, skip_tokenizer_init=True, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
