/* The pool's eviction order against a model of its rule. With a lower tier, a slot is freed by
 * evicting the least recently used unpinned block of that slot size, where a use is a block's
 * arrival in a slot (made by an append, fetched back by an acquire, imported) or an acquire of
 * its layer while resident, and a block is pinned when its last use came after its sequence's
 * last unpin. The model below applies that rule by scanning every block it knows; the pool keeps
 * per-class use-ordered lists instead. Random appends, acquires, unpins, spills, resumes,
 * migrations and frees on a two-class plan must leave the same blocks resident, the same free
 * slot count and the same outcomes (including "every slot is pinned") after each operation. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kvstore/block.h"
#include "kvstore/kv_cache.h"
#include "test_rng.h"

/* A lower tier in plain heap memory: every block it is given, by handle. */
enum { STORE_CAP = 4096 };
typedef struct heap_store {
    uint8_t *bytes[STORE_CAP];
    size_t len[STORE_CAP];
} heap_store;

static int store_put(void *ctx, const uint8_t *block, size_t len, uint64_t seq_id, uint64_t clock,
                     uint64_t *handle, strata_error *err)
{
    (void)seq_id;
    (void)clock;
    heap_store *s = ctx;
    for (size_t h = 0; h < STORE_CAP; h++)
        if (!s->bytes[h]) {
            s->bytes[h] = malloc(len);
            if (!s->bytes[h])
                return strata_fail(err, STRATA_ENOMEM, "test store: out of memory");
            memcpy(s->bytes[h], block, len);
            s->len[h] = len;
            *handle = h + 1;
            return STRATA_OK;
        }
    return strata_fail(err, STRATA_EFULL, "test store: full");
}

static int store_get(void *ctx, uint64_t handle, uint8_t *dst, size_t cap, uint64_t clock, strata_error *err)
{
    (void)clock;
    heap_store *s = ctx;
    if (handle < 1 || handle > STORE_CAP || !s->bytes[handle - 1] || s->len[handle - 1] > cap)
        return strata_fail(err, STRATA_EINVAL, "test store: bad handle %llu", (unsigned long long)handle);
    memcpy(dst, s->bytes[handle - 1], s->len[handle - 1]);
    return STRATA_OK;
}

static void store_release(void *ctx, uint64_t handle)
{
    heap_store *s = ctx;
    assert_true(handle >= 1 && handle <= STORE_CAP && s->bytes[handle - 1]);
    free(s->bytes[handle - 1]);
    s->bytes[handle - 1] = NULL;
}

/* After every sequence is gone: every slot free and nothing left in the store below. */
static void assert_all_returned(const kv_pool *pool, const heap_store *store)
{
    kv_pool_stats st;
    kv_pool_get_stats(pool, &st);
    assert_int_equal(st.free_slots, st.slots);
    for (size_t h = 0; h < STORE_CAP; h++)
        assert_null(store->bytes[h]);
}

/* The model. */
enum { LAYERS = 4, MAX_SEQS = 5, MAX_BLOCKS = 12, BT = 32, SLOTS_PER_LAYER = 3 };
typedef struct model_block {
    bool resident;
    uint64_t last_use;
} model_block;
typedef struct model_seq {
    bool live;             /* the entry is a sequence (or one being imported) */
    kv_seq *seq;
    bool spilled;
    uint64_t floor;
    size_t tokens[LAYERS];  /* blocks * BT + tail */
    size_t n_blocks[LAYERS];
    model_block b[LAYERS][MAX_BLOCKS];
} model_seq;
typedef struct model {
    model_seq s[MAX_SEQS];
    uint64_t clock;
    size_t free[2];         /* per class: layers 0-1 kivi2, layers 2-3 kivi4 */
} model;

static int class_of_layer(int l) { return l < 2 ? 0 : 1; }

static void use(model *m, model_block *b)
{
    b->resident = true;
    b->last_use = ++m->clock;
}

