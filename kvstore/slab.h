/* Slabs: the slot books of a KV pool whose blocks come in several sizes.
 *
 * A region of n_slabs equal slabs of slab_bytes (the largest block any plan makes there). A slab
 * is free until a size class first needs it; it is then carved into that class's slots
 * (slab_bytes / slot_bytes of them, at most KV_SLABS_MAX_PER_SLAB) and serves that class until
 * its last slot is given back. So a kivi2 block in a pool sized for fp16 costs its own share of a
 * slab, not a whole fp16 slot; what is lost is at most one partly used slab per class and the
 * remainder of each slab's carving (docs/decisions.md, "Slabs").
 *
 * Bookkeeping only: slots are byte offsets from the region's start (slab i at i * slab_bytes,
 * slot j of it j * slot_bytes further), and the caller owns the memory (host memory for the CPU
 * pool, a cudaMalloc arena for the device pool). Each used slot keeps an owner pointer so that a
 * pool can evict a whole slab's blocks to hand the slab to another class.
 *
 * Thread-safety: none; one caller at a time. */
#ifndef STRATA_KVSTORE_SLAB_H
#define STRATA_KVSTORE_SLAB_H

#include <stdbool.h>
#include <stddef.h>

#include "kvstore/error.h"

#define KV_SLABS_MAX_PER_SLAB 64

typedef struct kv_slabs kv_slabs;

/* n_slabs slabs of slab_bytes; classes[0..n_classes) are distinct slot sizes, each at least 1 and
 * at most slab_bytes. STRATA_EINVAL (message) for anything else, STRATA_ENOMEM. */
kv_slabs *kv_slabs_create(size_t slab_bytes, size_t n_slabs, const size_t *slot_bytes, int n_classes,
                          strata_error *err);
void kv_slabs_destroy(kv_slabs *s);

size_t kv_slabs_slab_bytes(const kv_slabs *s);
size_t kv_slabs_count(const kv_slabs *s);          /* slabs in the region */
size_t kv_slabs_free_slabs(const kv_slabs *s);     /* slabs no class holds */
int kv_slabs_n_classes(const kv_slabs *s);
/* The class of a slot size, or -1 when the region has none of that size. */
int kv_slabs_class_of(const kv_slabs *s, size_t slot_bytes);
size_t kv_slabs_slot_bytes(const kv_slabs *s, int cls);
size_t kv_slabs_per_slab(const kv_slabs *s, int cls);   /* slots of one slab of the class */
/* Slots of class cls taken now, and free in the slabs the class holds. */
size_t kv_slabs_used_slots(const kv_slabs *s, int cls);
size_t kv_slabs_free_slots(const kv_slabs *s, int cls);
/* Slots of class cls that can be taken without giving any back: the free ones of its slabs plus
 * every free slab carved for it. */
size_t kv_slabs_room(const kv_slabs *s, int cls);

/* Takes a slot of class cls for owner (not NULL): a free slot of a slab the class holds, else a
 * free slab carved for it. false (nothing changes) when there is neither. */
bool kv_slabs_take(kv_slabs *s, int cls, void *owner, size_t *offset);
/* Gives a slot back; a slab left without used slots becomes free for every class. */
void kv_slabs_give(kv_slabs *s, size_t offset);

/* Compaction: empties a slab of a class into free slots of the class's other slabs, so that it is
 * free for any class. Possible when the class's slabs have at least a slab's worth of free slots
 * (kv_slabs_free_slots >= kv_slabs_per_slab). kv_slabs_sparsest gives the class's slab with the
 * fewest used slots, skipping those for which skip(ctx, slab) is true (e.g. holding a block in
 * use), or SIZE_MAX. kv_slabs_evacuate moves the books: for each used slot of the slab, src[i] is
 * its offset and dst[i] the slot it moves to (same owner); *n is their count. The caller copies
 * the bytes from src[i] to dst[i] afterwards (the books never touch memory). false (nothing
 * changes) when the class lacks the free slots or the slab is not the class's. */
size_t kv_slabs_sparsest(const kv_slabs *s, int cls, bool (*skip)(void *ctx, size_t slab), void *ctx);
bool kv_slabs_evacuate(kv_slabs *s, size_t slab, size_t src[KV_SLABS_MAX_PER_SLAB], size_t dst[KV_SLABS_MAX_PER_SLAB],
                       size_t *n);

/* The owner given to kv_slabs_take for the slot at offset (NULL when the slot is free). */
void *kv_slabs_owner(const kv_slabs *s, size_t offset);
size_t kv_slabs_slab_of(const kv_slabs *s, size_t offset);
/* The class holding slab i (-1 while it is free), and the offsets of its used slots (at most
 * KV_SLABS_MAX_PER_SLAB, written to offsets) as their count. */
int kv_slabs_slab_class(const kv_slabs *s, size_t slab);
size_t kv_slabs_slab_used(const kv_slabs *s, size_t slab, size_t offsets[KV_SLABS_MAX_PER_SLAB]);

#endif
