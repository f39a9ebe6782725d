#include "kernels/ops.h"

#include <cblas.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "kernels/cpu/cpu_features.h"
#include "kernels/weight_values.h"

#if defined(__GNUC__) && defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#define KERN_X86_AVX2 1
#endif

/* ---- kern_matmul: a batch-invariant matmul --------------------------------------------------
 *
 * Why not BLAS: measured with OpenBLAS 0.3.21 (Debian, DYNAMIC_ARCH, Zen 3 / Haswell kernels) on
 * the model's shapes ([576 -> 576, 192, 1536, 49152], [1536 -> 576]), row r of
 * sgemm(x[0:M]) is not bitwise equal to sgemm(x[r:r+1]): about half the rows differ for
 * M = 4..200 (which rows depends on M, on where the row falls in the micro-kernel's 4/8/16-row
 * tiles and on the thread count: with 2 threads every M >= 15 differs), and sgemv never equals
 * any sgemm row. So a sequence's logits would change with the batch it runs in. Per-row sgemv
 * would be invariant but reads the weights once per row, which is what batching is meant to
 * avoid.
 *
 * Here every output element has one fixed summation order, the same whatever n, the row's place
 * in x, the tile that computes it and the thread that runs it:
 *     y[r][o] = dot(x[r], w[o]) with in8 = in - in % 8:
 *     lane l (0..7) = fma(x[i], w[i], lane l) for i = l, l+8, ... < in8, from 0.0f, in order;
 *     s = ((lane0 + lane4) + (lane2 + lane6)) + ((lane1 + lane5) + (lane3 + lane7));
 *     s = fma(x[i], w[i], s) for i = in8 .. in-1, in order.
 * Only fused multiply-adds and additions (no separate multiply a compiler could contract).
 * The AVX2+FMA path keeps the eight lanes in one register and blocks 4 rows x 3 outputs (12
 * independent chains); the portable path is the same arithmetic in scalar fmaf, so it gives the
 * same bits, only slower. Threads split the outputs, never the sum. Speed (one Zen 3 core,
 * GFLOP/s, ours vs OpenBLAS sgemm): about 50 vs 60-70 for 64-256 rows, on par for 1-4 rows. */

typedef struct mm_job {
    const float *x;
    kern_weights stored;   /* W as given */
    const float *w;        /* fp32 rows of W from output w_first on: W itself, or a decoded panel */
    size_t w_first;
    size_t n, in, out;
    float *y;
} mm_job;

static float mm_dot_portable(const float *x, const float *w, size_t in)
{
    const size_t in8 = in / 8 * 8;
    float l[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (size_t i = 0; i < in8; i += 8)
        for (int j = 0; j < 8; j++)
            l[j] = fmaf(x[i + (size_t)j], w[i + (size_t)j], l[j]);
    float s = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
    for (size_t i = in8; i < in; i++)
        s = fmaf(x[i], w[i], s);
    return s;
}

static void mm_range_portable(const mm_job *j, size_t o_begin, size_t o_end)
{
    for (size_t r = 0; r < j->n; r++)
        for (size_t o = o_begin; o < o_end; o++)
            j->y[r * j->out + o] = mm_dot_portable(j->x + r * j->in, j->w + (o - j->w_first) * j->in, j->in);
}

#ifdef KERN_X86_AVX2
/* Under AddressSanitizer the tiles' accumulator arrays get stack redzones and live in memory
 * instead of registers: the matmul then took about three quarters of the sanitizer run's time
 * (measured with perf on test_model). So the tiles are not instrumented; instead mm_range_avx2
 * (which is) checks every region a tile will read or write before calling it, so an index
 * mistake still stops the run with the region named. */
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <stdio.h>
#include <stdlib.h>
#define MM_TARGET __attribute__((target("avx2,fma"), no_sanitize("address")))
static void mm_check_region(const void *p, size_t bytes, const char *what)
{
    const void *bad = __asan_region_is_poisoned((void *)(uintptr_t)p, bytes);
    if (bad) {
        fprintf(stderr, "kern_matmul: %s [%p, +%zu) reaches poisoned memory at %p\n", what, p, bytes, bad);
        abort();
    }
}
#else
#define MM_TARGET __attribute__((target("avx2,fma")))
#endif

MM_TARGET static inline float mm_hsum(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* l0+l4 .. l3+l7 */
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));     /* (l0+l4)+(l2+l6), (l1+l5)+(l3+l7) */
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y[R][C] (row stride ld) = x[R][in] (row stride in) times w[C][in]^T, for constant R <= 4,
 * C <= 3 (the loops unroll fully so that the accumulators stay in registers). */
