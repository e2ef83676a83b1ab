"""Constrained decoding end to end on the default model: 50 sampled requests per grammar kind (one batch each)
all match; free requests beside constrained ones decode exactly as alone; grammar failures finish with their
own finish reason; compiling happens outside the scheduler."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future

import pytest

from deepserve import SamplingParams
from deepserve.sequence import SequenceStatus
from deepserve.structured.spec import from_structured_outputs

# One OpenMP thread: on 2 cores shared with other jobs, two threads spin against each other (a small matmul
# took 12x longer), and these tests run many small decode steps.
pytestmark = pytest.mark.usefixtures("one_torch_thread")

N = 50

# Short outputs keep 50-request batches quick on a shared 2-core CPU (SmolLM2 writes one token per digit).
PERSON = {"type": "object",
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"},
                         "tag": {"type": "string", "pattern": "^[a-z]{1,4}$"}},
          "required": ["id", "ok", "tag"]}

# Sums of one-digit numbers or products, e.g. "3+(4*5)": a GBNF / EBNF grammar.
SUM_EBNF = r'''
root ::= term ("+" term)?
term ::= [1-9] | "(" [1-9] "*" [1-9] ")"
'''
SUM_RE = re.compile(r"(?:[1-9]|\([1-9]\*[1-9]\))(?:\+(?:[1-9]|\([1-9]\*[1-9]\)))?")


def check_person(value) -> None:
    assert isinstance(value, dict) and set(value) == set(PERSON["properties"]), value
    assert isinstance(value["id"], int) and not isinstance(value["id"], bool) and 0 <= value["id"] <= 99
    assert isinstance(value["ok"], bool)
    assert isinstance(value["tag"], str) and re.fullmatch("[a-z]{1,4}", value["tag"])


def sampled(structured_outputs: dict, max_tokens: int = 40, temperature: float = 1.0) -> list[SamplingParams]:
    return [SamplingParams(temperature=temperature, seed=i, max_tokens=max_tokens,
                           structured_outputs=structured_outputs)
            for i in range(N)]


def texts_of(outs) -> list[str]:
    for o in outs:
        assert o.outputs[0].finish_reason == "stop", (o.outputs[0].text, o.outputs[0].finish_reason)
    return [o.outputs[0].text for o in outs]


def test_json_schema(smollm):
    outs = smollm.generate(["A user record in JSON:"] * N, sampled({"json": PERSON}), use_tqdm=False)
    for text in texts_of(outs):
        check_person(json.loads(text))


def test_json_object(smollm):
    outs = smollm.generate(['A JSON object, e.g. {"a": 1}:'] * N, sampled({"json_object": True}, 24, 0.7),
                           use_tqdm=False)
    for o in outs:      # a free-form object may run past max_tokens; every one that ended is an object
        c = o.outputs[0]
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict), c.text
        else:
            assert c.finish_reason == "length" and c.text.startswith("{")
    assert sum(o.outputs[0].finish_reason == "stop" for o in outs) >= 0.6 * N


def test_regex(smollm):
    pattern = r"[A-Z]{2}-\d{3}"
    outs = smollm.generate(["Flight number:"] * N, sampled({"regex": pattern}), use_tqdm=False)
    for text in texts_of(outs):
        assert re.fullmatch(pattern, text), text


def test_choice(smollm):
    choices = ["positive", "negative", "neutral", "don't know"]
    outs = smollm.generate(["The sentiment of 'I love it' is"] * N, sampled({"choice": choices}), use_tqdm=False)
    texts = texts_of(outs)
    assert set(texts) <= set(choices) and len(set(texts)) > 1        # sampled: more than one answer


def test_ebnf_grammar(smollm):
    outs = smollm.generate(["A sum:"] * N, sampled({"grammar": SUM_EBNF}), use_tqdm=False)
    texts = texts_of(outs)
    for text in texts:
        assert SUM_RE.fullmatch(text), text
    assert any("+" in t for t in texts) and any("*" in t for t in texts)


def test_so_args_trigger_frees_tokens_until_the_bound_token(smollm, tokenizer):
    prompt = "Write the number three hundred and twelve:"
    free = smollm.generate(prompt, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    first = free.outputs[0].token_ids[0]           # the bound token: the model's own first token
    trigger = tokenizer.encode("ANSWER=", add_special_tokens=False)
    so_args = {"schema_type": "regex", "schema": "[0-9]{3}", "trigger_token_ids": trigger, "bound_token_id": first}
    out = smollm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, so_args=so_args),
                          use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:1 + len(trigger)] == [first] + trigger          # free token, then the forced trigger
    assert re.fullmatch(r"[0-9]{3}", tokenizer.decode(out.token_ids[1 + len(trigger):])), out.text
    assert out.finish_reason == "stop"


def test_free_requests_are_unchanged_by_constrained_companions(smollm):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = smollm.generate(prompts, greedy, use_tqdm=False)
    companions = [SamplingParams(temperature=0.8, seed=i, max_tokens=40, structured_outputs=so)
                  for i, so in enumerate([{"json": PERSON}, {"regex": "[a-z]{5,9}"}, {"choice": ["x", "y"]}])]
    mixed = smollm.generate(["JSON:", *prompts, "word:", "pick:"], [companions[0], greedy, greedy, greedy,
                                                                     companions[1], companions[2]], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[1:4]] == [o.outputs[0].token_ids for o in alone]
    check_person(json.loads(mixed[0].outputs[0].text))
    assert re.fullmatch("[a-z]{5,9}", mixed[4].outputs[0].text) and mixed[5].outputs[0].text in ("x", "y")


def test_n_greater_than_one_gives_each_sequence_its_own_matcher(smollm):
    out = smollm.generate("Pick:", SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=16,
                                                  structured_outputs={"regex": "(ab|cd){2}"}), use_tqdm=False)[0]
    for c in out.outputs:
        assert re.fullmatch("(ab|cd){2}", c.text) and c.finish_reason == "stop"


def test_a_grammar_that_cannot_continue_finishes_with_its_own_reason(smollm, eos):
    # After "yes" only EOS is allowed, but min_tokens bans EOS: nothing is left, the token drawn is refused.
    out = smollm.generate("Answer:", SamplingParams(temperature=0, max_tokens=8, min_tokens=4,
                                                    structured_outputs={"choice": ["yes"]}), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == SequenceStatus.FINISHED_SO_FAILED.finish_reason == "structured_output_failed"
    assert c.token_ids[:-1] and c.stop_reason == c.token_ids[-1] != eos
    assert out.finished and out.error is None


@pytest.mark.parametrize("so", [{"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
                                {"regex": "(unclosed"}, {"grammar": "root ::= missing"}])
def test_a_bad_grammar_is_a_value_error_for_that_request_only(smollm, so):
    before = smollm.engine.get_num_unfinished_requests()
    with pytest.raises(ValueError, match="structured_outputs: invalid"):
        smollm.generate(["fine", "bad"], [SamplingParams(max_tokens=2), SamplingParams(structured_outputs=so)],
                        use_tqdm=False)
    assert smollm.engine.get_num_unfinished_requests() == before
    assert smollm.generate("still fine", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_others_decode_while_a_grammar_compiles_and_it_is_scheduled_once_compiled(smollm):
    """A compile still running (a Future not yet done, standing in for a slow grammar) keeps its request out of
    the scheduler; the free request decodes meanwhile; once the grammar is there the request runs and matches."""
    engine = smollm.engine
    spec = from_structured_outputs({"regex": "slow-[0-9]{2}"})
    compiled = engine.grammar_compiler.compile(spec)
    pending: Future = Future()
    engine.add_request("free", "Hello", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    engine.add_request("slow", "Code:", SamplingParams(temperature=0, max_tokens=8))
    slow_seq = engine.requests["slow"].seqs[0]
    assert engine.grammars.remove(slow_seq) is False      # plain params: it went to the scheduler ...
    engine.abort_request("slow")                           # ... so re-add it as a compiling structured request
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=spec)
    engine.add_request("slow", "Code:", params)
    seq = engine.requests["slow"].seqs[0]
    engine.grammars.remove(seq)
    engine.grammars.add([seq], spec, pending)
    outputs = {}
    for _ in range(6):
        for out in engine.step():
            outputs[out.request_id] = out
    assert outputs["free"].finished and len(outputs["free"].outputs[0].token_ids) == 6
    assert seq.status is SequenceStatus.WAITING and seq.num_computed_tokens == 0 and "slow" not in outputs
    pending.set_result(compiled)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    assert re.fullmatch("slow-[0-9]{2}", outputs["slow"].outputs[0].text)


def test_a_compile_past_the_timeout_fails_that_request(smollm, monkeypatch):
    engine = smollm.engine
    monkeypatch.setenv("DEEPSERVE_SO_COMPILE_TIMEOUT", "0")
    spec = from_structured_outputs({"regex": "never"})
    engine.add_request("late", "x", SamplingParams(max_tokens=4, structured_outputs=spec))
    seq = engine.requests["late"].seqs[0]
    engine.grammars.remove(seq)
    engine.grammars.add([seq], spec, Future())             # a compile that never ends
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    (out,) = [o for o in outs if o.request_id == "late"]
    assert out.outputs[0].finish_reason == "structured_output_failed" and "did not compile" in out.error


@pytest.fixture(scope="module")
def overlapped(smollm, default_model_path):
    """A second engine of the default model, overlapped (async scheduling) and with a KV cache of 12 blocks of
    16 tokens, so that a batch of structured requests gets preempted. One load serves both tests below."""
    from deepserve import LLM
    per_token = smollm.engine.runner.kv_bytes_per_token()
    return LLM(default_model_path, max_model_len=512, seed=0, async_scheduling=True, block_size=16,
               kv_cache_memory_bytes=int(12 * 16 * per_token))


def test_overlapped_scheduling_waits_for_the_token_a_mask_needs(smollm, overlapped):
    """With async scheduling a step is launched before the previous token is known; a constrained sequence's
    mask needs that token, so the engine collects it first: outputs equal the plain loop's, free ones too."""
    assert overlapped.engine.async_scheduling
    prompts = ["JSON:", "The capital of France is", "word:"]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json": PERSON}),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=5, max_tokens=12, structured_outputs={"regex": "[a-z]{3,8}"})]
    plain = smollm.generate(prompts, params, use_tqdm=False)
    ahead = overlapped.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ahead] == [o.outputs[0].token_ids for o in plain]
    check_person(json.loads(ahead[0].outputs[0].text))
    assert re.fullmatch("[a-z]{3,8}", ahead[2].outputs[0].text)


def test_aborting_a_request_whose_grammar_compiles_removes_it(smollm):
    engine = smollm.engine
    spec = from_structured_outputs({"regex": "abort-me"})
    engine.add_request("gone", "x", SamplingParams(max_tokens=4, structured_outputs=spec))
    seq = engine.requests["gone"].seqs[0]
    engine.grammars.remove(seq)
    engine.grammars.add([seq], spec, Future())             # still compiling
    engine.abort_request("gone")
    assert seq.status is SequenceStatus.FINISHED_ABORTED and len(engine.grammars) == 0
    assert not engine.has_unfinished_requests() and engine.scheduler.num_waiting == 0


def test_a_preempted_structured_request_is_recomputed_and_still_matches(smollm, overlapped):
    """The matcher follows tokens, not KV: a request preempted (KV dropped, recomputed from its tokens) resumes
    from the same grammar state, so its output equals the run without preemption."""
    small = overlapped
    before = small.engine.scheduler.num_preemptions
    prompts = [f"Record {i} as JSON:" for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json": PERSON})
    squeezed = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > before, "the cache was meant to force preemption"
    roomy = smollm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in squeezed] == [o.outputs[0].token_ids for o in roomy]
    for o in squeezed:
        check_person(json.loads(o.outputs[0].text))
