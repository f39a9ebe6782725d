/* The block pool, per-sequence block tables and the fp16 tail (kv_cache.h). */
#include <inttypes.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "kvstore/block.h"
#include "kvstore/bytes.h"
#include "kvstore/crc32c.h"
#include "kvstore/half.h"
#include "kvstore/kv_cache.h"
#include "kvstore/ott.h"
#include "kvstore/seq_image.h"
#include "kvstore/slab.h"
#include "kvstore/sysmem.h"

typedef struct kv_block_ref kv_block_ref;

/* Slab memory and its books. Without a lower tier the layers whose largest block (over the
 * plans) has one size share a region, each bringing its blocks_per_layer slabs; with one, every
 * layer shares one region of slabs of the largest block (decisions.md, "Slabs"). A slab serves
 * one block size at a time: a plan whose blocks are smaller fits several in a slab. */
typedef struct slab_region {
    kv_slabs *books;
    uint8_t *mem;          /* slab_bytes * slabs, 64-byte aligned */
    /* The region's resident blocks, oldest last_use first, so the eviction victim is the first
     * unpinned one from the front: pins are recent uses, so that is almost always the front. */
    kv_block_ref *oldest, *newest;
} slab_region;

struct kv_pool {
    kv_geometry geom;
    kv_codec_params *codecs;   /* [n_layers] */
    int *layer_region;         /* [n_layers] */
    slab_region *regions;
    int n_regions;
    int max_classes;           /* the most block sizes of one region */
    float *stage_k;            /* one block of fp32 rows handed to the encoder */
    float *stage_v;
    float *check_k;            /* the same block decoded again, for error tracking */
    float *check_v;
    kv_ott_entry *ott;         /* entries of the block being made */
    uint64_t next_seq_id;
    kv_lower_tier lower;       /* put == NULL: none */
    uint64_t clock;            /* advanced by every append and acquire of a block (LRU order) */
    kv_seq *seqs;              /* every live sequence, for eviction */
    uint8_t *tail_block;       /* encode/decode buffer for spilled tails */
    size_t tail_block_cap;
    kv_pool_stats stats;
};

/* Where a block is: in a pool slot, in the lower tier, or both (blocks never change, so a copy
 * below stays valid and evicting a block that has one costs no I/O). */
struct kv_block_ref {
    uint8_t *slot;         /* NULL when not in the pool */
    uint64_t lower;        /* lower-tier handle, 0 when none */
    uint64_t last_use;     /* pool clock of the last append, acquire or fetch */
    uint32_t bytes;        /* the block's own size */
    kv_seq *owner;         /* set while resident, with the class's use-order links */
    kv_block_ref *older, *newer;
};

typedef struct kv_layer {
    kv_block_ref *refs;    /* max_blocks entries; the first n_blocks are in use */
    uint8_t **blocks;      /* refs[i].slot, as attention reads them */
    size_t n_blocks;
    uint64_t tail_lower;   /* spilled tail (an fp16 block) in the lower tier, 0 when none */
    uint16_t *tail_k;      /* tail_cap rows of n_kv_heads * head_dim halves */
    uint16_t *tail_v;
    size_t tail_len;
    size_t tail_cap;
    size_t prompt_end;     /* tokens [0, prompt_end) count as prompt: everything up to the end of
                            * the latest multi-token append (a second turn's prompt also covers
                            * decode tokens still in the fp16 tail; GEAR's rank rule, format.md) */
    kv_ott_tracker *ott;   /* ott codec with a pool, else NULL */
    kv_ott_tracker *ott_undo;
    kv_layer_error error;
} kv_layer;

struct kv_seq {
    kv_pool *pool;
    kv_codec_params *codecs;   /* [n_layers]: the pool's plan or the sequence's own */
    int *slot_class;           /* [n_layers]: the class of its layer's blocks in the layer's region */
    uint64_t id;
    size_t max_tokens;
    size_t max_blocks;
    bool track_error;
    bool spilled;
    uint64_t pin_floor;    /* blocks with last_use > pin_floor are pinned */
    kv_layer *layers;
    kv_seq *next, *prev;   /* the pool's list */
};

static bool mul_ok(size_t a, size_t b, size_t *out) { return !__builtin_mul_overflow(a, b, out); }

/* The slot a layer needs so that a block of any of the plans fits; 0 if one does not validate. */
static size_t layer_slot(const kv_geometry *g, const kv_codec_params *const *plans, int n_plans, int layer)
{
    size_t slot = 0;
    for (int i = 0; i < n_plans; i++) {
        size_t b = kv_block_size(&plans[i][layer], g);
        if (b == 0)
            return 0;
        slot = b > slot ? b : slot;
    }
    return slot;
}

size_t kv_plans_row_bytes(const kv_geometry *g, const kv_codec_params *const *plans, int n_plans)
{
    if (!g || !plans || n_plans < 1 || g->n_layers < 1)
        return 0;
    size_t total = 0;
    for (int l = 0; l < g->n_layers; l++) {
        size_t b = layer_slot(g, plans, n_plans, l);
        if (b == 0 || total > SIZE_MAX - b)
            return 0;
        total += b;
    }
    return total;
}

size_t kv_plans_largest_block(const kv_geometry *g, const kv_codec_params *const *plans, int n_plans)
{
    size_t largest = 0;
    for (int l = 0; g && plans && n_plans > 0 && l < g->n_layers; l++) {
        size_t b = layer_slot(g, plans, n_plans, l);
        if (b == 0)
            return 0;
        largest = b > largest ? b : largest;
    }
    return largest;
}

size_t kv_plan_row_bytes(const kv_geometry *g, const kv_codec_params *codecs)
{
    return kv_plans_row_bytes(g, &codecs, 1);
}

size_t kv_plan_largest_block(const kv_geometry *g, const kv_codec_params *codecs)
{
    return kv_plans_largest_block(g, &codecs, 1);
}

static int validate_plan(const kv_geometry *g, const kv_codec_params *codecs, strata_error *err)
{
    for (int l = 0; l < g->n_layers; l++)
        if (kv_codec_validate(&codecs[l], g, err) != STRATA_OK) {
            if (err && g->n_layers > 1)
                strata_error_prefix(err, "kv plan layer %d", l);
            return err ? err->code : STRATA_EINVAL;
        }
    return STRATA_OK;
}

/* The distinct block sizes the plans make in the layers of region r (its slot classes). */
static int region_sizes(const kv_pool *p, const kv_codec_params *const *plans, int n_plans, int r, size_t *sizes)
{
    int n = 0;
    for (int l = 0; l < p->geom.n_layers; l++)
        for (int i = 0; p->layer_region[l] == r && i < n_plans; i++) {
            size_t b = kv_block_size(&plans[i][l], &p->geom);
            int c = 0;
            while (c < n && sizes[c] != b)
                c++;
            if (c == n)
                sizes[n++] = b;
        }
    return n;
}

/* plans[0] is the pool's own plan (a sequence's unless it names another); a layer's slabs are the
 * largest block any of the plans makes there (one_region: the largest of all layers). */
static kv_pool *pool_new(const kv_geometry *g, const kv_codec_params *const *plans, int n_plans,
                         const size_t *slabs_of_layer, bool one_region, strata_error *err)
{
    for (int i = 0; i < n_plans; i++)
        if (validate_plan(g, plans[i], err) != STRATA_OK)
            return NULL;
    const kv_codec_params *codecs = plans[0];
    size_t *slab_bytes = NULL, *n_slabs = NULL, *sizes = NULL;
    kv_pool *p = calloc(1, sizeof *p);
    if (!p)
        goto oom;
    p->geom = *g;
    const size_t L = (size_t)g->n_layers;
    p->codecs = malloc(L * sizeof *p->codecs);
    p->layer_region = malloc(L * sizeof *p->layer_region);
    p->regions = calloc(L, sizeof *p->regions);
    slab_bytes = calloc(L, sizeof *slab_bytes);
    n_slabs = calloc(L, sizeof *n_slabs);
    sizes = malloc(L * (size_t)n_plans * sizeof *sizes);
    if (!p->codecs || !p->layer_region || !p->regions || !slab_bytes || !n_slabs || !sizes)
        goto oom;
    memcpy(p->codecs, codecs, L * sizeof *codecs);
    const size_t largest = kv_plans_largest_block(g, plans, n_plans);
    for (size_t l = 0; l < L; l++) {
        size_t slab = one_region ? largest : layer_slot(g, plans, n_plans, (int)l);
        int r = 0;
        while (r < p->n_regions && slab_bytes[r] != slab)
            r++;
        if (r == p->n_regions)
            slab_bytes[p->n_regions++] = slab;
        p->layer_region[l] = r;
        if (n_slabs[r] > SIZE_MAX - slabs_of_layer[l]) {
            strata_fail(err, STRATA_EINVAL, "kv pool: slot count overflows");
            goto fail;
        }
        n_slabs[r] += slabs_of_layer[l];
    }
    /* Every region is checked, and the whole pool against the machine's memory, before any slab
     * memory is allocated. */
    size_t all_bytes = 0;
    for (int r = 0; r < p->n_regions; r++) {
        size_t total;
        if (n_slabs[r] < 1) {
            strata_fail(err, STRATA_EINVAL, "kv pool: n_slots must be at least 1");
            goto fail;
        }
        if (!mul_ok(slab_bytes[r], n_slabs[r], &total) || all_bytes > SIZE_MAX - total) {
            strata_fail(err, STRATA_EINVAL, "kv pool: %zu slots of %zu bytes overflow the address space", n_slabs[r],
                        slab_bytes[r]);
            goto fail;
        }
        all_bytes += total;
    }
    if (strata_check_memory("kv pool", all_bytes, err) != STRATA_OK)
        goto fail;
    for (int r = 0; r < p->n_regions; r++) {
        slab_region *rg = &p->regions[r];
        const int n_sizes = region_sizes(p, plans, n_plans, r, sizes);
        p->max_classes = n_sizes > p->max_classes ? n_sizes : p->max_classes;
        rg->books = kv_slabs_create(slab_bytes[r], n_slabs[r], sizes, n_sizes, err);
        if (!rg->books)
            goto fail;
        rg->mem = aligned_alloc(64, slab_bytes[r] * n_slabs[r]);   /* block sizes are multiples of 64 */
        if (!rg->mem) {
            strata_fail(err, STRATA_ENOMEM, "kv pool: cannot allocate %zu slots of %zu bytes (%zu MiB)", n_slabs[r],
                        slab_bytes[r], (slab_bytes[r] * n_slabs[r]) >> 20);
            goto fail;
        }
    }
    size_t stage = (size_t)g->block_tokens * (size_t)g->n_kv_heads * (size_t)g->head_dim;
    p->stage_k = malloc(stage * sizeof(float));
    p->stage_v = malloc(stage * sizeof(float));
    p->check_k = malloc(stage * sizeof(float));
    p->check_v = malloc(stage * sizeof(float));
    p->ott = malloc((size_t)g->n_kv_heads * 64 * sizeof *p->ott);   /* 64: the largest ott pool */
    if (!p->stage_k || !p->stage_v || !p->check_k || !p->check_v || !p->ott)
        goto oom;
    p->next_seq_id = 1;
    free(slab_bytes);
    free(n_slabs);
    free(sizes);
    return p;
oom:
    strata_fail(err, STRATA_ENOMEM, "kv pool: out of memory");
fail:
    free(slab_bytes);
    free(n_slabs);
    free(sizes);
    kv_pool_destroy(p);
    return NULL;
}

