"""A CPU stand-in for the decode CUDA graphs (worker/cuda_graph.py), for tests: the runner's real capture and replay
path (static input buffers, padding rows, placeholder host lengths, context buckets, late captures) with each
"graph" running the forward it would have captured."""

from __future__ import annotations


class _EagerReplay:
    """Stands in for a CUDA graph on the CPU: replay() runs the forward it would have captured, on the same static
    input buffers, so the captured-decode code path (padding rows, placeholder host lengths, slot -1 writes,
    context buckets) runs exactly as it would inside a graph."""

    def __init__(self, graphs, size: int, batch) -> None:
        self.graphs, self.size, self.batch = graphs, size, batch

    def replay(self) -> None:
        self.graphs._forward(self.batch, self.size)


def install_eager_replay_graphs(llm, buckets: list[int], sizes: tuple[int, ...] = (1, 2, 4, 8)):
    """The engine's decode steps through a CUDAGraphRunner whose graphs are `_EagerReplay`s (CPU)."""
    from deepserve.worker.cuda_graph import CUDAGraphRunner

    class EagerReplayRunner(CUDAGraphRunner):
        def _record(self, size, batch):
            return _EagerReplay(self, size, batch)

    runner = llm.engine.runner
    sched = llm.engine.config.scheduler
    graphs = EagerReplayRunner(runner.model, runner.attn_backend, runner.block_size, sched.max_model_len,
                               llm.engine.config.model.vocab_size, list(sizes), runner.device,
                               window=bool(runner.window_states()))
    graphs.buckets = buckets
    graphs.capture()
    runner.cuda_graphs = graphs
    return graphs