/* Frees a slot of class c the way the rule says, or reports that every resident block is pinned. */
static bool model_take(model *m, int c)
{
    if (m->free[c] > 0) {
        m->free[c]--;
        return true;
    }
    model_block *victim = NULL;
    for (int i = 0; i < MAX_SEQS; i++)
        for (int l = 0; m->s[i].live && l < LAYERS; l++)
            for (size_t k = 0; class_of_layer(l) == c && k < m->s[i].n_blocks[l]; k++) {
                model_block *b = &m->s[i].b[l][k];
                if (b->resident && b->last_use <= m->s[i].floor && (!victim || b->last_use < victim->last_use))
                    victim = b;
            }
    if (!victim)
        return false;
    victim->resident = false;
    return true;
}

static void model_drop(model *m, model_seq *s)
{
    for (int l = 0; l < LAYERS; l++)
        for (size_t k = 0; k < s->n_blocks[l]; k++)
            if (s->b[l][k].resident) {
                s->b[l][k].resident = false;
                m->free[class_of_layer(l)]++;
            }
}

static void assert_same(const model *m, const kv_pool *pool)
{
    kv_pool_stats st;
    kv_pool_get_stats(pool, &st);
    assert_int_equal(st.free_slots, m->free[0] + m->free[1]);
    for (int i = 0; i < MAX_SEQS; i++) {
        const model_seq *s = &m->s[i];
        if (!s->live || s->spilled)
            continue;
        for (int l = 0; l < LAYERS; l++) {
            kv_layer_view v;
            kv_seq_layer_view(s->seq, l, &v);
            assert_int_equal(v.n_blocks, s->n_blocks[l]);
            assert_int_equal(kv_seq_length(s->seq, l), s->tokens[l]);
            for (size_t k = 0; k < v.n_blocks; k++)
                if ((v.blocks[k] != NULL) != s->b[l][k].resident)
                    fail_msg("sequence slot %d layer %d block %zu: pool %s, model %s (clock %llu)", i, l, k,
                             v.blocks[k] ? "resident" : "below", s->b[l][k].resident ? "resident" : "below",
                             (unsigned long long)m->clock);
        }
    }
}

/* Appends n rows to layer l of the pool's sequence and of the model: each block the append
 * completes takes a slot (evicting by the rule) and is used; if one cannot, the append fails and
 * the blocks it made leave their slots again. Returns whether the append succeeded. */
static bool append_both(model *m, model_seq *s, int l, size_t n, const float *rows)
{
    enum { R = 32 };
    if (n == 0)
        return true;
    const int c = class_of_layer(l);
    const size_t tail = s->tokens[l] - s->n_blocks[l] * BT, stream = tail + n;
    const size_t n_new = stream >= R + BT ? (stream - R) / BT : 0;
    size_t made = 0;
    bool ok = true;
    while (ok && made < n_new) {
        ok = model_take(m, c);
        if (ok)
            use(m, &s->b[l][s->n_blocks[l] + made++]);
    }
    strata_error err = {0};
    int rc = kv_seq_append(s->seq, l, rows, rows, n, &err);
    if (!ok) {
        assert_int_equal(rc, STRATA_EFULL);
        for (size_t k = 0; k < made; k++) {
            s->b[l][s->n_blocks[l] + k].resident = false;
            m->free[c]++;
        }
        return false;
    }
    if (rc != STRATA_OK)
        fail_msg("append refused: %s", err.msg);
    s->n_blocks[l] += n_new;
    s->tokens[l] += n;
    return true;
}