kv_pool *kv_pool_create(const kv_geometry *g, const kv_codec_params *codec, size_t n_slots,
                        strata_error *err)
{
    if (!g || !codec) {
        strata_fail(err, STRATA_EINVAL, "kv pool: NULL geometry or codec");
        return NULL;
    }
    if (kv_codec_validate(codec, g, err) != STRATA_OK)
        return NULL;
    if (n_slots < 1) {
        strata_fail(err, STRATA_EINVAL, "kv pool: n_slots must be at least 1");
        return NULL;
    }
    size_t L = (size_t)g->n_layers;
    kv_codec_params *codecs = malloc(L * sizeof *codecs);
    size_t *slots = calloc(L, sizeof *slots);
    kv_pool *p = NULL;
    if (!codecs || !slots) {
        strata_fail(err, STRATA_ENOMEM, "kv pool: out of memory");
    } else {
        for (size_t l = 0; l < L; l++)
            codecs[l] = *codec;
        slots[0] = n_slots;   /* one class: all layers share every slot */
        const kv_codec_params *plan = codecs;
        p = pool_new(g, &plan, 1, slots, false, err);
    }
    free(codecs);
    free(slots);
    return p;
}

kv_pool *kv_pool_create_plans(const kv_geometry *g, const kv_codec_params *const *plans, int n_plans,
                              size_t blocks_per_layer, bool shared, strata_error *err)
{
    if (!g || !plans || n_plans < 1) {
        strata_fail(err, STRATA_EINVAL, "kv pool: NULL geometry or plan");
        return NULL;
    }
    for (int i = 0; i < n_plans; i++)
        if (!plans[i]) {
            strata_fail(err, STRATA_EINVAL, "kv pool: NULL geometry or plan");
            return NULL;
        }
    if (g->n_layers < 1) {
        strata_fail(err, STRATA_EINVAL, "kv geometry: n_layers %d must be positive", g->n_layers);
        return NULL;
    }
    if (blocks_per_layer < 1) {
        strata_fail(err, STRATA_EINVAL, shared ? "kv pool: n_slots must be at least 1"
                                               : "kv pool: blocks_per_layer must be at least 1");
        return NULL;
    }
    size_t *slots = calloc((size_t)g->n_layers, sizeof *slots);
    if (!slots) {
        strata_fail(err, STRATA_ENOMEM, "kv pool: out of memory");
        return NULL;
    }
    for (int l = 0; l < g->n_layers; l++)
        slots[l] = shared ? (l == 0 ? blocks_per_layer : 0) : blocks_per_layer;
    kv_pool *p = pool_new(g, plans, n_plans, slots, shared, err);
    free(slots);
    return p;
}

kv_pool *kv_pool_create_plan(const kv_geometry *g, const kv_codec_params *codecs, size_t blocks_per_layer,
                             strata_error *err)
{
    return kv_pool_create_plans(g, &codecs, 1, blocks_per_layer, false, err);
}

kv_pool *kv_pool_create_shared(const kv_geometry *g, const kv_codec_params *codecs, size_t n_slots, strata_error *err)
{
    return kv_pool_create_plans(g, &codecs, 1, n_slots, true, err);
}

void kv_pool_destroy(kv_pool *pool)
{
    if (!pool)
        return;
    if (pool->regions)
        for (int r = 0; r < pool->n_regions; r++) {
            free(pool->regions[r].mem);
            kv_slabs_destroy(pool->regions[r].books);
        }
    free(pool->regions);
    free(pool->codecs);
    free(pool->layer_region);
    free(pool->stage_k);
    free(pool->stage_v);
    free(pool->check_k);
    free(pool->check_v);
    free(pool->ott);
    free(pool->tail_block);
    free(pool);
}

size_t kv_pool_capacity(const kv_pool *pool)
{
    size_t n = 0;
    for (int r = 0; r < pool->n_regions; r++)
        n += kv_slabs_count(pool->regions[r].books);
    return n;
}

size_t kv_pool_free(const kv_pool *pool)
{
    size_t n = 0;
    for (int r = 0; r < pool->n_regions; r++)
        n += kv_slabs_free_slabs(pool->regions[r].books);
    return n;
}

size_t kv_pool_slot_bytes(const kv_pool *pool)
{
    size_t m = 0;
    for (int r = 0; r < pool->n_regions; r++)
        if (kv_slabs_slab_bytes(pool->regions[r].books) > m)
            m = kv_slabs_slab_bytes(pool->regions[r].books);
    return m;
}

size_t kv_pool_bytes(const kv_pool *pool)
{
    size_t n = 0;
    for (int r = 0; r < pool->n_regions; r++)
        n += kv_slabs_count(pool->regions[r].books) * kv_slabs_slab_bytes(pool->regions[r].books);
    return n;
}

const kv_geometry *kv_pool_geometry(const kv_pool *pool) { return &pool->geom; }
const kv_codec_params *kv_pool_codec(const kv_pool *pool) { return &pool->codecs[0]; }

const kv_codec_params *kv_pool_layer_codec(const kv_pool *pool, int layer)
{
    if (!pool || layer < 0 || layer >= pool->geom.n_layers)
        return NULL;
    return &pool->codecs[layer];
}

static slab_region *region_of(kv_pool *p, int layer) { return &p->regions[p->layer_region[layer]]; }

/* The bytes of a slot of a sequence's layer. */
static size_t slot_bytes_of(const kv_seq *seq, int layer)
{
    const kv_pool *p = seq->pool;
    return kv_slabs_slot_bytes(p->regions[p->layer_region[layer]].books, seq->slot_class[layer]);
}

/* Block refs live in per-sequence tables sized once at creation, so the links stay valid. */
static void use_order_push(slab_region *rg, kv_block_ref *r)
{
    r->older = rg->newest;
    r->newer = NULL;
    if (rg->newest)
        rg->newest->newer = r;
    else
        rg->oldest = r;
    rg->newest = r;
}

static void use_order_remove(slab_region *rg, kv_block_ref *r)
{
    if (r->older)
        r->older->newer = r->newer;
    else
        rg->oldest = r->newer;
    if (r->newer)
        r->newer->older = r->older;
    else
        rg->newest = r->older;
    r->older = r->newer = NULL;
}

/* A block entering a slot: stamped now, so the region's list stays in last_use order. */
static void block_resident(kv_pool *p, slab_region *rg, kv_seq *owner, kv_block_ref *r, uint8_t *slot)
{
    r->slot = slot;
    r->owner = owner;
    r->last_use = ++p->clock;
    use_order_push(rg, r);
}

/* A block leaving its slot (evicted, spilled, rolled back or freed with its sequence). */
static void block_leaves(slab_region *rg, kv_block_ref *r)
{
    use_order_remove(rg, r);
    kv_slabs_give(rg->books, (size_t)(r->slot - rg->mem));
    r->slot = NULL;
}

static bool has_lower(const kv_pool *p) { return p->lower.put != NULL; }

int kv_pool_set_lower_tier(kv_pool *pool, const kv_lower_tier *lower, strata_error *err)
{
    if (!pool)
        return strata_fail(err, STRATA_EINVAL, "kv pool: NULL pool");
    if (pool->seqs)
        return strata_fail(err, STRATA_EINVAL, "kv pool: a lower tier can only be attached while no sequence exists");
    if (lower && (!lower->put || !lower->get || !lower->release))
        return strata_fail(err, STRATA_EINVAL, "kv pool: a lower tier needs put, get and release");
    memset(&pool->lower, 0, sizeof pool->lower);
    if (lower)
        pool->lower = *lower;
    return STRATA_OK;
}

