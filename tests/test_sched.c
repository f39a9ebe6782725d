/* The continuous-batching scheduler (coordinator/sched/scheduler.h): admission and
 * RESOURCE_EXHAUSTED, routing to the least loaded replica, step composition under the token and
 * sequence budgets, preemption when the device working set overflows and resumption before new
 * prompts, finish/abort at any time, and a randomized simulation (with migrations between the
 * replicas) whose invariants (budgets, every
 * request completes with exactly max_tokens tokens, reservations return to zero) are checked
 * every step against an independent model of the state. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "coordinator/sched/scheduler.h"
#include "test_rng.h"

/* n replicas of the capacities rc[0..n). */
static scheduler *make_replicas(size_t bt, size_t batch, size_t seqs, int n, sched_replica_config *rc)
{
    sched_config c = {.block_tokens = bt, .max_batch_tokens = batch, .max_seqs = seqs, .n_replicas = n,
                      .replicas = rc};
    strata_error err = {0};
    scheduler *s = sched_create(&c, &err);
    if (!s)
        fail_msg("%s", err.msg);
    return s;
}

static scheduler *make_streaming(size_t bt, size_t batch, size_t seqs, int n, size_t device, size_t stream,
                                 size_t total)
{
    sched_replica_config rc[4];
    for (int i = 0; i < n; i++)
        rc[i] = (sched_replica_config){.device_blocks = device, .stream_blocks = stream, .total_blocks = total};
    return make_replicas(bt, batch, seqs, n, rc);
}

/* Without a tier below the device: a sequence never holds more than device blocks. */
static scheduler *make(size_t bt, size_t batch, size_t seqs, int n, size_t device, size_t total)
{
    return make_streaming(bt, batch, seqs, n, device, 0, total);
}

static void test_config_errors(void **state)
{
    (void)state;
    sched_replica_config rc = {.device_blocks = 0, .total_blocks = 10};
    sched_config c = {.block_tokens = 16, .max_batch_tokens = 64, .max_seqs = 4, .n_replicas = 1, .replicas = &rc};
    strata_error err = {0};
    assert_null(sched_create(&c, &err));
    rc.device_blocks = 11;
    assert_null(sched_create(&c, &err));
    rc.device_blocks = 5;
    rc.stream_blocks = 4;   /* one layer at once holds fewer than all layers at once: nonsense */
    assert_null(sched_create(&c, &err));
    assert_non_null(strstr(err.msg, "stream_blocks 4"));
    rc.stream_blocks = 0;
    c.max_seqs = 65;
    assert_null(sched_create(&c, &err));
    assert_non_null(strstr(err.msg, "max_seqs"));
    c.max_seqs = 4;
    scheduler *s = sched_create(&c, &err);
    assert_non_null(s);
    sched_destroy(s);
}

static void test_admission(void **state)
{
    (void)state;
    scheduler *s = make(16, 256, 8, 1, 8, 20);   /* one sequence may hold 8 blocks = 128 tokens */
    strata_error err = {0};
    int r = -1;
    assert_int_equal(sched_submit(s, 1, 100, 28, &r, &err), STRATA_OK);   /* 128 tokens: fits */
    assert_int_equal(r, 0);
    assert_int_equal(sched_submit(s, 2, 100, 29, &r, &err), STRATA_EFULL);   /* 129: never */
    assert_non_null(strstr(err.msg, "129 tokens"));
    assert_int_equal(sched_submit(s, 1, 5, 5, &r, &err), STRATA_EINVAL);   /* duplicate id */
    assert_int_equal(sched_submit(s, 3, 0, 5, &r, &err), STRATA_EINVAL);
    assert_int_equal(sched_submit(s, 4, 5, 0, &r, &err), STRATA_EINVAL);
    /* 20 total blocks: request 1 reserved 8; another 8 fits, a third waits unrouted. */
    assert_int_equal(sched_submit(s, 5, 100, 28, &r, &err), STRATA_OK);
    assert_int_equal(sched_submit(s, 6, 100, 28, &r, &err), STRATA_OK);
    assert_int_equal(r, -1);
    sched_stats st;
    sched_get_stats(s, -1, &st);
    assert_int_equal(st.reserved_blocks, 16);
    assert_int_equal(st.rejected, 1);
    assert_true(sched_finish(s, 1));   /* releases 8: request 6 gets routed */
    sched_get_stats(s, -1, &st);
    assert_int_equal(st.reserved_blocks, 16);
    assert_false(sched_finish(s, 1));
    assert_false(sched_finish(s, 99));
    sched_destroy(s);
}

static void test_routing_least_loaded(void **state)
{
    (void)state;
    scheduler *s = make(16, 256, 8, 3, 16, 64);
    strata_error err = {0};
    int r;
    assert_int_equal(sched_submit(s, 1, 64, 64, &r, &err), STRATA_OK);   /* 8 blocks */
    assert_int_equal(r, 0);
    assert_int_equal(sched_submit(s, 2, 16, 16, &r, &err), STRATA_OK);
    assert_int_equal(r, 1);
    assert_int_equal(sched_submit(s, 3, 16, 16, &r, &err), STRATA_OK);
    assert_int_equal(r, 2);
    assert_int_equal(sched_submit(s, 4, 16, 16, &r, &err), STRATA_OK);   /* 1 and 2 have 62 free, 0 has 56 */
    assert_int_equal(r, 1);
    sched_destroy(s);
}

static void test_step_composition(void **state)
{
    (void)state;
    scheduler *s = make(16, 100, 3, 1, 1000, 1000);
    strata_error err = {0};
    int r;
    assert_int_equal(sched_submit(s, 1, 60, 3, &r, &err), STRATA_OK);
    assert_int_equal(sched_submit(s, 2, 30, 3, &r, &err), STRATA_OK);
    assert_int_equal(sched_submit(s, 3, 30, 3, &r, &err), STRATA_OK);   /* 60 + 30 + 30 > 100 */
    assert_int_equal(sched_submit(s, 4, 5, 3, &r, &err), STRATA_OK);
    sched_plan p;
    assert_int_equal(sched_next_step(s, 0, &p, &err), STRATA_OK);
    assert_int_equal(p.n_work, 2);   /* FIFO: 1 and 2; 3 does not fit and 4 may not pass it */
    assert_int_equal(p.work[0].id, 1);
    assert_int_equal(p.work[0].n_tokens, 60);
    assert_int_equal(p.work[1].id, 2);
    assert_int_equal(p.n_tokens, 90);
    const uint64_t first = p.step;
    assert_int_equal(sched_next_step(s, 0, &p, &err), STRATA_EINVAL);   /* results first */
    sched_outcome o[4] = {{1, false}, {2, false}};
    assert_int_equal(sched_step_done(s, 0, first + 1, o, 2, &err), STRATA_EINVAL);   /* not out */
    assert_int_equal(sched_step_done(s, 0, first, o, 2, &err), STRATA_OK);
    assert_int_equal(sched_step_done(s, 0, first, o, 2, &err), STRATA_EINVAL);   /* twice */
    assert_int_equal(sched_next_step(s, 0, &p, &err), STRATA_OK);
    /* decode 1 and 2 (pos 60 and 30), then prompt 3 (max_seqs 3: 4 waits) */
    assert_int_equal(p.n_work, 3);
    assert_int_equal(p.work[0].id, 1);
    assert_int_equal(p.work[0].pos0, 60);
    assert_int_equal(p.work[0].n_tokens, 1);
    assert_int_equal(p.work[1].pos0, 30);
    assert_int_equal(p.work[2].id, 3);
    assert_int_equal(p.work[2].n_tokens, 30);
    /* 1 finishes (EOS); 2 is aborted while the step is out */
    assert_true(sched_finish(s, 2));
    sched_outcome o2[3] = {{1, true}, {2, false}, {3, false}};
    assert_int_equal(sched_step_done(s, 0, p.step, o2, 3, &err), STRATA_OK);
    assert_int_equal(sched_next_step(s, 0, &p, &err), STRATA_OK);
    assert_int_equal(p.n_free, 2);   /* both leave the workers */
    assert_int_equal(p.n_work, 2);   /* decode 3, prompt 4 */
    assert_int_equal(p.work[1].id, 4);
    sched_destroy(s);
}