static void test_eviction_against_model(void **state)
{
    (void)state;
    enum { OPS = 3000, MAX_TOKENS = MAX_BLOCKS * BT };
    const kv_geometry g = {LAYERS, 2, 64, BT};
    kv_codec_params plan[LAYERS];
    strata_error err = {0};
    for (int l = 0; l < LAYERS; l++)
        assert_int_equal(kv_codec_parse(l < 2 ? "kivi2-r32" : "kivi4-r32", &plan[l], &err), STRATA_OK);
    kv_pool *pool = kv_pool_create_plan(&g, plan, SLOTS_PER_LAYER, &err);
    assert_non_null(pool);
    static heap_store store;
    memset(&store, 0, sizeof store);
    const kv_lower_tier lower = {.ctx = &store, .put = store_put, .get = store_get, .release = store_release};
    assert_int_equal(kv_pool_set_lower_tier(pool, &lower, &err), STRATA_OK);
    static model m;
    memset(&m, 0, sizeof m);
    m.free[0] = m.free[1] = 2 * SLOTS_PER_LAYER;
    const size_t row = 2 * 64;
    float *rows = malloc(3 * BT * row * sizeof(float));
    assert_non_null(rows);
    uint64_t seed = 11;
    for (size_t i = 0; i < 3 * BT * row; i++)
        rows[i] = (float)((double)(rng_next(&seed) >> 11) * 0x1p-52 - 0.5);
    size_t counts[8] = {0}, refusals = 0;

    for (int op = 0; op < OPS; op++) {
        const int i = (int)(rng_next(&seed) % MAX_SEQS), l = (int)(rng_next(&seed) % LAYERS);
        const int c = class_of_layer(l);
        model_seq *s = &m.s[i];
        const unsigned what = (unsigned)(rng_next(&seed) % 16);
        int rc;
        if (!s->live) {   /* a new sequence, sometimes a migrated copy of another */
            int from = (int)(rng_next(&seed) % MAX_SEQS);
            model_seq *o = &m.s[from];
            bool even = true;   /* a sequence image needs every layer at the same length */
            for (int k = 1; k < LAYERS; k++)
                even = even && o->tokens[k] == o->tokens[0];
            if (what < 8 || !o->live || o->spilled || !even) {
                memset(s, 0, sizeof *s);
                s->live = true;
                s->seq = kv_seq_create(pool, MAX_TOKENS, &err);
                assert_non_null(s->seq);
                counts[0]++;
                continue;
            }
            uint8_t *img = NULL;
            size_t len = 0;
            assert_int_equal(kv_seq_export(o->seq, &img, &len, &err), STRATA_OK);
            /* The import takes a slot per block, layer by layer, unpinning after each. */
            memset(s, 0, sizeof *s);
            s->live = true;   /* its blocks are candidates as soon as they arrive */
            bool fits = true;
            for (int k = 0; k < LAYERS && fits; k++) {
                s->tokens[k] = o->tokens[k];
                for (size_t b = 0; b < o->n_blocks[k] && fits; b++) {
                    fits = model_take(&m, class_of_layer(k));
                    if (fits) {
                        use(&m, &s->b[k][b]);
                        s->n_blocks[k] = b + 1;
                        s->floor = m.clock;
                    }
                }
            }
            s->seq = kv_seq_import(pool, MAX_TOKENS, img, len, &err);
            free(img);
            if (!fits) {   /* the import fails and frees what it took */
                assert_null(s->seq);
                model_drop(&m, s);
                memset(s, 0, sizeof *s);
                refusals++;
            } else {
                if (!s->seq)
                    fail_msg("import refused: %s", err.msg);
                counts[1]++;
            }
        } else if (what < 6 && !s->spilled) {
            /* n tokens to one layer, or to every layer in turn as a forward step does */
            size_t n = 1 + (size_t)(rng_next(&seed) % (what % 2 ? 2 : 3 * BT));
            bool ok = true;
            for (int k = what < 3 ? 0 : l; ok && k < (what < 3 ? LAYERS : l + 1); k++) {
                ok = append_both(&m, s, k, n < MAX_TOKENS - s->tokens[k] ? n : MAX_TOKENS - s->tokens[k], rows);
                counts[2] += ok;
                refusals += !ok;
            }
        } else if (what < 10 && !s->spilled) {   /* acquire a layer: resident blocks first, then fetches */
            bool ok = s->n_blocks[l] <= 2 * SLOTS_PER_LAYER;
            for (size_t k = 0; ok && k < s->n_blocks[l]; k++)
                if (s->b[l][k].resident)
                    s->b[l][k].last_use = ++m.clock;
            for (size_t k = 0; ok && k < s->n_blocks[l]; k++)
                if (!s->b[l][k].resident) {
                    ok = model_take(&m, c);
                    if (ok)
                        use(&m, &s->b[l][k]);
                }
            kv_layer_view v;
            rc = kv_seq_acquire_layer(s->seq, l, &v, &err);
            assert_int_equal(rc, ok ? STRATA_OK : STRATA_EFULL);
            counts[3] += ok;
            refusals += !ok;
            if (rng_next(&seed) % 2) {   /* held pinned across later operations half the time */
                kv_seq_unpin(s->seq);
                s->floor = m.clock;
            }
        } else if (what < 12) {
            kv_seq_unpin(s->seq);
            s->floor = m.clock;
            counts[4]++;
        } else if (what == 12 && !s->spilled) {
            assert_int_equal(kv_seq_spill(s->seq, &err), STRATA_OK);
            s->floor = m.clock;
            model_drop(&m, s);
            s->spilled = true;
            counts[5]++;
        } else if (what == 13 && s->spilled) {
            assert_int_equal(kv_seq_resume(s->seq, &err), STRATA_OK);
            s->spilled = false;
            counts[6]++;
        } else if (what == 14) {
            kv_seq_destroy(s->seq);
            model_drop(&m, s);
            memset(s, 0, sizeof *s);
            counts[7]++;
        }
        assert_same(&m, pool);
    }
    /* Every kind of operation ran, and so did evictions and refusals. */
    for (size_t k = 0; k < sizeof counts / sizeof *counts; k++)
        assert_true(counts[k] > 0);
    assert_true(refusals > 0);
    kv_pool_stats st;
    kv_pool_get_stats(pool, &st);
    assert_true(st.evictions > 100);
    assert_true(st.fetches > 100);
    for (int i = 0; i < MAX_SEQS; i++)
        kv_seq_destroy(m.s[i].seq);   /* NULL for unused entries */
    assert_all_returned(pool, &store);
    kv_pool_destroy(pool);
    free(rows);
}

