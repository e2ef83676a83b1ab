/* One decode step of a whole Llama-style decoder stack on the CPU, in one call: weights kept as GGUF's packed blocks
 * (Q4_1 / Q8_0) or plain float32 / int8 rows (f32_gemv, i8_gemv), activations fp32 (a GEMV's input quantized to
 * int8 per 32-block for a matrix in gguf_a8.c's layout: quantization="gguf_a8"), the KV cache paged (fp32, or bf16
 * built with -DKV_BF16, or fp8 with -DKV_FP8_E4M3 / -DKV_FP8_E5M2).
 *
 * Why: at batch 1 the default model's GEMVs are ~7 ms of a 12.5 ms step and the rest was ~5 ms of Python and ~25
 * small PyTorch ops per layer (norms, rotary, cache writes, SwiGLU, residual adds: a few microseconds of dispatch
 * each, for a few hundred floats of work). Here a layer is:
 *
 *     xn = rms_norm(h) * input_norm                      h: [B, hidden], the residual stream, updated in place
 *     qkv = xn @ Wqkv^T (+ bias)                         packed GEMV (gguf_linear.c)
 *     q, k = rotate_half(q, k) at positions              NeoX rotary, in place in qkv
 *     cache[slots] = k, v                                 (rounded to bf16 / fp8 in those builds)
 *     a = paged decode attention of q over the cache     paged_attention.c's kernel
 *     h += a @ Wo^T
 *     xn = rms_norm(h) * post_norm
 *     g, u = xn @ Wgate_up^T                             packed GEMV
 *     h += (silu(g) * u) @ Wdown^T
 *
 * with the same kernels the module path calls (gguf_linear, gguf_a8_linear, paged_decode_attention, included here as
 * source), so
 * the GEMVs and the attention give the same bits as there; norms and SwiGLU are plain loops whose sums run in
 * another order than PyTorch's (ulp-level differences). The PyTorch twin is llama_decode.py's decode_step_ref.
 *
 * Every index the step reads from its caller (positions, slots, block tables, lengths) is checked against the
 * tensors' sizes before anything runs: a bad one returns an error code and leaves h and the cache untouched.
 */

#include "gguf_a8.c"             /* includes gguf_linear.c */
#include "paged_attention.c"

/* ggml's type numbers of the plain matrices: float32 (the dequantized model), int8 with a float32 scale a row
 * (quantization="int8" / "w8a8": layers/quantization.py's Int8Linear). */
enum { GGML_F32 = 0, GGML_I8 = 24 };

typedef struct {
    const uint8_t *blocks;         /* [rows, K / 32 * block bytes]; GGML_F32: float32 [rows, K]; GGML_I8: int8 */
    const float *bias;             /* [rows] or NULL */
    int64_t rows, qtype;
    int64_t int8_activations;      /* blocks in gguf_a8.c's layout: int8 activations (else the file's, fp32) */
    const float *scales;           /* GGML_I8: [rows], the weight row r = blocks[r] * scales[r]; else NULL */
} PackedMat;

typedef struct {
    const float *input_norm, *post_norm;   /* [hidden] */
    PackedMat qkv, o, gate_up, down;
    kv_t *k_cache, *v_cache;               /* each [num_blocks, block_size, kv_heads, head_dim] */
    int64_t window;                        /* > 0: the layer's sliding window (keys a query sees); 0: all */
} Layer;

typedef struct {
    const Layer *layers;
    int64_t n_layers, hidden, intermediate, heads, kv_heads, head_dim;
    int64_t num_blocks, block_size;
    const float *cos, *sin;                /* [rotary_len, head_dim], rows rotary_stride apart */
    int64_t rotary_len, rotary_stride;
    float eps, scale;
    int64_t isa;                           /* gguf_linear.c's ISA_* code */
    int64_t isa_a8;                        /* gguf_a8.c's A8_* code */
} Stack;

enum { OK = 0, BAD_POSITION = 1, BAD_SLOT = 2, BAD_BLOCK = 3, BAD_LENGTH = 4, NO_MEMORY = 5 };

/* Built with -DPHASE_TIMES (the benchmark's profile, never the engine's build): seconds spent in each phase of the
 * layers, summed over calls until read (llama_decode_phase_times). PHASE(i) closes phase i at the current time. */