static void test_preempt_and_resume(void **state)
{
    (void)state;
    /* device holds 4 blocks of 16 tokens; three 20-token prompts need 2 blocks each at once */
    scheduler *s = make(16, 256, 8, 1, 4, 100);
    strata_error err = {0};
    int r;
    for (uint64_t id = 1; id <= 3; id++)
        assert_int_equal(sched_submit(s, id, 20, 40, &r, &err), STRATA_OK);
    sched_plan p;
    assert_int_equal(sched_next_step(s, 0, &p, &err), STRATA_OK);
    assert_int_equal(p.n_work, 2);   /* the third prompt does not fit the device: waits */
    sched_outcome o[2] = {{1, false}, {2, false}};
    assert_int_equal(sched_step_done(s, 0, p.step, o, 2, &err), STRATA_OK);
    /* Decode until 1 and 2 need 3 blocks each: the newest (2) is preempted. */
    bool preempted = false;
    for (int step = 0; step < 40 && !preempted; step++) {
        assert_int_equal(sched_next_step(s, 0, &p, &err), STRATA_OK);
        if (p.n_preempt) {
            assert_int_equal(p.preempt_ids[0], 2);
            assert_int_equal(sched_get_state(s, 2), SCHED_PREEMPTED);
            preempted = true;
        }
        sched_outcome d[8];
        for (size_t i = 0; i < p.n_work; i++)
            d[i] = (sched_outcome){p.work[i].id, false};
        assert_int_equal(sched_step_done(s, 0, p.step, d, p.n_work, &err), STRATA_OK);
    }
    assert_true(preempted);
    /* 1 runs to its end; then 2 resumes before 3 is admitted. */
    bool resumed = false;
    for (int step = 0; step < 100 && !resumed; step++) {
        assert_int_equal(sched_next_step(s, 0, &p, &err), STRATA_OK);
        for (size_t i = 0; i < p.n_work; i++)
            assert_int_not_equal(p.work[i].id, 3);
        if (p.n_resume) {
            assert_int_equal(p.resume_ids[0], 2);
            resumed = true;
        }
        sched_outcome d[8];
        for (size_t i = 0; i < p.n_work; i++)
            d[i] = (sched_outcome){p.work[i].id, false};
        assert_int_equal(sched_step_done(s, 0, p.step, d, p.n_work, &err), STRATA_OK);
    }
    assert_true(resumed);
    sched_stats st;
    sched_get_stats(s, 0, &st);
    assert_true(st.preemptions >= 1 && st.resumptions >= 1);
    sched_destroy(s);
}

/* Runs replica r's step, every item going on. */
static void run_step(scheduler *s, int r, sched_plan *p)
{
    strata_error err = {0};
    assert_int_equal(sched_next_step(s, r, p, &err), STRATA_OK);
    sched_outcome d[16];
    assert_true(p->n_work <= 16);
    for (size_t i = 0; i < p->n_work; i++)
        d[i] = (sched_outcome){p->work[i].id, false};
    assert_int_equal(sched_step_done(s, r, p->step, d, p->n_work, &err), STRATA_OK);
}

/* A running sequence moved (migration) onto a replica that already runs max_seqs: the target's
 * next step preempts the most recently admitted decoder instead of planning max_seqs + 1 items. */
static void test_move_onto_full_replica(void **state)
{
    (void)state;
    scheduler *s = make(16, 64, 2, 2, 100, 1000);
    strata_error err = {0};
    uint64_t on[2][4];
    size_t n_on[2] = {0, 0};
    for (uint64_t id = 1; id <= 4; id++) {
        int r;
        assert_int_equal(sched_submit(s, id, 4, 50, &r, &err), STRATA_OK);
        on[r][n_on[r]++] = id;
    }
    assert_true(n_on[0] == 2 && n_on[1] == 2);
    sched_plan p;
    for (int r = 0; r < 2; r++) {   /* the prompts run: every request is a decoder now */
        run_step(s, r, &p);
        assert_int_equal(p.n_work, 2);
    }
    assert_true(sched_finish(s, on[0][1]));   /* replica 0 runs one, replica 1 two */
    const uint64_t moved = on[0][0];
    assert_int_equal(sched_move(s, moved, 1, &err), STRATA_OK);
    assert_int_equal(sched_get_replica(s, moved), 1);
    run_step(s, 1, &p);
    assert_int_equal(p.n_work, 2);
    assert_int_equal(p.n_preempt, 1);
    const uint64_t newest = on[1][1];   /* the most recently admitted of the three */
    assert_int_equal(p.preempt_ids[0], newest);
    for (size_t i = 0; i < p.n_work; i++)
        assert_int_not_equal(p.work[i].id, newest);
    /* When one of the others ends, the preempted one resumes. */
    assert_true(sched_finish(s, on[1][0]));
    run_step(s, 1, &p);
    assert_int_equal(p.n_resume, 1);
    assert_int_equal(p.resume_ids[0], newest);
    assert_int_equal(p.n_work, 2);
    sched_destroy(s);
}

/* Randomized: requests arrive, run, get aborted, move; invariants every step. */
#define SIM_N 300
#define SIM_WORK 64   /* most work items of one plan */

/* A plan whose results the simulation has not given back yet. */
typedef struct sim_step {
    uint64_t step;
    size_t n;
    sched_work work[SIM_WORK];
} sim_step;

/* stream: the replicas' stream_blocks (0: none); max_prompt: prompts are 1..max_prompt tokens;
 * depth: steps out at once per replica (the pipeline stages), given back oldest first; mixed:
 * replica 0 has no tier to stream from (one sequence holds at most `device` blocks there), so
 * the longest requests can run on replica 1 only. */