/* A store below that refuses its put from the fail_at-th on (0: never). */
typedef struct failing_store {
    heap_store heap;
    int puts, fail_at;
} failing_store;

static int failing_put(void *ctx, const uint8_t *block, size_t len, uint64_t seq_id, uint64_t clock,
                       uint64_t *handle, strata_error *err)
{
    failing_store *f = ctx;
    if (f->fail_at && ++f->puts >= f->fail_at)
        return strata_fail(err, STRATA_EIO, "test store: write failed");
    return store_put(&f->heap, block, len, seq_id, clock, handle, err);
}

static int failing_get(void *ctx, uint64_t handle, uint8_t *dst, size_t cap, uint64_t clock, strata_error *err)
{
    return store_get(&((failing_store *)ctx)->heap, handle, dst, cap, clock, err);
}

static void failing_release(void *ctx, uint64_t handle)
{
    store_release(&((failing_store *)ctx)->heap, handle);
}

static void assert_layer_same(kv_seq *s, const kv_seq *ref, int l);

/* An append that makes three blocks, each slot freed by evicting a block to the store below,
 * whose second eviction fails: the append fails with the store's error and leaves the sequence
 * as it was (no block, no length, the outlier pool's state undone, no slot held), so the same
 * append once the store works again gives the blocks of a sequence that never failed. */
static void test_append_undone_when_an_eviction_fails(void **state)
{
    (void)state;
    const kv_geometry g = {LAYERS, 2, 64, BT};
    kv_codec_params plan[LAYERS];
    strata_error err = {0};
    for (int l = 0; l < LAYERS; l++)
        assert_int_equal(kv_codec_parse("ott2-n2-a4-r0", &plan[l], &err), STRATA_OK);
    kv_pool *pool = kv_pool_create_shared(&g, plan, 4, &err);
    kv_pool *ref_pool = kv_pool_create_plan(&g, plan, 8, &err);
    assert_non_null(pool);
    assert_non_null(ref_pool);
    static failing_store store;
    memset(&store, 0, sizeof store);
    const kv_lower_tier lower = {.ctx = &store, .put = failing_put, .get = failing_get, .release = failing_release};
    assert_int_equal(kv_pool_set_lower_tier(pool, &lower, &err), STRATA_OK);
    const size_t row = 2 * 64, n = 3 * BT;
    float *rows = malloc(2 * n * row * sizeof(float));
    assert_non_null(rows);
    uint64_t seed = 5;
    for (size_t t = 0; t < 2 * n * row; t++)   /* K rows, then V rows */
        rows[t] = (float)((double)(rng_next(&seed) >> 11) * 0x1p-52 - 0.5);
    rows[7 * row + 3] = 40.0f;   /* an outlier token for the pool to keep */

    /* Another sequence fills the four slots, then lets them go (unpinned). */
    kv_seq *other = kv_seq_create(pool, n, &err);
    assert_non_null(other);
    for (int l = 0; l < 2; l++)
        assert_int_equal(kv_seq_append(other, l, rows, rows + n * row, 2 * BT, &err), STRATA_OK);
    kv_seq_unpin(other);
    kv_pool_stats st;
    kv_pool_get_stats(pool, &st);
    assert_int_equal(st.free_slots, 0);

    kv_seq *s = kv_seq_create(pool, n, &err), *ref = kv_seq_create(ref_pool, n, &err);
    assert_non_null(s);
    assert_non_null(ref);
    store.fail_at = 2;
    assert_int_equal(kv_seq_append(s, 0, rows, rows + n * row, n, &err), STRATA_EIO);
    if (!strstr(err.msg, "test store: write failed"))
        fail_msg("%s", err.msg);
    assert_int_equal(kv_seq_length(s, 0), 0);
    kv_seq_unpin(s);
    kv_pool_get_stats(pool, &st);
    assert_int_equal(st.free_slots, 1);   /* the one eviction that worked; nothing of s is held */

    store.fail_at = 0;
    assert_int_equal(kv_seq_append(s, 0, rows, rows + n * row, n, &err), STRATA_OK);
    assert_int_equal(kv_seq_append(ref, 0, rows, rows + n * row, n, &err), STRATA_OK);
    assert_int_equal(kv_seq_length(s, 0), n);
    kv_seq_unpin(s);
    assert_layer_same(s, ref, 0);
    kv_seq_destroy(s);
    kv_seq_destroy(ref);
    kv_seq_destroy(other);
    assert_all_returned(pool, &store.heap);
    free(rows);
    kv_pool_destroy(pool);
    kv_pool_destroy(ref_pool);
}

