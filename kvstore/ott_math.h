/* The pool update of outlier-token tracing for one KV head (kvstore/ott.h describes the method),
 * inline so that the CUDA encoder runs the CPU tracker's own code on the tracker state it keeps
 * in device memory, and picks the same tokens. The state is plain fixed-width structs for that
 * reason: a head's counters, then its pool of at most N (position, L1 key norm) members, sorted
 * by norm (ties: the earlier position). */
#ifndef STRATA_KVSTORE_OTT_MATH_H
#define STRATA_KVSTORE_OTT_MATH_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "kvstore/half.h"
#include "kvstore/hd.h"

#define KV_OTT_MAX_POOL 64   /* the bound kv_codec_validate enforces */

typedef struct kv_ott_member {
    uint64_t pos;
    double norm;
} kv_ott_member;

typedef struct kv_ott_head {
    uint32_t n;          /* pool members */
    uint32_t aux_used;   /* tokens pushed out of the pool so far */
    uint32_t stopped;    /* the auxiliary pool is full: no more tracing */
    uint32_t reserved;
} kv_ott_head;

/* Smaller norm first; equal norms keep the earlier position (deterministic). */
STRATA_HD static inline int kv_ott_before(const kv_ott_member *a, const kv_ott_member *b)
{
    return a->norm < b->norm || (a->norm == b->norm && a->pos < b->pos);
}

/* Head h's update for a block of n_tokens key rows whose first token is at first_pos: element c of
 * token j is at index (j * H + h) * D + c of kf (fp32) or, when kf is NULL, kh (fp16). The block's
 * tokens compete with the pool (N members at most; a NaN key is never ranked); members pushed out
 * count against the auxiliary pool of aux tokens, and when it would overflow, tracing stops for
 * the head and the pool stays as it was. Writes the block's tokens that entered the pool (indices
 * within the block, in pool order) to entered and returns their count. chosen: room for N members. */
STRATA_HD static inline size_t kv_ott_update_head(kv_ott_head *hd, kv_ott_member *pool, size_t N, size_t aux,
                                                  const float *kf, const uint16_t *kh, size_t n_tokens, size_t H,
                                                  size_t D, size_t h, uint64_t first_pos, kv_ott_member *chosen,
                                                  uint16_t *entered)
{
    if (hd->stopped || N == 0)
        return 0;
    size_t n = hd->n;
    for (size_t i = 0; i < n; i++)
        chosen[i] = pool[i];
    /* Insertion into a sorted list of at most N: the pool is tiny (N <= 64). */
    for (size_t j = 0; j < n_tokens; j++) {
        const size_t row = (j * H + h) * D;
        double norm = 0.0;
        for (size_t c = 0; c < D; c++)
            norm += fabs((double)(kf ? kf[row + c] : strata_half_to_float(kh[row + c])));
        const kv_ott_member m = {first_pos + j, norm};
        if (isnan(norm))
            continue;   /* a NaN key cannot be ranked; it stays in its quantized group */
        if (n == N && !kv_ott_before(&m, &chosen[n - 1]))
            continue;
        size_t at = n < N ? n++ : N - 1;
        while (at > 0 && kv_ott_before(&m, &chosen[at - 1])) {
            chosen[at] = chosen[at - 1];
            at--;
        }
        chosen[at] = m;
    }
    /* Old members that fell out go to the auxiliary pool. */
    size_t evicted = 0;
    for (size_t i = 0; i < hd->n; i++) {
        int kept = 0;
        for (size_t u = 0; u < n && !kept; u++)
            kept = chosen[u].pos == pool[i].pos;
        evicted += !kept;
    }
    if ((size_t)hd->aux_used + evicted > aux) {
        hd->stopped = 1;
        return 0;
    }
    hd->aux_used += (uint32_t)evicted;
    size_t n_new = 0;
    for (size_t u = 0; u < n; u++) {
        pool[u] = chosen[u];
        if (chosen[u].pos >= first_pos)
            entered[n_new++] = (uint16_t)(chosen[u].pos - first_pos);
    }
    hd->n = (uint32_t)n;
    return n_new;
}

#endif
