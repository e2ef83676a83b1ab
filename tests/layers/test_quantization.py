"""Int8 layers: the path choice per CPU feature set (pure, no host read), and each path's numerics against the
float reference of what it claims to compute (tolerances a wrong path fails)."""

import logging

import pytest
import torch
from torch import nn

from deepserve.kernels.cpu import isa
from deepserve.kernels.cpu.int8_quant import quantize_per_token_ref
from deepserve.layers import quantization
from deepserve.layers.quantization import Int8Linear, Int8Plan, choose_plan, quantize_model

WEIGHT_KERNEL, INT_MM = quantization.torch_kernels()
needs_weight_kernel = pytest.mark.skipif(not WEIGHT_KERNEL, reason="torch lacks _weight_int8pack_mm")
needs_int_mm = pytest.mark.skipif(not INT_MM, reason="torch lacks _int_mm on the CPU")


# ---- dispatch --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,many", [("avx2", "fp32"), ("avx512", "fp32"), ("avx_vnni", "int_mm"),
                                       ("avx512_vnni", "int_mm"), ("amx", "int_mm")])
def test_w8a8_runs_the_int8_gemm_only_with_an_int8_dot_product(name, many):
    plan = choose_plan("w8a8", isa.preset(name))
    assert (plan.few_rows, plan.many_rows) == ("int8_weight", many)
    if many == "fp32":
        assert "VNNI/AMX" in plan.reason and "exact activations" in plan.reason


@pytest.mark.parametrize("name", list(isa.PRESETS))
def test_int8_keeps_activations_exact_on_every_cpu(name):
    plan = choose_plan("int8", isa.preset(name))
    assert (plan.few_rows, plan.many_rows) == ("int8_weight", "fp32")


def test_timings_keep_the_int8_gemm_only_where_it_won_at_every_size():
    vnni = isa.preset("avx512_vnni")
    won = {"int_mm": {17: 1.0, 256: 2.0}, "fp32": {17: 3.0, 256: 9.0}}
    lost_once = {"int_mm": {17: 1.0, 256: 9.5}, "fp32": {17: 3.0, 256: 9.0}}
    assert choose_plan("w8a8", vnni, won).many_rows == "int_mm"
    slow = choose_plan("w8a8", vnni, lost_once)
    assert slow.many_rows == "fp32" and "256 rows 1.06x" in slow.reason
    # Features gate first: a timing cannot bring the int8 GEMM back on a CPU without an int8 dot product.
    assert choose_plan("w8a8", isa.preset("avx2"), won).many_rows == "fp32"


def test_missing_torch_kernels_fall_back_to_fp32():
    amx = isa.preset("amx")
    assert choose_plan("w8a8", amx, int_mm=False).many_rows == "fp32"
    assert choose_plan("w8a8", amx, weight_kernel=False).few_rows == "fp32"
    with pytest.raises(ValueError):
        choose_plan("int4", amx)
    with pytest.raises(ValueError):
        Int8Plan("int_mm", "fp32", "few rows never take the int8 GEMM")


def test_int_mm_without_onednn_is_no_candidate(monkeypatch):
    # torch._int_mm still runs without oneDNN, as a plain loop: far slower than fp32.
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    quantization.torch_kernels.cache_clear()
    try:
        assert quantization.torch_kernels()[1] is False
        assert quantization.default_plan("w8a8", features=isa.preset("amx")).many_rows == "fp32"
    finally:
        quantization.torch_kernels.cache_clear()


def test_environment_forces_the_avx2_choice(monkeypatch):
    monkeypatch.setenv("DEEPSERVE_CPU_ISA", "avx2")
    layer = Int8Linear(torch.randn(32, 64), None, quantize_activations=True)
    assert layer.many_rows == "fp32" and layer.weight_fp32 is not None


# ---- numerics: each path against the float reference of what it claims -------------------------------------

def _layer(rows_in=96, out=160, plan=Int8Plan("int8_weight", "int_mm", "test")):
    torch.manual_seed(0)
    lin = nn.Linear(rows_in, out, bias=True)
    return lin, Int8Linear(lin.weight, lin.bias, quantize_activations=True, plan=plan)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _dequantized(q):
    return q.qweight.double() * q.scales.double()[:, None]


def test_fp32_path_is_the_dequantized_weight_with_exact_activations():
    lin, q = _layer(plan=Int8Plan("fp32", "fp32", "test"))
    x = torch.randn(64, 96)
    out = q.run("fp32", x)
    assert _rel(out, x.double() @ _dequantized(q).T) < 1e-6          # per-token activation rounding: ~1e-2
    assert _rel(out, x @ lin.weight.T) > 1e-4                        # and the weight really is int8


@needs_int_mm
@pytest.mark.parametrize("rows", [17, 64, 300])
def test_int_mm_path_is_per_token_int8_activations(rows):
    _, q = _layer()
    x = torch.randn(rows, 96) * torch.logspace(-2, 2, rows)[:, None]
    xq, xs = quantize_per_token_ref(x)
    ref = (xq.double() @ q.qweight.double().T) * xs.double() * q.scales.double()
    out = q.run("int_mm", x)
    assert _rel(out, ref) < 1e-6
    assert _rel(out, x.double() @ _dequantized(q).T) > 1e-4         # the activations really were quantized