/* One layer of a sequence against its reference (a pool of its own plan, no tier): acquired
 * (fetched back as needed), every block's stored bytes and the tail equal. */
static void assert_layer_same(kv_seq *s, const kv_seq *ref, int l)
{
    strata_error err = {0};
    kv_layer_view v, w;
    if (kv_seq_acquire_layer(s, l, &v, &err) != STRATA_OK)
        fail_msg("acquire layer %d: %s", l, err.msg);
    kv_seq_layer_view(ref, l, &w);
    assert_int_equal(v.n_blocks, w.n_blocks);
    assert_int_equal(v.tail_tokens, w.tail_tokens);
    for (size_t b = 0; b < v.n_blocks; b++) {
        kv_block bv, bw;
        assert_int_equal(kv_block_parse(v.blocks[b], v.block_bytes, &bv, &err), STRATA_OK);
        assert_int_equal(kv_block_parse(w.blocks[b], w.block_bytes, &bw, &err), STRATA_OK);
        assert_int_equal(bv.block_bytes, bw.block_bytes);
        assert_memory_equal(v.blocks[b], w.blocks[b], bw.block_bytes);
    }
    const size_t row = (size_t)v.n_kv_heads * (size_t)v.head_dim * 2;
    if (v.tail_tokens) {
        assert_memory_equal(v.tail_k, w.tail_k, v.tail_tokens * row);
        assert_memory_equal(v.tail_v, w.tail_v, v.tail_tokens * row);
    }
    kv_seq_unpin(s);
}

/* Two block sizes (fp16 and kivi2 sequences) in one shared pool over a lower tier: same-size
 * eviction and whole-slab eviction for the other size (and compaction when it applies) under
 * random appends, acquires, spills, resumes and frees; every sequence always reads back what a
 * pool of its own plan holds. (test_kvstore_seq_plan forces compaction.) */
