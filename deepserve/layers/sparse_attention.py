"""DeepSeek-V4.1 attention over paged state (deepinfer.md §2.5-§2.7, §16.6-§16.10): single-KV-head latent attention
with per-head sinks, a sliding window on every layer, and on compressed layers the compressed entries the indexer
picks (sparse) or all visible ones (dense).

Per layer, for the T rows of the step:
    qn = q_norm(wq_a · a);  q = RoPE(wq_b · qn)             [T, nH, D]
    kv = RoPE(kv_norm(wkv · a))  -> the layer's SWA state    [T, D]   (keys = values)
    KV source: compress (own normed input, or the YOCO shared hidden in the consumer half) -> RoPE at j·ratio
               -> compressed state; index-K source: RoPE(k_norm(wk · pre_rope)) -> index-key state
    per sequence: keys = SWA keys [p - W + 1, p]  ∪  compressed entries (selected)
    o = sink softmax attention; o = RoPE⁻¹(o) at the query's position; out = wo_b · (grouped wo_a · o)

Sharing (§2.2): a layer reads its KV source's compressed state, its index-K source's keys and its index source's
top-k choice; `ModelStep` carries what one layer leaves for the next within a forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from deepserve.kernels.reference import sparse_attention as reference
from deepserve.kernels.reference.sparse_attention import candidate_block_mask, rope_interleaved
from deepserve.kernels.topk import topk_indices, topk_mask
from deepserve.layers.kernel_dispatch import use_triton
from deepserve.layers.compressor import NewEntries, compress_step
from deepserve.layers.forward_batch import ForwardBatch
from deepserve.layers.linear import Linear
from deepserve.layers.norm import RMSNorm
from deepserve.layers.paged_state import PagedState, RowSlots, SequenceLayout, keep_rows


# --- kernels: Triton on a GPU, the PyTorch twins elsewhere (kernels/reference/sparse_attention.py) ----------------

def sink_attention_gathered(q, sources, sink, scale):
    if use_triton(q):
        from deepserve.kernels.sparse_attention import sink_attention_gathered as kernel
        return kernel(q, sources, sink, scale)
    return reference.sink_attention_gathered(q, sources, sink, scale)


def index_logits(qi, w, ki):
    if use_triton(qi):
        from deepserve.kernels.sparse_attention import index_logits as kernel
        return kernel(qi, w, ki)
    return reference.index_logits(qi, w, ki)


# --- RoPE (§2.12, §16.12) ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Yarn:
    original_max_position_embeddings: int
    factor: float
    beta_fast: float
    beta_slow: float


def interleaved_inv_freq(rope_dim: int, base: float, yarn: Yarn | None) -> torch.Tensor:
    """float64 [R/2]: base^(-2i/R), blended with base^(-2i/R)/factor by YaRN's ramp when `yarn` (magnitude scale
    1: V4.1 disables mscale). low/high are clamped to [0, R-1] and the ramp runs over i in [0, R/2) (§16.12)."""
    R = rope_dim
    inv_freq = base ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)
    if yarn is None:
        return inv_freq

    def correction_dim(beta: float) -> float:
        return R * math.log(yarn.original_max_position_embeddings / (beta * 2 * math.pi)) / (2 * math.log(base))

    low = min(max(math.floor(correction_dim(yarn.beta_fast)), 0), R - 1)
    high = min(max(math.ceil(correction_dim(yarn.beta_slow)), 0), R - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(R // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq / yarn.factor * ramp + inv_freq * (1 - ramp)


def unit_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x · rsqrt(mean(x²) + eps) over the last dim, no weight, in fp32, returned in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


class InterleavedRope(nn.Module):
    """cos/sin tables [max_position, R/2] (angles in float64, tables fp32) for one (base, YaRN) pair; rotates the
    trailing R dims in place of the pairs (2i, 2i+1), so keys that double as values keep their layout."""

    def __init__(self, rope_dim: int, max_position: int, base: float, yarn: Yarn | None) -> None:
        super().__init__()
        angles = torch.arange(max_position, dtype=torch.float64)[:, None] * interleaved_inv_freq(rope_dim, base, yarn)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        if use_triton(x):                   # one launch instead of the twin's dozen (kernels/interleaved_rope.py)
            from deepserve.kernels.interleaved_rope import rope_at_positions
            return rope_at_positions(x, self.cos, self.sin, positions, inverse)
        sin = self.sin[positions]
        return rope_interleaved(x, self.cos[positions], -sin if inverse else sin)


# --- cross-layer values of one forward (§2.7) ------------------------------------------------------------------

@dataclass
class ModelStep:
    """What one forward's layers hand each other (§2.7): the YOCO shared hidden, each KV source's entries completed
    this step, each index source's chosen entry slots per row, the candidate-block masks per row, and the key-slot
    lists every layer of a kind reads (built once per step, for all rows at once).

    Rows: `layouts`, `rows`, `positions` and `slot_mapping` (their window-state slots) describe the rows the layers
    compute now. They start as
    the batch's rows; YOCO's compact mode (`yoco`, an object with kept_range / window_floor / active / compact,
    models/yoco.py) narrows them to each sequence's kept suffix at the first consumer layer (`compact_rows`).
    Compressors always see every row (`full_rows`, `batch.positions`, `batch.window_slots`): the consumer half's
    compressed KV covers the whole context."""
    batch: ForwardBatch
    full_layouts: list[SequenceLayout]
    window: int
    yoco: object | None = None
    shared_hidden: torch.Tensor | None = None
    new_entries: dict[int, NewEntries] = field(default_factory=dict)
    selected_slots: dict[int, torch.Tensor] = field(default_factory=dict)
    candidates: torch.Tensor | None = None         # [rows, entries] the candidate source's kept blocks
    kept_rows: torch.Tensor | None = None          # after compaction: the computed rows' batch row indices
    full_rows: RowSlots = field(init=False)
    layouts: list[SequenceLayout] = field(init=False)
    rows: RowSlots = field(init=False)
    positions: torch.Tensor = field(init=False)
    slot_mapping: torch.Tensor = field(init=False)
    _slots: dict[tuple, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.full_rows = self.rows = RowSlots.of(self.batch)
        self.layouts, self.positions, self.slot_mapping = self.full_layouts, self.batch.positions, \
            self.batch.window_slots

    def compact_rows(self) -> None:
        """YOCO compact: from here on, each sequence's rows are its kept suffix (§8)."""
        kept_from = [self.yoco.kept_range(seq.first_pos, seq.num_rows, seq.data_len)[0] for seq in self.layouts]
        self.layouts, rows = keep_rows(self.layouts, kept_from)
        self.kept_rows = torch.tensor(rows, dtype=torch.long, device=self.positions.device)
        self.rows = self.rows.select(self.kept_rows)
        self.positions, self.slot_mapping = self.positions[self.kept_rows], self.slot_mapping[self.kept_rows]
        self._slots.clear()
        # Per-row choices made before the split follow their rows (a producer-half candidate source with a
        # consumer-half consumer of the same ratio; the sharing maps never let top-k reuse cross the split).
        if self.candidates is not None:
            self.candidates = self.candidates[self.kept_rows]
        self.selected_slots = {l: slots[self.kept_rows] for l, slots in self.selected_slots.items()}

    def entry_count(self, ratio: int) -> int:
        """The most compressed entries any sequence of the step has (the width of per-row entry lists); in a
        captured decode, the most any row may have (its host-side lengths are placeholders)."""
        if self.batch.graph_max_seq_len:
            return max(1, self.batch.graph_max_seq_len // ratio)
        return max([seq.seq_len // ratio for seq in self.layouts] + [1])

    def decode_entry_table(self, ratio: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, [rows, N] entry slots) of the one-row sequences (decodes), shared by every index source of a
        ratio; None without decodes."""
        key = ("decode_entries", ratio)
        if key not in self._slots:
            decodes = [seq.row_start for seq in self.layouts if seq.num_rows == 1]
            if not decodes:
                return None
            device = self.positions.device
            rows = (torch.arange(len(decodes), device=device) if len(decodes) == self.positions.shape[0]
                    else torch.tensor(decodes, dtype=torch.long, device=device))    # all rows: no host copy
            j = torch.arange(self.entry_count(ratio), device=device)[None, :].expand(len(decodes), -1)
            self._slots[key] = (rows, self.rows.select(rows).entry_slots(j, ratio))
        return self._slots[key]

    def swa_slots(self, consumer: bool) -> torch.Tensor:
        """[rows, W]: the slots of positions p, p-1, ..., p-W+1 of each row's sequence, -1 before position 0 and,
        in consumer layers under YOCO, before the sequence's suffix (window_floor)."""
        # A captured decode has no real data lengths, and needs none: YOCO's KEEP >= W + tokens per decode step
        # (models/yoco.py) puts a decode row's whole window inside the suffix, so the floor never narrows it.
        narrowed = consumer and self.yoco is not None and self.yoco.active and not self.batch.graph_max_seq_len
        key = ("swa", narrowed)
        if key not in self._slots:
            keys = self.positions[:, None] - torch.arange(self.window, device=self.positions.device)[None, :]
            floor = torch.zeros_like(self.positions)
            if narrowed:
                floors = [self.yoco.window_floor(seq.data_len) for seq in self.layouts]
                floor = torch.tensor(floors, dtype=torch.long, device=floor.device)[self.rows.row_seq]
            self._slots[key] = torch.where(keys >= floor[:, None], self.rows.token_slots(keys), -1)
        return self._slots[key]

    def dense_slots(self, ratio: int) -> torch.Tensor:
        """[rows, N]: the slots of every compressed entry visible to each row ([0, (p+1) // ratio)), -1 padded."""
        key = ("dense", ratio)
        if key not in self._slots:
            j = torch.arange(self.entry_count(ratio), device=self.positions.device)[None, :]
            j = j.expand(self.positions.shape[0], -1)
            visible = j < ((self.positions + 1) // ratio)[:, None]
            self._slots[key] = torch.where(visible, self.rows.entry_slots(j, ratio), -1)
        return self._slots[key]


@dataclass(frozen=True)
class LayerRoles:
    """A layer's part in the sharing maps (§2.2, §16.4), from the model config."""
    layer_id: int
    ratio: int                      # 0: window layer
    kv_source: int                  # whose compressed state it reads
    index_source: int               # whose top-k it uses (sparse layers)
    index_k_source: int             # whose index keys an index source scores
    sparse: bool                    # index_topk > 0 on a compressed layer
    consumer: bool                  # YOCO consumer half (its KV source compresses the shared hidden)
    candidate_source: bool = False
    candidate_consumer: bool = False

    @property
    def is_kv_source(self) -> bool:
        return self.ratio > 0 and self.kv_source == self.layer_id

    @property
    def is_index_source(self) -> bool:
        return self.sparse and self.index_source == self.layer_id

    @property
    def is_index_k_source(self) -> bool:
        return self.sparse and self.index_k_source == self.layer_id


@dataclass(frozen=True)
class AttentionShape:
    hidden: int
    heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    eps: float
    index_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    candidate_block_size: int = 0
    candidate_topk_blocks: int = 0
    head_q_norm: bool = False        # DeepSeek-V4: an unweighted RMSNorm over each query head before RoPE


class Indexer(nn.Module):
    """Index sources: `wq_b` [Hi·Di, Lq], `weights_proj` [Hi, H]. Index-K sources: V4.1 projects the KV source's
    compressed entries, `wk` [Di, D] + `k_norm` [Di]; DeepSeek-V4 compresses the layer's input with a compressor of
    its own at Di (`key_compressor`, checkpoint name `indexer.compressor`)."""

    def __init__(self, s: AttentionShape, query: bool, keys: bool, key_compressor: nn.Module | None) -> None:
        super().__init__()
        if query:
            self.wq_b = Linear(s.q_lora_rank, s.index_heads * s.index_head_dim, bias=False)
            self.weights_proj = Linear(s.hidden, s.index_heads, bias=False)
        if keys and key_compressor is not None:
            self.compressor = key_compressor
        elif keys:
            self.wk = Linear(s.head_dim, s.index_head_dim, bias=False)
            self.k_norm = RMSNorm(s.index_head_dim, s.eps)


class SparseLatentAttention(nn.Module):
    """One V4.1 attention layer; parameter names are the checkpoint's (§2.14)."""

    def __init__(self, s: AttentionShape, roles: LayerRoles, rope: InterleavedRope,
                 compressor: nn.Module | None, index_key_compressor: nn.Module | None = None) -> None:
        super().__init__()
        self.shape, self.roles, self.rope = s, roles, rope
        D = s.head_dim
        self.wq_a = Linear(s.hidden, s.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(s.q_lora_rank, s.eps)
        self.wq_b = Linear(s.q_lora_rank, s.heads * D, bias=False)
        self.wkv = Linear(s.hidden, D, bias=False)
        self.kv_norm = RMSNorm(D, s.eps)
        self.wo_a = Linear(s.heads // s.o_groups * D, s.o_groups * s.o_lora_rank, bias=False)   # grouped Wv
        self.wo_b = Linear(s.o_groups * s.o_lora_rank, s.hidden, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(s.heads, dtype=torch.float32))
        self.swa = PagedState("swa_kv", D)
        if roles.is_kv_source:
            self.compressor = compressor
            self.compressed = PagedState("compressed_kv", D, roles.ratio)
            self.compressor_state = PagedState("compressor_state", compressor.state_width, 0, torch.float32)
        if roles.is_index_source or roles.is_index_k_source:
            self.indexer = Indexer(s, roles.is_index_source, roles.is_index_k_source, index_key_compressor)
        if roles.is_index_k_source:
            self.index_keys = PagedState("index_k", s.index_head_dim, roles.ratio)
            if index_key_compressor is not None:
                self.index_key_state = PagedState("index_key_compressor_state", index_key_compressor.state_width, 0,
                                                  torch.float32)
        self.bind_sources(None, None)

    def bind_sources(self, kv_source: "SparseLatentAttention | None",
                     index_k_source: "SparseLatentAttention | None") -> None:
        """The layers whose compressed KV and index keys this one reads (itself when it is the source), bound by
        the model once every layer exists. Plain attributes, not submodules: a source is not owned twice."""
        self.__dict__["kv_source_layer"] = kv_source
        self.__dict__["index_k_source_layer"] = index_k_source

    def paged_states(self) -> list[PagedState]:
        """The states this layer owns (what it shares from a source is the source's)."""
        return [p for p in (self.swa, getattr(self, "compressed", None), getattr(self, "compressor_state", None),
                            getattr(self, "index_keys", None), getattr(self, "index_key_state", None))
                if p is not None]

    def forward(self, a: torch.Tensor, step: ModelStep, compact_here: bool = False) -> torch.Tensor:
        """a: the normed input of step's current rows -> the sublayer output of the rows it computes (with
        `compact_here`, YOCO's first consumer layer: every row compresses, then only the kept rows go on)."""
        s, r = self.shape, self.roles
        if r.is_kv_source:
            self._compress(step.shared_hidden if r.consumer else a, step)
        if r.is_index_k_source:
            self._write_index_keys(a, step)
        if compact_here:
            step.compact_rows()
            a = a[step.kept_rows]
        T, pos = a.shape[0], step.positions
        qn = self.q_norm(self.wq_a(a))
        q = self.wq_b(qn).view(T, s.heads, s.head_dim)
        if s.head_q_norm:
            q = unit_rms_norm(q, s.eps)
        q = self.rope(q, pos)
        kv = self.rope(self.kv_norm(self.wkv(a)), pos)
        self.swa.write(step.slot_mapping, kv)
        sources = [(self.swa.flat(), step.swa_slots(r.consumer))]
        if r.ratio:
            sources.append((self.kv_source_layer.compressed.flat(), self._compressed_slots(qn, a, step)))
        out = sink_attention_gathered(q, sources, self.attn_sink, 1 / math.sqrt(s.head_dim))
        o = self.rope(out.to(a.dtype), pos, inverse=True)               # undo RoPE at the query position (§2.5)
        return self.wo_b(self._grouped_wv(o))

    # --- DSpark draft layers (§2.10): SWA only, the main keys in `swa`, the block's own keys never stored ---------
    def write_main_keys(self, hm: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Main-cache keys RoPE(kv_norm(wkv · hm)) of the target's rows, at their positions' slots."""
        self.swa.write(slots, self.rope(self.kv_norm(self.wkv(hm)), positions))

    def forward_block(self, a: torch.Tensor, positions: torch.Tensor, main_slots: torch.Tensor,
                      block_slots: torch.Tensor) -> torch.Tensor:
        """Draft block rows `a` [T, H] attend to the main keys at `main_slots` [T, W] (-1: none) and to the rows'
        own keys at `block_slots` [T, N] (row indices of this call, -1: none), plus the sink. The block's keys
        are not written anywhere: the positions they stand at belong to the target's next rows."""
        s, T = self.shape, a.shape[0]
        q = self.wq_b(self.q_norm(self.wq_a(a))).view(T, s.heads, s.head_dim)
        if s.head_q_norm:
            q = unit_rms_norm(q, s.eps)
        q = self.rope(q, positions)
        kv = self.rope(self.kv_norm(self.wkv(a)), positions)
        out = sink_attention_gathered(q, [(self.swa.flat(), main_slots), (kv, block_slots)], self.attn_sink,
                                      1 / math.sqrt(s.head_dim))
        o = self.rope(out.to(a.dtype), positions, inverse=True)
        return self.wo_b(self._grouped_wv(o))

    def _grouped_wv(self, o: torch.Tensor) -> torch.Tensor:
        """[T, nH, D] -> [T, G·Lo]: group g = heads g·nH/G .. (g+1)·nH/G - 1 through its own Wv[g] (§16.6)."""
        s, T = self.shape, o.shape[0]
        wv = self.wo_a.weight.view(s.o_groups, s.o_lora_rank, -1)
        grouped = o.reshape(T, s.o_groups, -1).transpose(0, 1)             # [G, T, nH/G·D]
        return torch.bmm(grouped.to(wv.dtype), wv.transpose(1, 2)).transpose(0, 1).reshape(T, -1)

    # --- writes --------------------------------------------------------------------------------------------
    def _compress(self, x: torch.Tensor, step: ModelStep) -> None:
        new = compress_step(self.compressor, x, step.batch.window_slots, step.batch.positions, step.full_rows,
                            self.compressor_state, step.batch.is_decode_only)
        step.new_entries[self.roles.layer_id] = new
        if new.index.numel():
            self.compressed.write(new.slots, self.rope(new.pre_rope, new.index * self.roles.ratio))

    def _write_index_keys(self, a: torch.Tensor, step: ModelStep) -> None:
        """Index keys of the entries completed this step, RoPE'd at j·ratio: V4.1 ki = k_norm(wk · pre_rope) of the
        KV source's new entries; V4 the entries of the indexer's own compressor over this layer's input."""
        if hasattr(self.indexer, "compressor"):
            new = compress_step(self.indexer.compressor, a, step.batch.window_slots, step.batch.positions,
                                step.full_rows, self.index_key_state, step.batch.is_decode_only)
            ki = new.pre_rope
        else:
            new = step.new_entries[self.roles.kv_source]
            ki = self.indexer.k_norm(self.indexer.wk(new.pre_rope)) if new.index.numel() else None
        if new.index.numel():
            self.index_keys.write(new.slots, self.rope(ki, new.index * self.roles.ratio))

    # --- reads ---------------------------------------------------------------------------------------------
    def _compressed_slots(self, qn: torch.Tensor, a: torch.Tensor, step: ModelStep) -> torch.Tensor:
        """[T, K] slots of the compressed entries each row attends to: all visible ones ([0, (p+1) // ratio)) on a
        dense layer, else its index source's top-k (computed here when this layer is that source)."""
        r = self.roles
        if not r.sparse:
            return step.dense_slots(r.ratio)
        if r.is_index_source:
            step.selected_slots[r.layer_id] = self._select(qn, a, step)
        return step.selected_slots[r.index_source]

    def _select(self, qn: torch.Tensor, a: torch.Tensor, step: ModelStep) -> torch.Tensor:
        """Index logits over each row's visible entries, top-k (within the candidate blocks for a candidate
        consumer); the candidate source also keeps each row's best blocks for the consumers (§2.6, §16.10).
        Decode rows go together, each with its own sequence's keys; a prompt chunk's rows share theirs."""
        r, s, ratio = self.roles, self.shape, self.roles.ratio
        pos = step.positions
        width = step.entry_count(ratio)
        chosen = torch.full((pos.shape[0], s.index_topk), -1, dtype=torch.long, device=pos.device)
        if r.candidate_source:
            step.candidates = torch.zeros(pos.shape[0], width, dtype=torch.bool, device=pos.device)
        decode = step.decode_entry_table(ratio)
        if decode is not None:
            rows, table = decode                                                    # [B], [B, N]
            ki = self.index_k_source_layer.index_keys.read(table.flatten()).view(*table.shape, -1)
            self._choose(rows, qn[rows], a[rows], pos[rows], ki, table, width, step, chosen)
        for seq in step.layouts:
            if seq.num_rows == 1:
                continue
            count = seq.seq_len // ratio
            table = seq.entry_slots(ratio, count)
            ki = self.index_k_source_layer.index_keys.read(table)
            # Rows a few at a time: the reference's [rows, heads, entries] fp32 intermediate, or the GPU kernel's
            # [rows, entries] logits (+ the top-k's int64 keys), stays under ~256 MB at long contexts (a 32k-token
            # prompt scores 16k entries per row). Fewer, bigger chunks on the GPU: each chunk is ~10 launches.
            per_row = (1 if use_triton(qn) else s.index_heads) * max(1, count)
            step_rows = max(1, (1 << 26) // per_row)
            for r0 in range(seq.row_start, seq.row_start + seq.num_rows, step_rows):
                rows = torch.arange(r0, min(r0 + step_rows, seq.row_start + seq.num_rows), device=pos.device)
                self._choose(rows, qn[rows], a[rows], pos[rows], ki, table, width, step, chosen)
        return chosen

    def _choose(self, rows: torch.Tensor, qn: torch.Tensor, a: torch.Tensor, pos: torch.Tensor, ki: torch.Tensor,
                table: torch.Tensor, width: int, step: ModelStep, chosen: torch.Tensor) -> None:
        """Top-k of `rows` over keys ki ([N, Di] shared, or [rows, N, Di] per row) whose slots are `table` ([N] or
        [rows, N]); fills chosen[rows] with the chosen entries' slots (and the candidate masks)."""
        r, s, ratio = self.roles, self.shape, self.roles.ratio
        logits = self._index_logits(qn, a, ki, pos)                                 # [n, N]
        N = logits.shape[1]
        visible = torch.arange(N, device=pos.device)[None, :] < ((pos + 1) // ratio)[:, None]
        allowed = visible
        if r.candidate_consumer and step.candidates is not None:
            allowed = allowed & step.candidates[rows, :N]
        top = topk_indices(logits, allowed, s.index_topk)
        table = table.expand(len(rows), -1) if table.dim() == 1 else table
        chosen[rows] = torch.where(top >= 0, table.gather(1, top.clamp(min=0)) if N else -1, -1)
        if r.candidate_source:                          # its own top-k above is unrestricted
            step.candidates[rows, :N] = candidate_block_mask(logits, visible, s.candidate_block_size,
                                                             s.candidate_topk_blocks, select=topk_mask)

    def _index_logits(self, qn: torch.Tensor, a: torch.Tensor, ki: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """[n, N] index logits against shared keys ki [N, Di], or per-row keys ki [n, N, Di]."""
        s, n = self.shape, qn.shape[0]
        qi = self.rope(self.indexer.wq_b(qn).view(n, s.index_heads, s.index_head_dim), pos)
        w = self.indexer.weights_proj(a)
        if ki.dim() == 2:
            return index_logits(qi, w, ki)
        return torch.einsum("th,thj->tj", w.float(), torch.einsum("thd,tjd->thj", qi.float(), ki.float()).relu_())