#define MM_TILE(R, C)                                                                                  \
    MM_TARGET static void mm_tile_##R##_##C(const float *x, size_t in, const float *w, float *y,      \
                                            size_t ld)                                                 \
    {                                                                                                  \
        const size_t in8 = in / 8 * 8;                                                                 \
        __m256 acc[R][C];                                                                              \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                                            \
            _Pragma("GCC unroll 4") for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();       \
        for (size_t i = 0; i < in8; i += 8) {                                                          \
            __m256 wv[C];                                                                              \
            _Pragma("GCC unroll 4") for (int c = 0; c < C; c++) wv[c] = _mm256_loadu_ps(w + (size_t)c * in + i); \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                      \
                const __m256 xv = _mm256_loadu_ps(x + (size_t)r * in + i);                             \
                _Pragma("GCC unroll 4") for (int c = 0; c < C; c++)                                    \
                    acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);                                 \
            }                                                                                          \
        }                                                                                              \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                                            \
            _Pragma("GCC unroll 4") for (int c = 0; c < C; c++) {                                      \
                float s = mm_hsum(acc[r][c]);                                                          \
                for (size_t i = in8; i < in; i++)                                                      \
                    s = __builtin_fmaf(x[(size_t)r * in + i], w[(size_t)c * in + i], s);               \
                y[(size_t)r * ld + (size_t)c] = s;                                                     \
            }                                                                                          \
    }

MM_TILE(1, 1) MM_TILE(1, 2) MM_TILE(1, 3)
MM_TILE(2, 1) MM_TILE(2, 2) MM_TILE(2, 3)
MM_TILE(3, 1) MM_TILE(3, 2) MM_TILE(3, 3)
MM_TILE(4, 1) MM_TILE(4, 2) MM_TILE(4, 3)

typedef void (*mm_tile_fn)(const float *, size_t, const float *, float *, size_t);
static const mm_tile_fn mm_tiles[4][3] = {
    {mm_tile_1_1, mm_tile_1_2, mm_tile_1_3},
    {mm_tile_2_1, mm_tile_2_2, mm_tile_2_3},
    {mm_tile_3_1, mm_tile_3_2, mm_tile_3_3},
    {mm_tile_4_1, mm_tile_4_2, mm_tile_4_3},
};

/* Outputs [o_begin, o_end) of every row, in blocks of outputs whose weights (about 256 KiB)
 * stay in L2 while all the rows pass over them. */
static void mm_range_avx2(const mm_job *j, size_t o_begin, size_t o_end)
{
    size_t ob = 65536 / (j->in ? j->in : 1) / 3 * 3;
    if (ob < 3)
        ob = 3;
    for (size_t o0 = o_begin; o0 < o_end; o0 += ob) {
        const size_t oe = o_end - o0 < ob ? o_end : o0 + ob;
        for (size_t r0 = 0; r0 < j->n; r0 += 4) {
            const size_t R = j->n - r0 < 4 ? j->n - r0 : 4;
            for (size_t o = o0; o < oe; o += 3) {
                const size_t C = oe - o < 3 ? oe - o : 3;
#if defined(__SANITIZE_ADDRESS__)
                mm_check_region(j->x + r0 * j->in, R * j->in * sizeof(float), "input rows");
                mm_check_region(j->w + (o - j->w_first) * j->in, C * j->in * sizeof(float), "weight rows");
                for (size_t r = 0; r < R; r++)
                    mm_check_region(j->y + (r0 + r) * j->out + o, C * sizeof(float), "output");
#endif
                mm_tiles[R - 1][C - 1](j->x + r0 * j->in, j->in, j->w + (o - j->w_first) * j->in, j->y + r0 * j->out + o,
                                       j->out);
            }
        }
    }
}
#endif

