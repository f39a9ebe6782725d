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

void kern_attention_causal(const float *q, const float *k, const float *v, size_t n,
                           size_t n_q_heads, size_t n_kv_heads, size_t head_dim, float *out,
                           float *scratch)
{
    const size_t group = n_q_heads / n_kv_heads;
    const float scale = 1.0f / sqrtf((float)head_dim);
    const size_t qs = n_q_heads * head_dim, kvs = n_kv_heads * head_dim;
    for (size_t i = 0; i < n; i++) {
        for (size_t h = 0; h < n_q_heads; h++) {
            const float *qh = q + i * qs + h * head_dim;
            const size_t kh = h / group;
            for (size_t j = 0; j <= i; j++) {
                const float *kj = k + j * kvs + kh * head_dim;
                float dot = 0.0f;
                for (size_t c = 0; c < head_dim; c++)
                    dot += qh[c] * kj[c];
                scratch[j] = dot * scale;
            }
            kern_softmax(scratch, i + 1);
            float *o = out + i * qs + h * head_dim;
            memset(o, 0, head_dim * sizeof *o);
            for (size_t j = 0; j <= i; j++) {
                const float *vj = v + j * kvs + kh * head_dim;
                const float p = scratch[j];
                for (size_t c = 0; c < head_dim; c++)
                    o[c] += p * vj[c];
            }
        }
    }
}

void kern_set_threads(int n)
{
    if (n > 0)
        openblas_set_num_threads(n);
}