void kv_pool_get_stats(const kv_pool *pool, kv_pool_stats *out)
{
    memset(out, 0, sizeof *out);
    if (!pool)
        return;
    *out = pool->stats;
    out->slots = kv_pool_capacity(pool);
    out->free_slots = kv_pool_free(pool);
}

static bool pinned(const kv_seq *s, const kv_block_ref *r) { return r->last_use > s->pin_floor; }

/* Moves a resident, unpinned block down to the lower tier (copying it first if it has no copy
 * there) and frees its slot. */
static int evict_block(kv_pool *p, slab_region *rg, kv_block_ref *victim, strata_error *err)
{
    if (!victim->lower) {
        int rc = p->lower.put(p->lower.ctx, victim->slot, victim->bytes, victim->owner->id, p->clock, &victim->lower,
                              err);
        if (rc != STRATA_OK)
            return strata_error_prefix(err, "evicting a block of sequence %" PRIu64, victim->owner->id);
        p->stats.writebacks++;
        p->stats.writeback_bytes += victim->bytes;
    }
    block_leaves(rg, victim);
    p->stats.evictions++;
    return STRATA_OK;
}

/* The used slots of the slab holding r, as block refs; false when one of them is pinned. */
static bool slab_unpinned(const slab_region *rg, const kv_block_ref *r, kv_block_ref **refs, size_t *n)
{
    size_t offsets[KV_SLABS_MAX_PER_SLAB];
    *n = kv_slabs_slab_used(rg->books, kv_slabs_slab_of(rg->books, (size_t)(r->slot - rg->mem)), offsets);
    for (size_t i = 0; i < *n; i++) {
        refs[i] = kv_slabs_owner(rg->books, offsets[i]);
        if (pinned(refs[i]->owner, refs[i]))
            return false;
    }
    return true;
}

/* Frees room for one slot of class cls of region rg: the least recently used unpinned block of
 * the region goes down when it is of that class; when it is of another, its whole slab does
 * (every block in it, none pinned), and the slab is then free for cls. With one block size this
 * is plain LRU over the region's blocks. */
static int evict_for(kv_pool *p, slab_region *rg, int cls, strata_error *err)
{
    const kv_slabs *b = rg->books;
    if (!has_lower(p))
        return strata_fail(err, STRATA_EFULL, "KV block pool exhausted: all %zu slots of %zu bytes are in use "
                           "(no host/NVMe tier to evict to)", kv_slabs_count(b), kv_slabs_slab_bytes(b));
    for (kv_block_ref *v = rg->oldest; v; v = v->newer) {
        if (pinned(v->owner, v))
            continue;
        const int v_cls = kv_slabs_slab_class(b, kv_slabs_slab_of(b, (size_t)(v->slot - rg->mem)));
        if (v_cls == cls)
            return evict_block(p, rg, v, err);
        kv_block_ref *refs[KV_SLABS_MAX_PER_SLAB];
        size_t n;
        if (!slab_unpinned(rg, v, refs, &n))
            continue;
        for (size_t i = 0; i < n; i++) {
            int rc = evict_block(p, rg, refs[i], err);
            if (rc != STRATA_OK)
                return rc;   /* the blocks evicted so far are below, as evictions leave them */
        }
        return STRATA_OK;
    }
    return strata_fail(err, STRATA_EFULL, "KV block pool too small: all %zu slots of %zu bytes hold blocks in use "
                       "by this step; raise the device KV budget", kv_slabs_count(b), kv_slabs_slab_bytes(b));
}

static bool slab_holds_pinned(void *ctx, size_t slab)
{
    const slab_region *rg = ctx;
    size_t offsets[KV_SLABS_MAX_PER_SLAB];
    const size_t n = kv_slabs_slab_used(rg->books, slab, offsets);
    for (size_t i = 0; i < n; i++) {
        const kv_block_ref *r = kv_slabs_owner(rg->books, offsets[i]);
        if (pinned(r->owner, r))
            return true;
    }
    return false;
}

/* Frees a slab for class cls by compaction: another class whose slabs have a slab's worth of
 * free slots moves the blocks of its sparsest slab (none of them pinned) into those, in memory.
 * Nothing goes down a tier, so this comes before eviction. false when no class can. */
static bool compact_for(kv_pool *p, slab_region *rg, int cls)
{
    kv_slabs *b = rg->books;
    for (int d = 0; d < kv_slabs_n_classes(b); d++) {
        if (d == cls || kv_slabs_per_slab(b, d) < 2 || kv_slabs_free_slots(b, d) < kv_slabs_per_slab(b, d))
            continue;
        size_t src[KV_SLABS_MAX_PER_SLAB], dst[KV_SLABS_MAX_PER_SLAB], n;
        const size_t slab = kv_slabs_sparsest(b, d, slab_holds_pinned, rg);
        if (slab == SIZE_MAX || !kv_slabs_evacuate(b, slab, src, dst, &n))
            continue;
        for (size_t i = 0; i < n; i++) {
            kv_block_ref *r = kv_slabs_owner(b, dst[i]);
            memcpy(rg->mem + dst[i], rg->mem + src[i], r->bytes);
            r->slot = rg->mem + dst[i];   /* views re-read it (kv_seq_layer_view) */
            p->stats.compaction_bytes += r->bytes;
        }
        p->stats.compactions++;
        return true;
    }
    return false;
}

/* Slabs a region's blocks would need if every class were packed (what compaction reaches), with
 * extra[c] more blocks of class c (NULL: none). */
static size_t packed_slabs(const kv_slabs *b, const size_t *extra)
{
    size_t slabs = 0;
    for (int c = 0; c < kv_slabs_n_classes(b); c++) {
        const size_t n = kv_slabs_used_slots(b, c) + (extra ? extra[c] : 0), per = kv_slabs_per_slab(b, c);
        slabs += (n + per - 1) / per;
    }
    return slabs;
}

/* Blocks of class cls region rg can take without evicting (compacting the other classes). */
static size_t region_room(const kv_slabs *b, int cls)
{
    const size_t others = packed_slabs(b, NULL) - (kv_slabs_used_slots(b, cls) + kv_slabs_per_slab(b, cls) - 1) /
                                                      kv_slabs_per_slab(b, cls);
    const size_t n = kv_slabs_count(b);
    return n > others ? (n - others) * kv_slabs_per_slab(b, cls) - kv_slabs_used_slots(b, cls) : 0;
}

/* A slot of class cls of region rg for block r: a free one, else one freed by compaction, else by
 * eviction. */
static int slot_take(kv_pool *p, slab_region *rg, int cls, kv_block_ref *r, uint8_t **out, strata_error *err)
{
    size_t offset;
    while (!kv_slabs_take(rg->books, cls, r, &offset)) {
        if (compact_for(p, rg, cls))
            continue;
        int rc = evict_for(p, rg, cls, err);
        if (rc != STRATA_OK)
            return rc;
    }
    *out = rg->mem + offset;
    return STRATA_OK;
}

kv_seq *kv_seq_create(kv_pool *pool, size_t max_tokens, strata_error *err)
{
    return kv_seq_create_plan(pool, NULL, max_tokens, err);
}

/* A sequence's own plan must validate and make no block larger than the pool's slots there. */
static int plan_fits_pool(const kv_pool *pool, const kv_codec_params *codecs, strata_error *err)
{
    const kv_geometry *g = &pool->geom;
    int rc = validate_plan(g, codecs, err);
    for (int l = 0; rc == STRATA_OK && l < g->n_layers; l++) {
        const size_t block = kv_block_size(&codecs[l], g),
                     slot = kv_slabs_slab_bytes(pool->regions[pool->layer_region[l]].books);
        if (block > slot) {
            char name[64];
            kv_codec_name(&codecs[l], name, sizeof name);
            rc = strata_fail(err, STRATA_EINVAL, "kv sequence: layer %d's codec %s makes blocks of %zu bytes; this "
                             "pool's slots there hold %zu (a pool takes other plans only when made for them)", l,
                             name, block, slot);
        }
    }
    return rc;
}

/* The class a layer's blocks of a plan take in its region: the smallest slot that holds them
 * (the size itself for the pool's plans; the slab size, a class, holds any block that fits). */
static int class_for(const kv_pool *p, int layer, const kv_codec_params *codec)
{
    const kv_slabs *b = p->regions[p->layer_region[layer]].books;
    const size_t block = kv_block_size(codec, &p->geom);
    int best = -1;
    for (int c = 0; c < kv_slabs_n_classes(b); c++)
        if (kv_slabs_slot_bytes(b, c) >= block && (best < 0 || kv_slabs_slot_bytes(b, c) < kv_slabs_slot_bytes(b, best)))
            best = c;
    return best;
}