int kern_cpu_has_avx2(void)
{
#ifdef KERN_X86_AVX2
    static atomic_int cached = -1;
    int v = atomic_load_explicit(&cached, memory_order_relaxed);
    if (v < 0) {
        __builtin_cpu_init();
        const char *portable = getenv("STRATA_KERNELS_PORTABLE");   /* tests run both paths */
        /* F16C from CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports does not know "f16c" */
        unsigned eax, ebx, ecx, edx;
        const int f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
        v = !(portable && *portable && strcmp(portable, "0") != 0) && __builtin_cpu_supports("avx2") &&
            __builtin_cpu_supports("fma") && f16c;
        atomic_store_explicit(&cached, v, memory_order_relaxed);
    }
    return v;
#else
    return 0;
#endif
}

static void mm_range_f32(const mm_job *j, size_t o_begin, size_t o_end)
{
#ifdef KERN_X86_AVX2
    if (kern_cpu_has_avx2()) {
        mm_range_avx2(j, o_begin, o_end);
        return;
    }
#endif
    mm_range_portable(j, o_begin, o_end);
}

/* Stored weights are decoded into a panel of rows per thread (128 KiB: in L2 while every input
 * row passes over it), then multiplied exactly as fp32 weights are. */
#define MM_PANEL_FLOATS 32768
static pthread_once_t mm_panel_once = PTHREAD_ONCE_INIT;
static pthread_key_t mm_panel_key;   /* frees a thread's panel when the thread exits */
static int mm_panel_key_ok;
static _Thread_local float *mm_panel_mine;

static void mm_panel_key_make(void) { mm_panel_key_ok = pthread_key_create(&mm_panel_key, free) == 0; }

static float *mm_panel(void)
{
    if (!mm_panel_mine) {
        pthread_once(&mm_panel_once, mm_panel_key_make);
        float *p = mm_panel_key_ok ? aligned_alloc(64, MM_PANEL_FLOATS * sizeof(float)) : NULL;
        if (p && pthread_setspecific(mm_panel_key, p) != 0) {
            free(p);
            p = NULL;
        }
        mm_panel_mine = p;
    }
    return mm_panel_mine;
}

/* Without a panel (no memory, or a row longer than one): each weight decoded where it is used,
 * in the same summation order. Slow, and only a fallback. */