static void simulate(size_t stream, size_t max_prompt, size_t depth, bool mixed)
{
    const size_t bt = 16, batch = 128, seqs = 6, device = 24, total = 200;
    const size_t one_seq = stream > device ? stream : device;   /* the most one sequence may hold */
    sched_replica_config caps[2];
    for (int i = 0; i < 2; i++)
        caps[i] = (sched_replica_config){.device_blocks = device, .stream_blocks = mixed && i == 0 ? 0 : stream,
                                         .total_blocks = total};
    sched_config c = {.block_tokens = bt, .max_batch_tokens = batch, .max_seqs = seqs, .max_steps_in_flight = depth,
                      .n_replicas = 2, .replicas = caps};
    strata_error err = {0};
    scheduler *s = sched_create(&c, &err);
    assert_non_null(s);
    uint64_t seed = 12345;
    size_t prompt[SIM_N + 1], max_tokens[SIM_N + 1], got[SIM_N + 1], len[SIM_N + 1];
    bool done[SIM_N + 1], in_step[SIM_N + 1];
    memset(got, 0, sizeof got);
    memset(len, 0, sizeof len);
    memset(done, 0, sizeof done);
    memset(in_step, 0, sizeof in_step);
    sim_step out[2][8];
    size_t n_out[2] = {0, 0};
    assert_true(depth <= 8);
    uint64_t next_id = 1;
    size_t finished = 0, rejected = 0, moved_running = 0, streamed_steps = 0, overlapped = 0;
    for (int iter = 0; iter < 40000 && finished < SIM_N; iter++) {
        if (next_id <= SIM_N && rng_next(&seed) % 3 == 0) {
            uint64_t id = next_id++;
            prompt[id] = 1 + rng_next(&seed) % max_prompt;   /* > the step budget: chunked */
            max_tokens[id] = 1 + rng_next(&seed) % 60;
            int r;
            int rc = sched_submit(s, id, prompt[id], max_tokens[id], &r, &err);
            if (rc == STRATA_EFULL) {
                assert_true((prompt[id] + max_tokens[id] + bt - 1) / bt > one_seq);
                done[id] = true;
                finished++;
                rejected++;
            } else {
                assert_int_equal(rc, STRATA_OK);
            }
        }
        if (next_id > 2 && rng_next(&seed) % 40 == 0) {   /* an abort, also of one in a step out */
            uint64_t id = 1 + rng_next(&seed) % (next_id - 1);
            if (!done[id] && sched_finish(s, id)) {
                done[id] = true;
                finished++;
            }
        }
        /* Migrations (strata drain): a request moves to the other replica between steps, also
         * onto one that already runs max_seqs sequences or whose device is full. */
        if (next_id > 2 && rng_next(&seed) % 2 == 0) {
            uint64_t id = 1 + rng_next(&seed) % (next_id - 1);
            int from = sched_get_replica(s, id);
            sched_state st = sched_get_state(s, id);
            const bool prefilling = sched_is_prefilling(s, id);
            if (!done[id] && from >= 0) {
                int rc = sched_move(s, id, 1 - from, &err);
                assert_true(rc == STRATA_OK || rc == STRATA_EFULL ||
                            (rc == STRATA_EINVAL && (st == SCHED_PREEMPTED || in_step[id] || prefilling)));
                assert_true(rc != STRATA_EINVAL || !prefilling || in_step[id] || strstr(err.msg, "still being prefilled"));
                assert_true(rc != STRATA_OK || !in_step[id]);
                moved_running += rc == STRATA_OK && st == SCHED_RUNNING;
            }
        }
        for (int r = 0; r < 2; r++) {
            sched_plan p;
            assert_int_equal(sched_next_step(s, r, &p, &err), STRATA_OK);
            assert_true(p.n_work <= seqs && p.n_work <= SIM_WORK);
            size_t tokens = 0, working = 0, items = p.n_work;
            for (size_t i = 0; i < p.n_work; i++) {
                uint64_t id = p.work[i].id;
                assert_false(done[id]);
                assert_false(in_step[id]);   /* in one step out at a time */
                assert_int_equal(p.work[i].pos0, len[id]);
                if (p.work[i].pos0 < prompt[id]) {   /* a prompt chunk; the last one samples */
                    assert_true(p.work[i].n_tokens >= 1 && p.work[i].n_tokens <= prompt[id] - len[id]);
                    assert_int_equal(p.work[i].sample, p.work[i].pos0 + p.work[i].n_tokens == prompt[id]);
                } else {
                    assert_int_equal(p.work[i].n_tokens, 1);
                    assert_true(p.work[i].sample);
                }
                tokens += p.work[i].n_tokens;
                working += (len[id] + p.work[i].n_tokens + bt - 1) / bt;
            }
            /* the device holds this step's sequences and those of the steps still out */
            for (size_t k = 0; k < n_out[r]; k++)
                for (size_t i = 0; i < out[r][k].n; i++) {
                    uint64_t id = out[r][k].work[i].id;
                    if (done[id])
                        continue;
                    items++;
                    working += (len[id] + out[r][k].work[i].n_tokens + bt - 1) / bt;
                }
            assert_int_equal(tokens, p.n_tokens);
            /* past the device's block rows only a sequence alone, streaming its layers */
            assert_true(p.n_work == 0 || working <= device || (items == 1 && working <= one_seq));
            assert_true(tokens <= batch);
            streamed_steps += p.n_work && working > device;
            overlapped += p.n_work && n_out[r] > 0;
            if (p.step != 0) {
                sim_step *st = &out[r][n_out[r]++];
                st->step = p.step;
                st->n = p.n_work;
                memcpy(st->work, p.work, p.n_work * sizeof *p.work);
                for (size_t i = 0; i < p.n_work; i++)
                    in_step[p.work[i].id] = true;
            }
            /* Results of the oldest step come back when the pipeline is full (so
             * at once with depth 1), or at random. */
            while (n_out[r] && (n_out[r] == depth || rng_next(&seed) % 2 == 0)) {
                sim_step *st = &out[r][0];
                sched_outcome res[SIM_WORK];
                for (size_t i = 0; i < st->n; i++) {
                    uint64_t id = st->work[i].id;
                    in_step[id] = false;
                    bool fin = false;
                    if (!done[id]) {
                        len[id] += st->work[i].n_tokens;
                        got[id] += st->work[i].sample;
                        fin = got[id] == max_tokens[id] || rng_next(&seed) % 50 == 0;
                        if (fin) {
                            assert_true(got[id] <= max_tokens[id]);
                            done[id] = true;
                            finished++;
                        }
                    }
                    res[i] = (sched_outcome){id, fin};
                }
                assert_int_equal(sched_step_done(s, r, st->step, res, st->n, &err), STRATA_OK);
                memmove(&out[r][0], &out[r][1], (n_out[r] - 1) * sizeof out[r][0]);
                n_out[r]--;
            }
        }
    }
    assert_int_equal(finished, SIM_N);
    for (uint64_t id = 1; id <= SIM_N; id++)
        assert_true(done[id]);
    for (int r = 0; r < 2; r++)   /* what is still out ends; nothing is left reserved */
        for (size_t k = 0; k < n_out[r]; k++)
            assert_int_equal(sched_step_done(s, r, out[r][k].step, NULL, 0, &err), STRATA_OK);
    sched_stats st;
    sched_get_stats(s, -1, &st);
    assert_int_equal(st.reserved_blocks, 0);
    assert_int_equal(st.running + st.waiting + st.preempted, 0);
    print_message("simulation (stream %zu%s, depth %zu): %d requests, %zu rejected, %llu preemptions, %llu resumptions, "
                  "%zu running moved, %zu streamed steps, %zu steps planned beside others\n", stream,
                  mixed ? " on replica 1 only" : "", depth, SIM_N,
                  rejected, (unsigned long long)st.preemptions, (unsigned long long)st.resumptions, moved_running,
                  streamed_steps, overlapped);
    assert_true(st.preemptions > 0);
    assert_true(moved_running > 0);
    assert_true(stream > device ? streamed_steps > 0 && rejected > 0 : streamed_steps == 0);
    assert_true(depth > 1 ? overlapped > 0 : overlapped == 0);
    sched_destroy(s);
}