kv_seq *kv_seq_create_plan(kv_pool *pool, const kv_codec_params *codecs, size_t max_tokens, strata_error *err)
{
    if (!pool) {
        strata_fail(err, STRATA_EINVAL, "kv sequence: NULL pool");
        return NULL;
    }
    if (max_tokens < 1) {
        strata_fail(err, STRATA_EINVAL, "kv sequence: max_tokens must be at least 1");
        return NULL;
    }
    if (codecs && plan_fits_pool(pool, codecs, err) != STRATA_OK)
        return NULL;
    const kv_geometry *g = &pool->geom;
    const size_t bt = (size_t)g->block_tokens;
    const size_t row = (size_t)g->n_kv_heads * (size_t)g->head_dim;
    kv_seq *s = calloc(1, sizeof *s);
    if (!s) {
        strata_fail(err, STRATA_ENOMEM, "kv sequence: out of memory");
        return NULL;
    }
    s->pool = pool;
    s->id = pool->next_seq_id++;
    s->max_tokens = max_tokens;
    s->max_blocks = max_tokens / bt;
    s->layers = calloc((size_t)g->n_layers, sizeof *s->layers);
    s->codecs = malloc((size_t)g->n_layers * sizeof *s->codecs);
    s->slot_class = malloc((size_t)g->n_layers * sizeof *s->slot_class);
    if (!s->layers || !s->codecs || !s->slot_class) {
        free(s->layers);
        free(s->codecs);
        free(s->slot_class);
        free(s);
        strata_fail(err, STRATA_ENOMEM, "kv sequence: out of memory for %d layers", g->n_layers);
        return NULL;
    }
    memcpy(s->codecs, codecs ? codecs : pool->codecs, (size_t)g->n_layers * sizeof *s->codecs);
    for (int l = 0; l < g->n_layers; l++)
        s->slot_class[l] = class_for(pool, l, &s->codecs[l]);   /* >= 0: plan_fits_pool checked the size */
    for (int l = 0; l < g->n_layers; l++) {
        kv_layer *L = &s->layers[l];
        const kv_codec_params *c = &s->codecs[l];
        size_t window = (size_t)c->residual + bt, tail_elems;
        L->tail_cap = max_tokens < window ? max_tokens : window;
        if (!mul_ok(L->tail_cap, row, &tail_elems) || tail_elems > SIZE_MAX / sizeof(uint16_t)) {
            strata_fail(err, STRATA_EINVAL, "kv sequence: tail of %zu tokens is too large", L->tail_cap);
            kv_seq_destroy(s);
            return NULL;
        }
        /* Block tables are sized for max_tokens up front so that append never allocates. */
        L->blocks = s->max_blocks ? malloc(s->max_blocks * sizeof *L->blocks) : NULL;
        L->refs = s->max_blocks ? calloc(s->max_blocks, sizeof *L->refs) : NULL;
        L->tail_k = malloc(tail_elems * sizeof(uint16_t));
        L->tail_v = malloc(tail_elems * sizeof(uint16_t));
        bool ok = (!s->max_blocks || (L->blocks && L->refs)) && L->tail_k && L->tail_v;
        if (ok && c->codec == KV_CODEC_OTT && c->pool_tokens > 0) {
            L->ott = kv_ott_tracker_create(g->n_kv_heads, c->pool_tokens, c->aux_tokens);
            L->ott_undo = kv_ott_tracker_create(g->n_kv_heads, c->pool_tokens, c->aux_tokens);
            ok = L->ott && L->ott_undo;
        }
        if (!ok) {
            strata_fail(err, STRATA_ENOMEM, "kv sequence: out of memory for the block table and tail of layer %d "
                        "(%zu tokens max)", l, max_tokens);
            kv_seq_destroy(s);
            return NULL;
        }
    }
    s->next = pool->seqs;
    if (pool->seqs)
        pool->seqs->prev = s;
    pool->seqs = s;
    return s;
}

void kv_seq_destroy(kv_seq *seq)
{
    if (!seq)
        return;
    kv_pool *p = seq->pool;
    for (int l = 0; l < p->geom.n_layers && seq->layers; l++) {
        kv_layer *L = &seq->layers[l];
        for (size_t b = 0; b < L->n_blocks; b++) {
            if (L->refs[b].slot)
                block_leaves(region_of(p, l), &L->refs[b]);
            if (L->refs[b].lower)
                p->lower.release(p->lower.ctx, L->refs[b].lower);
        }
        if (L->tail_lower)
            p->lower.release(p->lower.ctx, L->tail_lower);
        free(L->refs);
        free(L->blocks);
        free(L->tail_k);
        free(L->tail_v);
        kv_ott_tracker_destroy(L->ott);
        kv_ott_tracker_destroy(L->ott_undo);
    }
    free(seq->layers);
    free(seq->codecs);
    free(seq->slot_class);
    if (seq->prev)
        seq->prev->next = seq->next;
    else if (p->seqs == seq)
        p->seqs = seq->next;
    if (seq->next)
        seq->next->prev = seq->prev;
    free(seq);
}

const kv_pool *kv_seq_pool(const kv_seq *seq) { return seq->pool; }

const kv_codec_params *kv_seq_codec(const kv_seq *seq, int layer)
{
    if (!seq || layer < 0 || layer >= seq->pool->geom.n_layers)
        return NULL;
    return &seq->codecs[layer];
}
uint64_t kv_seq_id(const kv_seq *seq) { return seq->id; }
void kv_seq_set_id(kv_seq *seq, uint64_t id) { seq->id = id; }

static void half_row_to_f32(const uint16_t *src, float *dst, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = strata_half_to_float(src[i]);
}

/* The tail holds fp16, so rows entering a block directly from the caller are rounded the same
 * way: a token quantizes identically whether it passed through the tail or not. */
static void f32_row_rounded(const float *src, float *dst, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = strata_round_half(src[i]);
}

static void f32_row_to_half(const float *src, uint16_t *dst, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = strata_float_to_half(src[i]);
}

/* Decodes a block just made and adds its error against the rows it was made from. */
static int measure_block(kv_pool *p, kv_layer *L, const uint8_t *slot, size_t slot_bytes, strata_error *err)
{
    kv_block b;
    int rc = kv_block_parse(slot, slot_bytes, &b, err);
    if (rc == STRATA_OK)
        rc = kv_block_decode(&b, p->check_k, p->check_v, err);
    if (rc)
        return rc;
    size_t n = (size_t)b.desc.n_tokens * (size_t)b.desc.n_kv_heads * (size_t)b.desc.head_dim;
    double ke = 0, kr = 0, ve = 0, vr = 0;
    for (size_t i = 0; i < n; i++) {
        double dk = (double)p->check_k[i] - (double)p->stage_k[i], dv = (double)p->check_v[i] - (double)p->stage_v[i];
        ke += dk * dk;
        kr += (double)p->stage_k[i] * (double)p->stage_k[i];
        ve += dv * dv;
        vr += (double)p->stage_v[i] * (double)p->stage_v[i];
    }
    L->error.tokens += b.desc.n_tokens;
    L->error.k_err2 += ke;
    L->error.k_ref2 += kr;
    L->error.v_err2 += ve;
    L->error.v_ref2 += vr;
    return STRATA_OK;
}

/* The append rule: of a stream of tail tokens, every full block that leaves at least R tokens
 * behind it is compressed, oldest first. Blocks that leave a stream of `stream` tokens. */
static size_t blocks_leaving(size_t stream, size_t R, size_t bt)
{
    return stream >= R + bt ? (stream - R) / bt : 0;
}