static void mm_range_stored_each(const mm_job *j, size_t o_begin, size_t o_end)
{
    const size_t in = j->in, in8 = in / 8 * 8, row_bytes = kern_weights_row_bytes(j->stored.type, in);
    for (size_t r = 0; r < j->n; r++)
        for (size_t o = o_begin; o < o_end; o++) {
            const float *x = j->x + r * in;
            const uint8_t *w = (const uint8_t *)j->stored.data + o * row_bytes;
            float l[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
            for (size_t i = 0; i < in8; i += 8)
                for (int k = 0; k < 8; k++)
                    l[k] = fmaf(x[i + (size_t)k], gguf_value(j->stored.type, w, i + (size_t)k), l[k]);
            float s = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
            for (size_t i = in8; i < in; i++)
                s = fmaf(x[i], gguf_value(j->stored.type, w, i), s);
            j->y[r * j->out + o] = s;
        }
}

static void mm_range(const mm_job *j, size_t o_begin, size_t o_end)
{
    if (j->stored.type == GGUF_T_F32) {
        mm_range_f32(j, o_begin, o_end);
        return;
    }
    float *panel = mm_panel();
    size_t rows = panel ? MM_PANEL_FLOATS / j->in : 0;
    if (rows == 0) {
        mm_range_stored_each(j, o_begin, o_end);
        return;
    }
    if (rows > 3)
        rows = rows / 3 * 3;   /* whole tiles */
    for (size_t o0 = o_begin; o0 < o_end; o0 += rows) {
        const size_t oe = o_end - o0 < rows ? o_end : o0 + rows;
        kern_weights_rows(j->stored, j->in, o0, oe - o0, panel);
        mm_job part = *j;
        part.w = panel;
        part.w_first = o0;
        mm_range_f32(&part, o0, oe);
    }
}

/* Part p of parts: a contiguous range of outputs, boundaries on multiples of 3 (the tile). */
static void mm_part(const mm_job *j, int p, int parts)
{
    size_t b = j->out * (size_t)p / (size_t)parts / 3 * 3;
    size_t e = p + 1 == parts ? j->out : j->out * (size_t)(p + 1) / (size_t)parts / 3 * 3;
    if (b < e)
        mm_range(j, b, e);
}

/* A small pool of worker threads for kern_matmul. One caller at a time uses it (try-lock); a
 * concurrent caller computes alone, which gives the same bits. Workers spin briefly after a job
 * (the matmuls of a layer come microseconds apart) and then sleep on a condition variable. */
#define MM_MAX_THREADS 64
/* Below this many multiply-adds a call runs on the calling thread. */
#define MM_PARALLEL_MIN ((size_t)1 << 17)
/* Polls of a worker for the next job before it sleeps (about 100 us). */
#define MM_SPINS 4000

static inline void mm_relax(void)
{
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
    __builtin_ia32_pause();
#endif
}

static atomic_int mm_threads_wanted;   /* kern_set_threads; 0: OpenBLAS's thread count */
static pthread_mutex_t mm_caller = PTHREAD_MUTEX_INITIALIZER;
static struct {
    pthread_mutex_t lock;   /* guards sleeping on start and starting workers */
    pthread_cond_t start;
    int workers;            /* started (changed only under mm_caller) */
    atomic_uint_fast64_t generation;   /* of the job posted last */
    atomic_int pending;     /* workers yet to finish it */
    int parts;              /* written before generation is bumped */
    mm_job job;
    uint64_t gen0[MM_MAX_THREADS];  /* generation when worker i started */
} mm_pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .start = PTHREAD_COND_INITIALIZER};

static void *mm_worker(void *arg)
{
    const int id = (int)(intptr_t)arg;   /* does part id + 1 */
    pthread_mutex_lock(&mm_pool.lock);
    uint64_t seen = mm_pool.gen0[id];
    pthread_mutex_unlock(&mm_pool.lock);
    for (;;) {
        uint64_t g;
        int spins = 0;
        while ((g = atomic_load_explicit(&mm_pool.generation, memory_order_acquire)) == seen) {
            if (++spins < MM_SPINS) {
                mm_relax();
                continue;
            }
            pthread_mutex_lock(&mm_pool.lock);
            while (atomic_load_explicit(&mm_pool.generation, memory_order_acquire) == seen)
                pthread_cond_wait(&mm_pool.start, &mm_pool.lock);
            pthread_mutex_unlock(&mm_pool.lock);
        }
        seen = g;
        const mm_job job = mm_pool.job;
        const int parts = mm_pool.parts;
        if (id + 1 < parts)
            mm_part(&job, id + 1, parts);
        atomic_fetch_sub_explicit(&mm_pool.pending, 1, memory_order_acq_rel);
    }
    return NULL;
}

/* After fork the child has none of the workers. */
static void mm_pool_atfork_child(void)
{
    pthread_mutex_init(&mm_caller, NULL);
    pthread_mutex_init(&mm_pool.lock, NULL);
    pthread_cond_init(&mm_pool.start, NULL);
    mm_pool.workers = 0;
    atomic_store(&mm_pool.pending, 0);
}

