/* The coordinator's iteration-level scheduler (continuous batching), without I/O: it decides,
 * step by step and replica by replica, which sequences run, which prompts join, which sequences
 * are preempted (spilled to the tiers below the device) and resumed, and where a new request
 * goes. The coordinator turns each decision into a step plan for the replica's workers and
 * feeds the results back.
 *
 * KV accounting is in blocks of block_tokens tokens of one layer-slice ("a block row": what one
 * block of every layer of a stage costs, per stage). A replica has
 *   - device_blocks: block rows its device pools hold at once (the smallest over its stages);
 *   - stream_blocks: blocks of one layer its device pools hold at once: with a tier below, a
 *     sequence running alone may grow past device_blocks up to this, its layers then taking turns
 *     on the device (each layer's blocks come up for its attention and leave for the next layer's,
 *     as `strata generate` streams a long sequence); equal to device_blocks without a tier;
 *   - total_blocks:  block rows across the device pool and the host and NVMe tiers below.
 * A sequence of n tokens occupies ceil(n / block_tokens) block rows (the fp16 tail is counted as
 * a block, conservatively).
 *
 * Rules (docs/decisions.md):
 * - Admission reserves a request's worst case, prompt + max_tokens, against total_blocks of the
 *   replica it is routed to; a request whose worst case exceeds every replica's total_blocks or
 *   stream_blocks can never run: STRATA_EFULL at submit (RESOURCE_EXHAUSTED to the client).
 *   Otherwise it waits in FIFO order until a replica has room. A waiting request holds back
 *   younger ones only on the replicas it could run on: with replicas of different sizes, one
 *   that only a larger replica can take does not keep a smaller replica idle.
 * - Routing: the replica with the most unreserved blocks (ties: the lowest index).
 * - Steps in flight: a replica may have up to max_steps_in_flight steps planned whose results
 *   have not come back (a pipeline of that many stages runs one each). A sequence is in at most
 *   one of them; the running decoders are shared among them, a step taking at most
 *   ceil(running / max_steps_in_flight), so that the stages alternate between groups of
 *   sequences instead of waiting for one another.
 * - A step of a replica holds the decode token of every running sequence (that is in no step
 *   still out, up to its share above), then the next chunk of
 *   every prompt already started (chunked prefill: as many tokens as the budget and the device
 *   allow), then preempted sequences that resume, then new prompts (FIFO) while the step's tokens
 *   stay within max_batch_tokens and the running count within max_seqs. A new prompt starts when
 *   it can get a first chunk of at least min(prompt, max_batch_tokens / 2) tokens; only the step
 *   with its last chunk samples a token. A prefilling sequence is never preempted. A prompt
 *   with a cached prefix on its replica (sched_submit_prefix) starts after the prefix.
 * - Device working set: a decode step brings every running sequence's blocks of a layer onto
 *   the device at once, so the blocks of the step's sequences must fit device_blocks. When they
 *   do not, the most recently admitted running sequence is preempted (spilled: its blocks and
 *   tail move down, nothing is recomputed) until they do; preempted sequences resume, oldest
 *   first, before new prompts are admitted, as soon as they fit again.
 * - Streaming: a sequence that is the only running one of its replica may exceed device_blocks
 *   (up to stream_blocks): its prompt chunks grow, it resumes, or it starts, alone. While it runs
 *   past device_blocks nothing joins it (new prompts and preempted sequences wait), and when
 *   another sequence is running beside one that needs to stream, the preemption rule above
 *   applies, so a step past device_blocks always holds exactly one sequence.
 *
 * Thread-safety: none; the coordinator's scheduler thread owns it. */
#ifndef STRATA_COORDINATOR_SCHEDULER_H
#define STRATA_COORDINATOR_SCHEDULER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvstore/error.h"

typedef struct sched_replica_config {
    size_t device_blocks;   /* block rows held on the devices at once (> 0) */
    size_t stream_blocks;   /* blocks of one layer held at once (0: device_blocks; else >= it) */
    size_t total_blocks;    /* block rows across device, host and NVMe (>= device_blocks) */
} sched_replica_config;

#define SCHED_MAX_STEPS_IN_FLIGHT 64

typedef struct sched_config {
    size_t block_tokens;       /* tokens per block (> 0) */
    size_t max_batch_tokens;   /* tokens per step (> 0) */
    size_t max_seqs;           /* running sequences per replica (> 0) */
    size_t max_steps_in_flight;   /* per replica (0: 1; at most SCHED_MAX_STEPS_IN_FLIGHT) */
    int n_replicas;            /* >= 1 */
    const sched_replica_config *replicas;   /* n_replicas entries */
} sched_config;

typedef enum sched_state {
    SCHED_WAITING = 1,   /* admitted, routed, prompt not run yet */
    SCHED_RUNNING,       /* in the replica's batch */
    SCHED_PREEMPTED,     /* spilled below the device; resumes later */
    SCHED_FINISHED,      /* done, aborted or failed: forgotten at the next step */
} sched_state;

typedef struct scheduler scheduler;

scheduler *sched_create(const sched_config *c, strata_error *err);
void sched_destroy(scheduler *s);

/* Admits a request: prompt_tokens >= 1, max_tokens >= 1, id unique among live requests.
 * STRATA_EFULL when it can never fit any replica, STRATA_EINVAL for bad arguments or a
 * duplicate id; *replica gets where it was routed. */
int sched_submit(scheduler *s, uint64_t id, size_t prompt_tokens, size_t max_tokens, int *replica,
                 strata_error *err);