static void test_simulation(void **state)
{
    (void)state;
    simulate(0, 300, 1, false);
}

/* With a tier below: prompts up to 40 blocks, past the device's 24; one sequence may hold 32.
 * Then with replicas of different sizes: replica 0 cannot stream, so requests of 25-32 blocks
 * wait for replica 1 while shorter ones go on on replica 0. */
static void test_simulation_streaming(void **state)
{
    (void)state;
    simulate(32, 640, 1, false);
    simulate(32, 640, 1, true);
    simulate(32, 640, 2, true);
}

/* Pipelined: up to 2 and 3 steps out per replica, with and without streaming. */
static void test_simulation_pipelined(void **state)
{
    (void)state;
    simulate(0, 300, 2, false);
    simulate(32, 640, 3, false);
}

/* Two steps out at once (a 2-stage pipeline): the decoders are shared between them, each
 * sequence in one; a third step waits for results; results may come back in any order. */
static void test_pipelined_steps(void **state)
{
    (void)state;
    sched_replica_config cap = {.device_blocks = 100, .total_blocks = 1000};
    sched_config c = {.block_tokens = 16, .max_batch_tokens = 64, .max_seqs = 8, .max_steps_in_flight = 2,
                      .n_replicas = 1, .replicas = &cap};
    strata_error err = {0};
    scheduler *s = sched_create(&c, &err);
    assert_non_null(s);
    int r;
    for (uint64_t id = 1; id <= 4; id++)
        assert_int_equal(sched_submit(s, id, 8, 10, &r, &err), STRATA_OK);
    sched_plan p;
    assert_int_equal(sched_next_step(s, 0, &p, &err), STRATA_OK);   /* the four prompts at once */
    assert_int_equal(p.n_work, 4);
    const uint64_t prompts = p.step;
    assert_int_equal(sched_next_step(s, 0, &p, &err), STRATA_OK);   /* nothing free to run beside it */
    assert_int_equal(p.step, 0);
    sched_outcome o[4] = {{1, false}, {2, false}, {3, false}, {4, false}};
    assert_int_equal(sched_step_done(s, 0, prompts, o, 4, &err), STRATA_OK);
    assert_int_equal(sched_next_step(s, 0, &p, &err), STRATA_OK);   /* half the decoders */
    assert_int_equal(p.n_work, 2);
    const uint64_t a = p.step, a0 = p.work[0].id, a1 = p.work[1].id;
    assert_int_equal(sched_next_step(s, 0, &p, &err), STRATA_OK);   /* the other half, beside it */
    assert_int_equal(p.n_work, 2);
    const uint64_t b = p.step;
    assert_true(p.work[0].id != a0 && p.work[0].id != a1 && p.work[1].id != a0 && p.work[1].id != a1);
    sched_outcome ob[2] = {{p.work[0].id, false}, {p.work[1].id, true}};   /* one of them ends */
    assert_int_equal(sched_next_step(s, 0, &p, &err), STRATA_EINVAL);   /* two out: the most */
    assert_int_equal(sched_step_done(s, 0, b, ob, 2, &err), STRATA_OK);   /* the later step first */
    assert_int_equal(sched_next_step(s, 0, &p, &err), STRATA_OK);
    assert_int_equal(p.n_work, 1);   /* the one of b that goes on; a's are still out */
    assert_int_equal(p.work[0].id, ob[0].id);
    assert_int_equal(p.work[0].pos0, 9);
    assert_int_equal(p.n_free, 1);   /* the ended one's blocks */
    sched_outcome oa[2] = {{a0, false}, {a1, false}};
    assert_int_equal(sched_step_done(s, 0, a, oa, 2, &err), STRATA_OK);
    sched_destroy(s);
}

/* A replica kept to one step out (being drained) runs all its decoders in that step, not the
 * share of a deeper pipeline; lowering the depth while two are out holds the next plan back until
 * both returned; 0 restores the default. */
static void test_steps_in_flight_per_replica(void **state)
{
    (void)state;
    sched_replica_config caps[2] = {{.device_blocks = 100, .total_blocks = 1000},
                                    {.device_blocks = 100, .total_blocks = 1000}};
    sched_config c = {.block_tokens = 16, .max_batch_tokens = 64, .max_seqs = 8, .max_steps_in_flight = 2,
                      .n_replicas = 2, .replicas = caps};
    strata_error err = {0};
    scheduler *s = sched_create(&c, &err);
    assert_non_null(s);
    assert_int_equal(sched_steps_in_flight(s, 0), 2);
    assert_int_equal(sched_set_steps_in_flight(s, 0, 3), STRATA_EINVAL);   /* above the configured most */
    assert_int_equal(sched_set_steps_in_flight(s, 2, 1), STRATA_EINVAL);
    int r;
    for (uint64_t id = 1; id <= 4; id++) {
        assert_int_equal(sched_submit(s, id, 8, 10, &r, &err), STRATA_OK);
        assert_int_equal(sched_move(s, id, 0, &err), STRATA_OK);
    }
    sched_plan p;
    assert_int_equal(sched_next_step(s, 0, &p, &err), STRATA_OK);
    assert_int_equal(p.n_work, 4);
    sched_outcome o[4] = {{1, false}, {2, false}, {3, false}, {4, false}};
    assert_int_equal(sched_step_done(s, 0, p.step, o, 4, &err), STRATA_OK);
    assert_int_equal(sched_next_step(s, 0, &p, &err), STRATA_OK);
    const uint64_t a = p.step;
    sched_outcome oa[2] = {{p.work[0].id, false}, {p.work[1].id, false}};
    assert_int_equal(sched_next_step(s, 0, &p, &err), STRATA_OK);
    const uint64_t b = p.step;
    sched_outcome ob[2] = {{p.work[0].id, false}, {p.work[1].id, false}};
    assert_int_equal(sched_set_steps_in_flight(s, 0, 1), STRATA_OK);
    assert_int_equal(sched_steps_in_flight(s, 0), 1);
    assert_int_equal(sched_steps_in_flight(s, 1), 2);   /* the other replica keeps its depth */
    assert_int_equal(sched_step_done(s, 0, a, oa, 2, &err), STRATA_OK);
    assert_int_equal(sched_next_step(s, 0, &p, &err), STRATA_EINVAL);   /* b is still out */
    assert_int_equal(sched_step_done(s, 0, b, ob, 2, &err), STRATA_OK);
    assert_int_equal(sched_next_step(s, 0, &p, &err), STRATA_OK);
    assert_int_equal(p.n_work, 4);   /* every decoder in the one step */
    for (size_t i = 0; i < 4; i++)
        o[i] = (sched_outcome){p.work[i].id, false};
    assert_int_equal(sched_step_done(s, 0, p.step, o, 4, &err), STRATA_OK);
    assert_int_equal(sched_set_steps_in_flight(s, 0, 0), STRATA_OK);
    assert_int_equal(sched_steps_in_flight(s, 0), 2);
    assert_int_equal(sched_next_step(s, 0, &p, &err), STRATA_OK);
    assert_int_equal(p.n_work, 2);   /* shared again */
    sched_destroy(s);
}

