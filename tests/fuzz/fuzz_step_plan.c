/* Fuzz target for a worker's stage (worker/stage/stage.c): what it does with the step plans its
 * coordinator sends. A plan the coordinator would never send (a sequence twice, a wrong position,
 * an unknown id, an unassigned KV plan, a token outside the vocabulary, a prefix park of a
 * sequence that is not there, frees and preemptions of anything) must end in a per-sequence
 * status, or at worst a stage error, never a crash or a leak; sampled tokens lie in the
 * vocabulary; and once every sequence is freed and every prefix dropped, the stage holds no KV
 * block.
 *
 * One stage holds the whole synthetic "tiny" model (4 layers, vocabulary 384), freshly made for
 * each input, with a device budget of a few dozen blocks (and, per the first byte, a host tier
 * below it, so preemption spills). Input:
 *   'P' then frames of [u16 length][StepPlan protobuf bytes]: plans as the wire carries them;
 *   anything else: a program of steps decoded from the bytes (decode_step below), where a
 *   "right" position is the one the target tracks for the id, so that well-formed runs of
 *   prefills, decodes, preemptions and prefix reuse are reachable by mutation.
 * Seeds: tests/fuzz/corpus/fuzz_step_plan (made by tests/fuzz/make_step_plan_seeds.py). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto/strata_internal.pb-c.h"
#include "worker/model.h"
#include "worker/stage/stage.h"
#include "tests/fuzz/byte_reader.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define MAX_STEPS 12
#define MAX_WORK 6
#define MAX_TOKENS 48
#define MAX_IDS 64
#define BLOCK_TOKENS 32

/* The ids a run touched and what the target believes each holds (tokens), so that the final
 * cleanup can free all of them. */
typedef struct tracker {
    uint64_t ids[MAX_IDS];
    uint32_t len[MAX_IDS];
    size_t n;
} tracker;

static size_t track(tracker *t, uint64_t id)
{
    for (size_t i = 0; i < t->n; i++)
        if (t->ids[i] == id)
            return i;
    if (t->n == MAX_IDS)
        return MAX_IDS - 1;   /* shares the last entry: only a belief */
    t->ids[t->n] = id;
    t->len[t->n] = 0;
    return t->n++;
}

static uint64_t decode_id(reader *r)
{
    const uint8_t b = next_byte(r);
    switch (b >> 5) {
    case 7:
        return b & 1 ? UINT64_MAX : 0;   /* ids no coordinator uses */
    case 6:
        return 1000 + b;
    default:
        return 1 + b % 6;   /* a few ids, so that steps meet the same sequences */
    }
}

static const char *decode_plan_name(uint8_t b)
{
    static const char *const names[] = {"", "", "", "fp16", "kivi4-r32", "kivi2-r32", "tada2", "kivi2-q9", "x"};
    return names[b % (sizeof names / sizeof names[0])];
}

/* Storage for one decoded plan. */
typedef struct plan_buf {
    Strata__Internal__V1__StepPlan plan;
    Strata__Internal__V1__SeqWork work[MAX_WORK], *workp[MAX_WORK];
    uint32_t tokens[MAX_WORK][MAX_TOKENS];
    uint64_t freed[4], preempt[4], resume[4], drop[4];
    Strata__Internal__V1__PrefixPark park[2], *parkp[2];
} plan_buf;