/* sched_submit for a request whose first `cached` prompt tokens are in a prefix entry on replica
 * `prefer` (prefix caching; 0 < cached < prompt_tokens, a multiple of block_tokens; cached 0:
 * sched_submit). It is routed to `prefer` when that replica can take it, and its first work
 * then starts at pos0 = cached; routed elsewhere (prefer has no room when a replica does, an idle
 * replica takes it while prefer cannot start it, or a migration moves it) it starts at 0. Admission and reservations are those of sched_submit: the
 * prefix is copied, not shared. */
int sched_submit_prefix(scheduler *s, uint64_t id, size_t prompt_tokens, size_t max_tokens, int prefer, size_t cached,
                        int *replica, strata_error *err);

/* Forgets a WAITING request's cached prefix (the entry is gone): it will start at 0. Returns
 * whether it had one. */
bool sched_drop_prefix(scheduler *s, uint64_t id);

/* Ends a request now (abort, client gone, failure): its reservation is released; if it was
 * running or preempted, the next plan of its replica lists it in free_ids so that its workers
 * free its blocks. Returns false for an unknown id. */
bool sched_finish(scheduler *s, uint64_t id);

/* One sequence's part of a step. */
typedef struct sched_work {
    uint64_t id;
    size_t pos0;        /* position of the first token of this step */
    size_t n_tokens;    /* a prompt chunk (pos0 < prompt) or 1 decode token */
    bool sample;        /* a token is sampled: decode, or the prompt's last chunk */
} sched_work;

/* A replica's next step. Arrays are owned by the scheduler, valid until the next call. */
typedef struct sched_plan {
    uint64_t step;
    const sched_work *work;     /* prompts and decode tokens of this step */
    size_t n_work;
    size_t n_tokens;            /* sum of work[].n_tokens */
    const uint64_t *preempt_ids;   /* spill these before the step */
    size_t n_preempt;
    const uint64_t *resume_ids;    /* bring these back before the step (they decode in it) */
    size_t n_resume;
    const uint64_t *free_ids;      /* finished sequences whose blocks can be freed */
    size_t n_free;
} sched_plan;

/* Plans the next step of replica r, from the sequences that are in no step still out. An empty
 * plan (step 0) means nothing to do; an unavailable replica (sched_set_available) always gets
 * one, since it has no workers to run a step. STRATA_EINVAL when max_steps_in_flight steps are
 * out. */
int sched_next_step(scheduler *s, int r, sched_plan *plan, strata_error *err);

/* The outcome of one sequence in the step just planned: its work ran (the sequence is n_tokens
 * longer, and one token was produced when the work sampled); finished: it ended (EOS, stop,
 * length, failure) and is released. */
typedef struct sched_outcome {
    uint64_t id;
    bool finished;
} sched_outcome;

/* Applies the results of replica r's step `step` (plan.step; every work item of that plan must
 * appear once, in any order; steps may complete in any order). A work item of a request finished
 * meanwhile by sched_finish is ignored. STRATA_EINVAL for a step that is not out (step 0 with no
 * results, an empty plan's, is accepted and changes nothing). */
int sched_step_done(scheduler *s, int r, uint64_t step, const sched_outcome *out, size_t n, strata_error *err);

typedef struct sched_stats {
    size_t waiting, running, preempted;
    size_t reserved_blocks;     /* over all replicas */
    uint64_t admitted, rejected, preemptions, resumptions, finished;
} sched_stats;

void sched_get_stats(const scheduler *s, int replica /* -1: all */, sched_stats *out);

/* Whether replica r can take requests (every replica can at creation). Requests are routed only
 * to available replicas; a request that fits some replica waits in the queue while none is
 * available. Making a replica unavailable (its workers are gone) drops its outstanding step and
 * its pending frees: finish its requests with sched_finish first. */
void sched_set_available(scheduler *s, int r, bool available);
bool sched_is_available(const scheduler *s, int r);
/* Whether replica r takes new requests now: available and not held by a drain or migration. */
bool sched_is_accepting(const scheduler *s, int r);

/* Whether new requests may be routed to replica r (default true). A replica being drained keeps
 * running what it has but takes nothing new. */
void sched_set_accepting(scheduler *s, int r, bool accepting);

/* How many steps replica r may have out (0: max_steps_in_flight, the default; at most that).
 * Lowering it while more are out only holds back the next plans until enough come back; the
 * running decoders are shared among `depth` steps, so a replica kept to one step (a drained
 * one, whose quiet moments let its sequences migrate) still runs all of them in each.
 * STRATA_EINVAL for a bad replica or depth. */
int sched_set_steps_in_flight(scheduler *s, int r, size_t depth);
size_t sched_steps_in_flight(const scheduler *s, int r);

/* Moves a request to replica `to` (migration): a request whose prompt has not run yet (WAITING)
 * or a RUNNING one that is not in an outstanding step; its reservation moves with it. STRATA_EFULL
 * when `to` lacks room, STRATA_EINVAL when `to` is unavailable, for another state (a RUNNING request still prefilling its
 * prompt included: it could not be preempted there) or an unknown id. The caller moves the
 * KV blocks of a RUNNING request first. A RUNNING request may take `to` past max_seqs: its next
 * step preempts the most recently admitted decoders until the count fits. */
int sched_move(scheduler *s, uint64_t id, int to, strata_error *err);

/* Has replica r's workers free sequence id with its next plan (e.g. the receiver's copy of a
 * migration that failed half way). */
int sched_free_on(scheduler *s, int r, uint64_t id);

/* The replica a request is routed to, or -1 (unknown id, or still waiting for a replica). */
int sched_get_replica(const scheduler *s, uint64_t id);
sched_state sched_get_state(const scheduler *s, uint64_t id);   /* 0 when unknown */
/* Whether a RUNNING request's prompt is still being prefilled (it cannot move: sched_move). */
bool sched_is_prefilling(const scheduler *s, uint64_t id);

#endif