/* A sequence larger than the device's block rows runs alone, streaming: admitted (it fits the
 * tiers and one layer of it the device), prefilled in chunks past the device, decoded with no
 * other sequence beside it; the others wait and run after it. */
static void test_streaming_alone(void **state)
{
    (void)state;
    scheduler *s = make_streaming(16, 64, 8, 1, 4, 12, 100);
    strata_error err = {0};
    int r;
    assert_int_equal(sched_submit(s, 9, 200, 20, &r, &err), STRATA_EFULL);   /* 14 blocks > 12 */
    assert_non_null(strstr(err.msg, "at most 12 blocks for one sequence"));
    assert_int_equal(sched_submit(s, 1, 150, 20, &r, &err), STRATA_OK);   /* 11 blocks > 4: streams */
    assert_int_equal(sched_submit(s, 2, 10, 5, &r, &err), STRATA_OK);
    sched_plan p;
    size_t len = 0, got = 0;
    while (got < 20) {
        assert_int_equal(sched_next_step(s, 0, &p, &err), STRATA_OK);
        assert_int_equal(p.n_work, 1);   /* request 2 never joins a step that streams */
        assert_int_equal(p.work[0].id, 1);
        assert_int_equal(p.work[0].pos0, len);
        len += p.work[0].n_tokens;
        got += p.work[0].sample;
        sched_outcome o = {1, got == 20};
        assert_int_equal(sched_step_done(s, 0, p.step, &o, 1, &err), STRATA_OK);
    }
    assert_int_equal(len, 169);   /* the prompt in chunks of at most 64, then 19 decode tokens */
    assert_int_equal(sched_next_step(s, 0, &p, &err), STRATA_OK);
    assert_int_equal(p.n_work, 1);
    assert_int_equal(p.work[0].id, 2);
    sched_destroy(s);
}

/* A streaming sequence moved (migration) beside an older one is preempted there, and resumes
 * when it is alone again, although it never fits the device's block rows beside another. */
static void test_streaming_preempted_resumes_alone(void **state)
{
    (void)state;
    scheduler *s = make_streaming(16, 256, 8, 2, 4, 12, 100);
    strata_error err = {0};
    int r;
    assert_int_equal(sched_submit(s, 1, 10, 40, &r, &err), STRATA_OK);
    assert_int_equal(r, 0);
    assert_int_equal(sched_submit(s, 2, 150, 20, &r, &err), STRATA_OK);
    assert_int_equal(r, 1);
    sched_plan p;
    run_step(s, 0, &p);   /* both prompts run: 1 on replica 0, 2 (past the device) on 1 */
    run_step(s, 1, &p);
    assert_int_equal(p.n_work, 1);
    assert_int_equal(p.work[0].n_tokens, 150);
    assert_int_equal(sched_move(s, 2, 0, &err), STRATA_OK);
    run_step(s, 0, &p);   /* 1 and 2 together exceed the device: the newer (2) waits */
    assert_int_equal(p.n_preempt, 1);
    assert_int_equal(p.preempt_ids[0], 2);
    assert_int_equal(p.n_work, 1);
    assert_int_equal(p.work[0].id, 1);
    run_step(s, 0, &p);
    assert_int_equal(p.n_resume, 0);
    assert_true(sched_finish(s, 1));
    run_step(s, 0, &p);   /* alone now: it comes back and streams */
    assert_int_equal(p.n_resume, 1);
    assert_int_equal(p.resume_ids[0], 2);
    assert_int_equal(p.n_work, 1);
    assert_int_equal(p.work[0].id, 2);
    assert_int_equal(p.work[0].pos0, 150);
    sched_destroy(s);
}

/* Chunked prefill: a prompt larger than the step budget runs in chunks beside the decode tokens,
 * only its last chunk samples, and it is never preempted. */
static void test_chunked_prefill(void **state)
{
    (void)state;
    scheduler *s = make(16, 64, 4, 1, 1000, 1000);
    strata_error err = {0};
    int r;
    assert_int_equal(sched_submit(s, 1, 10, 5, &r, &err), STRATA_OK);
    assert_int_equal(sched_submit(s, 2, 150, 2, &r, &err), STRATA_OK);
    sched_plan p;
    assert_int_equal(sched_next_step(s, 0, &p, &err), STRATA_OK);
    assert_int_equal(p.n_work, 2);   /* prompt 1 whole (10), prompt 2's first chunk: 54 >= 32 */
    assert_true(p.work[0].sample);
    assert_int_equal(p.work[1].n_tokens, 54);
    assert_false(p.work[1].sample);
    sched_outcome o[2] = {{1, false}, {2, false}};
    assert_int_equal(sched_step_done(s, 0, p.step, o, 2, &err), STRATA_OK);
    size_t pos = 54;
    for (int step = 0; pos < 150; step++) {
        assert_int_equal(sched_next_step(s, 0, &p, &err), STRATA_OK);
        assert_int_equal(p.n_work, 2);
        assert_int_equal(p.work[0].id, 1);   /* the decode token first */
        assert_int_equal(p.work[0].n_tokens, 1);
        assert_int_equal(p.work[1].id, 2);
        assert_int_equal(p.work[1].pos0, pos);
        size_t want = 150 - pos < 63 ? 150 - pos : 63;
        assert_int_equal(p.work[1].n_tokens, want);
        assert_int_equal(p.work[1].sample, pos + want == 150);
        assert_int_equal(p.n_tokens, 1 + want);
        pos += want;
        assert_int_equal(sched_step_done(s, 0, p.step, o, 2, &err), STRATA_OK);
    }
    assert_int_equal(sched_next_step(s, 0, &p, &err), STRATA_OK);   /* both decode now */
    assert_int_equal(p.n_work, 2);
    assert_int_equal(p.work[1].pos0, 150);   /* the sampled token enters the KV now */
    assert_int_equal(p.work[1].n_tokens, 1);
    sched_destroy(s);
}

/* A prompt with a cached prefix (sched_submit_prefix) goes to the replica holding it even when
 * another has more room, and its first work starts after the prefix; where that replica has no
 * room, or the prefix is dropped or left behind by a move, it starts at 0 like any prompt. */
