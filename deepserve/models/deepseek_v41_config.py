"""DeepSeek-V4.1-Flash config (`DeepseekV41ForCausalLM`, model_type "deepseek_v41"): spec §2.1, §2.2, §16.1-§16.4.

`DeepseekV41Config.from_hf_dict(config_json)` reads a config.json dict (the top level overlaid by `text_config`,
§16.1), and the dataclass derives every per-layer role once (§2.2): the layer type (window / C1 / C2), the KV,
index and index-K sharing maps, the YOCO producer/consumer split (`n_prefill_layer`), the candidate-block source
and the DSpark draft layers. Every failed check is a ValueError naming the offending field and value.

Differences from DeepSeek-V4 are kept as explicit fields. `from_hf_dict` reads V4.1 only and validates every
internal field to its V4.1 value; a DeepSeek-V4 config (`model_type` "deepseek_v4") is built by
models/deepseek_v4_config.py (`deepseek_v4_config`), validated here to V4's values (`_check_v4`; docs/deepseek_v4.md
has each difference with its formula). V4 (transformers' DeepseekV4): per-layer `attention_types` window / CSA /
HCA with any compress ratio (released: 4 and 128, tiny tests: smaller), CSA pooling overlapping windows of 2·ratio
tokens (`compress_overlap`) with a learned position bias (`use_ape`) and an indexer whose keys come from its own
compressor (`indexer_kproj` False), HCA dense (no indexer); a per-head unweighted q RMSNorm (`use_qnorm`); hash-routed
MoE in the first `num_hash_layers` layers; the HC head (`hc_shifted` False); no sharing lists, YOCO split, candidate
blocks, Engram or DSpark drafts (every layer its own source, `n_prefill_layer` = L).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

MODEL_TYPE = "deepseek_v41"
ARCHITECTURE = "DeepseekV41ForCausalLM"
V4_MODEL_TYPE = "deepseek_v4"                  # DeepSeek-V4, built by models/deepseek_v4_config.py
WINDOW, C1, C2 = "window", "c1", "c2"          # layer types by compress ratio 0, 1, 2 (§2.2)
LAYER_TYPES = {0: WINDOW, 1: C1, 2: C2}
# DeepSeek-V4 layer types: compressed sparse (overlapping windows + indexer top-k), heavily compressed (dense).
CSA, HCA = "csa", "hca"
V4_ATTENTION_TYPES = (WINDOW, CSA, HCA)

# §2.1: the one quantization_config accepted (absent = unquantized checkpoint, §16.1).
QUANTIZATION_CONFIG = {"quant_method": "fp8", "expert_dtype": "fp4", "activation_scheme": "dynamic",
                       "weight_block_size": [32, 32], "scale_fmt": "ue8m0"}
# §2.1 hard requirements: field -> the only accepted value.
HARD_REQUIREMENTS = {"hidden_act": "silu", "attention_bias": False, "attention_dropout": 0,
                     "num_key_value_heads": 1, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True,
                     "topk_method": "noaux_tc", "dspark_target_attn_input": True}
# §2.1 "internal defaults of note": not in config.json; settable for another reading, validated to V4.1's value.
INTERNAL_DEFAULTS = {"hc_dynamic": True, "hc_post_mult_value": 2.0, "hc_pre_init": 3.0, "hc_res_init": 3.0,
                     "hc_post_init": 0.0, "hc_dynamic_scale": 0.01, "rope_interleaved": True, "use_qnorm": False,
                     "use_kv_norm_weight": True, "yoco_swa_share_hidden": False, "sparse_stage": 2,
                     "use_ape": False, "compress_overlap": False, "num_hash_layers": 0, "indexer_kproj": True}
# Internal defaults the reference forward implements only at their V4.1 value.
FIXED_INTERNALS = ("hc_dynamic", "rope_interleaved", "use_qnorm", "use_kv_norm_weight", "yoco_swa_share_hidden",
                   "use_ape", "compress_overlap", "num_hash_layers", "indexer_kproj")
# DeepSeek-V4's values of the same internals (num_hash_layers is free there: 0..L hash-routed first layers).
V4_INTERNALS = {**{k: INTERNAL_DEFAULTS[k] for k in FIXED_INTERNALS if k != "num_hash_layers"},
                "use_qnorm": True, "use_ape": True, "compress_overlap": True, "indexer_kproj": False}


def _fail(name: str, value: Any, why: str) -> ValueError:
    return ValueError(f"DeepseekV41Config: {name}={value!r}: {why}")


@dataclass(frozen=True)
class YarnScaling:
    """`rope_scaling` (§2.1, §2.12): YaRN for compressed layers only; mscale disabled."""
    original_max_position_embeddings: int
    factor: float
    beta_fast: float
    beta_slow: float


@dataclass(frozen=True)
class DeepseekV41Config:
    # --- dimensions (§2.1) ---
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    sliding_window: int
    rope_theta: float
    q_lora_rank: int
    head_dim: int
    qk_rope_head_dim: int
    o_lora_rank: int
    o_groups: int
    # --- mHC (§2.4) ---
    hc_mult: int
    # --- attention topology (§2.2, §2.6) ---
    compress_ratios: tuple[int, ...]
    index_topk: int
    index_n_heads: int
    index_head_dim: int
    # --- MoE (§2.8) ---
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    routed_scaling_factor: float
    # --- optional, with the defaults of §2.1 / §16.1 ---
    compress_rope_theta: float | None = None          # None -> rope_theta (§16.1)
    rope_scaling: YarnScaling | None = None
    swiglu_limit: float | None = None                 # falsy -> no clamp (§16.1)
    hc_shifted: bool = True
    hc_eps: float | None = None                       # required when hc_mult > 1 (§16.1)
    hc_sinkhorn_iters: int | None = None              # required when hc_mult > 1 (§16.1)
    kv_source_layer_ids: tuple[int, ...] | None = None      # None -> every layer is its own source (§16.1)
    index_source_layer_ids: tuple[int, ...] | None = None
    index_k_source_layer_ids: tuple[int, ...] | None = None  # None -> the kv sources (§2.1)
    candidate_source_layer_id: int | None = None
    candidate_topk_blocks: int | None = None
    candidate_block_size: int | None = None
    use_fp4_sparse_kv: bool = True
    hidden_act: str = "silu"
    attention_bias: bool = False
    attention_dropout: float = 0.0
    num_key_value_heads: int = 1
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    topk_method: str = "noaux_tc"
    # --- DSpark draft model (§2.10) ---
    num_nextn_predict_layers: int = 0
    dspark_block_size: int | None = None              # parsed, not used at runtime (§2.1)
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_target_attn_input: bool = True
    dspark_markov_rank: int | None = None
    dspark_noise_token_id: int | None = None
    # Reading: absent dspark expert counts = the backbone's (§2.8 "overridden by the dspark fields").
    dspark_n_routed_experts: int | None = None        # None -> n_routed_experts
    dspark_num_experts_per_tok: int | None = None     # None -> num_experts_per_tok
    # --- Engram (§2.9); empty engram_layer_ids disables it ---
    engram_layer_ids: tuple[int, ...] = ()
    engram_max_ngram_size: int | None = None
    engram_vocab_size: int | None = None
    engram_n_heads: int | None = None
    engram_head_dim: int | None = None
    engram_compressed_vocab_size: int | None = None   # truthy -> compressed tokenizer required
    engram_pad_token_id: int | None = None            # None -> pad_token_id (Reading, see from_hf_dict)
    # --- top level ---
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    quantization_config: Mapping[str, Any] | None = field(default=None, compare=False, hash=False)
    vision_config: Mapping[str, Any] | None = field(default=None, compare=False, hash=False)
    # --- §2.1 internal defaults (explicit so that a DeepSeek-V4 reading can differ) ---
    hc_dynamic: bool = True
    hc_post_mult_value: float = 2.0
    hc_pre_init: float = 3.0
    hc_res_init: float = 3.0
    hc_post_init: float = 0.0
    hc_dynamic_scale: float = 0.01
    rope_interleaved: bool = True
    use_qnorm: bool = False
    use_kv_norm_weight: bool = True
    yoco_swa_share_hidden: bool = False
    sparse_stage: int = 2
    use_ape: bool = False
    compress_overlap: bool = False
    num_hash_layers: int = 0                          # DeepSeek-V4: hash-routed MoE in the first layers
    indexer_kproj: bool = True                        # index K = wk(compressed KV) (§2.6); V4: own compressor
    # --- model family: V4.1, or DeepSeek-V4 (set only by models/deepseek_v4_config.py) ---
    model_type: str = MODEL_TYPE
    attention_types: tuple[str, ...] | None = None    # V4 only: "window" / "csa" / "hca" per backbone layer
    # --- derived once in __post_init__ (§2.1 "Derived", §2.2) ---
    kv_lora_rank: int = field(init=False)
    n_prefill_layer: int = field(init=False)
    layer_types: tuple[str, ...] = field(init=False)
    kv_map: tuple[int, ...] = field(init=False)
    index_map: tuple[int, ...] = field(init=False)
    index_k_map: tuple[int, ...] = field(init=False)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_hf_dict(cls, config: Mapping[str, Any]) -> "DeepseekV41Config":
        """From a config.json dict: the top level overlaid by `text_config` (text_config wins, §16.1)."""
        top = dict(config)
        if top.get("model_type") != MODEL_TYPE:
            raise _fail("model_type", top.get("model_type"), f"must be {MODEL_TYPE!r}")
        archs = top.get("architectures")
        if not isinstance(archs, (list, tuple)) or len(archs) != 1 or archs[0] != ARCHITECTURE:
            raise _fail("architectures", archs, f"must be exactly [{ARCHITECTURE!r}]")
        # Reading: `torch_dtype` (the pre-transformers-5 name) is accepted for `dtype`; absent = an error (§2.1
        # "must have"). The tensors themselves may be F32 in unquantized checkpoints (§16.3).
        dtype = top.get("dtype", top.get("torch_dtype"))
        if dtype != "bfloat16":
            raise _fail("dtype", dtype, "must be 'bfloat16'")
        merged = {**top, **dict(top.get("text_config") or {})}
        merged.pop("text_config", None)

        quant = merged.get("quantization_config")
        if quant is not None:
            for key, want in QUANTIZATION_CONFIG.items():
                got = quant.get(key)
                if (list(got) if isinstance(got, (list, tuple)) else got) != want:
                    raise _fail(f"quantization_config.{key}", got, f"must be {want!r}")
        # Reading: a hard requirement must be present (except dspark_target_attn_input, default True in §2.1);
        # a JSON null counts as absent everywhere (the field's default applies, or it is "missing").
        for name, want in HARD_REQUIREMENTS.items():
            if name not in merged and name != "dspark_target_attn_input":
                raise _fail(name, None, "required field is missing")
            if merged.get(name, want) != want:
                raise _fail(name, merged[name], f"must be {want!r}")

        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            if not f.init:
                continue
            if merged.get(f.name) is not None:                    # null = absent: the default applies
                kwargs[f.name] = merged[f.name]
            elif f.default is MISSING:
                raise _fail(f.name, None, "required field is missing")

        if kwargs.get("rope_scaling") is not None:
            # Reading: all four rope_scaling keys are required (no HF-style beta defaults); "type" is ignored.
            rs = kwargs["rope_scaling"]
            for key in ("original_max_position_embeddings", "factor", "beta_fast", "beta_slow"):
                if rs.get(key) is None:
                    raise _fail(f"rope_scaling.{key}", None, "required field is missing")
            kwargs["rope_scaling"] = YarnScaling(int(rs["original_max_position_embeddings"]), float(rs["factor"]),
                                                 float(rs["beta_fast"]), float(rs["beta_slow"]))
        for name in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids",
                     "index_k_source_layer_ids", "dspark_target_layer_ids", "engram_layer_ids"):
            value = kwargs.get(name)
            if value is not None:
                if not isinstance(value, Sequence) or isinstance(value, str):
                    raise _fail(name, value, "must be a list of integers")
                kwargs[name] = tuple(int(v) for v in value)
        if isinstance(kwargs.get("eos_token_id"), list):
            kwargs["eos_token_id"] = tuple(kwargs["eos_token_id"])
        # Reading: the Engram pad id defaults to the top-level pad_token_id (the tokenizer's PAD, id 2 in §2.1).
        if kwargs.get("engram_layer_ids") and kwargs.get("engram_pad_token_id") is None:
            kwargs["engram_pad_token_id"] = kwargs.get("pad_token_id")
        if not kwargs.get("swiglu_limit"):
            kwargs["swiglu_limit"] = None                         # falsy = no clamp (§16.1)
        for name in ("tie_word_embeddings", "hc_shifted", "use_fp4_sparse_kv"):
            if name in kwargs:
                kwargs[name] = bool(kwargs[name])
        return cls(**kwargs)

    # ------------------------------------------------------------------ derivation and validation

    def __post_init__(self) -> None:
        L = self.num_hidden_layers
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen dataclass)
        if self.compress_rope_theta is None:
            set_("compress_rope_theta", self.rope_theta)               # §16.1
        if not self.swiglu_limit:
            set_("swiglu_limit", None)
        self._check_dimensions()
        if len(self.compress_ratios) != L + self.num_nextn_predict_layers:
            raise _fail("compress_ratios", list(self.compress_ratios),
                        f"length must be num_hidden_layers + num_nextn_predict_layers = "
                        f"{L + self.num_nextn_predict_layers}")
        ratios = self.compress_ratios[:L]
        set_("kv_lora_rank", self.head_dim - self.qk_rope_head_dim)
        if self.is_v4:
            self._check_v4()
            set_("layer_types", self.attention_types)
            set_("n_prefill_layer", L)                                  # V4 has no YOCO split
        else:
            if self.model_type != MODEL_TYPE:
                raise _fail("model_type", self.model_type, f"must be {MODEL_TYPE!r} or {V4_MODEL_TYPE!r}")
            if self.attention_types is not None:
                raise _fail("attention_types", self.attention_types, "DeepSeek-V4 only (V4.1 layer types come "
                            "from compress_ratios)")
            # §16.4 check 1: ratios in {0, 1, 2}. # Reading: draft entries are checked too, but a draft layer is
            # SWA-only (base RoPE) whatever its value (§2.2).
            for i, r in enumerate(self.compress_ratios):
                if r not in LAYER_TYPES:
                    raise _fail(f"compress_ratios[{i}]", r, "compress ratio must be 0, 1 or 2")
            set_("layer_types", tuple(LAYER_TYPES[r] for r in ratios))
            # §2.1 / §16.2: the first layer of ratio 1 starts the YOCO consumer half; L when there is none.
            set_("n_prefill_layer", next((l for l, r in enumerate(ratios) if r == 1), L))

        kv_ids = self._source_ids("kv_source_layer_ids", self.kv_source_layer_ids)
        index_ids = self._source_ids("index_source_layer_ids", self.index_source_layer_ids)
        index_k_ids = self._source_ids("index_k_source_layer_ids",
                                       self.index_k_source_layer_ids if self.index_k_source_layer_ids is not None
                                       else self.kv_source_layer_ids)
        set_("kv_map", sharing_map(kv_ids, L))
        set_("index_map", sharing_map(index_ids, L))
        set_("index_k_map", sharing_map(index_k_ids, L))
        self._check_maps()
        self._check_candidates()
        self._check_drafts()
        self._check_engram()
        self._check_internals()

    def _check_dimensions(self) -> None:
        positive = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_position_embeddings",
                    "sliding_window", "q_lora_rank", "head_dim", "qk_rope_head_dim", "o_lora_rank", "o_groups",
                    "hc_mult", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise _fail(name, value, "must be a positive integer")
        for name in ("index_topk", "n_shared_experts", "num_nextn_predict_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise _fail(name, value, "must be a non-negative integer")
        for name, want in HARD_REQUIREMENTS.items():
            if getattr(self, name) != want:
                raise _fail(name, getattr(self, name), f"must be {want!r}")
        R = self.qk_rope_head_dim
        if R % 2:
            raise _fail("qk_rope_head_dim", R, "must be even (RoPE rotates pairs)")
        if self.head_dim <= R:
            raise _fail("head_dim", self.head_dim, f"must exceed qk_rope_head_dim={R} (kv_lora_rank = D - R > 0)")
        if self.num_attention_heads % self.o_groups:
            raise _fail("o_groups", self.o_groups,
                        f"must divide num_attention_heads={self.num_attention_heads}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise _fail("num_experts_per_tok", self.num_experts_per_tok,
                        f"must be <= n_routed_experts={self.n_routed_experts}")
        if any(r > 0 for r in self.compress_ratios[:self.num_hidden_layers]) and self.index_topk > 0:
            for name in ("index_n_heads", "index_head_dim"):
                if getattr(self, name) <= 0:
                    raise _fail(name, getattr(self, name), "must be positive for sparse compressed layers")
            if self.index_head_dim < R:
                raise _fail("index_head_dim", self.index_head_dim, f"must be >= qk_rope_head_dim={R}")
        if self.hc_mult > 1:
            if self.hc_eps is None:
                raise _fail("hc_eps", None, "required when hc_mult > 1")
            if self.hc_sinkhorn_iters is None:
                raise _fail("hc_sinkhorn_iters", None, "required when hc_mult > 1")
        else:
            # Reading: with one stream (hc_mult == 1) an absent hc_eps is 0 and one Sinkhorn iteration is run.
            if self.hc_eps is None:
                object.__setattr__(self, "hc_eps", 0.0)
            if self.hc_sinkhorn_iters is None:
                object.__setattr__(self, "hc_sinkhorn_iters", 1)
        if not isinstance(self.hc_sinkhorn_iters, int) or self.hc_sinkhorn_iters < 1:
            raise _fail("hc_sinkhorn_iters", self.hc_sinkhorn_iters, "must be a positive integer")
        if self.hc_eps < 0:
            raise _fail("hc_eps", self.hc_eps, "must be >= 0")

    def _source_ids(self, name: str, ids: tuple[int, ...] | None) -> tuple[int, ...]:
        """A listed source must be a backbone layer (draft layers never share); None = every layer (§16.1).
        # Reading: ids outside [0, L) are an error; the list is taken as a set (sorted, duplicates ignored); a
        # listed window layer is allowed and is simply not a KV source (§16.4 defines a source by ratio > 0) —
        # the equal-ratio check then rejects any compressed layer mapped to it."""
        L = self.num_hidden_layers
        if ids is None:
            return tuple(range(L))
        for s in ids:
            if not 0 <= s < L:
                raise _fail(name, list(ids), f"source {s} is not a backbone layer in [0, {L})")
        return tuple(sorted(set(ids)))

    def _check_maps(self) -> None:
        """§2.2 validation chain, in §16.4's order (check 1, the ratios, ran before the maps were built)."""
        L, n, ratios = self.num_hidden_layers, self.n_prefill_layer, self.compress_ratios
        maps = (("kv_source_layer_ids", self.kv_map), ("index_source_layer_ids", self.index_map),
                ("index_k_source_layer_ids", self.index_k_map))
        # 2: the KV map does not cross n_prefill_layer.
        for l in range(L):
            if (l >= n) != (self.kv_map[l] >= n):
                raise _fail("kv_source_layer_ids", self._listed("kv_source_layer_ids"),
                            f"layer {l} maps to source {self.kv_map[l]} across n_prefill_layer={n}")
        # 3: a layer and its source (all three maps) have equal ratio (index_topk is one global value, so the
        # equal-index_topk half of the check always holds). # Reading: the index maps are validated even when
        # index_topk == 0 (dense layers never use them), literally as §16.4 lists the checks.
        for name, m in maps:
            for l in range(L):
                s = m[l]
                if ratios[l] != ratios[s]:
                    raise _fail(name, self._listed(name), f"layer {l} (compress ratio {ratios[l]}) maps to source "
                                f"{s} (compress ratio {ratios[s]}): a source must be an earlier layer of the same "
                                f"type")
        # 4: index segments within index-K segments within KV segments.
        for l in range(L):
            if self.index_k_map[self.index_map[l]] != self.index_k_map[l]:
                raise _fail("index_source_layer_ids", self._listed("index_source_layer_ids"),
                            f"layer {l} and its index source {self.index_map[l]} lie in different index-K segments "
                            f"(index_k_source_layer_ids={self._listed('index_k_source_layer_ids')})")
            if self.kv_map[self.index_k_map[l]] != self.kv_map[l]:
                raise _fail("index_k_source_layer_ids", self._listed("index_k_source_layer_ids"),
                            f"layer {l} and its index-K source {self.index_k_map[l]} lie in different KV segments "
                            f"(kv_source_layer_ids={self._listed('kv_source_layer_ids')})")

    def _listed(self, name: str) -> list[int] | None:
        value = getattr(self, name)
        if name == "index_k_source_layer_ids" and value is None:
            value = self.kv_source_layer_ids
        return None if value is None else list(value)

    def _check_candidates(self) -> None:
        """§2.6 constraints, as §16.10 states them."""
        cs = self.candidate_source_layer_id
        if cs is None:
            return
        if not 0 <= cs < self.num_hidden_layers or not self.is_index_source(cs):
            raise _fail("candidate_source_layer_id", cs, "must be a sparse index-source layer (compress ratio > 0, "
                        "index_topk > 0, its own index source)")
        bs, nb = self.candidate_block_size, self.candidate_topk_blocks
        if not isinstance(bs, int) or not 1 <= bs <= 16:
            raise _fail("candidate_block_size", bs, "must be an integer in [1, 16]")
        if not isinstance(nb, int) or nb <= 0 or nb % 8:
            raise _fail("candidate_topk_blocks", nb, "must be a positive multiple of 8")
        if bs * nb < self.index_topk:
            raise _fail("candidate_topk_blocks", nb, f"candidate capacity candidate_block_size * "
                        f"candidate_topk_blocks = {bs * nb} must be >= index_topk={self.index_topk}")
        for l in self.candidate_consumers:
            if self.compress_ratios[l] != self.compress_ratios[cs]:
                raise _fail("candidate_source_layer_id", cs, f"candidate consumer layer {l} has compress ratio "
                            f"{self.compress_ratios[l]}, the source {self.compress_ratios[cs]}")

    def _check_drafts(self) -> None:
        nD, L = self.num_nextn_predict_layers, self.num_hidden_layers
        if nD == 0:
            return
        if not self.dspark_target_layer_ids:
            raise _fail("dspark_target_layer_ids", self.dspark_target_layer_ids, "required when "
                        "num_nextn_predict_layers > 0")
        for t in self.dspark_target_layer_ids:
            if not 0 <= t < L:
                raise _fail("dspark_target_layer_ids", list(self.dspark_target_layer_ids),
                            f"target {t} is not a backbone layer in [0, {L})")
        if not isinstance(self.dspark_markov_rank, int) or self.dspark_markov_rank <= 0:
            raise _fail("dspark_markov_rank", self.dspark_markov_rank, "required (a positive integer) when "
                        "num_nextn_predict_layers > 0")
        if self.draft_num_experts_per_tok > self.draft_n_routed_experts:
            raise _fail("dspark_num_experts_per_tok", self.dspark_num_experts_per_tok,
                        f"must be <= the draft expert count {self.draft_n_routed_experts}")

    def _check_engram(self) -> None:
        ids, L = self.engram_layer_ids, self.num_hidden_layers
        if not ids:
            return
        if len(set(ids)) != len(ids) or any(not 0 <= l < L for l in ids):
            raise _fail("engram_layer_ids", list(ids), f"must be distinct backbone layers in [0, {L})")
        for name in ("engram_max_ngram_size", "engram_vocab_size", "engram_n_heads", "engram_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise _fail(name, value, "required (a positive integer) when engram_layer_ids is not empty")
        if self.engram_max_ngram_size < 2:
            raise _fail("engram_max_ngram_size", self.engram_max_ngram_size, "must be >= 2 (n-grams of size 2..M)")
        if self.engram_pad_token_id is None:
            raise _fail("engram_pad_token_id", None, "required (or a top-level pad_token_id) when Engram is on")

    def _check_v4(self) -> None:
        """DeepSeek-V4 (docs/deepseek_v4.md): explicit per-layer types, any positive ratio for CSA / HCA layers,
        V4's internals, none of V4.1's sharing / YOCO / candidate / Engram / DSpark features."""
        L, types = self.num_hidden_layers, self.attention_types
        if types is None or len(types) != L or any(t not in V4_ATTENTION_TYPES for t in types):
            raise _fail("attention_types", types, f"DeepSeek-V4 needs one of {V4_ATTENTION_TYPES} per backbone "
                        f"layer ({L})")
        if self.num_nextn_predict_layers:
            raise _fail("num_nextn_predict_layers", self.num_nextn_predict_layers, "DeepSeek-V4's MTP layers are "
                        "not DSpark drafts and are not built (as in transformers): must be 0")
        for i, (t, r) in enumerate(zip(types, self.compress_ratios)):
            if not isinstance(r, int) or isinstance(r, bool) or (r == 0) != (t == WINDOW) or r < 0:
                raise _fail(f"compress_ratios[{i}]", r, f"layer type {t!r}: 0 for a window layer, a positive "
                            f"integer for CSA / HCA")
        for name in ("kv_source_layer_ids", "index_source_layer_ids", "index_k_source_layer_ids",
                     "candidate_source_layer_id"):
            if getattr(self, name) is not None:
                raise _fail(name, getattr(self, name), "DeepSeek-V4 shares nothing between layers: must be absent")
        if self.engram_layer_ids:
            raise _fail("engram_layer_ids", list(self.engram_layer_ids), "DeepSeek-V4 has no Engram")
        if CSA in types and self.index_topk <= 0:
            raise _fail("index_topk", self.index_topk, "must be positive with CSA layers (transformers then "
                        "selects no compressed entry at all, it does not fall back to dense)")
        if self.hc_shifted:
            raise _fail("hc_shifted", True, "DeepSeek-V4 mixes non-shifted, with the HC head")
        for name, want in V4_INTERNALS.items():
            if getattr(self, name) != want:
                raise _fail(name, getattr(self, name), f"only {want!r} (DeepSeek-V4) is implemented")
        n = self.num_hash_layers
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= L:
            raise _fail("num_hash_layers", n, f"must be an integer in [0, {L}]")

    def _check_internals(self) -> None:
        if self.is_v4:
            return                                                 # _check_v4 checked V4's values
        for name in FIXED_INTERNALS:
            if getattr(self, name) != INTERNAL_DEFAULTS[name]:
                raise _fail(name, getattr(self, name), f"only {INTERNAL_DEFAULTS[name]!r} (V4.1) is implemented")

    # ------------------------------------------------------------------ per-layer roles (§2.2)

    @property
    def is_v4(self) -> bool:
        return self.model_type == V4_MODEL_TYPE

    def compress_ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def compress_span(self, layer: int) -> int:
        """Consecutive tokens one compressed entry pools: 2·ratio for V4's overlapping CSA, else the ratio."""
        r = self.compress_ratios[layer]
        return 2 * r if self.compress_overlap and self.layer_types[layer] == CSA else r

    def is_hash_moe(self, layer: int) -> bool:
        """V4: the first num_hash_layers layers pick experts by tid2eid[token id] (docs/deepseek_v4.md)."""
        return layer < self.num_hash_layers

    def is_compressed(self, layer: int) -> bool:
        return self.compress_ratios[layer] > 0

    def is_kv_source(self, layer: int) -> bool:
        """Holds compressor weights and writes the compressed KV its KV segment reads (§16.4)."""
        return self.is_compressed(layer) and self.kv_map[layer] == layer

    def is_sparse(self, layer: int) -> bool:
        if self.is_v4:
            return self.layer_types[layer] == CSA                 # V4: CSA selects by indexer, HCA attends to all
        return self.is_compressed(layer) and self.index_topk > 0

    def is_index_source(self, layer: int) -> bool:
        """Runs its own indexer query (indexer.wq_b, weights_proj) and top-k (§2.6)."""
        return self.is_sparse(layer) and self.index_map[layer] == layer

    def is_index_k_source(self, layer: int) -> bool:
        """Computes index keys (indexer.wk, k_norm) for its index-K segment."""
        return self.is_sparse(layer) and self.index_k_map[layer] == layer

    @property
    def candidate_consumers(self) -> tuple[int, ...]:
        """Index sources after the candidate source (§16.10); their top-k is restricted to its blocks."""
        cs = self.candidate_source_layer_id
        if cs is None:
            return ()
        return tuple(l for l in range(cs + 1, self.num_hidden_layers) if self.is_index_source(l))

    def is_consumer(self, layer: int) -> bool:
        """YOCO consumer half (§2.7): layers from n_prefill_layer on."""
        return layer >= self.n_prefill_layer

    def layer_rope_theta(self, layer: int) -> float:
        """§2.2: compressed layers use compress_rope_theta (+YaRN) for everything; window layers rope_theta."""
        return self.compress_rope_theta if self.is_compressed(layer) else self.rope_theta

    def layer_yarn(self, layer: int) -> YarnScaling | None:
        return self.rope_scaling if self.is_compressed(layer) else None   # §16.12: compressed layers only

    @property
    def num_draft_layers(self) -> int:
        return self.num_nextn_predict_layers

    @property
    def draft_n_routed_experts(self) -> int:
        return self.dspark_n_routed_experts or self.n_routed_experts

    @property
    def draft_num_experts_per_tok(self) -> int:
        return self.dspark_num_experts_per_tok or self.num_experts_per_tok

    @property
    def engram_enabled(self) -> bool:
        return bool(self.engram_layer_ids)


def sharing_map(sources: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """§2.2: each layer at or after the first source maps to the nearest source <= it; earlier layers map to
    themselves."""
    srcs = sorted(sources)
    out = []
    for l in range(num_layers):
        below = [s for s in srcs if s <= l]
        out.append(below[-1] if below else l)
    return tuple(out)