enum { PH_NORM, PH_QKV, PH_ROTARY_KV, PH_ATTENTION, PH_O_ADD, PH_GATE_UP, PH_SWIGLU, PH_DOWN_ADD, NUM_PHASES };
#ifdef PHASE_TIMES
#include <time.h>
static double phase_seconds[NUM_PHASES], phase_mark;
static double now_seconds(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
#define PHASE(i) do { const double t_ = now_seconds(); phase_seconds[i] += t_ - phase_mark; phase_mark = t_; } while (0)
#define PHASE_START() (phase_mark = now_seconds())
#else
#define PHASE(i) ((void)0)
#define PHASE_START() ((void)0)
#endif

/* out[NUM_PHASES]: the seconds per phase since the last read (zeros without -DPHASE_TIMES); resets them. */
void llama_decode_phase_times(double *out)
{
    for (int i = 0; i < NUM_PHASES; ++i) {
#ifdef PHASE_TIMES
        out[i] = phase_seconds[i];
        phase_seconds[i] = 0.;
#else
        out[i] = 0.;
#endif
    }
}

/* out = x * rsqrt(mean(x^2) + eps) * weight, as kernels/reference/norm.py (16 partial sums: another order). */
static void rms_norm_row(const float *x, const float *weight, int64_t n, float eps, float *out)
{
    float part[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; ++l)
            part[l] += x[i + l] * x[i + l];
    float ss = 0.f;
    for (; i < n; ++i)
        ss += x[i] * x[i];
    for (int l = 0; l < 16; ++l)
        ss += part[l];
    const float r = 1.f / sqrtf(ss / (float)n + eps);
    for (i = 0; i < n; ++i)
        out[i] = weight[i] * (x[i] * r);
}

/* NeoX rotate-half of `heads` consecutive heads of one row, in place (rotary.c's formula). */
static void rotate_row(float *x, int64_t heads, int64_t dim, const float *cs, const float *sn)
{
    const int64_t half = dim / 2;
    for (int64_t h = 0; h < heads; ++h) {
        float *xh = x + h * dim;
        for (int64_t j = 0; j < half; ++j) {
            const float x1 = xh[j], x2 = xh[j + half];
            xh[j] = x1 * cs[j] - x2 * sn[j];
            xh[j + half] = x2 * cs[j + half] + x1 * sn[j + half];
        }
    }
}

#ifdef KV_BF16
/* fp32 -> bf16, round to nearest even (NaN stays NaN), as torch's .to(torch.bfloat16). */
static inline kv_t to_kv(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        return (kv_t)((bits >> 16) | 0x40);
    return (kv_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
#elif defined(KV_FP8_E4M3) || defined(KV_FP8_E5M2)
static inline kv_t to_kv(float f) { return fp8_narrow(f); }      /* kv_fp8.h: nearest, saturated */

/* The cache writes' rounding of n floats, for tests (llama_decode.py's fp8_narrow). */
void kv_fp8_narrow(const float *x, uint8_t *out, int64_t n)
{
    for (int64_t i = 0; i < n; ++i)
        out[i] = fp8_narrow(x[i]);
}
#else
static inline kv_t to_kv(float f) { return f; }
#endif

static void store_kv(kv_t *dst, const float *src, int64_t n)
{
    for (int64_t i = 0; i < n; ++i)
        dst[i] = to_kv(src[i]);
}

typedef int8_t vi8_u __attribute__((vector_size(W), aligned(1)));     /* W int8 lanes, unaligned */

/* W weights widened to floats: float32 as they are, int8 converted exactly (the row's scale comes after the sum;
 * the sign extension as one instruction where the ISA has it: GCC's generic conversion goes byte by byte). */
static inline vf load_w(const float *p) { return load_f(p); }
#if W == 16 && defined(__AVX512F__)
static inline vf load_w_i8(const int8_t *p)
{
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#elif W == 8 && defined(__AVX2__)
static inline vf load_w_i8(const int8_t *p)
{
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#else
static inline vf load_w_i8(const int8_t *p) { return __builtin_convertvector(*(const vi8_u *)p, vf); }
#endif

/* y [B, N] = x [B, K] @ w^T (times scales[n] per output for int8 weights), K a multiple of 2 W (the stack's shapes
 * are of 32): the threads take contiguous ranges of w's rows and stream them once; each row meets the inputs four
 * at a time (one load of the weight for four products, four independent sums), then the rest one at a time. */
#define PLAIN_GEMV(NAME, T, LOAD)                                                                                \
static void NAME(const T *w, const float *scales, int64_t N, int64_t K, const float *x, int64_t B, float *y,   \
                 int num_threads)                                                                               \
{                                                                                                               \
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (N * K > 65536)")                   \
    for (int64_t n = 0; n < N; ++n) {                                                                           \
        const T *wr = w + n * K;                                                                                \
        const float sc = scales ? scales[n] : 1.f;                                                              \
        int64_t b = 0;                                                                                          \
        for (; b + 4 <= B; b += 4) {                                                                            \
            const float *x0 = x + b * K, *x1 = x0 + K, *x2 = x1 + K, *x3 = x2 + K;                              \
            vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                                                          \
            for (int64_t k = 0; k < K; k += W) {                                                                \
                const vf wv = LOAD(wr + k);                                                                     \
                a0 += wv * load_f(x0 + k);                                                                      \
                a1 += wv * load_f(x1 + k);                                                                      \
                a2 += wv * load_f(x2 + k);                                                                      \
                a3 += wv * load_f(x3 + k);                                                                      \
            }                                                                                                   \
            y[b * N + n] = sc * sum_lanes(a0);                                                                  \
            y[(b + 1) * N + n] = sc * sum_lanes(a1);                                                            \
            y[(b + 2) * N + n] = sc * sum_lanes(a2);                                                            \
            y[(b + 3) * N + n] = sc * sum_lanes(a3);                                                            \
        }                                                                                                       \
        for (; b < B; ++b) {                                                                                    \
            const float *xr = x + b * K;                                                                        \
            vf acc0 = {0}, acc1 = {0};                                                                          \
            for (int64_t k = 0; k < K; k += 2 * W) {                                                            \
                acc0 += LOAD(wr + k) * load_f(xr + k);                                                          \
                acc1 += LOAD(wr + k + W) * load_f(xr + k + W);                                                  \
            }                                                                                                   \
            y[b * N + n] = sc * sum_lanes(acc0 + acc1);                                                         \
        }                                                                                                       \
    }                                                                                                           \
}
PLAIN_GEMV(f32_gemv, float, load_w)
PLAIN_GEMV(i8_gemv, int8_t, load_w_i8)

/* y [B, m.rows] = x [B, K] @ W^T (+ bias). xq: room for B quantized rows of x (gguf_a8_row_bytes(K) each). */
static void packed_gemv(const Stack *s, const PackedMat *m, const float *x, int64_t B, int64_t K, float *y,
                        uint8_t *xq, int num_threads)
{
    if (m->qtype == GGML_F32)
        f32_gemv((const float *)m->blocks, NULL, m->rows, K, x, B, y, num_threads);
    else if (m->qtype == GGML_I8)
        i8_gemv((const int8_t *)m->blocks, m->scales, m->rows, K, x, B, y, num_threads);
    else if (m->int8_activations)
        gguf_a8_linear((int)m->qtype, (int)s->isa_a8, m->blocks, m->rows, K, x, B, K, y, m->rows, num_threads, xq);
    else
        gguf_linear((int)m->qtype, (int)s->isa, m->blocks, m->rows, K, x, B, K, y, m->rows, num_threads);
    if (m->bias)
        for (int64_t b = 0; b < B; ++b)
            for (int64_t n = 0; n < m->rows; ++n)
                y[b * m->rows + n] += m->bias[n];
}

static int check_indices(const Stack *s, int64_t B, const int64_t *positions, const int64_t *slots,
                         const int64_t *block_tables, int64_t max_blocks, const int64_t *seq_lens)
{
    for (int64_t b = 0; b < B; ++b) {
        if (positions[b] < 0 || positions[b] >= s->rotary_len)
            return BAD_POSITION;
        if (slots[b] < 0 || slots[b] >= s->num_blocks * s->block_size)
            return BAD_SLOT;
        if (seq_lens[b] < 1 || seq_lens[b] > max_blocks * s->block_size)
            return BAD_LENGTH;
        for (int64_t j = 0; j < (seq_lens[b] + s->block_size - 1) / s->block_size; ++j)
            if (block_tables[b * max_blocks + j] < 0 || block_tables[b * max_blocks + j] >= s->num_blocks)
                return BAD_BLOCK;
    }
    return OK;
}

/* The attention half of a layer: h += attention(norm(h)) @ Wo^T. */
static void attention_block(const Stack *s, const Layer *L, float *h, int64_t B, const int64_t *positions,
                            const int64_t *slots, const int64_t *rows, const int64_t *block_tables,
                            int64_t max_blocks, const int64_t *seq_lens, float *xn, float *qkv, float *attn,
                            float *tmp, uint8_t *xq, int num_threads)
{
    const int64_t E = s->hidden, D = s->head_dim, H = s->heads, Hkv = s->kv_heads;
    const int64_t nqkv = L->qkv.rows, kv_width = Hkv * D;
    for (int64_t b = 0; b < B; ++b)
        rms_norm_row(h + b * E, L->input_norm, E, s->eps, xn + b * E);
    PHASE(PH_NORM);
    packed_gemv(s, &L->qkv, xn, B, E, qkv, xq, num_threads);
    PHASE(PH_QKV);
    for (int64_t b = 0; b < B; ++b) {
        float *row = qkv + b * nqkv;
        const float *cs = s->cos + positions[b] * s->rotary_stride, *sn = s->sin + positions[b] * s->rotary_stride;
        rotate_row(row, H + Hkv, D, cs, sn);                   /* q and k heads are consecutive in the row */
        store_kv(L->k_cache + slots[b] * kv_width, row + H * D, kv_width);
        store_kv(L->v_cache + slots[b] * kv_width, row + (H + Hkv) * D, kv_width);
    }
    PHASE(PH_ROTARY_KV);
    paged_decode_attention(qkv, nqkv, D, L->k_cache, L->v_cache, rows, block_tables, seq_lens, attn, H * D, D, B, H,
                           Hkv, D, s->block_size, max_blocks, L->window, s->scale, num_threads);
    PHASE(PH_ATTENTION);
    packed_gemv(s, &L->o, attn, B, H * D, tmp, xq, num_threads);
    for (int64_t i = 0; i < B * E; ++i)
        h[i] = tmp[i] + h[i];
    PHASE(PH_O_ADD);
}

/* The MLP half of a layer: h += (silu(g) * u) @ Wdown^T, (g, u) = norm(h) @ Wgate_up^T. */
static void mlp_block(const Stack *s, const Layer *L, float *h, int64_t B, float *xn, float *gate_up, float *act,
                      float *tmp, uint8_t *xq, int num_threads)
{
    const int64_t E = s->hidden, I = s->intermediate;
    for (int64_t b = 0; b < B; ++b)
        rms_norm_row(h + b * E, L->post_norm, E, s->eps, xn + b * E);
    PHASE(PH_NORM);
    packed_gemv(s, &L->gate_up, xn, B, E, gate_up, xq, num_threads);
    PHASE(PH_GATE_UP);
    for (int64_t b = 0; b < B; ++b) {
        const float *g = gate_up + b * 2 * I, *u = g + I;
        for (int64_t i = 0; i < I; ++i)
            act[b * I + i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
    PHASE(PH_SWIGLU);
    packed_gemv(s, &L->down, act, B, I, tmp, xq, num_threads);
    for (int64_t i = 0; i < B * E; ++i)
        h[i] = tmp[i] + h[i];
    PHASE(PH_DOWN_ADD);
}

/* h [B, hidden]: the embeddings of the step's B decode tokens in, the residual stream after the last layer out
 * (before the final norm). Sequence b's token is at positions[b], its key/value go to slots[b], it attends over its
 * first seq_lens[b] cached tokens (this one's included) through block_tables [B, max_blocks]. Returns OK, or the
 * first failed check (nothing written then). */
int llama_decode_step(const Stack *s, float *h, int64_t B, const int64_t *positions, const int64_t *slots,
                      const int64_t *block_tables, int64_t max_blocks, const int64_t *seq_lens, int num_threads)
{
    const int err = check_indices(s, B, positions, slots, block_tables, max_blocks, seq_lens);
    if (err != OK)
        return err;
    const int64_t E = s->hidden, nqkv = s->layers[0].qkv.rows, I = s->intermediate;
    const size_t floats = (size_t)B * (2 * E + nqkv + s->heads * s->head_dim + 3 * I);
    int64_t widest = E > I ? E : I;                  /* the GEMVs' inputs: E, heads * head_dim, I */
    widest = widest > s->heads * s->head_dim ? widest : s->heads * s->head_dim;
    float *buf = malloc(sizeof(float) * floats);
    int64_t *rows = malloc(sizeof(int64_t) * (size_t)B);
    uint8_t *xq = malloc((size_t)(B * gguf_a8_row_bytes(widest)));
    if (!buf || !rows || !xq) {
        free(buf);
        free(rows);
        free(xq);
        return NO_MEMORY;
    }
    for (int64_t b = 0; b < B; ++b)
        rows[b] = b;
    PHASE_START();
    float *xn = buf, *tmp = xn + B * E, *qkv = tmp + B * E, *attn = qkv + B * nqkv;
    float *gate_up = attn + B * s->heads * s->head_dim, *act = gate_up + B * 2 * I;
    for (int64_t l = 0; l < s->n_layers; ++l) {
        const Layer *L = s->layers + l;
        attention_block(s, L, h, B, positions, slots, rows, block_tables, max_blocks, seq_lens, xn, qkv, attn, tmp,
                        xq, num_threads);
        mlp_block(s, L, h, B, xn, gate_up, act, tmp, xq, num_threads);
    }
    free(buf);
    free(rows);
    free(xq);
    return OK;
}