static void test_cached_prefix(void **state)
{
    (void)state;
    scheduler *s = make(16, 256, 4, 2, 20, 20);
    strata_error err = {0};
    int r;
    assert_int_equal(sched_submit(s, 1, 100, 100, &r, &err), STRATA_OK);   /* 13 blocks on replica 0 */
    assert_int_equal(r, 0);
    assert_int_equal(sched_submit_prefix(s, 2, 50, 10, 0, 32, &r, &err), STRATA_OK);   /* 4 blocks: 0 has 7 */
    assert_int_equal(r, 0);
    sched_plan p;
    assert_int_equal(sched_next_step(s, 0, &p, &err), STRATA_OK);
    assert_int_equal(p.n_work, 2);
    assert_int_equal(p.work[1].id, 2);
    assert_int_equal(p.work[1].pos0, 32);
    assert_int_equal(p.work[1].n_tokens, 18);
    assert_true(p.work[1].sample);
    sched_outcome o[2] = {{1, false}, {2, false}};
    assert_int_equal(sched_step_done(s, 0, p.step, o, 2, &err), STRATA_OK);
    run_step(s, 0, &p);
    assert_int_equal(p.work[0].pos0, 100);   /* request 1 decodes */
    assert_int_equal(p.work[1].pos0, 50);    /* request 2 too, past its whole prompt */
    assert_int_equal(p.work[1].n_tokens, 1);
    /* Replica 0 has 3 blocks left: a request needing 4 goes to replica 1, from position 0. */
    assert_int_equal(sched_submit_prefix(s, 3, 40, 20, 0, 16, &r, &err), STRATA_OK);
    assert_int_equal(r, 1);
    assert_int_equal(sched_next_step(s, 1, &p, &err), STRATA_OK);
    assert_int_equal(p.n_work, 1);
    assert_int_equal(p.work[0].pos0, 0);
    assert_int_equal(p.work[0].n_tokens, 40);
    /* A dropped prefix: from 0. */
    assert_int_equal(sched_submit_prefix(s, 4, 40, 8, 0, 32, &r, &err), STRATA_OK);
    assert_int_equal(r, 0);
    assert_true(sched_drop_prefix(s, 4));
    assert_false(sched_drop_prefix(s, 4));
    assert_false(sched_drop_prefix(s, 1));   /* running: nothing to drop */
    assert_int_equal(sched_next_step(s, 0, &p, &err), STRATA_OK);
    assert_int_equal(p.n_work, 3);
    assert_int_equal(p.work[2].id, 4);
    assert_int_equal(p.work[2].pos0, 0);
    sched_destroy(s);

    /* A waiting request moved to the other replica leaves its prefix behind. */
    s = make(16, 64, 4, 2, 20, 20);
    assert_int_equal(sched_submit_prefix(s, 5, 40, 8, 1, 32, &r, &err), STRATA_OK);
    assert_int_equal(r, 1);
    assert_int_equal(sched_move(s, 5, 0, &err), STRATA_OK);
    assert_int_equal(sched_next_step(s, 0, &p, &err), STRATA_OK);
    assert_int_equal(p.work[0].pos0, 0);
    /* A request waiting for room goes to its prefix's replica once that one has room. */
    assert_int_equal(sched_submit(s, 6, 300, 10, &r, &err), STRATA_OK);   /* 20 blocks: all of replica 1 */
    assert_int_equal(r, 1);
    assert_int_equal(sched_submit_prefix(s, 7, 40, 8, 1, 32, &r, &err), STRATA_OK);
    assert_int_equal(r, 0);   /* replica 1 is full now: replica 0, without the prefix */
    assert_int_equal(sched_submit(s, 8, 200, 10, &r, &err), STRATA_OK);   /* 14 blocks: fills replica 0 */
    assert_int_equal(sched_submit_prefix(s, 9, 40, 8, 1, 32, &r, &err), STRATA_OK);
    assert_int_equal(r, -1);   /* neither has room: it waits */
    assert_true(sched_finish(s, 6));
    assert_int_equal(sched_get_replica(s, 9), 1);
    assert_int_equal(sched_next_step(s, 1, &p, &err), STRATA_OK);
    assert_int_equal(p.n_work, 1);
    assert_int_equal(p.work[0].id, 9);
    assert_int_equal(p.work[0].pos0, 32);
    assert_int_equal(p.work[0].n_tokens, 8);
    /* Bad prefixes. */
    assert_int_equal(sched_submit_prefix(s, 10, 40, 8, 1, 40, &r, &err), STRATA_EINVAL);   /* the whole prompt */
    assert_int_equal(sched_submit_prefix(s, 10, 40, 8, 1, 20, &r, &err), STRATA_EINVAL);   /* not whole blocks */
    assert_int_equal(sched_submit_prefix(s, 10, 40, 8, 2, 16, &r, &err), STRATA_EINVAL);   /* no replica 2 */
    assert_int_equal(sched_submit_prefix(s, 10, 40, 8, -1, 16, &r, &err), STRATA_EINVAL);
    sched_destroy(s);
}

/* A replica whose workers are gone takes no requests; its outstanding step and frees are dropped
 * and it can come back. */
/* Two prompts prefilled in chunks side by side, two steps out at a time, on a device that holds
 * only one of them whole (plus room to stream one alone): the second must not start beside the
 * first (a prefilling sequence cannot be preempted; two half-prefilled prompts that fill the
 * device between them could neither go on nor be spilled, and the replica would plan nothing
 * for ever). Both finish. */
static void test_prefills_never_wedge(void **state)
{
    (void)state;
    sched_replica_config cap = {.device_blocks = 40, .stream_blocks = 100, .total_blocks = 1000};
    sched_config c = {.block_tokens = 1, .max_batch_tokens = 8, .max_seqs = 4, .max_steps_in_flight = 2,
                      .n_replicas = 1, .replicas = &cap};
    strata_error err = {0};
    scheduler *s = sched_create(&c, &err);
    assert_non_null(s);
    int r;
    assert_int_equal(sched_submit(s, 1, 60, 4, &r, &err), STRATA_OK);
    assert_int_equal(sched_submit(s, 2, 60, 4, &r, &err), STRATA_OK);
    uint64_t out[2];
    sched_outcome res[2][4];
    size_t n_res[2] = {0, 0}, n_out = 0, produced[3] = {0, 0, 0};
    bool finished[3] = {false, false, false};
    for (int round = 0; round < 400 && !(finished[1] && finished[2]); round++) {
        while (n_out < 2) {   /* keep two steps out when there is work */
            sched_plan p;
            assert_int_equal(sched_next_step(s, 0, &p, &err), STRATA_OK);
            if (p.step == 0)
                break;
            size_t k = 0;
            for (size_t i = 0; i < p.n_work; i++) {
                const uint64_t id = p.work[i].id;
                bool ends = false;
                if (p.work[i].sample)
                    ends = ++produced[id] == 4;
                res[n_out][k++] = (sched_outcome){id, ends};
            }
            n_res[n_out] = k;
            out[n_out++] = p.step;
        }
        if (n_out == 0)
            fail_msg("round %d: nothing planned and no step out; finished %d %d", round, finished[1], finished[2]);
        assert_int_equal(sched_step_done(s, 0, out[0], res[0], n_res[0], &err), STRATA_OK);   /* oldest first */
        for (size_t i = 0; i < n_res[0]; i++)
            if (res[0][i].finished)
                finished[res[0][i].id] = true;
        out[0] = out[1];
        memcpy(res[0], res[1], sizeof res[0]);
        n_res[0] = n_res[1];
        n_out--;
    }
    assert_true(finished[1] && finished[2]);
    sched_destroy(s);
}

