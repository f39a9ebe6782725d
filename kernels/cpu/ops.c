#include "kernels/ops.h"

#include <cblas.h>
#include <math.h>
#include <string.h>

void kern_matmul(const float *x, size_t n, size_t in, const float *w, size_t out, float *y)
{
    if (n == 1)
        cblas_sgemv(CblasRowMajor, CblasNoTrans, (int)out, (int)in, 1.0f, w, (int)in, x, 1, 0.0f, y, 1);
    else
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n, (int)out, (int)in, 1.0f, x,
                    (int)in, w, (int)in, 0.0f, y, (int)out);
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

void kern_softmax(float *x, size_t n)
{
    if (n == 0)
        return;
    float mx = x[0];
    for (size_t i = 1; i < n; i++)
        if (x[i] > mx)
            mx = x[i];
    double sum = 0.0;
    for (size_t i = 0; i < n; i++) {
        x[i] = expf(x[i] - mx);
        sum += x[i];
    }
    float inv = (float)(1.0 / sum);
    for (size_t i = 0; i < n; i++)
        x[i] *= inv;
}

/* Query rows per tile: the score block of one tile is ATT_TILE x n floats. */
#define ATT_TILE 128

/* kern_softmax for one score row, with four independent max and sum chains (the compiler may
 * not reorder float reductions itself). The sum is kept in double. n >= 1. */
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
    if (n > 0)
        openblas_set_num_threads(n);
}