int kv_seq_append(kv_seq *seq, int layer, const float *k, const float *v, size_t n_tokens,
                  strata_error *err)
{
    if (!seq)
        return strata_fail(err, STRATA_EINVAL, "kv append: NULL sequence");
    kv_pool *p = seq->pool;
    const kv_geometry *g = &p->geom;
    if (layer < 0 || layer >= g->n_layers)
        return strata_fail(err, STRATA_EINVAL, "kv append: layer %d out of range 0..%d", layer, g->n_layers - 1);
    if (n_tokens == 0)
        return STRATA_OK;
    if (!k || !v)
        return strata_fail(err, STRATA_EINVAL, "kv append: NULL rows");
    if (seq->spilled)
        return strata_fail(err, STRATA_EINVAL, "kv append: sequence %" PRIu64 " is spilled; resume it first", seq->id);
    kv_layer *L = &seq->layers[layer];
    slab_region *rg = region_of(p, layer);
    const int cls = seq->slot_class[layer];
    const size_t slot_bytes = kv_slabs_slot_bytes(rg->books, cls);
    const kv_codec_params *codec = &seq->codecs[layer];
    const size_t bt = (size_t)g->block_tokens, R = (size_t)codec->residual;
    const size_t row = (size_t)g->n_kv_heads * (size_t)g->head_dim;
    size_t len = L->n_blocks * bt + L->tail_len;
    if (n_tokens > seq->max_tokens - len)
        return strata_fail(err, STRATA_EINVAL,
                           "kv append: sequence %" PRIu64 " layer %d holds %zu tokens; %zu more exceed its max_tokens %zu",
                           seq->id, layer, len, n_tokens, seq->max_tokens);
    /* The tail followed by the new rows is one stream */
    size_t stream = L->tail_len + n_tokens;
    size_t n_new = blocks_leaving(stream, R, bt);
    if (!has_lower(p) && n_new > region_room(rg->books, cls))
        return strata_fail(err, STRATA_EFULL,
                           "KV block pool exhausted: sequence %" PRIu64 " layer %d needs %zu new block(s) of %zu bytes, "
                           "the pool has room for %zu (%zu of its %zu slots of %zu bytes are free)",
                           seq->id, layer, n_new, slot_bytes, region_room(rg->books, cls),
                           kv_slabs_free_slabs(rg->books), kv_slabs_count(rg->books), kv_slabs_slab_bytes(rg->books));
    const size_t prompt_end = n_tokens > 1 ? len + n_tokens : L->prompt_end;
    const kv_layer_error error_before = L->error;
    if (n_new && L->ott)
        kv_ott_tracker_copy(L->ott_undo, L->ott);
    for (size_t b = 0; b < n_new; b++) {
        for (size_t r = 0; r < bt; r++) {
            size_t i = b * bt + r;
            if (i < L->tail_len) {
                half_row_to_f32(L->tail_k + i * row, p->stage_k + r * row, row);
                half_row_to_f32(L->tail_v + i * row, p->stage_v + r * row, row);
            } else {
                f32_row_rounded(k + (i - L->tail_len) * row, p->stage_k + r * row, row);
                f32_row_rounded(v + (i - L->tail_len) * row, p->stage_v + r * row, row);
            }
        }
        const uint64_t first = (uint64_t)(L->n_blocks + b) * bt;
        kv_block_desc d;
        kv_block_desc_init(&d, codec, g, (uint32_t)layer, first);
        if (codec->codec == KV_CODEC_GEAR && first + bt <= prompt_end)
            d.rank = codec->rank_prompt;
        kv_block_extra extra = {NULL};
        if (L->ott) {
            d.ott_tokens = (int)kv_ott_select(L->ott, p->stage_k, bt, g->head_dim, first, p->ott);
            extra.ott = p->ott;
        }
        uint8_t *slot = NULL;
        size_t written = 0;
        kv_block_ref *ref = &L->refs[L->n_blocks + b];
        *ref = (kv_block_ref){0};
        int rc = slot_take(p, rg, cls, ref, &slot, err);
        if (rc == STRATA_OK) {
            /* not visible until n_blocks moves; pinned so that the rest of this call cannot evict it */
            block_resident(p, rg, seq, ref, slot);
            rc = kv_block_encode_ex(&d, p->stage_k, p->stage_v, &extra, slot, slot_bytes, &written, err);
            ref->bytes = (uint32_t)written;
        }
        if (rc == STRATA_OK && seq->track_error)
            rc = measure_block(p, L, slot, slot_bytes, err);
        if (rc) {
            for (size_t u = 0; u < b; u++)
                block_leaves(rg, &L->refs[L->n_blocks + u]);
            if (slot)
                block_leaves(rg, ref);
            if (L->ott)
                kv_ott_tracker_copy(L->ott, L->ott_undo);
            L->error = error_before;
            return rc;
        }
    }
    size_t consumed = n_new * bt;
    size_t new_tail = stream - consumed;
    if (consumed < L->tail_len) {
        size_t keep = L->tail_len - consumed;
        memmove(L->tail_k, L->tail_k + consumed * row, keep * row * sizeof(uint16_t));
        memmove(L->tail_v, L->tail_v + consumed * row, keep * row * sizeof(uint16_t));
        f32_row_to_half(k, L->tail_k + keep * row, n_tokens * row);
        f32_row_to_half(v, L->tail_v + keep * row, n_tokens * row);
    } else {
        size_t skip = consumed - L->tail_len;
        f32_row_to_half(k + skip * row, L->tail_k, new_tail * row);
        f32_row_to_half(v + skip * row, L->tail_v, new_tail * row);
    }
    for (size_t b = 0; b < n_new; b++)
        L->blocks[L->n_blocks + b] = L->refs[L->n_blocks + b].slot;
    L->n_blocks += n_new;
    L->tail_len = new_tail;
    L->prompt_end = prompt_end;
    return STRATA_OK;
}

size_t kv_seq_length(const kv_seq *seq, int layer)
{
    if (!seq || layer < 0 || layer >= seq->pool->geom.n_layers)
        return 0;
    const kv_layer *L = &seq->layers[layer];
    return L->n_blocks * (size_t)seq->pool->geom.block_tokens + L->tail_len;
}

void kv_seq_layer_view(const kv_seq *seq, int layer, kv_layer_view *view)
{
    memset(view, 0, sizeof *view);
    if (!seq || layer < 0 || layer >= seq->pool->geom.n_layers)
        return;
    const kv_geometry *g = &seq->pool->geom;
    const kv_layer *L = &seq->layers[layer];
    view->layer = layer;
    view->n_kv_heads = g->n_kv_heads;
    view->head_dim = g->head_dim;
    view->block_tokens = g->block_tokens;
    view->n_blocks = L->n_blocks;
    for (size_t b = 0; b < L->n_blocks; b++)
        L->blocks[b] = L->refs[b].slot;
    view->blocks = (const uint8_t *const *)L->blocks;
    view->block_bytes = slot_bytes_of(seq, layer);
    view->tail_tokens = L->tail_len;
    view->tail_k = L->tail_k;
    view->tail_v = L->tail_v;
}

void kv_seq_get_stats(const kv_seq *seq, kv_seq_stats *st)
{
    memset(st, 0, sizeof *st);
    if (!seq)
        return;
    const kv_geometry *g = &seq->pool->geom;
    size_t row_bytes = (size_t)g->n_kv_heads * (size_t)g->head_dim * sizeof(uint16_t) * 2;
    for (int l = 0; l < g->n_layers; l++) {
        const kv_layer *L = &seq->layers[l];
        st->blocks += L->n_blocks;
        st->block_tokens += L->n_blocks * (size_t)g->block_tokens;
        for (size_t b = 0; b < L->n_blocks; b++) {
            st->block_bytes += L->refs[b].bytes;
            st->resident_blocks += L->refs[b].slot != NULL;
            st->lower_blocks += L->refs[b].lower != 0;
        }
        st->slot_bytes += L->n_blocks * slot_bytes_of(seq, l);
        st->tail_tokens += L->tail_len;
        st->tail_bytes += L->tail_len * row_bytes;
    }
    st->tokens = st->block_tokens + st->tail_tokens;
}

int kv_seq_track_error(kv_seq *seq, int on, strata_error *err)
{
    if (!seq)
        return strata_fail(err, STRATA_EINVAL, "kv error tracking: NULL sequence");
    seq->track_error = on != 0;
    return STRATA_OK;
}

void kv_seq_layer_error(const kv_seq *seq, int layer, kv_layer_error *out)
{
    memset(out, 0, sizeof *out);
    if (seq && layer >= 0 && layer < seq->pool->geom.n_layers)
        *out = seq->layers[layer].error;
}

/* Blocks a layer makes when n_tokens more arrive (kv_seq_append's rule). */
static size_t new_blocks(const kv_seq *seq, int layer, size_t n_tokens)
{
    const kv_pool *p = seq->pool;
    const size_t bt = (size_t)p->geom.block_tokens, R = (size_t)seq->codecs[layer].residual;
    return blocks_leaving(seq->layers[layer].tail_len + n_tokens, R, bt);
}

size_t kv_tail_tokens(const kv_codec_params *p, int block_tokens, size_t n_tokens)
{
    const size_t bt = block_tokens > 0 ? (size_t)block_tokens : 1, R = p && p->residual > 0 ? (size_t)p->residual : 0;
    return n_tokens - blocks_leaving(n_tokens, R, bt) * bt;
}

/* A step's demand on one pool, summed over its sequences. Per region and class: the slots its
 * blocks take (new blocks, and blocks fetched back from the lower tier for attention); per region:
 * the new blocks (they have no copy below). */
struct kv_room {
    const kv_pool *pool;
    size_t *takes, *trial;       /* [n_regions * max_classes] */
    size_t *touch, *trial_touch; /* the same, counting every block the step uses as possibly fetched */
    size_t *made, *trial_made;   /* [n_regions] */
    size_t *dirty;               /* [n_regions]: resident blocks with no copy below; SIZE_MAX: not counted yet */
    size_t n_seqs;               /* sequences added */
    kv_lower_room below;         /* the tier's room, asked once */
};

kv_room *kv_room_begin(const kv_pool *pool, strata_error *err)
{
    if (!pool) {
        strata_fail(err, STRATA_EINVAL, "kv room: NULL pool");
        return NULL;
    }
    const size_t n = (size_t)pool->n_regions * (size_t)pool->max_classes, R = (size_t)pool->n_regions;
    kv_room *r = calloc(1, sizeof *r);
    if (r) {
        r->pool = pool;
        r->takes = calloc(n, sizeof *r->takes);
        r->trial = calloc(n, sizeof *r->trial);
        r->touch = calloc(n, sizeof *r->touch);
        r->trial_touch = calloc(n, sizeof *r->trial_touch);
        r->made = calloc(R, sizeof *r->made);
        r->trial_made = calloc(R, sizeof *r->trial_made);
        r->dirty = malloc(R * sizeof *r->dirty);
    }
    if (!r || !r->takes || !r->trial || !r->touch || !r->trial_touch || !r->made || !r->trial_made || !r->dirty) {
        kv_room_end(r);
        strata_fail(err, STRATA_ENOMEM, "kv room: out of memory");
        return NULL;
    }
    for (size_t i = 0; i < R; i++)
        r->dirty[i] = SIZE_MAX;
    return r;
}

void kv_room_end(kv_room *r)
{
    if (!r)
        return;
    free(r->takes);
    free(r->trial);
    free(r->touch);
    free(r->trial_touch);
    free(r->made);
    free(r->trial_made);
    free(r->dirty);
    free(r);
}

