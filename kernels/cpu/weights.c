/* Weight rows from their stored format to fp32 (kernels/ops.h: kern_weights_rows). The values
 * are those of kernels/weight_values.h, bit for bit: the vector paths do the same one or two
 * roundings per element (a product, then for Q4_1 a sum; the build is ISO C, so nothing is
 * contracted into a fused multiply-add). Non-finite values are not reproduced bit for bit (the
 * F16C conversion quiets signalling NaNs); the model loader refuses them. */
#include "kernels/ops.h"

#include <string.h>

#include "kernels/cpu/cpu_features.h"
#include "kernels/weight_values.h"

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define KW_X86 1
#endif

size_t kern_weights_row_bytes(uint32_t type, size_t in)
{
    uint64_t elems, bytes;
    if (type == GGUF_T_F32)
        return in * sizeof(float);
    if (!gguf_type_block(type, &elems, &bytes) || in % elems != 0)
        return 0;
    return in / elems * bytes;
}

static void rows_portable(uint32_t type, const uint8_t *data, size_t n, float *out)
{
    for (size_t i = 0; i < n; i++)
        out[i] = gguf_value(type, data, i);
}

#ifdef KW_X86
#define KW_TARGET __attribute__((target("avx2,f16c")))

/* The 32 codes of a Q4 block's 16 bytes as floats, in element order: the low nibbles are
 * elements 0-15, the high nibbles 16-31. */
KW_TARGET static inline void q4_codes(const uint8_t *qs, __m256 c[4])
{
    const __m128i b = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    c[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    c[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    c[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    c[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

/* A block's fp16 scale(s) at p, as floats (exact, as strata_half_to_float for finite values). */
KW_TARGET static inline __m128 half_pair(const uint8_t *p)
{
    uint32_t bits;
    memcpy(&bits, p, sizeof bits);
    return _mm_cvtph_ps(_mm_cvtsi32_si128((int)bits));
}

KW_TARGET static void rows_avx2(uint32_t type, const uint8_t *data, size_t n, float *out)
{
    switch (type) {
    case GGUF_T_F16:
        for (size_t i = 0; i + 8 <= n; i += 8)
            _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(data + 2 * i))));
        rows_portable(type, data + n / 8 * 16, n % 8, out + n / 8 * 8);
        return;
    case GGUF_T_BF16:
        for (size_t i = 0; i + 8 <= n; i += 8) {
            __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(data + 2 * i)));
            _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
        }
        rows_portable(type, data + n / 8 * 16, n % 8, out + n / 8 * 8);
        return;
    case GGUF_T_Q8_0:
        for (size_t b = 0; b < n / 32; b++) {
            const uint8_t *blk = data + b * 34;
            const __m256 d = _mm256_broadcastss_ps(half_pair(blk));
            for (int g = 0; g < 4; g++) {
                __m128i q = _mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * g));
                __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
                _mm256_storeu_ps(out + b * 32 + 8 * (size_t)g, _mm256_mul_ps(d, v));
            }
        }
        return;
    case GGUF_T_Q4_0:
        for (size_t b = 0; b < n / 32; b++) {
            const uint8_t *blk = data + b * 18;
            const __m256 d = _mm256_broadcastss_ps(half_pair(blk)), eight = _mm256_set1_ps(8.0f);
            __m256 c[4];
            q4_codes(blk + 2, c);
            for (int g = 0; g < 4; g++)   /* codes - 8 is exact in fp32; then one rounding */
                _mm256_storeu_ps(out + b * 32 + 8 * (size_t)g, _mm256_mul_ps(d, _mm256_sub_ps(c[g], eight)));
        }
        return;
    case GGUF_T_Q4_1:
        for (size_t b = 0; b < n / 32; b++) {
            const uint8_t *blk = data + b * 20;
            const __m128 dm = half_pair(blk);
            const __m256 d = _mm256_broadcastss_ps(dm), m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
            __m256 c[4];
            q4_codes(blk + 4, c);
            for (int g = 0; g < 4; g++)
                _mm256_storeu_ps(out + b * 32 + 8 * (size_t)g, _mm256_add_ps(_mm256_mul_ps(d, c[g]), m));
        }
        return;
    default:
        rows_portable(type, data, n, out);
    }
}

#endif

void kern_weights_rows(kern_weights w, size_t in, size_t first, size_t count, float *out)
{
    if (w.type == GGUF_T_F32) {
        memcpy(out, (const float *)w.data + first * in, count * in * sizeof(float));
        return;
    }
    const size_t row_bytes = kern_weights_row_bytes(w.type, in);
    const uint8_t *data = (const uint8_t *)w.data + first * row_bytes;
#ifdef KW_X86
    if (kern_cpu_has_avx2()) {
        rows_avx2(w.type, data, count * in, out);
        return;
    }
#endif
    rows_portable(w.type, data, count * in, out);
}