static void decode_step(reader *r, uint64_t step, tracker *t, int n_vocab, plan_buf *b)
{
    strata__internal__v1__step_plan__init(&b->plan);
    b->plan.step = step;
    const uint8_t shape = next_byte(r);
    b->plan.n_seqs = (size_t)(shape % (MAX_WORK + 1));
    b->plan.seqs = b->workp;
    for (size_t i = 0; i < b->plan.n_seqs; i++) {
        Strata__Internal__V1__SeqWork *w = &b->work[i];
        strata__internal__v1__seq_work__init(w);
        b->workp[i] = w;
        w->seq_id = decode_id(r);
        const size_t at = track(t, w->seq_id);
        const uint8_t how = next_byte(r);
        w->n_tokens = (size_t)(how % MAX_TOKENS) + (how >> 7 ? 0 : 1);   /* now and then none */
        const uint8_t pos = next_byte(r);
        w->pos0 = pos < 200 ? t->len[at] : pos < 250 ? (uint32_t)(pos - 200) * 8 : UINT32_MAX - (pos & 3);
        for (size_t k = 0; k < w->n_tokens; k++) {
            const uint8_t tb = next_byte(r);
            b->tokens[i][k] = tb == 0xff ? (uint32_t)n_vocab : tb == 0xfe ? UINT32_MAX : (uint32_t)(tb * 7 % n_vocab);
        }
        w->tokens = b->tokens[i];
        const uint8_t flags = next_byte(r);
        w->sample = flags & 1;
        w->last_chunk_of_prompt = flags & 2;
        w->kv_plan = (char *)decode_plan_name(flags >> 2);
        if (flags >> 6 == 3)
            w->prefix_entry = decode_id(r);
        const uint8_t temp = next_byte(r);
        w->temperature = temp < 128 ? 0.0f : (float)(temp - 128) / 32.0f;
        w->top_p = (float)next_byte(r) / 255.0f;
        w->top_k = next_byte(r) % 50;
        w->seed = next_byte(r);
    }
    const uint8_t lists = next_byte(r);
    b->plan.n_free_seqs = lists & 3;
    b->plan.n_preempt_seqs = (lists >> 2) & 3;
    b->plan.n_resume_seqs = (lists >> 4) & 3;
    b->plan.n_park_prefixes = (lists >> 6) & 1;
    b->plan.n_drop_prefixes = lists >> 7;
    b->plan.free_seqs = b->freed;
    b->plan.preempt_seqs = b->preempt;
    b->plan.resume_seqs = b->resume;
    b->plan.drop_prefixes = b->drop;
    b->plan.park_prefixes = b->parkp;
    for (size_t i = 0; i < b->plan.n_free_seqs; i++)
        b->freed[i] = decode_id(r);
    for (size_t i = 0; i < b->plan.n_preempt_seqs; i++)
        b->preempt[i] = decode_id(r);
    for (size_t i = 0; i < b->plan.n_resume_seqs; i++)
        b->resume[i] = decode_id(r);
    for (size_t i = 0; i < b->plan.n_drop_prefixes; i++)
        b->drop[i] = decode_id(r);
    for (size_t i = 0; i < b->plan.n_park_prefixes; i++) {
        Strata__Internal__V1__PrefixPark *p = &b->park[i];
        strata__internal__v1__prefix_park__init(p);
        b->parkp[i] = p;
        p->seq_id = decode_id(r);
        const uint8_t n = next_byte(r);
        p->n_tokens = n < 200 ? (uint32_t)(n % 4) * BLOCK_TOKENS : n;
        track(t, p->seq_id);
    }
}

#define FAIL(...) (fprintf(stderr, "fuzz_step_plan: " __VA_ARGS__), fputc('\n', stderr), abort())

/* What a step's result may say: tokens only for sequences of the plan that asked for one, in the
 * vocabulary; a sequence that failed is gone from the target's belief. */
static void check_result(const Strata__Internal__V1__StepPlan *plan, const stage_result *res, tracker *t,
                         int n_vocab)
{
    if (res->step != plan->step)
        FAIL("the result of step %llu says step %llu", (unsigned long long)plan->step, (unsigned long long)res->step);
    for (size_t i = 0; i < res->n_seqs; i++) {
        const stage_seq_result *sr = &res->seqs[i];
        if (sr->sampled) {
            bool asked = false;
            for (size_t k = 0; k < plan->n_seqs; k++)
                asked |= plan->seqs[k]->seq_id == sr->seq_id && plan->seqs[k]->sample;
            if (!asked || sr->token >= (uint32_t)n_vocab || sr->status != 0)
                FAIL("step %llu: sequence %llu sampled token %u (asked: %d, status %d)", (unsigned long long)plan->step,
                     (unsigned long long)sr->seq_id, sr->token, asked, sr->status);
        }
        if (sr->status != 0 && !memchr(sr->message, '\0', sizeof sr->message))
            FAIL("step %llu: an unterminated message", (unsigned long long)plan->step);
    }
    /* Advance the belief of the sequences that ran (no failure reported for them). */
    for (size_t k = 0; k < plan->n_seqs; k++) {
        const Strata__Internal__V1__SeqWork *w = plan->seqs[k];
        bool failed = false;
        for (size_t i = 0; i < res->n_seqs; i++)
            failed |= res->seqs[i].seq_id == w->seq_id && res->seqs[i].status != 0;
        const size_t at = track(t, w->seq_id);
        t->len[at] = failed ? 0 : w->pos0 + (uint32_t)w->n_tokens;
    }
}

/* FUZZ_STEP_PLAN_VERBOSE=1: what each step did, to check that a seed reaches what it is for. */
static void show_step(const Strata__Internal__V1__StepPlan *plan, int rc, const stage_result *res,
                      const strata_error *err, const stage *st)
{
    stage_kv_usage u;
    stage_get_kv_usage(st, &u);
    fprintf(stderr, "step %llu: %zu seqs, rc %d%s%s; %zu/%zu device blocks, %zu host, %zu seqs, %zu prefixes\n",
            (unsigned long long)plan->step, plan->n_seqs, rc, rc ? ": " : "", rc ? err->msg : "", u.device_blocks,
            u.device_capacity_blocks, u.host_blocks, u.sequences, u.prefix_entries);
    for (size_t i = 0; i < plan->n_seqs; i++)
        fprintf(stderr, "  run %llu: pos0 %u, %zu tokens%s%s%s, prefix %llu\n", (unsigned long long)plan->seqs[i]->seq_id,
                plan->seqs[i]->pos0, plan->seqs[i]->n_tokens, plan->seqs[i]->sample ? ", sample" : "",
                plan->seqs[i]->kv_plan && *plan->seqs[i]->kv_plan ? ", plan " : "",
                plan->seqs[i]->kv_plan ? plan->seqs[i]->kv_plan : "", (unsigned long long)plan->seqs[i]->prefix_entry);
    for (size_t i = 0; rc == STRATA_OK && i < res->n_seqs; i++)
        fprintf(stderr, "  seq %llu: status %d%s%s\n", (unsigned long long)res->seqs[i].seq_id, res->seqs[i].status,
                res->seqs[i].status ? ": " : res->seqs[i].sampled ? " sampled" : "",
                res->seqs[i].status ? res->seqs[i].message : "");
}