static size_t region_dirty(kv_room *room, int r)
{
    if (room->dirty[r] == SIZE_MAX) {
        size_t n = 0;
        for (const kv_block_ref *v = room->pool->regions[r].oldest; v; v = v->newer)
            n += v->lower == 0;
        room->dirty[r] = n;
    }
    return room->dirty[r];
}

/* A region's largest slab in blocks (over its block sizes), and the largest block as the tiers
 * below store it: whole 4 KiB pages (host arena extents, NVMe slabs). */
static size_t region_unit(const kv_slabs *b, size_t *max_per)
{
    size_t unit = 0;
    *max_per = 1;
    for (int c = 0; c < kv_slabs_n_classes(b); c++) {
        const size_t per = kv_slabs_per_slab(b, c), u = kv_lower_unit_bytes(kv_slabs_slot_bytes(b, c));
        *max_per = per > *max_per ? per : *max_per;
        unit = u > unit ? u : unit;
    }
    return unit;
}

/* The most bytes region r's part of the step may move below: *puts, blocks written down, and
 * *fetches, blocks brought back through the tier's memory (with NVMe a block comes back through
 * host memory, which costs room there as a put does: with such a tier, get_takes_room, fetches
 * are counted so, whether their copy is on NVMe or not). When the step's slots fit the region
 * (`after` packed slabs, counting the blocks below it fetches), nothing is evicted. Else a block
 * of the step not yet used may itself be evicted and fetched again later in the step (another
 * layer's, another sequence's), so every block the step uses counts as possibly fetched
 * (`touch`), and evictions happen only as slots run out: with one block size each frees one
 * slot, (touch - n_slabs) slabs' worth of blocks at most; with several, one eviction may free a
 * whole slab of another size (its blocks all go down), overshooting by up to a slab per size.
 * Only blocks with no copy below are put (a fetched block keeps its copy): no more than those,
 * counting the step's new blocks. */
static void region_below(kv_room *room, int r, size_t *puts, size_t *fetches, size_t *unit_out)
{
    const kv_pool *p = room->pool;
    const size_t C = (size_t)p->max_classes;
    const kv_slabs *b = p->regions[r].books;
    size_t max_per;
    const size_t unit = region_unit(b, &max_per), n_slabs = kv_slabs_count(b);
    size_t takes = 0, touch = 0;
    for (size_t c = 0; c < C; c++) {
        takes += room->trial[(size_t)r * C + c];
        touch += room->trial_touch[(size_t)r * C + c];
    }
    const size_t made = room->trial_made[r], fetch_cost = p->lower.get_takes_room ? 1 : 0;
    *unit_out = unit;
    if (packed_slabs(b, room->trial + (size_t)r * C) <= n_slabs) {
        *puts = 0;
        *fetches = (takes - made) * fetch_cost * unit;
        return;
    }
    const size_t after = packed_slabs(b, room->trial_touch + (size_t)r * C);
    const size_t evicted = after > n_slabs ? (after - n_slabs + (size_t)kv_slabs_n_classes(b) - 1) * max_per : 0;
    const size_t dirty = region_dirty(room, r) + made;
    *puts = (evicted < dirty ? evicted : dirty) * unit;
    *fetches = (touch - made) * fetch_cost * unit;
}

size_t kv_lower_unit_bytes(size_t block_bytes)
{
    return (block_bytes + 4095) / 4096 * 4096;   /* blocks are far below SIZE_MAX (kv_block_size) */
}

bool kv_lower_room_fits(const kv_lower_tier *lower, kv_lower_room *cache, size_t unit, size_t puts, size_t fetches)
{
    if (!lower->room || puts + fetches == 0)
        return true;
    if (!cache->asked || cache->unit != unit) {
        lower->room(lower->ctx, unit, &cache->through_host, &cache->below);
        cache->asked = true;
        cache->unit = unit;
    }
    return puts + fetches <= cache->through_host || (cache->below > 0 && puts <= cache->below);
}

int kv_room_add(kv_room *room, const kv_seq *seq, size_t n_tokens, strata_error *err)
{
    if (!room || !seq)
        return strata_fail(err, STRATA_EINVAL, "kv room: NULL argument");
    const kv_pool *p = room->pool;
    if (seq->pool != p)
        return strata_fail(err, STRATA_EINVAL, "kv room: sequence %" PRIu64 " is of another pool", seq->id);
    if (seq->spilled)
        return strata_fail(err, STRATA_EINVAL, "sequence %" PRIu64 " is spilled; resume it first", seq->id);
    const kv_geometry *g = &p->geom;
    size_t len = kv_seq_length(seq, 0);
    if (n_tokens > seq->max_tokens - len)
        return strata_fail(err, STRATA_EINVAL, "sequence %" PRIu64 " holds %zu tokens; %zu more exceed its limit of %zu",
                           seq->id, len, n_tokens, seq->max_tokens);
    const size_t C = (size_t)p->max_classes;
    memcpy(room->trial, room->takes, (size_t)p->n_regions * C * sizeof *room->trial);
    memcpy(room->trial_touch, room->touch, (size_t)p->n_regions * C * sizeof *room->trial_touch);
    memcpy(room->trial_made, room->made, (size_t)p->n_regions * sizeof *room->trial_made);
    for (int l = 0; l < g->n_layers; l++) {
        const int r = p->layer_region[l], c = seq->slot_class[l];
        const kv_slabs *b = p->regions[r].books;
        const kv_layer *L = &seq->layers[l];
        size_t n_new = new_blocks(seq, l, n_tokens), fetched = 0;
        /* A decode step or a later chunk pins the layer's whole table for attention, bringing
         * back what is below; a first prefill pins its new blocks. */
        const bool whole = !(n_tokens > 1 && len == 0);
        for (size_t k = 0; whole && k < L->n_blocks; k++)
            fetched += L->refs[k].slot == NULL;
        room->trial[(size_t)r * C + (size_t)c] += n_new + fetched;
        room->trial_touch[(size_t)r * C + (size_t)c] += n_new + (whole ? L->n_blocks : 0);
        room->trial_made[r] += n_new;
        const size_t at_once = whole ? L->n_blocks + n_new : n_new;
        const size_t most = kv_slabs_count(b) * kv_slabs_per_slab(b, c);
        if (has_lower(p) && at_once > most)
            return strata_fail(err, STRATA_EFULL,
                               "the device KV pool holds %zu blocks of %zu bytes, but layer %d of sequence %" PRIu64
                               " needs %zu at once for this step (%zu tokens); raise the device KV budget",
                               most, kv_slabs_slot_bytes(b, c), l, seq->id, at_once, len + n_tokens);
    }
    /* Per region: the slabs every block would need after the step, packed by compaction. */
    size_t put_bytes = 0, fetch_bytes = 0, evict_unit = 0;
    for (int r = 0; r < p->n_regions; r++) {
        const kv_slabs *b = p->regions[r].books;
        const size_t after = packed_slabs(b, room->trial + (size_t)r * C), n_slabs = kv_slabs_count(b);
        if (has_lower(p)) {
            size_t unit, puts, fetches;
            region_below(room, r, &puts, &fetches, &unit);
            put_bytes += puts;
            fetch_bytes += fetches;
            evict_unit = unit > evict_unit ? unit : evict_unit;
            continue;
        }
        if (after > n_slabs) {
            const size_t now = packed_slabs(b, room->takes + (size_t)r * C), free_slabs = n_slabs > now ? n_slabs - now : 0;
            return strata_fail(err, STRATA_EFULL,
                               "KV block pool exhausted: sequence %" PRIu64 " needs %zu more slot(s) of %zu bytes for "
                               "%zu more tokens, %zu of the pool's %zu are free%s",
                               seq->id, after - now, kv_slabs_slab_bytes(b), n_tokens, free_slabs, n_slabs,
                               room->n_seqs ? " beside this step's other sequences" : "");
        }
    }
    if (has_lower(p) && !kv_lower_room_fits(&p->lower, &room->below, evict_unit, put_bytes, fetch_bytes))
        return strata_fail(err, STRATA_EFULL,
                           "KV tiers full: this step may move %zu bytes of blocks down from the device pool and bring "
                           "%zu back (sequence %" PRIu64 "%s), but host memory has room for %zu and NVMe for %zu; "
                           "raise --host-kv-mib or --nvme-kv-mib",
                           put_bytes, fetch_bytes, seq->id, room->n_seqs ? " and those beside it" : "",
                           room->below.through_host, room->below.below);
    memcpy(room->takes, room->trial, (size_t)p->n_regions * C * sizeof *room->takes);
    memcpy(room->touch, room->trial_touch, (size_t)p->n_regions * C * sizeof *room->touch);
    memcpy(room->made, room->trial_made, (size_t)p->n_regions * sizeof *room->made);
    room->n_seqs++;
    return STRATA_OK;
}

int kv_seq_check_room(const kv_seq *seq, size_t n_tokens, strata_error *err)
{
    if (!seq)
        return strata_fail(err, STRATA_EINVAL, "kv room: NULL sequence");
    kv_room *room = kv_room_begin(seq->pool, err);
    if (!room)
        return err ? err->code : STRATA_ENOMEM;
    const int rc = kv_room_add(room, seq, n_tokens, err);
    kv_room_end(room);
    return rc;
}