static void test_availability(void **state)
{
    (void)state;
    scheduler *s = make(16, 256, 8, 2, 8, 20);
    strata_error err = {0};
    sched_set_available(s, 0, false);
    assert_false(sched_is_available(s, 0));
    int r = -1;
    assert_int_equal(sched_submit(s, 1, 10, 6, &r, &err), STRATA_OK);
    assert_int_equal(r, 1);   /* replica 0 has more room but is unavailable */
    assert_int_equal(sched_get_replica(s, 1), 1);
    sched_set_available(s, 1, false);
    assert_int_equal(sched_submit(s, 2, 10, 6, &r, &err), STRATA_OK);
    assert_int_equal(r, -1);   /* fits, waits for a replica */
    assert_int_equal(sched_get_replica(s, 2), -1);
    sched_set_available(s, 0, true);
    assert_int_equal(sched_get_replica(s, 2), 0);   /* routed as soon as one is back */
    sched_plan p;
    assert_int_equal(sched_next_step(s, 0, &p, &err), STRATA_OK);
    assert_int_equal(p.n_work, 1);
    /* replica 0 is lost mid-step: its request is finished, the step forgotten */
    assert_true(sched_finish(s, 2));
    sched_set_available(s, 0, false);
    sched_set_available(s, 0, true);
    assert_int_equal(sched_next_step(s, 0, &p, &err), STRATA_OK);
    assert_int_equal(p.n_work, 0);
    assert_int_equal(p.n_free, 0);   /* the lost workers' frees are not sent to new ones */
    sched_stats st;
    sched_get_stats(s, 0, &st);
    assert_int_equal(st.reserved_blocks, 0);
    sched_destroy(s);
}

/* Replicas of different sizes (a review's cases): a request is routed only to a replica that can
 * hold it alone (one that cannot would start nothing for ever, and hold back every request
 * queued behind it there), and a move to such a replica is refused. */
static void test_one_sequence_limit_routes(void **state)
{
    (void)state;
    sched_replica_config rc[2] = {{.device_blocks = 4, .stream_blocks = 50, .total_blocks = 50},
                                  {.device_blocks = 4, .stream_blocks = 0, .total_blocks = 100}};
    scheduler *s = make_replicas(16, 256, 4, 2, rc);
    strata_error err = {0};
    int r = -1;
    assert_int_equal(sched_submit(s, 1, 200, 100, &r, &err), STRATA_OK);   /* 19 blocks: replica 0 only */
    assert_int_equal(r, 0);
    assert_int_equal(sched_submit(s, 2, 10, 5, &r, &err), STRATA_OK);   /* 1 block: the roomier replica */
    assert_int_equal(r, 1);
    sched_plan p;
    assert_int_equal(sched_next_step(s, 0, &p, &err), STRATA_OK);   /* the prompt, streamed alone */
    assert_int_equal(p.n_work, 1);
    sched_outcome o = {1, false};
    assert_int_equal(sched_step_done(s, 0, p.step, &o, 1, &err), STRATA_OK);
    assert_int_equal(sched_move(s, 1, 1, &err), STRATA_EFULL);
    assert_non_null(strstr(err.msg, "at most 4 blocks for one sequence"));
    assert_int_equal(sched_get_replica(s, 1), 0);
    sched_destroy(s);
}

/* A move refused for room keeps the request's cached prefix (it stays where the prefix is). */
/* A request whose prefix is on a replica that cannot start it (its device is held by a long
 * decoder) is taken by an idle replica, from position 0, instead of waiting there for as long as
 * the decoder runs (the scheduler review saw replica 1 idle for 30 steps). */
static void test_idle_replica_takes_a_blocked_prefix_request(void **state)
{
    (void)state;
    sched_replica_config rc[2] = {{.device_blocks = 6, .total_blocks = 100}, {.device_blocks = 6, .total_blocks = 100}};
    sched_config c = {.block_tokens = 16, .max_batch_tokens = 64, .max_seqs = 4, .n_replicas = 2, .replicas = rc};
    strata_error err = {0};
    scheduler *s = sched_create(&c, &err);
    assert_non_null(s);
    int r;
    assert_int_equal(sched_submit(s, 1, 60, 30, &r, &err), STRATA_OK);
    assert_int_equal(r, 0);
    sched_plan p;
    assert_int_equal(sched_next_step(s, 0, &p, &err), STRATA_OK);
    sched_outcome o = {1, false};
    assert_int_equal(sched_step_done(s, 0, p.step, &o, 1, &err), STRATA_OK);
    assert_int_equal(sched_submit_prefix(s, 2, 40, 10, 0, 32, &r, &err), STRATA_OK);
    assert_int_equal(r, 0);   /* routed to its prefix */
    assert_int_equal(sched_next_step(s, 1, &p, &err), STRATA_OK);
    assert_int_equal(p.n_work, 1);
    assert_int_equal(p.work[0].id, 2);
    assert_int_equal(p.work[0].pos0, 0);   /* the prefix stays behind */
    assert_int_equal(p.work[0].n_tokens, 40);
    assert_int_equal(sched_get_replica(s, 2), 1);
    sched_destroy(s);
}

static void test_refused_move_keeps_prefix(void **state)
{
    (void)state;
    scheduler *s = make(16, 256, 4, 2, 20, 20);
    strata_error err = {0};
    int r;
    assert_int_equal(sched_submit(s, 1, 300, 10, &r, &err), STRATA_OK);   /* fills replica 0 */
    assert_int_equal(sched_submit_prefix(s, 2, 40, 8, 1, 32, &r, &err), STRATA_OK);
    assert_int_equal(r, 1);
    assert_int_equal(sched_move(s, 2, 0, &err), STRATA_EFULL);
    sched_plan p;
    assert_int_equal(sched_next_step(s, 1, &p, &err), STRATA_OK);
    assert_int_equal(p.n_work, 1);
    assert_int_equal(p.work[0].id, 2);
    assert_int_equal(p.work[0].pos0, 32);   /* from its prefix, not from 0 */
    /* sizes that overflow are refused, not admitted as one block */
    assert_int_equal(sched_submit(s, 3, SIZE_MAX - 5, 10, &r, &err), STRATA_EINVAL);
    sched_destroy(s);
}

/* A short request routed to a replica busy with a long sequence streaming alone (routing goes by
 * reserved blocks) is taken by the other replica once that one is idle, instead of waiting for
 * the long sequence to end (a review's case: it waited 500 steps). A request its own replica can
 * start stays there (routing stays least-loaded). */