static void test_mixed_sizes_over_tier(void **state)
{
    (void)state;
    enum { SEQS = 6, SLABS = 10, MAX_TOKENS = 40 * BT, OPS = 1500 };
    const kv_geometry g = {LAYERS, 2, 64, BT};
    kv_codec_params p16[LAYERS], p2[LAYERS];
    strata_error err = {0};
    for (int l = 0; l < LAYERS; l++) {
        assert_int_equal(kv_codec_parse("fp16", &p16[l], &err), STRATA_OK);
        assert_int_equal(kv_codec_parse("kivi2-r32", &p2[l], &err), STRATA_OK);
    }
    const kv_codec_params *both[] = {p16, p2};
    kv_pool *pool = kv_pool_create_plans(&g, both, 2, SLABS, true, &err);
    kv_pool *ref16 = kv_pool_create_plan(&g, p16, SEQS * MAX_TOKENS / BT, &err);
    kv_pool *ref2 = kv_pool_create_plan(&g, p2, SEQS * MAX_TOKENS / BT, &err);
    assert_non_null(pool);
    assert_non_null(ref16);
    assert_non_null(ref2);
    static heap_store store;
    memset(&store, 0, sizeof store);
    const kv_lower_tier lower = {.ctx = &store, .put = store_put, .get = store_get, .release = store_release};
    assert_int_equal(kv_pool_set_lower_tier(pool, &lower, &err), STRATA_OK);
    const size_t row = 2 * 64;
    float *rows = malloc(2 * BT * row * sizeof(float));
    assert_non_null(rows);
    uint64_t seed = 77;
    kv_seq *seqs[SEQS] = {0}, *refs[SEQS] = {0};
    size_t counts[5] = {0};
    for (int op = 0; op < OPS; op++) {
        const int i = (int)(rng_next(&seed) % SEQS);
        const unsigned what = (unsigned)(rng_next(&seed) % 16);
        if (!seqs[i]) {
            const bool fp16 = rng_next(&seed) % 2;
            seqs[i] = kv_seq_create_plan(pool, fp16 ? p16 : p2, MAX_TOKENS, &err);
            refs[i] = kv_seq_create(fp16 ? ref16 : ref2, MAX_TOKENS, &err);
            assert_non_null(seqs[i]);
            assert_non_null(refs[i]);
            continue;
        }
        if (what < 9 && !kv_seq_is_spilled(seqs[i])) {   /* a step: n tokens through every layer */
            const size_t n = what < 4 ? 1 + (size_t)(rng_next(&seed) % BT) : 1;
            if (kv_seq_length(seqs[i], 0) + n > MAX_TOKENS || kv_seq_check_room(seqs[i], n, &err) != STRATA_OK)
                continue;
            for (size_t t = 0; t < 2 * BT * row; t++)   /* K rows, then V rows */
                rows[t] = (float)((double)(rng_next(&seed) >> 11) * 0x1p-52 - 0.5);
            for (int l = 0; l < LAYERS; l++) {
                if (kv_seq_append(seqs[i], l, rows, rows + BT * row, n, &err) != STRATA_OK)
                    fail_msg("append: %s", err.msg);
                assert_int_equal(kv_seq_append(refs[i], l, rows, rows + BT * row, n, &err), STRATA_OK);
                kv_layer_view v;
                if (n == 1 && kv_seq_acquire_layer(seqs[i], l, &v, &err) != STRATA_OK)
                    fail_msg("acquire: %s", err.msg);
                kv_seq_unpin(seqs[i]);
            }
            counts[0]++;
        } else if (what < 11 && !kv_seq_is_spilled(seqs[i])) {
            for (int l = 0; l < LAYERS; l++)
                assert_layer_same(seqs[i], refs[i], l);
            counts[1]++;
        } else if (what == 11) {
            if (kv_seq_is_spilled(seqs[i])) {
                assert_int_equal(kv_seq_resume(seqs[i], &err), STRATA_OK);
                counts[2]++;
            } else {
                assert_int_equal(kv_seq_spill(seqs[i], &err), STRATA_OK);
                counts[3]++;
            }
        } else if (what == 12) {
            kv_seq_destroy(seqs[i]);
            kv_seq_destroy(refs[i]);
            seqs[i] = refs[i] = NULL;
            counts[4]++;
        }
    }
    for (size_t k = 0; k < sizeof counts / sizeof *counts; k++)
        assert_true(counts[k] > 0);
    kv_pool_stats st;
    kv_pool_get_stats(pool, &st);
    assert_true(st.evictions > 100);
    assert_true(st.fetches > 100);
    for (int i = 0; i < SEQS; i++) {
        kv_seq_destroy(seqs[i]);
        kv_seq_destroy(refs[i]);
    }
    assert_all_returned(pool, &store);
    kv_pool_destroy(pool);
    kv_pool_destroy(ref16);
    kv_pool_destroy(ref2);
    free(rows);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_eviction_against_model),
        cmocka_unit_test(test_mixed_sizes_over_tier),
        cmocka_unit_test(test_append_undone_when_an_eviction_fails),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