int kv_seq_acquire_layer(kv_seq *seq, int layer, kv_layer_view *view, strata_error *err)
{
    if (!seq || !view)
        return strata_fail(err, STRATA_EINVAL, "kv acquire: NULL argument");
    kv_pool *p = seq->pool;
    if (layer < 0 || layer >= p->geom.n_layers)
        return strata_fail(err, STRATA_EINVAL, "kv acquire: layer %d out of range 0..%d", layer, p->geom.n_layers - 1);
    if (seq->spilled)
        return strata_fail(err, STRATA_EINVAL, "sequence %" PRIu64 " is spilled; resume it first", seq->id);
    kv_layer *L = &seq->layers[layer];
    slab_region *rg = region_of(p, layer);
    const int cls = seq->slot_class[layer];
    const size_t most = kv_slabs_count(rg->books) * kv_slabs_per_slab(rg->books, cls);
    if (L->n_blocks > most)
        return strata_fail(err, STRATA_EFULL,
                           "the device KV pool holds %zu blocks of %zu bytes, but attention over layer %d of sequence "
                           "%" PRIu64 " needs its %zu blocks at once; raise the device KV budget",
                           most, kv_slabs_slot_bytes(rg->books, cls), layer, seq->id, L->n_blocks);
    /* Pin the layer's resident blocks first, so that bringing one block back never evicts another
     * of it; each fetched block is pinned as it arrives. */
    for (size_t b = 0; b < L->n_blocks; b++) {
        kv_block_ref *r = &L->refs[b];
        if (r->slot) {
            r->last_use = ++p->clock;
            use_order_remove(rg, r);
            use_order_push(rg, r);
        }
    }
    kv_seq_prefetch_layer(seq, layer);
    for (size_t b = 0; b < L->n_blocks; b++) {
        kv_block_ref *r = &L->refs[b];
        if (r->slot)
            continue;
        uint8_t *slot;
        int rc = slot_take(p, rg, cls, r, &slot, err);
        if (rc == STRATA_OK) {
            rc = p->lower.get(p->lower.ctx, r->lower, slot, kv_slabs_slot_bytes(rg->books, cls), p->clock, err);
            if (rc != STRATA_OK)
                kv_slabs_give(rg->books, (size_t)(slot - rg->mem));
        }
        if (rc != STRATA_OK)
            return strata_error_prefix(err, "sequence %" PRIu64 " layer %d block %zu", seq->id, layer, b);
        block_resident(p, rg, seq, r, slot);
        p->stats.fetches++;
        p->stats.fetch_bytes += r->bytes;
    }
    kv_seq_layer_view(seq, layer, view);
    return STRATA_OK;
}

void kv_seq_prefetch_layer(kv_seq *seq, int layer)
{
    if (!seq || layer < 0 || layer >= seq->pool->geom.n_layers || !seq->pool->lower.prefetch)
        return;
    kv_pool *p = seq->pool;
    kv_layer *L = &seq->layers[layer];
    for (size_t b = 0; b < L->n_blocks; b++)
        if (!L->refs[b].slot && L->refs[b].lower)
            p->lower.prefetch(p->lower.ctx, L->refs[b].lower, p->clock);
}

void kv_seq_unpin(kv_seq *seq)
{
    if (seq)
        seq->pin_floor = seq->pool->clock;
}

bool kv_seq_is_spilled(const kv_seq *seq) { return seq && seq->spilled; }

/* The fp16 block that holds a layer's tail while the sequence is spilled. */
static void tail_block_desc(const kv_seq *seq, int layer, kv_block_desc *d)
{
    const kv_pool *p = seq->pool;
    kv_codec_params fp16 = {.codec = KV_CODEC_FP16, .bits = 16};
    kv_block_desc_init(d, &fp16, &p->geom, (uint32_t)layer,
                       (uint64_t)seq->layers[layer].n_blocks * (uint64_t)p->geom.block_tokens);
    d->n_tokens = (uint32_t)seq->layers[layer].tail_len;
}

static int tail_buffer(kv_pool *p, size_t bytes, strata_error *err)
{
    if (bytes <= p->tail_block_cap)
        return STRATA_OK;
    uint8_t *b = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!b)
        return strata_fail(err, STRATA_ENOMEM, "kv spill: out of memory for a tail block of %zu bytes", bytes);
    free(p->tail_block);
    p->tail_block = b;
    p->tail_block_cap = bytes;
    return STRATA_OK;
}

/* Staging rows for a tail: the pool's block staging holds block_tokens rows, a tail up to R + G. */
static int tail_rows(size_t rows, float **k, float **v, strata_error *err)
{
    *k = malloc(rows * sizeof(float));
    *v = malloc(rows * sizeof(float));
    if (!*k || !*v) {   /* callers free both on every path: leave nothing to free twice */
        free(*k);
        free(*v);
        *k = *v = NULL;
        return strata_fail(err, STRATA_ENOMEM, "kv spill: out of memory for %zu tail values", rows);
    }
    return STRATA_OK;
}

int kv_seq_spill(kv_seq *seq, strata_error *err)
{
    if (!seq)
        return strata_fail(err, STRATA_EINVAL, "kv spill: NULL sequence");
    kv_pool *p = seq->pool;
    if (!has_lower(p))
        return strata_fail(err, STRATA_EUNSUPPORTED, "kv spill: the pool has no host/NVMe tier to spill to");
    if (seq->spilled)
        return STRATA_OK;
    const kv_geometry *g = &p->geom;
    const size_t row = (size_t)g->n_kv_heads * (size_t)g->head_dim;
    kv_seq_unpin(seq);
    /* Blocks first: each move leaves a consistent table, so a failure part way is harmless. */
    for (int l = 0; l < g->n_layers; l++) {
        kv_layer *L = &seq->layers[l];
        for (size_t b = 0; b < L->n_blocks; b++) {
            kv_block_ref *r = &L->refs[b];
            if (!r->slot)
                continue;
            if (!r->lower) {
                int rc = p->lower.put(p->lower.ctx, r->slot, r->bytes, seq->id, p->clock, &r->lower, err);
                if (rc != STRATA_OK)
                    return strata_error_prefix(err, "spilling sequence %" PRIu64 " layer %d", seq->id, l);
                p->stats.writebacks++;
                p->stats.writeback_bytes += r->bytes;
            }
            block_leaves(region_of(p, l), r);
            p->stats.evictions++;
        }
    }
    size_t max_tail = 0;
    for (int l = 0; l < g->n_layers; l++)
        if (seq->layers[l].tail_len > max_tail)
            max_tail = seq->layers[l].tail_len;
    float *k = NULL, *v = NULL;
    int rc = max_tail ? tail_rows(max_tail * row, &k, &v, err) : STRATA_OK;
    int l = 0;
    for (; l < g->n_layers && rc == STRATA_OK; l++) {
        kv_layer *L = &seq->layers[l];
        if (!L->tail_len)
            continue;
        kv_block_desc d;
        tail_block_desc(seq, l, &d);
        size_t bytes = kv_block_bytes(&d), written = 0;
        rc = tail_buffer(p, bytes, err);
        if (rc != STRATA_OK)
            break;
        half_row_to_f32(L->tail_k, k, L->tail_len * row);
        half_row_to_f32(L->tail_v, v, L->tail_len * row);
        rc = kv_block_encode(&d, k, v, p->tail_block, p->tail_block_cap, &written, err);
        if (rc == STRATA_OK)
            rc = p->lower.put(p->lower.ctx, p->tail_block, written, seq->id, p->clock, &L->tail_lower, err);
        if (rc != STRATA_OK)
            strata_error_prefix(err, "spilling the tail of sequence %" PRIu64 " layer %d", seq->id, l);
    }
    free(k);
    free(v);
    if (rc != STRATA_OK) {
        for (int u = 0; u < g->n_layers; u++)
            if (seq->layers[u].tail_lower) {
                p->lower.release(p->lower.ctx, seq->layers[u].tail_lower);
                seq->layers[u].tail_lower = 0;
            }
        return rc;
    }
    for (l = 0; l < g->n_layers; l++) {
        kv_layer *L = &seq->layers[l];
        free(L->tail_k);
        free(L->tail_v);
        L->tail_k = L->tail_v = NULL;
    }
    seq->spilled = true;
    p->stats.seq_spills++;
    if (p->lower.set_waiting)
        p->lower.set_waiting(p->lower.ctx, seq->id, 1);
    return STRATA_OK;
}