@needs_weight_kernel
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_int8_weight_path_is_bf16_activations(rows):
    _, q = _layer()
    x = torch.randn(rows, 96)
    ref = (x.bfloat16().double() @ q.qweight.double().T) * q.scales_bf16.double()
    assert _rel(q.run("int8_weight", x), ref) < 8e-3                 # one bf16 rounding of the output


@pytest.mark.parametrize("plan", [Int8Plan("int8_weight", "int_mm", "t"), Int8Plan("int8_weight", "fp32", "t"),
                                  Int8Plan("fp32", "fp32", "t")])
@pytest.mark.parametrize("rows", [1, 16, 17, 64])
def test_forward_takes_the_plans_path_for_its_row_count(plan, rows):
    if "int_mm" in (plan.few_rows, plan.many_rows) and not INT_MM:
        pytest.skip("torch lacks _int_mm")
    lin, q = _layer(plan=plan)
    x = torch.randn(rows, 96)
    path = q.few_rows if rows <= 16 else q.many_rows
    assert torch.equal(q(x), q.run(path, x).float() + q.bias)
    assert _rel(q(x), lin(x)) < 0.03                                  # and every path stays near the fp32 layer


def test_in_features_the_int8_weight_kernel_gets_wrong_run_fp32():
    # torch 2.13's _weight_int8pack_mm crashes or miscomputes unless in_features % 16 == 0.
    lin, q = _layer(rows_in=100, out=33)
    x = torch.randn(3, 100)
    assert q.few_rows == "fp32"
    assert _rel(q(x) - q.bias, x.double() @ _dequantized(q).T) < 1e-6


def test_set_plan_holds_the_fp32_weight_only_when_a_path_needs_it():
    _, q = _layer(plan=Int8Plan("int8_weight", "int_mm", "t"))
    assert q.weight_fp32 is None
    q.set_plan(Int8Plan("int8_weight", "fp32", "t"))
    assert torch.equal(q.weight_fp32, (q.qweight.float() * q.scales[:, None]))
    with pytest.raises(RuntimeError, match="fp32 weight"):
        Int8Linear(torch.randn(8, 16), None, plan=Int8Plan("int8_weight", "int_mm", "t")).run("fp32", torch.ones(1, 16))


# ---- whole models ----------------------------------------------------------------------------------------

def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))


def test_quantize_model_applies_one_plan_chosen_from_the_features(caplog):
    with caplog.at_level(logging.WARNING, logger="deepserve.layers.quantization"):
        model = quantize_model(_mlp(), "w8a8", features=isa.preset("avx2"))
    assert "many rows run fp32" in caplog.text and "VNNI/AMX" in caplog.text    # the fallback is logged
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert len(layers) == 2 and {m.many_rows for m in layers} == {"fp32"}
    if INT_MM:
        model = quantize_model(_mlp(), "w8a8", features=isa.preset("amx"))
        assert {m.many_rows for m in model.modules() if isinstance(m, Int8Linear)} == {"int_mm"}


@needs_int_mm
def test_quantize_model_drops_an_int8_gemm_that_timed_slower(monkeypatch):
    calls = []

    def slower(shapes):
        calls.append(shapes)
        return {"int_mm": {17: 2.0, 256: 2.0}, "fp32": {17: 1.0, 256: 1.0}}

    monkeypatch.setattr(quantization, "time_many_row_paths", slower)
    assert {m.many_rows for m in quantize_model(_mlp(), "w8a8", features=isa.preset("amx")).modules()
            if isinstance(m, Int8Linear)} == {"int_mm"} and not calls          # features alone by default
    model = quantize_model(_mlp(), "w8a8", features=isa.preset("amx"), measure=True)
    assert calls == [[(32, 128), (128, 64)]]
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert {m.many_rows for m in layers} == {"fp32"} and "measured" in layers[0].plan.reason


@needs_int_mm
def test_time_many_row_paths_times_both_paths_at_each_size():
    timings = quantization.time_many_row_paths([(48, 32)], rows=(17, 40), repeats=1)
    assert set(timings) == {"int_mm", "fp32"}
    assert all(set(t) == {17, 40} and min(t.values()) > 0 for t in timings.values())


def test_quantize_model_replaces_linears_and_ties_lm_head(tiny_qwen3):
    from deepserve import LLM, SamplingParams

    exact = LLM(tiny_qwen3, skip_tokenizer_init=True)
    quant = LLM(tiny_qwen3, skip_tokenizer_init=True, quantization="int8")
    model = quant.engine.runner.model
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, Int8Linear)
    prompt = {"prompt_token_ids": list(range(3, 40))}
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    a = exact.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    b = quant.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids
    for tok, lp in a.logprobs[0].items():
        assert abs(lp.logprob - b.logprobs[0].get(tok, lp).logprob) < 0.1


def test_unknown_quantization_rejected():
    with pytest.raises(ValueError, match="quantization"):
        quantize_model(nn.Linear(2, 2), "int4")