/* Starts workers up to want (caller holds mm_caller); returns how many run. */
static int mm_pool_grow(int want)
{
    static int atfork_done;
    if (mm_pool.workers >= want)
        return mm_pool.workers;
    if (!atfork_done) {
        if (pthread_atfork(NULL, NULL, mm_pool_atfork_child) != 0)
            return mm_pool.workers;
        atfork_done = 1;
    }
    pthread_mutex_lock(&mm_pool.lock);
    while (mm_pool.workers < want) {
        pthread_attr_t attr;
        pthread_t t;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        mm_pool.gen0[mm_pool.workers] = atomic_load(&mm_pool.generation);
        int rc = pthread_create(&t, &attr, mm_worker, (void *)(intptr_t)mm_pool.workers);
        pthread_attr_destroy(&attr);
        if (rc != 0)
            break;
        mm_pool.workers++;
    }
    pthread_mutex_unlock(&mm_pool.lock);
    return mm_pool.workers;
}

static int mm_thread_count(void)
{
    int n = atomic_load_explicit(&mm_threads_wanted, memory_order_relaxed);
    if (n <= 0)
        n = openblas_get_num_threads();
    if (n < 1)
        n = 1;
    return n > MM_MAX_THREADS ? MM_MAX_THREADS : n;
}

void kern_matmul(const float *x, size_t n, size_t in, const float *w, size_t out, float *y)
{
    kern_matmul_w(x, n, in, (kern_weights){GGUF_T_F32, w}, out, y);
}

void kern_matmul_w(const float *x, size_t n, size_t in, kern_weights w, size_t out, float *y)
{
    const mm_job job = {.x = x, .stored = w, .w = w.type == GGUF_T_F32 ? w.data : NULL, .n = n, .in = in, .out = out,
                        .y = y};
    if (n == 0 || out == 0)
        return;
    if (in == 0) {   /* empty sums; and no panel row count to divide by */
        memset(y, 0, n * out * sizeof *y);
        return;
    }
    int parts = mm_thread_count();
    if (parts > 1 && (n * in * out < MM_PARALLEL_MIN || out < 3 * (size_t)parts))
        parts = 1;
    if (parts == 1 || pthread_mutex_trylock(&mm_caller) != 0) {
        mm_range(&job, 0, out);
        return;
    }
    const int workers = mm_pool_grow(parts - 1);
    if (workers < parts - 1)
        parts = workers + 1;
    if (parts > 1) {
        mm_pool.job = job;
        mm_pool.parts = parts;
        atomic_store_explicit(&mm_pool.pending, workers, memory_order_relaxed);
        pthread_mutex_lock(&mm_pool.lock);
        atomic_fetch_add_explicit(&mm_pool.generation, 1, memory_order_release);
        pthread_cond_broadcast(&mm_pool.start);
        pthread_mutex_unlock(&mm_pool.lock);
    }
    mm_part(&job, 0, parts);
    if (parts > 1) {
        /* The other parts are as long as ours: wait for them spinning, yielding if they lag. */
        for (int spins = 0; atomic_load_explicit(&mm_pool.pending, memory_order_acquire) > 0; spins++) {
            if (spins < MM_SPINS)
                mm_relax();
            else
                sched_yield();
        }
    }
    pthread_mutex_unlock(&mm_caller);
}

void kern_rmsnorm(const float *x, const float *weight, size_t n, size_t dim, float eps, float *out)
{
    for (size_t r = 0; r < n; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        double ss = 0.0;
        for (size_t i = 0; i < dim; i++)
            ss += (double)xr[i] * xr[i];
        float scale = (float)(1.0 / sqrt(ss / (double)dim + eps));
        for (size_t i = 0; i < dim; i++)
            o[i] = xr[i] * scale * weight[i];
    }
}

