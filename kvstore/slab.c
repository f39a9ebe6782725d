/* Slab books (slab.h). */
#include <stdint.h>
#include <stdlib.h>

#include "kvstore/slab.h"

#define NONE SIZE_MAX

typedef struct slab_class {
    size_t slot_bytes;
    unsigned per_slab;
    size_t used;           /* slots taken */
    size_t free_in_held;   /* free slots of the slabs the class holds */
    size_t partial;        /* first slab of the class with a free slot, NONE when none */
} slab_class;

struct kv_slabs {
    size_t slab_bytes;
    size_t n_slabs;
    int n_classes;
    unsigned max_per_slab;
    slab_class *classes;
    int16_t *slab_class;   /* [n_slabs], -1: free */
    uint64_t *used_mask;   /* [n_slabs], bit j: slot j taken */
    size_t *next, *prev;   /* [n_slabs], the class's list of slabs with a free slot */
    size_t *free_slabs;    /* stack; the top is free_slabs[n_free - 1] */
    size_t n_free;
    void **owners;         /* [n_slabs * max_per_slab] */
};

static uint64_t full_mask(unsigned per) { return per == 64 ? UINT64_MAX : (UINT64_C(1) << per) - 1; }

kv_slabs *kv_slabs_create(size_t slab_bytes, size_t n_slabs, const size_t *slot_bytes, int n_classes,
                          strata_error *err)
{
    if (slab_bytes == 0 || n_slabs == 0 || !slot_bytes || n_classes < 1 || n_classes > INT16_MAX) {
        strata_fail(err, STRATA_EINVAL, "kv slabs: need a slab size, at least one slab and one slot size");
        return NULL;
    }
    for (int c = 0; c < n_classes; c++) {
        if (slot_bytes[c] == 0 || slot_bytes[c] > slab_bytes) {
            strata_fail(err, STRATA_EINVAL, "kv slabs: a slot of %zu bytes does not fit a slab of %zu", slot_bytes[c],
                        slab_bytes);
            return NULL;
        }
        for (int d = 0; d < c; d++)
            if (slot_bytes[d] == slot_bytes[c]) {
                strata_fail(err, STRATA_EINVAL, "kv slabs: slot size %zu given twice", slot_bytes[c]);
                return NULL;
            }
    }
    kv_slabs *s = calloc(1, sizeof *s);
    if (!s)
        goto oom;
    s->slab_bytes = slab_bytes;
    s->n_slabs = n_slabs;
    s->n_classes = n_classes;
    s->classes = calloc((size_t)n_classes, sizeof *s->classes);
    if (!s->classes)
        goto oom;
    for (int c = 0; c < n_classes; c++) {
        size_t per = slab_bytes / slot_bytes[c];
        s->classes[c].slot_bytes = slot_bytes[c];
        s->classes[c].per_slab = per > KV_SLABS_MAX_PER_SLAB ? KV_SLABS_MAX_PER_SLAB : (unsigned)per;
        s->classes[c].partial = NONE;
        if (s->classes[c].per_slab > s->max_per_slab)
            s->max_per_slab = s->classes[c].per_slab;
    }
    if (n_slabs > SIZE_MAX / sizeof(void *) / s->max_per_slab)
        goto oom;
    s->slab_class = malloc(n_slabs * sizeof *s->slab_class);
    s->used_mask = calloc(n_slabs, sizeof *s->used_mask);
    s->next = malloc(n_slabs * sizeof *s->next);
    s->prev = malloc(n_slabs * sizeof *s->prev);
    s->free_slabs = malloc(n_slabs * sizeof *s->free_slabs);
    s->owners = calloc(n_slabs * s->max_per_slab, sizeof *s->owners);
    if (!s->slab_class || !s->used_mask || !s->next || !s->prev || !s->free_slabs || !s->owners)
        goto oom;
    for (size_t i = 0; i < n_slabs; i++) {
        s->slab_class[i] = -1;
        s->next[i] = s->prev[i] = NONE;
        s->free_slabs[i] = n_slabs - 1 - i;   /* slab 0 is handed out first */
    }
    s->n_free = n_slabs;
    return s;
oom:
    strata_fail(err, STRATA_ENOMEM, "kv slabs: out of memory for the books of %zu slabs", n_slabs);
    kv_slabs_destroy(s);
    return NULL;
}

