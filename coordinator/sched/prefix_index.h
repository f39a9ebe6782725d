/* The coordinator's index of cached prompt prefixes (prefix caching), without I/O: which KV
 * prefixes the workers of each replica keep, for which token ids and KV plan, and which to
 * evict. The workers hold the bytes (a compressed-block image per stage, outside the KV tiers);
 * the coordinator decides everything, so the index and the workers never disagree: an entry
 * exists on a replica's workers from the step plan that parks it to the plan that drops it.
 *
 * An entry is named by the id of the sequence it was cut from (unique for the coordinator's
 * life). It holds the KV of token ids [0, n_tokens) of that sequence, n_tokens a multiple of
 * block_tokens. A request whose prompt starts with the same ids (same plan, same replica) starts
 * as a copy of the longest such prefix and prefills only the rest.
 *
 * Budget: per replica, in bytes summed over its stages (what the entries cost the workers'
 * host memory). Entries are evicted least recently used first; a pinned entry (a request is
 * about to start from it) is never evicted. Evicted ids are queued per replica until the
 * coordinator puts them in a step plan (prefix_index_take_drops).
 *
 * Thread-safety: none; the coordinator's lock covers it. */
#ifndef STRATA_COORDINATOR_PREFIX_INDEX_H
#define STRATA_COORDINATOR_PREFIX_INDEX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvstore/error.h"

typedef struct prefix_index prefix_index;

typedef struct prefix_index_config {
    int n_replicas;          /* >= 1 */
    size_t block_tokens;     /* > 0 */
    uint64_t budget_bytes;   /* per replica; 0: caching off (every insert answers keep = false) */
} prefix_index_config;

prefix_index *prefix_index_create(const prefix_index_config *c, strata_error *err);
void prefix_index_destroy(prefix_index *x);

/* A lookup's answer. */
typedef struct prefix_hit {
    uint64_t entry;     /* 0: nothing usable */
    int replica;        /* the entry's replica */
    size_t n_tokens;    /* tokens the request can take from it: a multiple of block_tokens, > 0 */
} prefix_hit;

/* The longest usable cached prefix for a prompt of plan `plan`: over the entries of the replicas
 * with usable[r] true (usable NULL: every replica), the longest run of ids the entry and the
 * prompt share from position 0, cut down to whole blocks and to at most n_prompt - 1 tokens (the
 * prompt's last token must run to give logits). Ties: the most recently used entry. Returns
 * whether hit->entry != 0. Changes nothing (no pin, no use mark). */
bool prefix_index_lookup(const prefix_index *x, int plan, const int32_t *prompt, size_t n_prompt, const bool *usable,
                         prefix_hit *hit);

/* A request will start from entry: it is marked most recently used, counted as a hit of
 * n_tokens tokens, and not evicted until unpinned (pins nest). False for an unknown entry. */
bool prefix_index_pin(prefix_index *x, uint64_t entry, size_t n_tokens);
/* Undoes one pin (no-op for an unknown entry or one not pinned). An entry removed or forgotten
 * while pinned is gone for good; its pins go with it. */
void prefix_index_unpin(prefix_index *x, uint64_t entry);

/* Offers a finished sequence's prefix as entry `entry` of replica r: the ids whose KV it would
 * hold (n_tokens > 0, a multiple of block_tokens; the index copies them) and what it costs
 * (bytes, over the replica's stages). *keep answers whether the caller must have the replica's
 * workers park it. keep is false when caching is off, an entry of r and plan already holds these
 * ids (same ids, at least as many), or it cannot fit the budget even after evicting every
 * unpinned entry of r. When keep is true, the entries of r and plan whose ids are a prefix of
 * these (now redundant) and then the least recently used unpinned entries of r needed to fit
 * the budget are evicted (queued for prefix_index_take_drops). STRATA_EINVAL for bad arguments
 * or an entry id already in the index, STRATA_ENOMEM. */
int prefix_index_insert(prefix_index *x, uint64_t entry, int r, int plan, const int32_t *tokens, size_t n_tokens,
                        uint64_t bytes, bool *keep, strata_error *err);

/* Removes an entry now (a copy of it failed on a worker) and queues its id for its replica's
 * workers. No-op for an unknown entry. */
void prefix_index_remove(prefix_index *x, uint64_t entry);

/* Moves up to cap queued ids of replica r into out (oldest first); returns how many. The rest
 * stay queued. */
size_t prefix_index_take_drops(prefix_index *x, int r, uint64_t *out, size_t cap);
/* Ids queued for replica r. */
size_t prefix_index_pending_drops(const prefix_index *x, int r);

/* Forgets every entry of replica r and its queued drops (its workers are gone or restarted and
 * hold nothing). */
void prefix_index_forget_replica(prefix_index *x, int r);

/* The replica of an entry, or -1 when it is not in the index. */
int prefix_index_replica(const prefix_index *x, uint64_t entry);

typedef struct prefix_index_stats {
    size_t entries;
    uint64_t bytes;           /* summed over the entries */
    uint64_t hits;            /* pins: requests meant to start from an entry (one that an idle
                               * replica then takes starts from 0 and still counts; the
                               * coordinator's metrics count the copies made) */
    uint64_t hit_tokens;      /* tokens those pins covered */
    uint64_t inserts;         /* offers answered keep = true */
    uint64_t evictions;       /* entries evicted (LRU or redundant) or removed */
} prefix_index_stats;

/* Over replica r, or every replica for r = -1. The counters are since creation. */
void prefix_index_get_stats(const prefix_index *x, int r, prefix_index_stats *out);

#endif