void kern_rope(float *x, size_t n_heads, size_t head_dim, size_t pos, float theta)
{
    /* Angles in double: at positions in the thousands float angles lose the low bits. */
    for (size_t i = 0; i < head_dim / 2; i++) {
        double angle = (double)pos * pow((double)theta, -2.0 * (double)i / (double)head_dim);
        float c = (float)cos(angle), s = (float)sin(angle);
        for (size_t h = 0; h < n_heads; h++) {
            float *p = x + h * head_dim + 2 * i;
            float a = p[0], b = p[1];
            p[0] = a * c - b * s;
            p[1] = a * s + b * c;
        }
    }
}

void kern_swiglu(const float *gate, const float *up, size_t n, float *out)
{
    for (size_t i = 0; i < n; i++) {
        float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

void kern_add(float *y, const float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        y[i] += x[i];
}

/* Query rows per tile: the score block of one tile is ATT_TILE x n floats. */
#define ATT_TILE 128

/* An in-place, max-subtracted softmax over one score row, with four independent max and sum
 * chains (the compiler may not reorder float reductions itself). The sum is kept in double.
 * n >= 1. */
static void softmax_row(float *x, size_t n)
{
    float m[4] = {x[0], x[0], x[0], x[0]};
    size_t i = 0;
    for (; i + 4 <= n; i += 4)
        for (int l = 0; l < 4; l++)
            m[l] = x[i + l] > m[l] ? x[i + l] : m[l];
    for (; i < n; i++)
        m[0] = x[i] > m[0] ? x[i] : m[0];
    const float mx = fmaxf(fmaxf(m[0], m[1]), fmaxf(m[2], m[3]));
    double s[4] = {0.0, 0.0, 0.0, 0.0};
    for (i = 0; i + 4 <= n; i += 4)
        for (int l = 0; l < 4; l++) {
            x[i + l] = expf(x[i + l] - mx);
            s[l] += x[i + l];
        }
    for (; i < n; i++) {
        x[i] = expf(x[i] - mx);
        s[0] += x[i];
    }
    const float inv = (float)(1.0 / ((s[0] + s[1]) + (s[2] + s[3])));
    for (i = 0; i < n; i++)
        x[i] *= inv;
}

size_t kern_attention_causal_scratch(size_t n)
{
    size_t rows = n < ATT_TILE ? n : ATT_TILE;
    return rows * n > 0 ? rows * n : 1;
}

void kern_attention_causal(const float *q, const float *k, const float *v, size_t n,
                           size_t n_q_heads, size_t n_kv_heads, size_t head_dim, float *out,
                           float *scratch)
{
    const size_t group = n_q_heads / n_kv_heads;
    const float scale = 1.0f / sqrtf((float)head_dim);
    const size_t qs = n_q_heads * head_dim, kvs = n_kv_heads * head_dim;
    for (size_t h = 0; h < n_q_heads; h++) {
        const size_t kh = h / group;
        const float *kb = k + kh * head_dim, *vb = v + kh * head_dim;
        for (size_t r0 = 0; r0 < n; r0 += ATT_TILE) {
            const size_t rows = n - r0 < ATT_TILE ? n - r0 : ATT_TILE;
            const size_t end = r0 + rows;   /* the tile's last query sees keys 0..end-1 */
            /* S[rows][end] = scale * Q_tile K[0:end]^T */
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)rows, (int)end, (int)head_dim,
                        scale, q + r0 * qs + h * head_dim, (int)qs, kb, (int)kvs, 0.0f, scratch,
                        (int)end);
            for (size_t t = 0; t < rows; t++) {
                float *s = scratch + t * end;
                const size_t len = r0 + t + 1;   /* causal: keys 0..r0+t */
                softmax_row(s, len);
                memset(s + len, 0, (end - len) * sizeof *s);
            }
            /* O_tile = P V[0:end] */
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)rows, (int)head_dim, (int)end,
                        1.0f, scratch, (int)end, vb, (int)kvs, 0.0f, out + r0 * qs + h * head_dim,
                        (int)qs);
        }
    }
}

void kern_set_threads(int n)
{
    if (n > 0) {
        openblas_set_num_threads(n);
        atomic_store_explicit(&mm_threads_wanted, n, memory_order_relaxed);
    }
}