void kv_slabs_destroy(kv_slabs *s)
{
    if (!s)
        return;
    free(s->classes);
    free(s->slab_class);
    free(s->used_mask);
    free(s->next);
    free(s->prev);
    free(s->free_slabs);
    free(s->owners);
    free(s);
}

size_t kv_slabs_slab_bytes(const kv_slabs *s) { return s->slab_bytes; }
size_t kv_slabs_count(const kv_slabs *s) { return s->n_slabs; }
size_t kv_slabs_free_slabs(const kv_slabs *s) { return s->n_free; }
int kv_slabs_n_classes(const kv_slabs *s) { return s->n_classes; }

int kv_slabs_class_of(const kv_slabs *s, size_t slot_bytes)
{
    for (int c = 0; c < s->n_classes; c++)
        if (s->classes[c].slot_bytes == slot_bytes)
            return c;
    return -1;
}

size_t kv_slabs_slot_bytes(const kv_slabs *s, int cls) { return s->classes[cls].slot_bytes; }
size_t kv_slabs_per_slab(const kv_slabs *s, int cls) { return s->classes[cls].per_slab; }
size_t kv_slabs_used_slots(const kv_slabs *s, int cls) { return s->classes[cls].used; }
size_t kv_slabs_free_slots(const kv_slabs *s, int cls) { return s->classes[cls].free_in_held; }

size_t kv_slabs_room(const kv_slabs *s, int cls)
{
    return s->classes[cls].free_in_held + s->n_free * s->classes[cls].per_slab;
}

static void partial_push(kv_slabs *s, slab_class *k, size_t slab)
{
    s->prev[slab] = NONE;
    s->next[slab] = k->partial;
    if (k->partial != NONE)
        s->prev[k->partial] = slab;
    k->partial = slab;
}

static void partial_remove(kv_slabs *s, slab_class *k, size_t slab)
{
    if (s->prev[slab] != NONE)
        s->next[s->prev[slab]] = s->next[slab];
    else
        k->partial = s->next[slab];
    if (s->next[slab] != NONE)
        s->prev[s->next[slab]] = s->prev[slab];
    s->next[slab] = s->prev[slab] = NONE;
}

bool kv_slabs_take(kv_slabs *s, int cls, void *owner, size_t *offset)
{
    if (!s || cls < 0 || cls >= s->n_classes || !owner || !offset)
        return false;
    slab_class *k = &s->classes[cls];
    size_t slab;
    if (k->partial != NONE) {
        slab = k->partial;
    } else if (s->n_free > 0) {
        slab = s->free_slabs[--s->n_free];
        s->slab_class[slab] = (int16_t)cls;
        k->free_in_held += k->per_slab;
        if (k->per_slab > 1)
            partial_push(s, k, slab);
    } else {
        return false;
    }
    const uint64_t full = full_mask(k->per_slab);
    const unsigned j = (unsigned)__builtin_ctzll(~s->used_mask[slab] & full);
    s->used_mask[slab] |= UINT64_C(1) << j;
    if (s->used_mask[slab] == full && k->per_slab > 1)
        partial_remove(s, k, slab);
    s->owners[slab * s->max_per_slab + j] = owner;
    k->used++;
    k->free_in_held--;
    *offset = slab * s->slab_bytes + j * k->slot_bytes;
    return true;
}

/* The slab and slot index of a used slot at offset; false for an offset that is none. */
static bool locate(const kv_slabs *s, size_t offset, size_t *slab, unsigned *j)
{
    if (offset / s->slab_bytes >= s->n_slabs)
        return false;
    *slab = offset / s->slab_bytes;
    const int cls = s->slab_class[*slab];
    if (cls < 0)
        return false;
    const slab_class *k = &s->classes[cls];
    const size_t within = offset % s->slab_bytes;
    if (within % k->slot_bytes != 0 || within / k->slot_bytes >= k->per_slab)
        return false;
    *j = (unsigned)(within / k->slot_bytes);
    return (s->used_mask[*slab] >> *j & 1) != 0;
}

