"""The speculation gate (spec_decode/gate.py): it exploits whichever mode gave more output tokens per second in its
probes, probes again after each exploit period; and in the engine, switching between speculating (no overlap) and
overlapped plain decoding mid-run changes no greedy token and leaks no KV block."""

from __future__ import annotations

import pytest

from deepserve import LLM, SamplingParams
from deepserve.spec_decode.gate import SpeculationGate
from tests.spec_decode.test_spec_engine import COPY_PROMPTS, token_ids


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def drive(gate: SpeculationGate, clock: FakeClock, steps: int, seconds_per_token: dict[bool, float]) -> list[bool]:
    """Each step emits 4 tokens, taking the mode's time; returns the mode of every step."""
    modes = []
    for _ in range(steps):
        mode = gate.speculating
        modes.append(mode)
        clock.now += 4 * seconds_per_token[mode]
        gate.step_done(4, decoding=True)
    return modes


@pytest.mark.parametrize("faster", [True, False])
def test_speculates_first_then_exploits_the_faster_mode_longer_each_time_it_wins(faster):
    clock = FakeClock()
    gate = SpeculationGate(probe_steps=4, first_steps=20, min_exploit_steps=10, max_exploit_steps=40, settle_steps=1,
                           clock=clock)
    times = {faster: 0.001, not faster: 0.003}
    modes = drive(gate, clock, 20 + 4 + 10 + 4 + 20 + 4 + 40 + 4 + 40, times)
    assert modes[:20] == [True] * 20 and modes[20:24] == [False] * 4     # speculate, then probe without drafts
    at = 24
    for exploit in (10, 20, 40, 40):                                    # doubles while the same mode wins, capped
        assert modes[at:at + exploit] == [faster] * exploit
        assert modes[at + exploit:at + exploit + 4] in ([not faster] * 4, [])   # probe the other again
        at += exploit + 4
    assert gate.rates[faster] == pytest.approx(1000.0) and gate.rates[not faster] == pytest.approx(1000 / 3)


def test_a_change_of_winner_restarts_from_the_shortest_exploit_period():
    clock = FakeClock()
    gate = SpeculationGate(probe_steps=4, first_steps=8, min_exploit_steps=8, max_exploit_steps=64, settle_steps=0,
                           clock=clock)
    modes = drive(gate, clock, 8 + 4 + 8 + 4 + 16 + 4, {True: 0.001, False: 0.003})   # speculating wins twice
    assert modes[-20:-4] == [True] * 16
    # The load changes: speculation is now slower. The probe just run measured off at its old rate, so the next
    # exploit period (32 steps) still speculates; its last 4 steps show the new rate and the probe after it decides.
    modes = drive(gate, clock, 32 + 4 + 8 + 4, {True: 0.005, False: 0.003})
    assert modes[:32] == [True] * 32 and modes[32:36] == [False] * 4
    assert modes[36:44] == [False] * 8                                     # exploit off, from the shortest length
    assert modes[44:48] == [True] * 4
    with pytest.raises(ValueError, match="probe_steps"):
        SpeculationGate(probe_steps=10, first_steps=8)


def test_steps_without_decodes_are_not_measured():
    clock = FakeClock()
    gate = SpeculationGate(probe_steps=3, first_steps=3, min_exploit_steps=3, settle_steps=0, clock=clock)
    for _ in range(3 + 3):                  # prompt-only steps measure nothing
        clock.now += 1.0
        gate.step_done(0, decoding=False)
    assert gate.rates == {True: None, False: None}
    assert gate.speculating and gate._phase.probing     # nothing measured at all: probe speculating again


def test_switching_modes_mid_run_changes_no_greedy_token(default_model_path, smollm):
    """Short phases force many switches, with overlapped scheduling on (the CPU allows it when asked): in both
    directions the engine's tokens equal plain decoding's, and no KV block stays allocated."""
    params = SamplingParams(temperature=0.0, max_tokens=40)
    want = token_ids(smollm.generate(COPY_PROMPTS, params, use_tqdm=False))
    llm = LLM(default_model_path, max_model_len=1024, seed=0, async_scheduling=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "verify_length": "confidence",
                                  "cost_curve": [[1, 10.0], [64, 12.0]]})
    engine = llm.engine
    engine.spec_gate = SpeculationGate(probe_steps=3, first_steps=4, min_exploit_steps=4, max_exploit_steps=4,
                                       settle_steps=0)
    assert token_ids(llm.generate(COPY_PROMPTS, params, use_tqdm=False)) == want
    assert engine.spec_gate.num_switches >= 4
    assert engine.get_stats().spec_decode_num_accepted_tokens > 0     # it did speculate in its speculating phases
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_gate_off_always_speculates(default_model_path):
    llm = LLM(default_model_path, max_model_len=512, seed=0,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2, "verify_length": "confidence",
                                  "cost_curve": [[1, 10.0], [64, 12.0]], "gate": False})
    assert llm.engine.spec_gate is None and llm.engine.speculating
    with pytest.raises(ValueError, match="gate must be true or false"):
        LLM(default_model_path, speculative_config={"method": "ngram", "num_speculative_tokens": 2, "gate": "yes"})