int kv_seq_resume(kv_seq *seq, strata_error *err)
{
    if (!seq)
        return strata_fail(err, STRATA_EINVAL, "kv resume: NULL sequence");
    if (!seq->spilled)
        return STRATA_OK;
    kv_pool *p = seq->pool;
    const kv_geometry *g = &p->geom;
    const size_t row = (size_t)g->n_kv_heads * (size_t)g->head_dim;
    for (int l = 0; l < g->n_layers; l++) {
        kv_layer *L = &seq->layers[l];
        if (!L->tail_k)
            L->tail_k = malloc(L->tail_cap * row * sizeof(uint16_t));
        if (!L->tail_v)
            L->tail_v = malloc(L->tail_cap * row * sizeof(uint16_t));
        if (!L->tail_k || !L->tail_v)
            return strata_fail(err, STRATA_ENOMEM, "kv resume: out of memory for the tail of layer %d", l);
    }
    size_t max_tail = 0;
    for (int l = 0; l < g->n_layers; l++)
        if (seq->layers[l].tail_len > max_tail)
            max_tail = seq->layers[l].tail_len;
    float *k = NULL, *v = NULL;
    int rc = max_tail ? tail_rows(max_tail * row, &k, &v, err) : STRATA_OK;
    for (int l = 0; l < g->n_layers && rc == STRATA_OK; l++) {
        kv_layer *L = &seq->layers[l];
        if (!L->tail_len)
            continue;
        kv_block_desc d;
        tail_block_desc(seq, l, &d);
        size_t bytes = kv_block_bytes(&d);
        kv_block b;
        rc = tail_buffer(p, bytes, err);
        if (rc == STRATA_OK)
            rc = p->lower.get(p->lower.ctx, L->tail_lower, p->tail_block, p->tail_block_cap, p->clock, err);
        if (rc == STRATA_OK)
            rc = kv_block_parse(p->tail_block, bytes, &b, err);
        if (rc == STRATA_OK && (b.desc.codec != KV_CODEC_FP16 || b.desc.n_tokens != L->tail_len ||
                                b.desc.layer != (uint32_t)l || b.desc.first_pos != d.first_pos))
            rc = strata_fail(err, STRATA_EFORMAT, "the block restored is not this layer's tail");
        if (rc == STRATA_OK)
            rc = kv_block_decode(&b, k, v, err);
        if (rc != STRATA_OK) {
            strata_error_prefix(err, "resuming the tail of sequence %" PRIu64 " layer %d", seq->id, l);
            break;
        }
        f32_row_to_half(k, L->tail_k, L->tail_len * row);   /* fp16 -> fp32 -> fp16 is exact */
        f32_row_to_half(v, L->tail_v, L->tail_len * row);
    }
    free(k);
    free(v);
    if (rc != STRATA_OK)
        return rc;
    for (int l = 0; l < g->n_layers; l++) {
        kv_layer *L = &seq->layers[l];
        if (L->tail_lower) {
            p->lower.release(p->lower.ctx, L->tail_lower);
            L->tail_lower = 0;
        }
    }
    seq->spilled = false;
    p->stats.seq_resumes++;
    if (p->lower.set_waiting)
        p->lower.set_waiting(p->lower.ctx, seq->id, 0);
    /* The first layers are needed first: start bringing them back now. */
    kv_seq_prefetch_layer(seq, 0);
    kv_seq_prefetch_layer(seq, 1);
    return STRATA_OK;
}

/* ---- migration: a sequence as one byte image (kv_cache.h, seq_image.h) ---- */

static int export_layer(void *ctx, int l, kv_image_layer *out, strata_error *err)
{
    (void)err;
    const kv_layer *L = &((kv_seq *)ctx)->layers[l];
    *out = (kv_image_layer){.n_blocks = L->n_blocks, .tail_len = L->tail_len, .prompt_end = L->prompt_end,
                            .ott_bytes = L->ott ? kv_ott_tracker_state_bytes(L->ott) : 0};
    return STRATA_OK;
}

static int export_ott(void *ctx, int l, uint8_t *dst, strata_error *err)
{
    (void)err;
    kv_ott_tracker_save(((kv_seq *)ctx)->layers[l].ott, dst);
    return STRATA_OK;
}

static int export_block_bytes(void *ctx, int l, size_t b, uint32_t *bytes, strata_error *err)
{
    (void)err;
    *bytes = ((kv_seq *)ctx)->layers[l].refs[b].bytes;
    return STRATA_OK;
}

static int export_block(void *ctx, int l, size_t b, uint8_t *dst, strata_error *err)
{
    kv_seq *seq = ctx;
    kv_pool *p = seq->pool;
    const kv_block_ref *r = &seq->layers[l].refs[b];
    if (r->slot) {
        memcpy(dst, r->slot, r->bytes);
        return STRATA_OK;
    }
    /* below the device: read the copy there without moving the block (the writer checks it) */
    return p->lower.get(p->lower.ctx, r->lower, dst, r->bytes, p->clock, err);
}

static int export_tail(void *ctx, int l, uint16_t *k, uint16_t *v, strata_error *err)
{
    (void)err;
    kv_seq *seq = ctx;
    const kv_layer *L = &seq->layers[l];
    const size_t n = L->tail_len * (size_t)seq->pool->geom.n_kv_heads * (size_t)seq->pool->geom.head_dim;
    memcpy(k, L->tail_k, n * sizeof *k);
    memcpy(v, L->tail_v, n * sizeof *v);
    return STRATA_OK;
}

int kv_seq_export(kv_seq *seq, uint8_t **out, size_t *out_len, strata_error *err)
{
    *out = NULL;
    *out_len = 0;
    if (!seq)
        return strata_fail(err, STRATA_EINVAL, "kv export: NULL sequence");
    if (seq->spilled)
        return strata_fail(err, STRATA_EINVAL, "kv export: sequence %" PRIu64 " is spilled; resume it first", seq->id);
    const kv_image_source src = {.ctx = seq, .layer = export_layer, .ott_state = export_ott,
                                 .block_bytes = export_block_bytes, .block = export_block, .tail = export_tail,
                                 .codecs = seq->codecs};
    return kv_image_write(&seq->pool->geom, &src, out, out_len, err);
}

typedef struct import_ctx {
    kv_pool *pool;
    kv_seq *s;           /* made when the image's plan is read */
    size_t max_tokens;
    size_t prompt_end;   /* of the layer being read */
} import_ctx;

static int import_plan(void *ctx, const kv_codec_params *codecs, strata_error *err)
{
    import_ctx *c = ctx;
    c->s = kv_seq_create_plan(c->pool, codecs, c->max_tokens, err);
    return c->s ? STRATA_OK : strata_error_prefix(err, "kv import");
}

static int import_layer(void *ctx, int l, const kv_image_layer *info, const uint8_t *ott, strata_error *err)
{
    import_ctx *c = ctx;
    kv_layer *L = &c->s->layers[l];
    const size_t bt = (size_t)c->s->pool->geom.block_tokens;
    if (info->n_blocks > c->s->max_blocks || info->tail_len > L->tail_cap ||
        info->n_blocks * bt + info->tail_len > c->max_tokens)
        return strata_fail(err, STRATA_EINVAL, "kv import: layer %d holds %zu blocks and %zu tail tokens; this "
                           "sequence takes at most %zu tokens", l, info->n_blocks, info->tail_len, c->max_tokens);
    if ((info->ott_bytes != 0) != (L->ott != NULL) || (L->ott && !kv_ott_tracker_load(L->ott, ott, info->ott_bytes)))
        return strata_fail(err, STRATA_EINVAL, "kv import: layer %d's OTT state (%zu bytes) does not fit the "
                           "sequence's codec", l, info->ott_bytes);
    c->prompt_end = info->prompt_end;
    return STRATA_OK;
}

static int import_block(void *ctx, int l, size_t b, const kv_block *blk, strata_error *err)
{
    import_ctx *c = ctx;
    kv_pool *pool = c->s->pool;
    kv_layer *L = &c->s->layers[l];
    const kv_codec_params *want = &c->s->codecs[l];
    if ((int)blk->desc.codec != (int)want->codec || blk->desc.k_bits != want->bits ||
        blk->block_bytes > kv_block_size(want, &pool->geom))
        return strata_fail(err, STRATA_EINVAL, "kv import: layer %d block %zu (codec %s, %zu bytes) is not what the "
                           "sequence's plan stores there", l, b, kv_codec_id_name(blk->desc.codec),
                           (size_t)blk->block_bytes);
    uint8_t *slot = NULL;
    slab_region *rg = region_of(pool, l);
    L->refs[b] = (kv_block_ref){.bytes = (uint32_t)blk->block_bytes};
    int rc = slot_take(pool, rg, c->s->slot_class[l], &L->refs[b], &slot, err);
    if (rc != STRATA_OK)
        return rc;
    memcpy(slot, blk->bytes, blk->block_bytes);
    block_resident(pool, rg, c->s, &L->refs[b], slot);
    L->blocks[b] = slot;
    L->n_blocks = b + 1;
    kv_seq_unpin(c->s);   /* imported blocks may make room for the next ones */
    return STRATA_OK;
}

static int import_tail(void *ctx, int l, const uint8_t *k, const uint8_t *v, size_t tail_len, strata_error *err)
{
    (void)err;
    import_ctx *c = ctx;
    kv_layer *L = &c->s->layers[l];
    const size_t n = tail_len * (size_t)c->s->pool->geom.n_kv_heads * (size_t)c->s->pool->geom.head_dim;
    for (size_t i = 0; i < n; i++) {
        L->tail_k[i] = kv_ld16(k + 2 * i);
        L->tail_v[i] = kv_ld16(v + 2 * i);
    }
    L->tail_len = tail_len;
    L->prompt_end = c->prompt_end;
    return STRATA_OK;
}

kv_seq *kv_seq_import(kv_pool *pool, size_t max_tokens, const uint8_t *img, size_t len, strata_error *err)
{
    if (!pool || !img) {
        strata_fail(err, STRATA_EINVAL, "kv import: NULL argument");
        return NULL;
    }
    import_ctx c = {.pool = pool, .max_tokens = max_tokens};
    const kv_image_sink sink = {.ctx = &c, .plan = import_plan, .layer = import_layer, .block = import_block,
                                .tail = import_tail};
    if (kv_image_read(&pool->geom, img, len, &sink, err) != STRATA_OK) {
        kv_seq_destroy(c.s);
        return NULL;
    }
    return c.s;
}