static model *tiny(void)
{
    static model *m;
    if (!m) {
        strata_error err = {0};
        if (!(m = model_load("synthetic:tiny:seed=5", 0, -1, &err)))
            FAIL("%s", err.msg);
    }
    return m;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    model *m = tiny();
    const int n_vocab = model_get_config(m)->n_vocab;
    const bool wire = data[0] == 'P';
    const bool tiered = !wire && (data[0] & 1);
    char *plans[] = {"fp16", "kivi4-r32"};
    Strata__Internal__V1__Assignment a;
    strata__internal__v1__assignment__init(&a);
    a.layer_begin = 0;
    a.layer_end = (uint32_t)model_layer_end(m);
    a.n_layers_total = a.layer_end;
    a.n_stages = 1;
    a.kv_plan = "kivi2-r32";
    a.kv_plans = plans;
    a.n_kv_plans = 2;
    a.block_tokens = BLOCK_TOKENS;
    a.max_seq_tokens = 256;
    a.max_batch_seqs = MAX_WORK;
    a.max_batch_tokens = MAX_WORK * MAX_TOKENS;
    a.device_kv_bytes = 24 * 4 * 4096;   /* about 20 blocks: full pools are reachable */
    a.host_kv_bytes = tiered ? 64 * 4096 : 0;
    strata_error err = {0};
    stage *st = stage_create(&a, m, NULL, NULL, NULL, &err);
    if (!st)
        FAIL("stage_create: %s", err.msg);
    tracker t = {.n = 0};
    reader r = {data + 1, size - 1};
    bool alive = true;
    const bool verbose = getenv("FUZZ_STEP_PLAN_VERBOSE") != NULL;
    for (uint64_t step = 1; alive && step <= MAX_STEPS && r.left; step++) {
        plan_buf b;
        Strata__Internal__V1__StepPlan *unpacked = NULL;
        const Strata__Internal__V1__StepPlan *plan = &b.plan;
        if (wire) {
            const size_t n = r.left < 2 ? 0 : (size_t)r.p[0] | (size_t)r.p[1] << 8;
            const size_t take = r.left < 2 ? r.left : 2 + (n < r.left - 2 ? n : r.left - 2);
            unpacked = strata__internal__v1__step_plan__unpack(NULL, take - (r.left < 2 ? 0 : 2), r.p + 2);
            r.p += take;
            r.left -= take;
            if (!unpacked)
                continue;
            plan = unpacked;
            for (size_t i = 0; i < plan->n_seqs; i++)
                track(&t, plan->seqs[i]->seq_id);
            for (size_t i = 0; i < plan->n_park_prefixes; i++)
                track(&t, plan->park_prefixes[i]->seq_id);
        } else {
            decode_step(&r, step, &t, n_vocab, &b);
        }
        stage_result res;
        const int rc = stage_step(st, plan, &res, &err);
        if (verbose)
            show_step(plan, rc, &res, &err, st);
        if (rc == STRATA_OK)
            check_result(plan, &res, &t, n_vocab);
        else
            alive = false;   /* the worker would leave: a status with a message, no crash */
        if (unpacked)
            strata__internal__v1__step_plan__free_unpacked(unpacked, NULL);
        stage_kv_usage u;
        stage_get_kv_usage(st, &u);
        if (u.device_blocks > u.device_capacity_blocks)
            FAIL("%zu device blocks in a pool of %zu", u.device_blocks, u.device_capacity_blocks);
    }
    if (alive) {   /* free everything: no block may stay behind */
        Strata__Internal__V1__StepPlan end;
        strata__internal__v1__step_plan__init(&end);
        end.step = MAX_STEPS + 1;
        end.free_seqs = t.ids;
        end.n_free_seqs = t.n;
        end.drop_prefixes = t.ids;
        end.n_drop_prefixes = t.n;
        stage_result res;
        if (stage_step(st, &end, &res, &err) == STRATA_OK && t.n < MAX_IDS) {
            stage_kv_usage u;
            stage_get_kv_usage(st, &u);
            if (u.device_blocks != 0 || u.sequences != 0 || u.prefix_entries != 0 || u.host_blocks != 0)
                FAIL("after freeing every sequence: %zu device blocks, %zu host blocks, %zu sequences, %zu prefix "
                     "entries", u.device_blocks, u.host_blocks, u.sequences, u.prefix_entries);
        }
    }
    stage_destroy(st);
    return 0;
}
