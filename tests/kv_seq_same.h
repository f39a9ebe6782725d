/* The check that two KV sequences hold the same thing: for every layer the same block count and
 * tail length, each block's stored bytes equal, the fp16 tails bit for bit. Header-only; include
 * after <cmocka.h> and kvstore/kv_cache.h. */
#ifndef STRATA_TESTS_KV_SEQ_SAME_H
#define STRATA_TESTS_KV_SEQ_SAME_H

#include "kvstore/block.h"
#include "kvstore/kv_cache.h"

static void assert_seqs_same(const kv_seq *a, const kv_seq *b)
{
    strata_error err = {0};
    const kv_geometry *g = kv_pool_geometry(kv_seq_pool(a));
    const size_t row_bytes = (size_t)g->n_kv_heads * (size_t)g->head_dim * 2;
    for (int l = 0; l < g->n_layers; l++) {
        kv_layer_view va, vb;
        kv_seq_layer_view(a, l, &va);
        kv_seq_layer_view(b, l, &vb);
        assert_int_equal(va.n_blocks, vb.n_blocks);
        assert_int_equal(va.tail_tokens, vb.tail_tokens);
        for (size_t i = 0; i < va.n_blocks; i++) {
            kv_block ba, bb;
            assert_non_null(va.blocks[i]);
            assert_non_null(vb.blocks[i]);
            assert_int_equal(kv_block_parse(va.blocks[i], va.block_bytes, &ba, &err), STRATA_OK);
            assert_int_equal(kv_block_parse(vb.blocks[i], vb.block_bytes, &bb, &err), STRATA_OK);
            assert_int_equal(ba.block_bytes, bb.block_bytes);
            assert_memory_equal(va.blocks[i], vb.blocks[i], ba.block_bytes);
        }
        if (va.tail_tokens) {
            assert_memory_equal(va.tail_k, vb.tail_k, va.tail_tokens * row_bytes);
            assert_memory_equal(va.tail_v, vb.tail_v, va.tail_tokens * row_bytes);
        }
    }
}

#endif
