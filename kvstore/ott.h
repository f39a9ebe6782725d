/* Outlier-token tracing state of one layer of one sequence (internal to kvstore).
 *
 * Per KV head a pool of at most N tokens with the smallest L1 key norms seen so far. When a block
 * is formed, its tokens compete with the pool; those that enter become the block's OTT entries
 * (kept in fp16 inside the block, taken out of the quantized groups). Pool members pushed out go
 * to an auxiliary pool; their fp16 rows stay in their blocks, so the auxiliary pool is a count
 * that bounds the fp16 rows held per head at N + aux. When a block would overflow it, tracing
 * stops for that head. */
#ifndef STRATA_KVSTORE_OTT_H
#define STRATA_KVSTORE_OTT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvstore/block.h"
#include "kvstore/ott_math.h"

typedef struct kv_ott_tracker kv_ott_tracker;

kv_ott_tracker *kv_ott_tracker_create(int n_kv_heads, int pool_tokens, int aux_tokens);
void kv_ott_tracker_destroy(kv_ott_tracker *t);
/* Copies the state of src into dst (same shape): a snapshot to roll back a failed append. */
void kv_ott_tracker_copy(kv_ott_tracker *dst, const kv_ott_tracker *src);

/* The tracker's state as bytes, for migration images (little-endian: per head u32 members, u32
 * auxiliary tokens used, u32 stopped, then pool_tokens entries of u64 position and the f64 norm's
 * bits). kv_ott_tracker_load checks the length and that member counts fit the pool. */
size_t kv_ott_tracker_state_bytes(const kv_ott_tracker *t);
void kv_ott_tracker_save(const kv_ott_tracker *t, uint8_t *out);
bool kv_ott_tracker_load(kv_ott_tracker *t, const uint8_t *in, size_t len);

/* The same bytes from and to a tracker's plain state held elsewhere (the CUDA encoder keeps it in
 * device memory): n_kv_heads counters, and head h's pool of pool_tokens members at
 * members[h * stride]. A pool of 0 tokens still takes one (zero) entry per head in the bytes, as
 * the CPU tracker writes it. kv_ott_state_load fails on a length or count that does not fit. */
size_t kv_ott_state_bytes(size_t n_kv_heads, size_t pool_tokens);
void kv_ott_state_save(const kv_ott_head *heads, const kv_ott_member *members, size_t n_kv_heads, size_t pool_tokens,
                       size_t stride, uint8_t *out);
bool kv_ott_state_load(kv_ott_head *heads, kv_ott_member *members, size_t n_kv_heads, size_t pool_tokens,
                       size_t stride, const uint8_t *in, size_t len);

/* Runs the pool update for a block of n_tokens rows k [token][head][head_dim] whose first token
 * is at first_pos. Writes the block's entries to out (room for n_kv_heads * pool_tokens), sorted
 * by token then head, and returns their count. */
size_t kv_ott_select(kv_ott_tracker *t, const float *k, size_t n_tokens, int head_dim, uint64_t first_pos,
                     kv_ott_entry *out);

#endif
