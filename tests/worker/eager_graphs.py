"""A CPU stand-in for the decode CUDA graphs (worker/cuda_graph.py), for tests: the runner's real capture and replay
path (static input buffers, padding rows, placeholder host lengths, context buckets, late captures) with each
"graph" running the forward it would have captured; and a recorder of the steps that took a graph's argmax."""

from __future__ import annotations


class _EagerReplay:
    """Stands in for a CUDA graph on the CPU: replay() runs the forward it would have captured, on the same static
    input buffers, so the captured-decode code path (padding rows, placeholder host lengths, slot -1 writes,
    context buckets) runs exactly as it would inside a graph."""

    def __init__(self, graphs, size: int, batch, decode: bool, turn: int | None = None) -> None:
        self.graphs, self.size, self.batch, self.decode, self.turn = graphs, size, batch, decode, turn

    def replay(self) -> None:
        self.graphs._forward(self.batch, self.size, self.decode, self.turn)


def install_eager_replay_graphs(llm, buckets: list[int], sizes: tuple[int, ...] = (1, 2, 4, 8),
                                mixed_buckets: tuple[int, ...] = (), carry_tokens: bool = False,
                                compact_tables: bool = False, mapped_io: bool = False):
    """The engine's decode steps (and, with `mixed_buckets`, its steps with prompt work, which needs an attention
    backend with `build_mixed_graph_metadata`: install_twin_triton_attention) through a CUDAGraphRunner whose graphs
    are `_EagerReplay`s (CPU); `carry_tokens`, `compact_tables` and `mapped_io` as CUDAGraphRunner's."""
    from deepserve.worker.cuda_graph import CUDAGraphRunner

    class EagerReplayRunner(CUDAGraphRunner):
        def _record(self, size, batch, decode=False, turn=None):
            return _EagerReplay(self, size, batch, decode, turn)

    runner = llm.engine.runner
    sched = llm.engine.config.scheduler
    graphs = EagerReplayRunner(runner.model, runner.attn_backend, runner.block_size, sched.max_model_len,
                               llm.engine.config.model.vocab_size, list(sizes), runner.device,
                               window=bool(runner.window_states()), mixed_buckets=list(mixed_buckets),
                               carry_tokens=carry_tokens, compact_tables=compact_tables, mapped_io=mapped_io)
    graphs.buckets = buckets
    graphs.capture()
    runner.cuda_graphs = graphs
    return graphs


def install_twin_triton_attention(llm):
    """Every attention layer's backend becomes TritonPagedAttention running the kernels' PyTorch twins (CPU): the GPU
    backend's metadata and dispatch (decode rows, prefill tiles, the mixed-step graph metadata) on the CPU."""
    from deepserve.kernels.kv_write import rotary_write_kv_ref, write_kv_ref
    from deepserve.kernels.paged_attention import decode_attention_ref
    from deepserve.kernels.paged_prefill import prefill_attention_ref
    from deepserve.layers.attention_triton import TritonPagedAttention, decode_inputs

    class TwinTritonAttention(TritonPagedAttention):
        def forward(self, q, k, v, kv_cache, batch, scale, rotary=None, qk_norm=None, prefetch=None, window=0):
            meta = batch.attn_metadata if batch.attn_metadata is not None else self.build_metadata(batch)
            if qk_norm is not None:      # (Qwen3) the norms the GPU kernel applies before rotating
                q, k = qk_norm[0](q), qk_norm[1](k)
            if rotary is not None:
                q = rotary_write_kv_ref(kv_cache, q, k, v, batch.slot_mapping, batch.positions,
                                        rotary.cos_cache, rotary.sin_cache)
            else:
                keep = batch.slot_mapping >= 0
                write_kv_ref(kv_cache, k[keep], v[keep], batch.slot_mapping[keep])
            out = q.new_zeros(q.shape)
            if meta.num_decodes:      # the int32 copies where the GPU backend reads them (decode_inputs)
                tables, lens, rows, seqs = decode_inputs(meta, batch)
                decode_attention_ref(q, kv_cache, tables, lens, scale, out=out, q_rows=rows, seq_ids=seqs,
                                     window=window)
            if meta.num_prefill_tiles:
                prefill_attention_ref(q, kv_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                                      scale, meta.tile_seq, meta.tile_m0, out=out, window=window)
            return out

    backend = TwinTritonAttention()
    runner = llm.engine.runner
    for layer in runner.model.attention_layers():
        layer.backend = backend
    runner.attn_backend = backend
    return backend


def record_carried_steps(llm) -> list[bool]:
    """A list that gets, for every step the engine launches from now on, whether it took the decode graph's argmax
    as its sample (LaunchedStep.carried, DEEPSERVE_GRAPH_TOKENS)."""
    carried: list[bool] = []
    launch = llm.engine.runner.launch

    def recording(out, previous=None):
        step = launch(out, previous)
        carried.append(step.carried)
        return step
    llm.engine.runner.launch = recording
    return carried
