"""The PyTorch twins of the kernels: plain, readable tensor code with the kernels' semantics.

What the CPU path runs and what each Triton kernel (and CPU C kernel) is tested against. Pure PyTorch:
importing a module here never imports Triton. The layers reach a twin or its kernel through one dispatch
point each (`layers/kernel_dispatch.use_triton` and the layer's forward); kernels call their twins directly
for fallbacks and for their `*_ref` test entry points.

    norm         RMS norm (statistics in fp32), with the residual add before it
    activation   SwiGLU on a fused gate/up row, with DeepSeek-V4.1's clamp
    rotary       the NeoX "rotate half" rotation
    attention    paged-cache writes and gathers; masked decode and causal prefill attention over gathered keys
    moe          routing rules (softmax / sigmoid / sqrt-softplus; greedy / grouped / noaux_tc) and the expert sum
    sampling     temperature / top-k / top-p / min-p shaping and the float64 inverse CDF
    counter_rng  the counter-based uniforms every sampler draws (a pure function of seed and position)
"""