void kv_slabs_give(kv_slabs *s, size_t offset)
{
    size_t slab;
    unsigned j;
    if (!s || !locate(s, offset, &slab, &j))
        return;   /* not a used slot: nothing to give back */
    slab_class *k = &s->classes[s->slab_class[slab]];
    const uint64_t full = full_mask(k->per_slab);
    const bool was_full = s->used_mask[slab] == full;
    s->used_mask[slab] &= ~(UINT64_C(1) << j);
    s->owners[slab * s->max_per_slab + j] = NULL;
    k->used--;
    k->free_in_held++;
    if (s->used_mask[slab] == 0) {
        if (k->per_slab > 1)
            partial_remove(s, k, slab);
        k->free_in_held -= k->per_slab;
        s->slab_class[slab] = -1;
        s->free_slabs[s->n_free++] = slab;
    } else if (was_full) {
        partial_push(s, k, slab);
    }
}

void *kv_slabs_owner(const kv_slabs *s, size_t offset)
{
    size_t slab;
    unsigned j;
    if (!s || !locate(s, offset, &slab, &j))
        return NULL;
    return s->owners[slab * s->max_per_slab + j];
}

size_t kv_slabs_slab_of(const kv_slabs *s, size_t offset) { return offset / s->slab_bytes; }

int kv_slabs_slab_class(const kv_slabs *s, size_t slab) { return slab < s->n_slabs ? s->slab_class[slab] : -1; }

size_t kv_slabs_slab_used(const kv_slabs *s, size_t slab, size_t offsets[KV_SLABS_MAX_PER_SLAB])
{
    if (slab >= s->n_slabs || s->slab_class[slab] < 0)
        return 0;
    const slab_class *k = &s->classes[s->slab_class[slab]];
    size_t n = 0;
    for (uint64_t m = s->used_mask[slab]; m; m &= m - 1)
        offsets[n++] = slab * s->slab_bytes + (size_t)__builtin_ctzll(m) * k->slot_bytes;
    return n;
}

size_t kv_slabs_sparsest(const kv_slabs *s, int cls, bool (*skip)(void *ctx, size_t slab), void *ctx)
{
    if (!s || cls < 0 || cls >= s->n_classes)
        return NONE;
    size_t best = NONE;
    int best_used = KV_SLABS_MAX_PER_SLAB + 1;
    /* a slab with a free slot has fewer used slots than a full one */
    for (size_t i = s->classes[cls].partial; i != NONE; i = s->next[i]) {
        const int used = __builtin_popcountll(s->used_mask[i]);
        if (used < best_used && !(skip && skip(ctx, i))) {
            best = i;
            best_used = used;
        }
    }
    return best;
}

bool kv_slabs_evacuate(kv_slabs *s, size_t slab, size_t src[KV_SLABS_MAX_PER_SLAB], size_t dst[KV_SLABS_MAX_PER_SLAB],
                       size_t *n)
{
    *n = 0;
    if (!s || slab >= s->n_slabs || s->slab_class[slab] < 0)
        return false;
    const int cls = s->slab_class[slab];
    slab_class *k = &s->classes[cls];
    if (k->free_in_held < k->per_slab)
        return false;   /* the other slabs cannot take what this one holds */
    const size_t used = kv_slabs_slab_used(s, slab, src);
    /* Out of the class's list first, so that no slot is taken from the slab being emptied. */
    if (s->used_mask[slab] != full_mask(k->per_slab))
        partial_remove(s, k, slab);
    k->free_in_held -= k->per_slab - used;
    for (size_t i = 0; i < used; i++) {
        void *owner = s->owners[slab * s->max_per_slab + (src[i] % s->slab_bytes) / k->slot_bytes];
        k->used--;   /* kv_slabs_take counts it again */
        /* free_in_held >= per_slab left at least `used` free slots in the class's other slabs, all
         * on its list, so this takes one of them and never a free slab */
        (void)kv_slabs_take(s, cls, owner, &dst[i]);
    }
    for (unsigned j = 0; j < k->per_slab; j++)
        s->owners[slab * s->max_per_slab + j] = NULL;
    s->used_mask[slab] = 0;
    s->slab_class[slab] = -1;
    s->free_slabs[s->n_free++] = slab;
    *n = used;
    return true;
}
