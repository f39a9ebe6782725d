/* strata-bench-kv-pool: the CPU block pool's cost per block brought back, as the pool grows
 * (kvstore/kv_cache.h over the host tier, offload/kv_tiers.h). Sequences of 16 kivi2 blocks
 * (one layer, one 64-wide head, 32-token blocks) fill a pool of --slots slots and a quarter more
 * spill to the host tier; then --moves acquires, each of the sequence whose blocks left longest
 * ago, so that every block it brings back evicts one. Prints the time per block moved: with the
 * victims taken from use-ordered lists it should not grow with --slots. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvstore/clock.h"
#include "kvstore/kv_cache.h"
#include "kvstore/numarg.h"
#include "offload/host_arena.h"
#include "offload/kv_tiers.h"

#define PROG "strata-bench-kv-pool"

enum { BLOCK_TOKENS = 32, HEAD_DIM = 64, BLOCKS_PER_SEQ = 16 };

int main(int argc, char **argv)
{
    long slots = 100000, moves = 2000;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--slots") == 0 && i + 1 < argc) {
            if (!strata_parse_long(PROG, "--slots", argv[++i], BLOCKS_PER_SEQ, 10000000, &slots))
                return 2;
        } else if (strcmp(argv[i], "--moves") == 0 && i + 1 < argc) {
            if (!strata_parse_long(PROG, "--moves", argv[++i], 1, 100000000, &moves))
                return 2;
        } else {
            fprintf(stderr, "usage: %s [--slots N (default 100000)] [--moves N acquires of %d blocks "
                    "(default 2000)]\n", PROG, BLOCKS_PER_SEQ);
            return strcmp(argv[i], "--help") == 0 ? 0 : 2;
        }
    }
    strata_error err = {0};
    const kv_geometry g = {1, 1, HEAD_DIM, BLOCK_TOKENS};
    kv_codec_params codec;
    if (kv_codec_parse("kivi2-r0", &codec, &err) != STRATA_OK) {
        fprintf(stderr, "%s: %s\n", PROG, err.msg);
        return 1;
    }
    const size_t n_seqs = ((size_t)slots + (size_t)slots / 4) / BLOCKS_PER_SEQ;
    const size_t block = kv_block_size(&codec, &g), page = HOST_ARENA_PAGE;   /* the host arena's unit */
    kv_tiers_options to = {.host_bytes = (n_seqs * BLOCKS_PER_SEQ + 64) * ((block + page - 1) / page * page)};
    kv_tiers *tiers = kv_tiers_create(&to, &err);
    kv_pool *pool = tiers ? kv_pool_create(&g, &codec, (size_t)slots, &err) : NULL;
    const kv_lower_tier lower = tiers ? kv_tiers_lower(tiers) : (kv_lower_tier){0};
    if (!pool || kv_pool_set_lower_tier(pool, &lower, &err) != STRATA_OK) {
        fprintf(stderr, "%s: %s\n", PROG, err.msg);
        return 1;
    }
    kv_seq **seqs = calloc(n_seqs, sizeof *seqs);
    float *rows = malloc((size_t)BLOCKS_PER_SEQ * BLOCK_TOKENS * HEAD_DIM * sizeof *rows);
    if (!seqs || !rows) {
        fprintf(stderr, "%s: out of memory\n", PROG);
        return 1;
    }
    for (size_t i = 0; i < (size_t)BLOCKS_PER_SEQ * BLOCK_TOKENS * HEAD_DIM; i++)
        rows[i] = (float)((i * 2654435761u) % 1000) / 500.0f - 1.0f;
    const double t0 = strata_mono_s();
    for (size_t s = 0; s < n_seqs; s++) {
        seqs[s] = kv_seq_create(pool, BLOCKS_PER_SEQ * BLOCK_TOKENS, &err);
        if (!seqs[s] || kv_seq_append(seqs[s], 0, rows, rows, BLOCKS_PER_SEQ * BLOCK_TOKENS, &err) != STRATA_OK) {
            fprintf(stderr, "%s: sequence %zu: %s\n", PROG, s, err.msg);
            return 1;
        }
        kv_seq_unpin(seqs[s]);
        kv_tiers_poll(tiers);
    }
    const double t1 = strata_mono_s();
    kv_pool_stats before;
    kv_pool_get_stats(pool, &before);
    /* The first sequences' blocks left first; bring them back in that order: every block evicts. */
    for (long m = 0; m < moves; m++) {
        kv_layer_view view;
        kv_seq *s = seqs[(size_t)m % n_seqs];
        if (kv_seq_acquire_layer(s, 0, &view, &err) != STRATA_OK) {
            fprintf(stderr, "%s: acquire %ld: %s\n", PROG, m, err.msg);
            return 1;
        }
        kv_seq_unpin(s);
        kv_tiers_poll(tiers);
    }
    const double t2 = strata_mono_s();
    kv_pool_stats st;
    kv_pool_get_stats(pool, &st);
    const unsigned long long moved = (unsigned long long)(st.fetches - before.fetches);
    printf("slots=%ld blocks=%zu block_bytes=%zu fill_us_per_block=%.3f move_us_per_block=%.3f evictions=%llu "
           "fetches=%llu\n",
           slots, n_seqs * BLOCKS_PER_SEQ, block, (t1 - t0) * 1e6 / (double)(n_seqs * BLOCKS_PER_SEQ),
           moved ? (t2 - t1) * 1e6 / (double)moved : 0.0, (unsigned long long)st.evictions, moved);
    for (size_t s = 0; s < n_seqs; s++)
        kv_seq_destroy(seqs[s]);
    kv_pool_destroy(pool);
    kv_tiers_destroy(tiers);
    free(seqs);
    free(rows);
    return 0;
}