static void test_idle_replica_takes_waiting(void **state)
{
    (void)state;
    scheduler *s = make_streaming(16, 256, 8, 2, 4, 40, 100);
    strata_error err = {0};
    int r;
    assert_int_equal(sched_submit(s, 1, 100, 500, &r, &err), STRATA_OK);   /* 38 blocks: streams alone */
    assert_int_equal(r, 0);
    assert_int_equal(sched_submit(s, 2, 30, 600, &r, &err), STRATA_OK);   /* 40 blocks: the other replica */
    assert_int_equal(r, 1);
    sched_plan p;
    assert_int_equal(sched_next_step(s, 0, &p, &err), STRATA_OK);   /* replica 0 does not take request 2 */
    assert_int_equal(p.n_work, 1);
    assert_int_equal(p.work[0].id, 1);
    assert_int_equal(sched_get_replica(s, 2), 1);
    sched_outcome o[8];
    o[0] = (sched_outcome){1, false};
    assert_int_equal(sched_step_done(s, 0, p.step, o, 1, &err), STRATA_OK);
    assert_int_equal(sched_submit(s, 3, 20, 5, &r, &err), STRATA_OK);   /* 2 blocks: replica 0 has more free */
    assert_int_equal(r, 0);
    assert_int_equal(sched_next_step(s, 1, &p, &err), STRATA_OK);   /* request 2's prompt... */
    assert_int_equal(p.n_work, 1);
    assert_int_equal(p.work[0].id, 2);
    o[0] = (sched_outcome){2, true};   /* ...and it ends at once (EOS) */
    assert_int_equal(sched_step_done(s, 1, p.step, o, 1, &err), STRATA_OK);
    assert_int_equal(sched_next_step(s, 1, &p, &err), STRATA_OK);   /* idle: takes request 3 */
    assert_int_equal(p.n_work, 1);
    assert_int_equal(p.work[0].id, 3);
    assert_int_equal(sched_get_replica(s, 3), 1);
    sched_stats st;
    sched_get_stats(s, 0, &st);
    assert_int_equal(st.reserved_blocks, 38);   /* the reservation moved with it */
    sched_destroy(s);
}

/* A waiting request holds back younger ones only on the replicas it could run on: one that only
 * the large replica takes does not keep the small one idle, while on the large one the order of
 * arrival holds (the scheduler review saw the small replica wait behind it). */
static void test_waiting_request_holds_only_its_replicas(void **state)
{
    (void)state;
    sched_replica_config rc[2] = {{.device_blocks = 4, .total_blocks = 10},     /* at most 4 per sequence */
                                  {.device_blocks = 40, .total_blocks = 40}};
    scheduler *s = make_replicas(16, 256, 8, 2, rc);
    strata_error err = {0};
    int r = -1;
    assert_int_equal(sched_submit(s, 1, 400, 240, &r, &err), STRATA_OK);   /* 40 blocks: the large one, full */
    assert_int_equal(r, 1);
    assert_int_equal(sched_submit(s, 2, 300, 180, &r, &err), STRATA_OK);   /* 30 blocks: large only, waits */
    assert_int_equal(r, -1);
    assert_int_equal(sched_submit(s, 3, 30, 18, &r, &err), STRATA_OK);   /* 3 blocks: the small one, now */
    assert_int_equal(r, 0);
    assert_int_equal(sched_submit(s, 4, 30, 18, &r, &err), STRATA_OK);   /* 3 more: the small one has 7 */
    assert_int_equal(r, 0);
    assert_int_equal(sched_submit(s, 5, 40, 24, &r, &err), STRATA_OK);   /* 4: the small one has 4 left */
    assert_int_equal(r, 0);
    assert_int_equal(sched_submit(s, 6, 10, 6, &r, &err), STRATA_OK);   /* 1: both full, waits */
    assert_int_equal(r, -1);
    /* The large replica frees: the oldest waiting request it can take goes first (2, 30 blocks),
     * then 6 (1 block) in the 10 left. */
    assert_true(sched_finish(s, 1));
    assert_int_equal(sched_get_replica(s, 2), 1);
    assert_int_equal(sched_get_replica(s, 6), 1);
    /* FIFO on a replica both could use: 7 (30 blocks, large only) waits behind nothing, but 8 (2
     * blocks) may not take the large replica's room before 7 does. */
    assert_int_equal(sched_submit(s, 7, 300, 180, &r, &err), STRATA_OK);
    assert_int_equal(r, -1);
    assert_int_equal(sched_submit(s, 8, 20, 12, &r, &err), STRATA_OK);   /* the small one is full: waits */
    assert_int_equal(r, -1);
    assert_true(sched_finish(s, 3));   /* the small one frees 3: 8 goes there, 7 still waits */
    assert_int_equal(sched_get_replica(s, 8), 0);
    assert_int_equal(sched_get_replica(s, 7), -1);
    sched_destroy(s);
}

/* An unavailable replica (its workers gone) gets only empty plans and takes no moved request. */
static void test_unavailable_replica_plans_nothing(void **state)
{
    (void)state;
    scheduler *s = make(16, 256, 8, 2, 16, 64);
    strata_error err = {0};
    int r;
    assert_int_equal(sched_submit(s, 1, 20, 10, &r, &err), STRATA_OK);
    assert_int_equal(r, 0);
    assert_int_equal(sched_submit(s, 2, 20, 10, &r, &err), STRATA_OK);
    assert_int_equal(r, 1);
    /* Gone, with request 2 left on it (the coordinator ends such requests first; a caller that
     * does not still gets no plan for workers that are not there). */
    sched_set_available(s, 1, false);
    sched_plan p;
    assert_int_equal(sched_next_step(s, 1, &p, &err), STRATA_OK);
    assert_int_equal(p.step, 0);
    assert_int_equal(p.n_work, 0);
    assert_int_equal(sched_move(s, 1, 1, &err), STRATA_EINVAL);
    assert_non_null(strstr(err.msg, "replica 1 is unavailable"));
    assert_int_equal(sched_get_replica(s, 1), 0);
    sched_set_available(s, 1, true);   /* rebuilt: it plans again */
    assert_int_equal(sched_next_step(s, 1, &p, &err), STRATA_OK);
    assert_int_equal(p.n_work, 1);
    assert_int_equal(p.work[0].id, 2);
    sched_destroy(s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_config_errors),
        cmocka_unit_test(test_admission),
        cmocka_unit_test(test_unavailable_replica_plans_nothing),
        cmocka_unit_test(test_waiting_request_holds_only_its_replicas),
        cmocka_unit_test(test_routing_least_loaded),
        cmocka_unit_test(test_step_composition),
        cmocka_unit_test(test_preempt_and_resume),
        cmocka_unit_test(test_move_onto_full_replica),
        cmocka_unit_test(test_simulation),
        cmocka_unit_test(test_simulation_streaming),
        cmocka_unit_test(test_simulation_pipelined),
        cmocka_unit_test(test_pipelined_steps),
        cmocka_unit_test(test_steps_in_flight_per_replica),
        cmocka_unit_test(test_streaming_alone),
        cmocka_unit_test(test_streaming_preempted_resumes_alone),
        cmocka_unit_test(test_prefills_never_wedge),
        cmocka_unit_test(test_availability),
        cmocka_unit_test(test_chunked_prefill),
        cmocka_unit_test(test_cached_prefix),
        cmocka_unit_test(test_one_sequence_limit_routes),
        cmocka_unit_test(test_idle_replica_takes_a_blocked_prefix_request),
        cmocka_unit_test(test_refused_move_keeps_prefix),
        cmocka_unit_test(test_idle_replica_takes_waiting),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
