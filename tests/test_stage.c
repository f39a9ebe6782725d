/* Pipeline stages (worker/stage/stage.h) on the real model: two stages (layers [0,15) and
 * [15,30)) joined by a real authenticated TCP data-plane link execute step plans with several
 * sequences joining at different steps; the greedy tokens equal each sequence run alone through
 * model_forward on the whole model. Also: one stage with a device budget far below the KV and
 * host/NVMe tiers, a sequence preempted (spilled) and resumed by the plan, same tokens; a
 * sequence the plan gets wrong fails alone on every stage while the others go on; rows of a
 * sequence the back stage no longer holds are skipped and the others' rows moved up. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvstore/plan.h"
#include "kvstore/sysmem.h"
#include "worker/model.h"
#include "worker/stage/stage.h"
#include "worker/stage/stage_gpu.h"
#include "test_dir.h"
#ifdef STRATA_FAKE_CUDA
#include <cuda_runtime.h>   /* the fake device's test controls */
#endif

static model *full, *front, *back;
/* The same ranges loaded for a GPU stage (model_load_for_device). */
static model *full_dev, *front_dev, *back_dev;

/* The model a stage of options o takes: the device's load for a GPU stage. */
static model *pick(model *host, const stage_options *o)
{
    if (!o || !o->cuda)
        return host;
    return host == full ? full_dev : host == front ? front_dev : back_dev;
}
static const char *model_path(void) { return getenv("STRATA_MODEL") ? getenv("STRATA_MODEL") : STRATA_DEFAULT_MODEL; }

static int32_t argmax(const float *x, int n)
{
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best])
            best = i;
    return best;
}

#define MAXSEQ 4
#define STEPS 10

typedef struct seq_spec {
    uint64_t id;
    int32_t prompt[160];
    size_t n_prompt;
    int join_step;              /* the step whose plan carries its prompt */
    int32_t want[STEPS + 1];    /* greedy tokens alone */
    int32_t got[STEPS + 1];
    size_t n_got;
    size_t len;                 /* tokens in its KV */
    const char *kv;             /* its own KV plan (SeqWork.kv_plan), NULL: the stage's */
} seq_spec;

static void reference(seq_spec *q, int n_tokens, const char *kv)
{
    const model_config *c = model_get_config(full);
    kv_geometry g = model_kv_geometry(full, 64);
    kv_codec_params plan[64];
    strata_error err = {0};
    assert_int_equal(kv_plan_parse(kv, g.n_layers, plan, &err), STRATA_OK);
    kv_pool *pool = kv_pool_create_plan(&g, plan, 8, &err);
    kv_seq *seq = kv_seq_create(pool, 512, &err);
    float *logits = malloc((size_t)c->n_vocab * sizeof *logits);
    assert_int_equal(model_forward(full, seq, q->prompt, q->n_prompt, 0, logits, false, &err), STRATA_OK);
    q->want[0] = argmax(logits, c->n_vocab);
    for (int i = 1; i < n_tokens; i++) {
        assert_int_equal(model_forward(full, seq, &q->want[i - 1], 1, q->n_prompt + (size_t)i - 1, logits, false, &err),
                         STRATA_OK);
        q->want[i] = argmax(logits, c->n_vocab);
    }
    free(logits);
    kv_seq_destroy(seq);
    kv_pool_destroy(pool);
}

/* The plan of one step for the given sequences (those joined and not finished). */
typedef struct plan_buf {
    Strata__Internal__V1__StepPlan plan;
    Strata__Internal__V1__SeqWork work[MAXSEQ], *workp[MAXSEQ];
    uint32_t tokens[MAXSEQ][160];
    uint64_t preempt[MAXSEQ], resume[MAXSEQ], freed[MAXSEQ];
} plan_buf;

static void build_plan(plan_buf *b, uint64_t step, seq_spec *seqs, size_t n, int at, int max_steps)
{
    memset(b, 0, sizeof *b);
    strata__internal__v1__step_plan__init(&b->plan);
    b->plan.step = step;
    b->plan.seqs = b->workp;
    b->plan.preempt_seqs = b->preempt;
    b->plan.resume_seqs = b->resume;
    b->plan.free_seqs = b->freed;
    for (size_t i = 0; i < n; i++) {
        seq_spec *q = &seqs[i];
        if (at < q->join_step || (int)q->n_got >= max_steps)
            continue;
        Strata__Internal__V1__SeqWork *w = &b->work[b->plan.n_seqs];
        strata__internal__v1__seq_work__init(w);
        w->seq_id = q->id;
        w->sample = true;
        w->last_chunk_of_prompt = q->len == 0;
        if (q->len == 0) {
            for (size_t k = 0; k < q->n_prompt; k++)
                b->tokens[b->plan.n_seqs][k] = (uint32_t)q->prompt[k];
            w->n_tokens = q->n_prompt;
            w->kv_plan = (char *)(q->kv ? q->kv : "");
        } else {
            b->tokens[b->plan.n_seqs][0] = (uint32_t)q->got[q->n_got - 1];
            w->n_tokens = 1;
        }
        w->tokens = b->tokens[b->plan.n_seqs];
        w->pos0 = (uint32_t)q->len;
        b->workp[b->plan.n_seqs++] = w;
    }
}

static void apply(const stage_result *r, seq_spec *seqs, size_t n, const plan_buf *b)
{
    for (size_t i = 0; i < b->plan.n_seqs; i++) {
        const Strata__Internal__V1__SeqWork *w = b->plan.seqs[i];
        seq_spec *q = NULL;
        for (size_t k = 0; k < n; k++)
            if (seqs[k].id == w->seq_id)
                q = &seqs[k];
        const stage_seq_result *res = NULL;
        for (size_t k = 0; k < r->n_seqs; k++)
            if (r->seqs[k].seq_id == w->seq_id)
                res = &r->seqs[k];
        assert_non_null(q);
        if (!res || !res->sampled)
            fail_msg("sequence %llu: no token (%s)", (unsigned long long)w->seq_id, res ? res->message : "no result");
        assert_int_equal(res->status, STRATA_OK);
        q->got[q->n_got++] = (int32_t)res->token;
        q->len += w->n_tokens;
    }
}

static Strata__Internal__V1__Assignment assignment(model *m, const char *kv)
{
    Strata__Internal__V1__Assignment a;
    strata__internal__v1__assignment__init(&a);
    a.layer_begin = (uint32_t)model_layer_begin(m);
    a.layer_end = (uint32_t)model_layer_end(m);
    a.n_layers_total = (uint32_t)model_get_config(m)->n_layers;
    a.kv_plan = (char *)kv;
    a.block_tokens = 64;
    a.max_seq_tokens = 512;
    a.max_batch_seqs = MAXSEQ;
    a.max_batch_tokens = 1024;
    return a;
}

typedef struct back_job {
    stage *st;
    const Strata__Internal__V1__StepPlan *plan;
    stage_result res;
    int rc;
    strata_error err;
} back_job;

static void *run_back(void *arg)
{
    back_job *j = arg;
    j->rc = stage_step(j->st, j->plan, &j->res, &j->err);
    return NULL;
}

typedef struct accept_job {
    dp_listener *l;
    dp_auth auth;
    dp_link *link;
    int rc;
} accept_job;

static void *run_accept(void *arg)
{
    accept_job *j = arg;
    j->rc = dp_tcp_accept(j->l, &j->auth, NULL, 10000, &j->link, NULL);
    return NULL;
}

/* The two stages and their link (link_pair's ends and listener). */
static void pipeline_free(stage *s0, stage *s1, dp_link *to_back, accept_job *aj)
{
    stage_destroy(s0);
    stage_destroy(s1);
    dp_link_close(to_back);
    dp_link_close(aj->link);
    dp_listener_close(aj->l);
}

/* One step of plan through the front stage s0 and the back stage s1 (in a thread of its own),
 * both of which must run it; the front stage reports nothing (it samples none and fails none).
 * *bj: the back stage's job, its results in bj->res. */
static void pipeline_step(stage *s0, stage *s1, const Strata__Internal__V1__StepPlan *plan, back_job *bj)
{
    *bj = (back_job){.st = s1, .plan = plan};
    pthread_t th;
    pthread_create(&th, NULL, run_back, bj);
    stage_result r0;
    strata_error err = {0};
    const int rc = stage_step(s0, plan, &r0, &err);
    pthread_join(th, NULL);
    if (rc != STRATA_OK)
        fail_msg("front stage, step %llu: %s", (unsigned long long)plan->step, err.msg);
    if (bj->rc != STRATA_OK)
        fail_msg("back stage, step %llu: %s", (unsigned long long)plan->step, bj->err.msg);
    assert_int_equal(r0.n_seqs, 0);
}

/* A real authenticated TCP link on loopback: *to_back sends, aj->link (accepted) receives. */
static void link_pair(accept_job *aj, dp_link **to_back)
{
    static uint8_t secret[32] = "a test cluster secret, 32 bytes";
    strata_error err = {0};
    *aj = (accept_job){.auth = {secret, sizeof secret}};
    assert_int_equal(dp_tcp_listen("127.0.0.1:0", &aj->l, &err), STRATA_OK);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", dp_listener_port(aj->l));
    pthread_t th;
    pthread_create(&th, NULL, run_accept, aj);
    *to_back = NULL;
    assert_int_equal(dp_tcp_connect(addr, &aj->auth, NULL, 10000, to_back, &err), STRATA_OK);
    pthread_join(th, NULL);
    assert_int_equal(aj->rc, STRATA_OK);
}

/* A front stage (assignment a0, sending) and a back stage (a1, receiving) of options o, joined by
 * link_pair's link. */
static void pipeline_new(const Strata__Internal__V1__Assignment *a0, const Strata__Internal__V1__Assignment *a1,
                         const stage_options *o, accept_job *aj, dp_link **to_back, stage **s0, stage **s1)
{
    strata_error err = {0};
    link_pair(aj, to_back);
    if (!(*s0 = stage_create(a0, pick(front, o), o, NULL, *to_back, &err)))
        fail_msg("front stage: %s", err.msg);
    if (!(*s1 = stage_create(a1, pick(back, o), o, aj->link, NULL, &err)))
        fail_msg("back stage: %s", err.msg);
}

/* Two stages over a TCP link, with two of the three sequences on plans of their own (one that
 * differs across the stages' layers), each against the whole model on that plan on the CPU.
 * o NULL: the CPU, whose tokens equal the whole model's bit for bit. With o->cuda (a GPU, or the
 * fake device) the stages run on the GPU with fp16 weights: every step must run, and the tokens
 * are compared with the CPU's (first tokens equal; the agreement is printed, since fp16 weights
 * may turn a greedy choice later on). */
static void two_stages(const stage_options *o)
{
    const bool gpu = o && o->cuda;
    const char *kv = "kivi2";
    char *others[] = {"fp16", "0-14:kivi4,15-29:tada2"};
    seq_spec seqs[3] = {{.id = 11, .n_prompt = 40, .join_step = 1},
                        {.id = 22, .n_prompt = 150, .join_step = 1, .kv = "fp16"},
                        {.id = 33, .n_prompt = 7, .join_step = 4, .kv = "0-14:kivi4,15-19:tada2,20-29:tada2"}};
    for (size_t i = 0; i < 3; i++) {
        for (size_t k = 0; k < seqs[i].n_prompt; k++)
            seqs[i].prompt[k] = (int32_t)(1 + (k * 7919 + i * 104729) % 40000);
        reference(&seqs[i], STEPS, seqs[i].kv ? seqs[i].kv : kv);
    }
    strata_error err = {0};
    pthread_t th;
    Strata__Internal__V1__Assignment a0 = assignment(front, kv), a1 = assignment(back, kv);
    a0.n_kv_plans = a1.n_kv_plans = 2;
    a0.kv_plans = a1.kv_plans = others;
    accept_job aj;
    dp_link *to_back;
    stage *s0, *s1;
    pipeline_new(&a0, &a1, o, &aj, &to_back, &s0, &s1);
    plan_buf b;
    for (int step = 1; step <= STEPS + 3; step++) {
        build_plan(&b, (uint64_t)step, seqs, 3, step, STEPS);
        if (!b.plan.n_seqs)
            break;
        back_job bj = {.st = s1, .plan = &b.plan};
        pthread_create(&th, NULL, run_back, &bj);
        stage_result r0;
        int rc = stage_step(s0, &b.plan, &r0, &err);
        if (rc != STRATA_OK)
            dp_link_close(to_back), to_back = NULL;   /* unblocks the back stage */
        pthread_join(th, NULL);
        if (rc != STRATA_OK)
            fail_msg("front stage, step %d: %s", step, err.msg);
        if (bj.rc != STRATA_OK)
            fail_msg("back stage: %s", bj.err.msg);
        assert_int_equal(r0.n_seqs, 0);   /* the first stage samples nothing and failed nothing */
        apply(&bj.res, seqs, 3, &b);
    }
    int agree = 0;
    for (size_t i = 0; i < 3; i++) {
        assert_int_equal(seqs[i].n_got, STEPS);
        for (int k = 0; k < STEPS; k++) {
            agree += seqs[i].got[k] == seqs[i].want[k];
            if (seqs[i].got[k] != seqs[i].want[k] && (!gpu || k == 0))
                fail_msg("sequence %llu token %d: %d in the pipeline, %d alone", (unsigned long long)seqs[i].id, k,
                         seqs[i].got[k], seqs[i].want[k]);
        }
    }
    if (gpu)
        print_message("GPU stages: %d of %d tokens equal to the CPU's\n", agree, 3 * STEPS);
    /* Each sequence made the blocks of its own plan (equal greedy tokens alone could hide a
     * sequence run on the stages' plan): fp16 keeps no window, the others 128 tokens. The GPU
     * stages form blocks by the same rule. */
    {
        size_t want[2] = {0, 0};
        kv_codec_params plan[64];
        for (size_t i = 0; i < 3; i++) {
            assert_int_equal(kv_plan_parse(seqs[i].kv ? seqs[i].kv : kv, model_get_config(full)->n_layers, plan, &err),
                             STRATA_OK);
            for (int l = 0; l < model_get_config(full)->n_layers; l++)
                want[l >= model_layer_end(front)] += (seqs[i].len - kv_tail_tokens(&plan[l], 64, seqs[i].len)) / 64;
        }
        stage_kv_usage u0, u1;
        stage_get_kv_usage(s0, &u0);
        stage_get_kv_usage(s1, &u1);
        assert_true(want[0] > 0);
        assert_int_equal(u0.device_blocks, want[0]);
        assert_int_equal(u1.device_blocks, want[1]);
    }

    /* A plan that is wrong for one sequence (position) fails it on both stages; the others go on. */
    build_plan(&b, 100, seqs, 2, 100, STEPS + 1);
    b.work[0].pos0 += 5;
    back_job bj = {.st = s1, .plan = &b.plan};
    pthread_create(&th, NULL, run_back, &bj);
    stage_result r0;
    assert_int_equal(stage_step(s0, &b.plan, &r0, &err), STRATA_OK);
    pthread_join(th, NULL);
    assert_int_equal(bj.rc, STRATA_OK);
    assert_int_equal(r0.n_seqs, 1);
    assert_int_equal(r0.seqs[0].seq_id, seqs[0].id);
    assert_int_equal(r0.seqs[0].status, STRATA_EINVAL);
    bool other_sampled = false, first_failed = false;
    for (size_t k = 0; k < bj.res.n_seqs; k++) {
        if (bj.res.seqs[k].seq_id == seqs[1].id && bj.res.seqs[k].sampled) {
            other_sampled = true;
            seqs[1].got[seqs[1].n_got++] = (int32_t)bj.res.seqs[k].token;
            seqs[1].len++;
        }
        first_failed |= bj.res.seqs[k].seq_id == seqs[0].id && bj.res.seqs[k].status == STRATA_EINVAL;
    }
    assert_true(other_sampled);
    assert_true(first_failed);

    /* A sequence on a plan the stages were not assigned fails on both, named; the others go on. */
    seq_spec odd = {.id = 44, .n_prompt = 5, .join_step = 0, .kv = "gear2"};
    for (size_t k = 0; k < odd.n_prompt; k++)
        odd.prompt[k] = (int32_t)(100 + k);
    seq_spec two[2] = {seqs[1], odd};
    build_plan(&b, 101, two, 2, 101, STEPS + 2);
    bj = (back_job){.st = s1, .plan = &b.plan};
    pthread_create(&th, NULL, run_back, &bj);
    assert_int_equal(stage_step(s0, &b.plan, &r0, &err), STRATA_OK);
    pthread_join(th, NULL);
    assert_int_equal(bj.rc, STRATA_OK);
    assert_int_equal(r0.n_seqs, 1);
    assert_int_equal(r0.seqs[0].seq_id, 44);
    assert_int_equal(r0.seqs[0].status, STRATA_EUNSUPPORTED);
    if (!strstr(r0.seqs[0].message, "'gear2'"))
        fail_msg("%s", r0.seqs[0].message);
    other_sampled = false;
    for (size_t k = 0; k < bj.res.n_seqs; k++)
        other_sampled |= bj.res.seqs[k].seq_id == seqs[1].id && bj.res.seqs[k].sampled;
    assert_true(other_sampled);

    pipeline_free(s0, s1, to_back, &aj);
}

/* One sequence that does not fit the back stage's KV pool (a 150-token prompt joining two short
 * decoding sequences) fails alone there, named, and is not dropped (nothing of it changed); the
 * others run on in the same step, their rows compacted past its rows, with the tokens they have
 * alone. o NULL: CPU stages, whose tokens equal the whole model's; with o->cuda GPU stages (their
 * device pool's room check, cuda_model_batch_check), whose first tokens are compared (fp16
 * weights may turn a later greedy choice) and every later step must run. */
static void unfit_fails_alone(const stage_options *o)
{
    const bool gpu = o && o->cuda;
    const char *kv = "fp16";   /* no window: every 64 tokens make a block */
    seq_spec seqs[3] = {{.id = 1, .n_prompt = 40, .join_step = 1},
                        {.id = 2, .n_prompt = 150, .join_step = 3},
                        {.id = 3, .n_prompt = 30, .join_step = 1}};
    for (size_t i = 0; i < 3; i++)
        for (size_t k = 0; k < seqs[i].n_prompt; k++)
            seqs[i].prompt[k] = (int32_t)(2 + (k * 4211 + i * 977) % 40000);
    reference(&seqs[0], STEPS, kv);
    reference(&seqs[2], STEPS, kv);
    Strata__Internal__V1__Assignment a0 = assignment(front, kv), a1 = assignment(back, kv);
    a1.device_kv_bytes = 20 * 49280;   /* 20 blocks of 64 fp16 tokens; the long prompt needs 2 x 15 */
    if (gpu)   /* a GPU pool takes a budget below max_seq_tokens only over a tier; this one holds 4 blocks */
        a1.host_kv_bytes = 256 * 1024;
    accept_job aj;
    dp_link *to_back;
    stage *s0, *s1;
    pipeline_new(&a0, &a1, o, &aj, &to_back, &s0, &s1);
    plan_buf b;
    for (int step = 1; step <= STEPS + 2; step++) {
        build_plan(&b, (uint64_t)step, seqs, 3, step, STEPS);
        if (!b.plan.n_seqs)
            break;
        back_job bj;
        pipeline_step(s0, s1, &b.plan, &bj);
        if (step == 3) {
            assert_int_equal(b.plan.n_seqs, 3);
            assert_int_equal(b.plan.seqs[1]->seq_id, 2);   /* between the two: its rows sit in the middle */
            const stage_seq_result *long_one = NULL;
            for (size_t k = 0; k < bj.res.n_seqs; k++)
                if (bj.res.seqs[k].seq_id == 2)
                    long_one = &bj.res.seqs[k];
            assert_non_null(long_one);
            if (long_one->status != STRATA_EFULL || long_one->sampled || !strstr(long_one->message, "sequence 2"))
                fail_msg("the long sequence: status %d, '%s'", long_one->status, long_one->message);
            stage_kv_usage u;
            stage_get_kv_usage(s1, &u);
            assert_int_equal(u.sequences, 3);   /* kept for the coordinator to free */
            b.work[1] = b.work[2];   /* the others' results as usual; the long one plans no more */
            b.plan.n_seqs = 2;
            seqs[1].join_step = STEPS + 100;
        }
        apply(&bj.res, seqs, 3, &b);
    }
    for (size_t i = 0; i < 3; i += 2) {
        assert_int_equal(seqs[i].n_got, STEPS);
        for (int k = 0; k < (gpu ? 1 : STEPS); k++)
            if (seqs[i].got[k] != seqs[i].want[k])
                fail_msg("sequence %llu token %d: %d beside the unfit one, %d alone", (unsigned long long)seqs[i].id, k,
                         seqs[i].got[k], seqs[i].want[k]);
    }
    pipeline_free(s0, s1, to_back, &aj);
}

static void test_unfit_sequence_fails_alone(void **state)
{
    (void)state;
    unfit_fails_alone(NULL);
}

/* Three sequences through a front and a back stage of options o for STEPS steps; from drop_step
 * on (0: never) the back stage no longer holds the second (dropped there, as after a fault on
 * that stage only) while the front stage still runs it at that step: its rows arrive between the
 * others' and are skipped, the rows after them moved up; it fails there alone and plans no more. */
static void pipeline_with_drop(const stage_options *o, seq_spec *seqs, int drop_step)
{
    const char *kv = "kivi4";
    Strata__Internal__V1__Assignment a0 = assignment(front, kv), a1 = assignment(back, kv);
    accept_job aj;
    dp_link *to_back;
    stage *s0, *s1;
    pipeline_new(&a0, &a1, o, &aj, &to_back, &s0, &s1);
    plan_buf b;
    for (int step = 1; step <= STEPS; step++) {
        if (step == drop_step)
            stage_drop_seq(s1, seqs[1].id);
        build_plan(&b, (uint64_t)step, seqs, 3, step, STEPS);
        back_job bj;
        pipeline_step(s0, s1, &b.plan, &bj);
        if (step == drop_step) {
            assert_int_equal(b.plan.n_seqs, 3);
            assert_int_equal(b.plan.seqs[1]->seq_id, seqs[1].id);   /* its rows sit between the others' */
            bool missing_failed = false;
            for (size_t k = 0; k < bj.res.n_seqs; k++)
                if (bj.res.seqs[k].seq_id == seqs[1].id) {
                    assert_false(bj.res.seqs[k].sampled);
                    assert_int_not_equal(bj.res.seqs[k].status, STRATA_OK);
                    missing_failed = true;
                }
            assert_true(missing_failed);
            b.work[1] = b.work[2];   /* the others' results as usual; the missing one plans no more */
            b.plan.n_seqs = 2;
            seqs[1].join_step = STEPS + 100;
        }
        apply(&bj.res, seqs, 3, &b);
    }
    pipeline_free(s0, s1, to_back, &aj);
}

/* The others' tokens past a sequence missing on the back stage are those they have without the
 * drop. o NULL: CPU stages, against the whole model, every token. With o->cuda: against the same
 * GPU stages without the drop, up to the token of the step that skipped the rows (fp16 weights
 * in batches of another size may turn a later greedy choice). */
static void rows_past_missing(const stage_options *o)
{
    const bool gpu = o && o->cuda;
    seq_spec seqs[3] = {{.id = 5, .n_prompt = 9, .join_step = 1},
                        {.id = 6, .n_prompt = 21, .join_step = 1},
                        {.id = 7, .n_prompt = 13, .join_step = 1}};
    for (size_t i = 0; i < 3; i++)
        for (size_t k = 0; k < seqs[i].n_prompt; k++)
            seqs[i].prompt[k] = (int32_t)(3 + (k * 6151 + i * 3119) % 40000);
    if (gpu) {
        seq_spec undropped[3];
        memcpy(undropped, seqs, sizeof seqs);
        pipeline_with_drop(o, undropped, 0);
        for (size_t i = 0; i < 3; i++)
            memcpy(seqs[i].want, undropped[i].got, sizeof seqs[i].want);
    } else {
        for (size_t i = 0; i < 3; i++)
            reference(&seqs[i], STEPS, "kivi4");
    }
    pipeline_with_drop(o, seqs, 4);
    for (size_t i = 0; i < 3; i += 2) {
        assert_int_equal(seqs[i].n_got, STEPS);
        for (int k = 0; k < (gpu ? 4 : STEPS); k++)
            if (seqs[i].got[k] != seqs[i].want[k])
                fail_msg("sequence %llu token %d: %d past the missing one, %d without", (unsigned long long)seqs[i].id,
                         k, seqs[i].got[k], seqs[i].want[k]);
    }
}

static void test_rows_past_a_sequence_missing_here(void **state)
{
    (void)state;
    rows_past_missing(NULL);
}

/* A step larger than the machine's memory (--max-batch-tokens at its 4M-token maximum: about
 * 40 KiB of activations per row of this model) is refused when the stage is made, naming the
 * flag, instead of failing (or meeting the OOM killer) at the first step that large. */
static void test_step_memory_checked(void **state)
{
    (void)state;
    strata_error err = {0};
    Strata__Internal__V1__Assignment a = assignment(full, "kivi2");
    a.max_batch_tokens = 1u << 22;
    if (model_step_bytes(full, a.max_batch_tokens) <= strata_memory_limit()) {
        print_message("this machine has memory for a step of %u tokens: nothing to refuse\n", a.max_batch_tokens);
        return;
    }
    assert_null(stage_create(&a, full, NULL, NULL, NULL, &err));
    assert_int_equal(err.code, STRATA_EINVAL);
    if (!strstr(err.msg, "--max-batch-tokens") || !strstr(err.msg, "more than this machine"))
        fail_msg("%s", err.msg);
    print_message("%s\n", err.msg);
    a.max_batch_tokens = 1024;   /* the tests' size is taken */
    stage *st = stage_create(&a, full, NULL, NULL, NULL, &err);
    if (!st)
        fail_msg("%s", err.msg);
    stage_destroy(st);
}

/* A previous stage (here a raw sender) whose row table lists a sequence of the plan twice: the
 * step is refused, never run with more items than the plan has. */
static void test_rows_listed_twice(void **state)
{
    (void)state;
    strata_error err = {0};
    accept_job aj;
    dp_link *to_back;
    link_pair(&aj, &to_back);
    Strata__Internal__V1__Assignment a1 = assignment(back, "kivi2");
    stage *s1 = stage_create(&a1, back, NULL, aj.link, NULL, &err);
    if (!s1)
        fail_msg("%s", err.msg);
    seq_spec q = {.id = 7, .n_prompt = 4, .join_step = 1, .prompt = {1, 2, 3, 4}};
    plan_buf b;
    build_plan(&b, 1, &q, 1, 1, STEPS);
    assert_int_equal(b.plan.n_seqs, 1);
    /* u32 n = 2, u32 0, then (u64 id, u32 n_tokens, u32 0) twice, little-endian (stage.c's table) */
    uint8_t table[8 + 2 * 16] = {2};
    for (int e = 0; e < 2; e++) {
        table[8 + 16 * e] = 7;
        table[8 + 16 * e + 8] = 4;
    }
    const size_t emb = (size_t)model_get_config(back)->n_embd, rows = 8;
    float *hidden = calloc(rows * emb, sizeof *hidden);
    assert_non_null(hidden);
    dp_msg_header h = {.kind = DP_MSG_CONTROL, .dtype = DP_DTYPE_BYTES, .step = 1};
    assert_int_equal(dp_send(to_back, &h, table, sizeof table, &err), STRATA_OK);
    dp_msg_header hh = {.kind = DP_MSG_HIDDEN, .dtype = DP_DTYPE_F32, .step = 1, .n_rows = (uint32_t)rows,
                        .row_bytes = (uint32_t)(emb * sizeof(float))};
    assert_int_equal(dp_send(to_back, &hh, hidden, rows * emb * sizeof(float), &err), STRATA_OK);
    stage_result r;
    assert_int_equal(stage_step(s1, &b.plan, &r, &err), STRATA_EFORMAT);
    if (!strstr(err.msg, "list sequence 7 twice"))
        fail_msg("unexpected message: %s", err.msg);
    free(hidden);
    stage_destroy(s1);
    dp_link_close(to_back);
    dp_link_close(aj.link);
    dp_listener_close(aj.l);
}

/* A plan that lists a sequence twice (a coordinator fault) fails that sequence alone, with a
 * message, and runs neither entry: its KV stays as it was, so it goes on with the next plan and
 * its tokens still equal the whole model's; the other sequence of the batch runs. */
static void test_plan_lists_sequence_twice(void **state)
{
    (void)state;
    seq_spec seqs[2] = {{.id = 1, .n_prompt = 12, .join_step = 1}, {.id = 2, .n_prompt = 9, .join_step = 1}};
    for (size_t i = 0; i < 2; i++) {
        for (size_t k = 0; k < seqs[i].n_prompt; k++)
            seqs[i].prompt[k] = (int32_t)(17 + 101 * k + 7 * i);
        reference(&seqs[i], 4, "kivi4");
    }
    Strata__Internal__V1__Assignment a = assignment(full, "kivi4");
    strata_error err = {0};
    stage *st = stage_create(&a, full, NULL, NULL, NULL, &err);
    if (!st)
        fail_msg("%s", err.msg);
    plan_buf b;
    stage_result r;
    build_plan(&b, 1, seqs, 2, 1, STEPS);
    assert_int_equal(stage_step(st, &b.plan, &r, &err), STRATA_OK);
    apply(&r, seqs, 2, &b);
    for (int twice_first = 0; twice_first < 2; twice_first++) {   /* the valid entry first, then second */
        build_plan(&b, 2, seqs, 2, 2, STEPS);
        b.work[2] = b.work[0];
        b.work[2].pos0 += 5;
        b.workp[2] = &b.work[2];
        b.plan.n_seqs = 3;
        if (twice_first) {   /* the wrong entry before the right one */
            b.workp[2] = b.workp[0];
            b.workp[0] = &b.work[2];
        }
        assert_int_equal(stage_step(st, &b.plan, &r, &err), STRATA_OK);
        bool one_failed = false, two_sampled = false;
        for (size_t k = 0; k < r.n_seqs; k++) {
            const stage_seq_result *sr = &r.seqs[k];
            if (sr->seq_id == 1) {
                assert_false(sr->sampled);
                assert_int_equal(sr->status, STRATA_EINVAL);
                one_failed = true;
                if (!strstr(sr->message, "listed twice") && !strstr(sr->message, "holds"))
                    fail_msg("%s", sr->message);
            } else if (sr->seq_id == 2 && sr->sampled) {
                assert_int_equal(sr->status, STRATA_OK);
                assert_int_equal((int32_t)sr->token, seqs[1].want[seqs[1].n_got]);
                seqs[1].got[seqs[1].n_got++] = (int32_t)sr->token;
                seqs[1].len += 1;
                two_sampled = true;
            }
        }
        assert_true(one_failed);
        assert_true(two_sampled);
    }
    /* Sequence 1 ran neither time: with the right plan it goes on where it was. */
    seqs[1].join_step = STEPS + 1;   /* left out of this plan */
    build_plan(&b, 3, seqs, 2, 3, STEPS);
    assert_int_equal(b.plan.n_seqs, 1);
    assert_int_equal(stage_step(st, &b.plan, &r, &err), STRATA_OK);
    apply(&r, seqs, 2, &b);
    assert_int_equal(seqs[0].got[1], seqs[0].want[1]);
    /* A work item claiming more sampled tokens than the sequence has fed is refused (the
     * sampler would skip that many draws: a bound on the work a plan can ask for). */
    build_plan(&b, 4, seqs, 2, 4, STEPS);
    assert_int_equal(b.plan.n_seqs, 1);
    b.work[0].sampled_before = (uint64_t)1 << 60;
    assert_int_equal(stage_step(st, &b.plan, &r, &err), STRATA_OK);
    assert_int_equal(r.n_seqs, 1);
    assert_int_equal(r.seqs[0].status, STRATA_EINVAL);
    if (!strstr(r.seqs[0].message, "sampled before"))
        fail_msg("%s", r.seqs[0].message);
    stage_destroy(st);
}

static void test_two_stages_equal_whole_model(void **state)
{
    (void)state;
    two_stages(NULL);
}

/* Migration with GPU stages (a GPU, or the fake device): two sequences move GPU stage to GPU
 * stage at step 3 and give the tokens of the same sequences left where they were (same kernels,
 * same bytes); at step 6 they move to a CPU stage and at step 9 back to a GPU stage, and every
 * step after each move runs (the CPU's tokens may differ from fp16 weights' later on). kv: the
 * stage's KV codec or plan; own: the second sequence's own plan (NULL: the stage's), which the
 * stages are assigned besides kv and which travels with it. */
static void gpu_migration(const stage_options *o, const char *kv, const char *own)
{
    seq_spec ref[2] = {{.id = 7, .n_prompt = 150, .join_step = 1}, {.id = 8, .n_prompt = 90, .join_step = 1, .kv = own}};
    for (size_t i = 0; i < 2; i++)
        for (size_t k = 0; k < ref[i].n_prompt; k++)
            ref[i].prompt[k] = (int32_t)(9 + (k * 7919 + i * 31) % 40000);
    seq_spec mov[2];
    memcpy(mov, ref, sizeof mov);
    Strata__Internal__V1__Assignment a = assignment(full, kv);
    char *others[] = {(char *)own};
    a.n_kv_plans = own ? 1 : 0;
    a.kv_plans = others;
    strata_error err = {0};
    stage *g_ref = stage_create(&a, pick(full, o), o, NULL, NULL, &err);
    stage *g1 = g_ref ? stage_create(&a, pick(full, o), o, NULL, NULL, &err) : NULL;
    stage *g2 = g1 ? stage_create(&a, pick(full, o), o, NULL, NULL, &err) : NULL;
    stage *cpu = g2 ? stage_create(&a, full, NULL, NULL, NULL, &err) : NULL;
    if (!cpu)
        fail_msg("GPU migration stages: %s", err.msg);
    plan_buf b;
    stage_result r;
    for (int step = 1; step <= STEPS; step++) {
        build_plan(&b, (uint64_t)step, ref, 2, step, STEPS);
        assert_int_equal(stage_step(g_ref, &b.plan, &r, &err), STRATA_OK);
        apply(&r, ref, 2, &b);
    }
    stage *where = g1;
    for (int step = 1; step <= STEPS; step++) {
        stage *to = step == 3 ? g2 : step == 6 ? cpu : step == 9 ? g1 : NULL;
        for (size_t i = 0; to && i < 2; i++) {
            uint8_t *img = NULL;
            size_t len = 0;
            if (stage_export_seq(where, mov[i].id, &img, &len, &err) != STRATA_OK ||
                stage_import_seq(to, mov[i].id, img, len, &err) != STRATA_OK)
                fail_msg("step %d, sequence %llu: %s", step, (unsigned long long)mov[i].id, err.msg);
            free(img);
            stage_drop_seq(where, mov[i].id);
        }
        where = to ? to : where;
        build_plan(&b, (uint64_t)step, mov, 2, step, STEPS);
        if (stage_step(where, &b.plan, &r, &err) != STRATA_OK)
            fail_msg("step %d after the moves: %s", step, err.msg);
        apply(&r, mov, 2, &b);
    }
    for (size_t i = 0; i < 2; i++)
        for (int k = 0; k < 5; k++)   /* up to the move to the CPU: GPU to GPU is exact */
            if (mov[i].got[k] != ref[i].got[k])
                fail_msg("sequence %llu token %d: %d after the GPU-to-GPU move, %d unmoved",
                         (unsigned long long)mov[i].id, k, mov[i].got[k], ref[i].got[k]);
    stage_destroy(g_ref);
    stage_destroy(g1);
    stage_destroy(g2);
    stage_destroy(cpu);
}

/* A GPU stage: without a device (or in a build without CUDA) stage_create says so and nothing is
 * left behind; with one, the two-stage pipeline runs on it. */
static void test_gpu_stage(void **state)
{
    (void)state;
    strata_error err = {0};
    const stage_options o = {.cuda = true, .cuda_device = 0};
    /* Each kind of stage takes the model loaded for it, on any machine. */
    Strata__Internal__V1__Assignment any = assignment(full, "kivi2");
    assert_null(stage_create(&any, full_dev, NULL, NULL, NULL, &err));
    assert_int_equal(err.code, STRATA_EINVAL);
    assert_non_null(strstr(err.msg, "by model_load"));
    assert_null(stage_create(&any, full, &o, NULL, NULL, &err));
    assert_int_equal(err.code, STRATA_EINVAL);
    assert_non_null(strstr(err.msg, "model_load_for_device"));
    if (stage_gpu_probe(0, &err) == STRATA_OK) {
        {   /* the largest step's device buffers are taken at the start: 4M tokens are ~120 GB here */
            Strata__Internal__V1__Assignment huge = assignment(full, "kivi2");
            huge.max_batch_tokens = 1u << 22;
            assert_null(stage_create(&huge, full_dev, &o, NULL, NULL, &err));
            if (!strstr(err.msg, "--max-batch-tokens"))
                fail_msg("%s", err.msg);
        }
        two_stages(&o);
        unfit_fails_alone(&o);
        rows_past_missing(&o);
        gpu_migration(&o, "kivi2-r32", "fp16");
        if (!getenv("STRATA_SANITIZED"))   /* plans under the sanitizers: test_cuda_model_fake's test_kv_plan */
            gpu_migration(&o, "0-9:kivi2-r32,10-19:kivi4-r32,20-29:tada4-r32", NULL);   /* a codec per layer range */
        /* A budget the coordinator counts in rows of each layer's block size, which a GPU pool
         * (one slot size) cannot hold when the layers' blocks differ and no host tier is below:
         * refused at the start, naming the way out; with a host tier (both count the largest
         * slots) it runs. */
        Strata__Internal__V1__Assignment het = assignment(full, "0-9:kivi2-r32,10-29:kivi4-r32");
        het.device_kv_bytes = 8u << 20;
        assert_null(stage_create(&het, full_dev, &o, NULL, NULL, &err));
        assert_int_equal(err.code, STRATA_EINVAL);
        if (!strstr(err.msg, "one slot size") || !strstr(err.msg, "--host-kv-mib"))
            fail_msg("%s", err.msg);
        /* A budget that cannot hold one sequence of max_seq_tokens (512: 8 blocks a layer) is
         * refused at the start, saying what it holds and needs: all its blocks without a tier
         * below, one layer's and the one forming over a host tier. */
        Strata__Internal__V1__Assignment small = assignment(full, "fp16");
        small.device_kv_bytes = 100 * 49280;
        assert_null(stage_create(&small, full_dev, &o, NULL, NULL, &err));
        if (err.code != STRATA_EINVAL || !strstr(err.msg, "holds 100 blocks of 49280 bytes; a 512-token sequence needs") ||
            !strstr(err.msg, "without a host tier below"))
            fail_msg("no tier: %s", err.msg);
        small.device_kv_bytes = 5 * 49280;
        small.host_kv_bytes = 8u << 20;
        assert_null(stage_create(&small, full_dev, &o, NULL, NULL, &err));
        if (err.code != STRATA_EINVAL || !strstr(err.msg, "holds 5 blocks") ||
            !strstr(err.msg, "(one layer's blocks and the one forming)"))
            fail_msg("over a host tier: %s", err.msg);
        het.host_kv_bytes = 8u << 20;
        stage *ok = stage_create(&het, full_dev, &o, NULL, NULL, &err);
        if (!ok)
            fail_msg("with a host tier: %s", err.msg);
        {   /* a preempted sequence is not exported; resumed, it is */
            seq_spec q = {.id = 7, .n_prompt = 20, .join_step = 1};
            for (size_t k = 0; k < q.n_prompt; k++)
                q.prompt[k] = (int32_t)(9 + k);
            plan_buf pb;
            stage_result r;
            build_plan(&pb, 1, &q, 1, 1, STEPS);
            assert_int_equal(stage_step(ok, &pb.plan, &r, &err), STRATA_OK);
            apply(&r, &q, 1, &pb);
            build_plan(&pb, 2, &q, 1, 2, STEPS);
            pb.plan.n_seqs = 0;
            pb.preempt[pb.plan.n_preempt_seqs++] = 7;
            assert_int_equal(stage_step(ok, &pb.plan, &r, &err), STRATA_OK);
            uint8_t *img = NULL;
            size_t len = 0;
            assert_int_equal(stage_export_seq(ok, 7, &img, &len, &err), STRATA_EINVAL);
            assert_non_null(strstr(err.msg, "preempted"));
            build_plan(&pb, 3, &q, 1, 3, STEPS);
            pb.resume[pb.plan.n_resume_seqs++] = 7;
            assert_int_equal(stage_step(ok, &pb.plan, &r, &err), STRATA_OK);
            apply(&r, &q, 1, &pb);
            assert_int_equal(stage_export_seq(ok, 7, &img, &len, &err), STRATA_OK);
            free(img);
            build_plan(&pb, 4, &q, 1, 4, 0);
            pb.freed[pb.plan.n_free_seqs++] = 7;
            assert_int_equal(stage_step(ok, &pb.plan, &r, &err), STRATA_OK);
        }
#ifdef STRATA_FAKE_CUDA
        {   /* Rows that came by NCCL are compacted in device memory when sequences drop out:
             * every gap (one row to more than the rest), the rows after it moved in order. */
            stage_gpu *g = NULL;
            const kv_codec_params *plans[1] = {NULL};
            kv_codec_params plan[64];
            assert_int_equal(kv_plan_parse("kivi2", model_get_config(full)->n_layers, plan, &err), STRATA_OK);
            plans[0] = plan;
            const stage_gpu_config gc = {.device = 0, .plans = plans, .n_plans = 1, .block_tokens = 64,
                                         .max_seq_tokens = 128, .max_batch_seqs = 2};
            assert_int_equal(stage_gpu_create(full_dev, &gc, &g, &err), STRATA_OK);
            const size_t emb = (size_t)model_get_config(full)->n_embd, rows = 9;
            float *host = malloc(rows * emb * sizeof *host), *out = malloc(rows * emb * sizeof *out);
            assert_non_null(host);
            assert_non_null(out);
            for (size_t gap = 1; gap < rows; gap++)
                for (size_t dst = 0; dst + gap < rows; dst++) {
                    for (size_t i = 0; i < rows * emb; i++)
                        host[i] = (float)i;
                    float *d = stage_gpu_device_rows(g, 0, rows, &err);
                    assert_non_null(d);
                    assert_int_equal(cudaMemcpy(d, host, rows * emb * sizeof *host, cudaMemcpyHostToDevice), cudaSuccess);
                    const size_t n = rows - dst - gap;
                    assert_int_equal(stage_gpu_compact_rows(g, dst, dst + gap, n, &err), STRATA_OK);
                    assert_int_equal(cudaMemcpy(out, d, rows * emb * sizeof *out, cudaMemcpyDeviceToHost), cudaSuccess);
                    for (size_t r = 0; r < dst + n; r++) {
                        const size_t from = r < dst ? r : r + gap;
                        if (out[r * emb + 3] != host[from * emb + 3])
                            fail_msg("rows %zu.. to %zu: row %zu holds %g, want row %zu's", dst + gap, dst, r,
                                     (double)out[r * emb + 3], from);
                    }
                }
            free(host);
            free(out);
            stage_gpu_destroy(g);
        }
        /* A device that lost its context fails the stage, not only the step's sequences: every
         * later step would fail, so the worker must leave and be restarted. */
        seq_spec lost = {.id = 9, .n_prompt = 20, .join_step = 1};
        for (size_t k = 0; k < lost.n_prompt; k++)
            lost.prompt[k] = (int32_t)(5 + k);
        plan_buf pb;
        build_plan(&pb, 1, &lost, 1, 1, STEPS);
        fakecuda_set_sticky_error(cudaErrorIllegalAddress);
        stage_result r;
        const int rc = stage_step(ok, &pb.plan, &r, &err);
        fakecuda_set_sticky_error(cudaSuccess);
        if (rc == STRATA_OK || !strstr(err.msg, "context is lost"))
            fail_msg("a step on a lost device: rc %d, '%s'", rc, err.msg);
#endif
        stage_destroy(ok);
        return;
    }
    assert_true(err.code == STRATA_EIO || err.code == STRATA_EUNSUPPORTED);
    Strata__Internal__V1__Assignment a = assignment(full, "kivi2");
    assert_null(stage_create(&a, full_dev, &o, NULL, NULL, &err));
    assert_non_null(strstr(err.msg, "CUDA"));
    /* A plan whose layers keep different fp16 windows is refused on a GPU stage before any device
     * is touched (plans sharing one run there: gpu_migration). */
    Strata__Internal__V1__Assignment mixed = assignment(full, "0-9:kivi2,10-29:fp16");
    assert_null(stage_create(&mixed, full_dev, &o, NULL, NULL, &err));
    assert_int_equal(err.code, STRATA_EUNSUPPORTED);
    assert_non_null(strstr(err.msg, "fp16 window"));
    print_message("no CUDA device or no CUDA in this build: the GPU stage checked for its errors only\n");
}

static void test_one_stage_tiers_preempt(void **state)
{
    (void)state;
    const char *kv = "kivi4";
    seq_spec seqs[2] = {{.id = 1, .n_prompt = 150, .join_step = 1}, {.id = 2, .n_prompt = 140, .join_step = 1}};
    for (size_t i = 0; i < 2; i++) {
        for (size_t k = 0; k < seqs[i].n_prompt; k++)
            seqs[i].prompt[k] = (int32_t)(3 + (k * 31337 + i * 7) % 40000);
        reference(&seqs[i], STEPS, kv);
    }
    char base[64], dir[128];
    snprintf(base, sizeof base, "/tmp/strata-stage-XXXXXX");
    assert_non_null(mkdtemp(base));
    snprintf(dir, sizeof dir, "%s/spill", base);
    Strata__Internal__V1__Assignment a = assignment(full, kv);
    a.device_kv_bytes = 40 * 15488;   /* 40 slots for ~2 x 30 blocks + tails */
    a.host_kv_bytes = 256 * 1024;
    a.nvme_kv_bytes = 64u << 20;
    stage_options o = {.nvme_dir = dir};
    strata_error err = {0};
    stage *st = stage_create(&a, pick(full, &o), &o, NULL, NULL, &err);
    if (!st)
        fail_msg("%s", err.msg);
    plan_buf b;
    for (int step = 1; step <= STEPS; step++) {
        build_plan(&b, (uint64_t)step, seqs, 2, step, STEPS);
        if (step == 4) {   /* sequence 2 leaves the batch, spilled */
            b.preempt[b.plan.n_preempt_seqs++] = 2;
            b.plan.n_seqs = 1;
        } else if (step > 4 && step < 7) {
            b.plan.n_seqs = 1;
            if (step == 5) {   /* a preempted sequence is not exported (on a GPU stage too) */
                uint8_t *img = NULL;
                size_t len = 0;
                assert_int_equal(stage_export_seq(st, 2, &img, &len, &err), STRATA_EINVAL);
                assert_null(img);
            }
        } else if (step == 7) {
            b.resume[b.plan.n_resume_seqs++] = 2;
        }
        stage_result r;
        assert_int_equal(stage_step(st, &b.plan, &r, &err), STRATA_OK);
        apply(&r, seqs, 2, &b);
    }
    /* finish both */
    while (seqs[1].n_got < STEPS) {
        build_plan(&b, 50 + seqs[1].n_got, seqs, 2, 100, STEPS);
        stage_result r;
        assert_int_equal(stage_step(st, &b.plan, &r, &err), STRATA_OK);
        apply(&r, seqs, 2, &b);
    }
    for (size_t i = 0; i < 2; i++)
        for (int k = 0; k < STEPS; k++)
            if (seqs[i].got[k] != seqs[i].want[k])
                fail_msg("sequence %llu token %d: %d with preemption, %d alone", (unsigned long long)seqs[i].id, k,
                         seqs[i].got[k], seqs[i].want[k]);
    stage_kv_usage u;
    stage_get_kv_usage(st, &u);
    assert_true(u.spills > 0 && u.restores > 0);
    assert_int_equal(u.crc_failures, 0);
    /* free_seqs releases them */
    build_plan(&b, 200, seqs, 2, 100, 0);
    b.freed[b.plan.n_free_seqs++] = 1;
    b.freed[b.plan.n_free_seqs++] = 2;
    stage_result r;
    assert_int_equal(stage_step(st, &b.plan, &r, &err), STRATA_OK);
    stage_get_kv_usage(st, &u);
    assert_int_equal(u.sequences, 0);
    stage_destroy(st);
    test_dir_remove_tree(base);
}


/* Migration between two stages holding the same layers (two replicas): a greedy and a sampled
 * sequence run 4 steps on a stage whose device budget is far below their KV (blocks sit in the
 * host/NVMe tiers, so the export reads them from below), move as images to a plain stage, and
 * continue there: the tokens equal an unmoved run (the sampled one: same PRNG position). */
static void test_migrate(void **state)
{
    (void)state;
    const char *kv = "kivi2-r32";   /* a short fp16 window: the prompts fill blocks */
    seq_spec ref[2] = {{.id = 5, .n_prompt = 150, .join_step = 1}, {.id = 6, .n_prompt = 140, .join_step = 1}};
    for (size_t i = 0; i < 2; i++)
        for (size_t k = 0; k < ref[i].n_prompt; k++)
            ref[i].prompt[k] = (int32_t)(5 + (k * 7919 + i * 13) % 40000);
    seq_spec mov[2];
    memcpy(mov, ref, sizeof mov);
    char base[64], dir[128];
    snprintf(base, sizeof base, "/tmp/strata-stage-XXXXXX");
    assert_non_null(mkdtemp(base));
    snprintf(dir, sizeof dir, "%s/spill", base);
    Strata__Internal__V1__Assignment plain = assignment(full, kv), tiered = assignment(full, kv);
    tiered.device_kv_bytes = 40 * 9344;
    tiered.host_kv_bytes = 128 * 1024;
    tiered.nvme_kv_bytes = 64u << 20;
    stage_options o = {.nvme_dir = dir};
    strata_error err = {0};
    stage *st_ref = stage_create(&plain, full, NULL, NULL, NULL, &err);
    stage *st_a = stage_create(&tiered, pick(full, &o), &o, NULL, NULL, &err);
    stage *st_b = stage_create(&plain, full, NULL, NULL, NULL, &err);
    /* larger slots, but not assigned the sequences' plan: its pool could hold them, it refuses */
    Strata__Internal__V1__Assignment wider = assignment(full, "kivi4-r32");
    stage *st_c = stage_create(&wider, full, NULL, NULL, NULL, &err);
    assert_true(st_ref && st_a && st_b && st_c);
    plan_buf b;
    stage_result r;
    for (int step = 1; step <= STEPS; step++) {
        build_plan(&b, (uint64_t)step, ref, 2, step, STEPS);
        b.work[1].temperature = 0.9f;   /* the second sequence samples */
        b.work[1].seed = 77;
        assert_int_equal(stage_step(st_ref, &b.plan, &r, &err), STRATA_OK);
        apply(&r, ref, 2, &b);
    }
    for (int step = 1; step <= STEPS; step++) {
        if (step == 5)
            for (size_t i = 0; i < 2; i++) {
                uint8_t *img = NULL;
                size_t len = 0;
                assert_int_equal(stage_export_seq(st_a, mov[i].id, &img, &len, &err), STRATA_OK);
                assert_int_equal(stage_import_seq(st_b, mov[i].id, img, len, &err), STRATA_OK);
                assert_int_equal(stage_import_seq(st_b, mov[i].id, img, len, &err), STRATA_EINVAL);   /* twice */
                assert_int_equal(stage_import_seq(st_c, mov[i].id, img, len, &err), STRATA_EUNSUPPORTED);
                img[len / 2] ^= 1;
                assert_int_not_equal(stage_import_seq(st_ref, 99, img, len, &err), STRATA_OK);   /* damaged */
                free(img);
                stage_drop_seq(st_a, mov[i].id);
            }
        build_plan(&b, (uint64_t)step, mov, 2, step, STEPS);
        b.work[1].temperature = 0.9f;
        b.work[1].seed = 77;
        assert_int_equal(stage_step(step < 5 ? st_a : st_b, &b.plan, &r, &err), STRATA_OK);
        apply(&r, mov, 2, &b);
    }
    stage_kv_usage u;
    stage_get_kv_usage(st_a, &u);
    assert_true(u.spills > 0);          /* the source really had blocks below the device */
    assert_int_equal(u.sequences, 0);   /* and freed them after the move */
    for (size_t i = 0; i < 2; i++)
        for (int k = 0; k < STEPS; k++)
            if (mov[i].got[k] != ref[i].got[k])
                fail_msg("sequence %llu token %d: %d after the move, %d unmoved", (unsigned long long)mov[i].id, k,
                         mov[i].got[k], ref[i].got[k]);
    assert_int_equal(stage_export_seq(st_a, 12345, &(uint8_t *){NULL}, &(size_t){0}, &err), STRATA_EINVAL);
    stage_destroy(st_ref);
    stage_destroy(st_a);
    stage_destroy(st_b);
    stage_destroy(st_c);
    test_dir_remove_tree(base);
}

/* Prefix caching on a stage: a finished sequence's first 128 tokens are parked; a new sequence
 * whose prompt shares them starts as a copy (SeqWork.prefix_entry, pos0 128) and prefills only
 * the rest. With the fp16 codec (no tail: every full block is stored as computed) its greedy
 * tokens equal the whole prompt run alone through model_forward. A copy of an entry that was
 * dropped, never parked, or whose park failed (an OTT plan; a sequence not there) fails that
 * sequence alone, with the reason, while the others run. */
static void test_prefix_entries(void **state)
{
    (void)state;
    const char *kv = "fp16";
    enum { SHARED = 128 };
    seq_spec donor = {.id = 1, .n_prompt = 150, .join_step = 1}, user = {.id = 2, .n_prompt = 140, .join_step = 1};
    for (size_t k = 0; k < 150; k++)
        donor.prompt[k] = (int32_t)(3 + (k * 7919) % 40000);
    memcpy(user.prompt, donor.prompt, SHARED * sizeof *user.prompt);
    for (size_t k = SHARED; k < user.n_prompt; k++)
        user.prompt[k] = (int32_t)(11 + (k * 104729) % 40000);
    reference(&user, STEPS, kv);
    Strata__Internal__V1__Assignment a = assignment(full, kv), ott = assignment(full, "ott2");
    strata_error err = {0};
    stage *st = stage_create(&a, full, NULL, NULL, NULL, &err), *st_ott = stage_create(&ott, full, NULL, NULL, NULL, &err);
    assert_true(st && st_ott);
    plan_buf b;
    stage_result r;
    for (int step = 1; step <= 3; step++) {   /* the donor: its prompt and two tokens */
        build_plan(&b, (uint64_t)step, &donor, 1, step, 3);
        assert_int_equal(stage_step(st, &b.plan, &r, &err), STRATA_OK);
        apply(&r, &donor, 1, &b);
        assert_int_equal(stage_step(st_ott, &b.plan, &r, &err), STRATA_OK);
    }
    /* It finishes: parked (entry 1) and freed in one plan; also a park of a sequence not there. */
    Strata__Internal__V1__PrefixPark park[2], *parkp[2] = {&park[0], &park[1]};
    for (int i = 0; i < 2; i++)
        strata__internal__v1__prefix_park__init(&park[i]);
    park[0].seq_id = 1;
    park[0].n_tokens = SHARED;
    park[1].seq_id = 77;
    park[1].n_tokens = SHARED;
    build_plan(&b, 4, &donor, 1, 4, 0);
    b.plan.park_prefixes = parkp;
    b.plan.n_park_prefixes = 2;
    b.freed[b.plan.n_free_seqs++] = 1;
    assert_int_equal(stage_step(st, &b.plan, &r, &err), STRATA_OK);
    assert_int_equal(stage_step(st_ott, &b.plan, &r, &err), STRATA_OK);
    stage_kv_usage u;
    stage_get_kv_usage(st, &u);
    assert_int_equal(u.sequences, 0);
    assert_int_equal(u.prefix_entries, 2);   /* entry 77 only says why it failed */
    assert_true(u.prefix_bytes > 0);
    /* The user's prompt from the entry: its first chunk is the 12 tokens after the prefix. */
    for (int step = 5; step < 5 + STEPS; step++) {
        build_plan(&b, (uint64_t)step, &user, 1, step, STEPS);   /* step 5: the whole prompt, cut below */
        if (step == 5) {
            b.work[0].pos0 = SHARED;
            b.work[0].n_tokens = user.n_prompt - SHARED;
            for (size_t k = 0; k < b.work[0].n_tokens; k++)
                b.tokens[0][k] = (uint32_t)user.prompt[SHARED + k];
            b.work[0].prefix_entry = 1;
        }
        assert_int_equal(stage_step(st, &b.plan, &r, &err), STRATA_OK);
        apply(&r, &user, 1, &b);
        if (step == 5)
            user.len = user.n_prompt;
    }
    for (int k = 0; k < STEPS; k++)
        if (user.got[k] != user.want[k])
            fail_msg("token %d: %d from the prefix entry, %d from the whole prompt", k, user.got[k], user.want[k]);
    /* A prompt sharing only the entry's first block takes that block alone (pos0 64 of the
     * entry's 128): the copy is cut, and its tokens are the whole prompt's. */
    seq_spec part = {.id = 3, .n_prompt = 100, .join_step = 1};
    memcpy(part.prompt, donor.prompt, 64 * sizeof *part.prompt);
    for (size_t k = 64; k < part.n_prompt; k++)
        part.prompt[k] = (int32_t)(5 + (k * 6007) % 40000);
    reference(&part, STEPS, kv);
    for (int step = 5; step < 5 + STEPS; step++) {
        build_plan(&b, (uint64_t)(100 + step), &part, 1, step, STEPS);
        if (step == 5) {
            b.work[0].pos0 = 64;
            b.work[0].n_tokens = part.n_prompt - 64;
            for (size_t k = 0; k < b.work[0].n_tokens; k++)
                b.tokens[0][k] = (uint32_t)part.prompt[64 + k];
            b.work[0].prefix_entry = 1;
        }
        assert_int_equal(stage_step(st, &b.plan, &r, &err), STRATA_OK);
        assert_int_equal(r.n_seqs, 1);
        if (r.seqs[0].status != STRATA_OK)
            fail_msg("from the entry's first block: %s", r.seqs[0].message);
        apply(&r, &part, 1, &b);
        if (step == 5)
            part.len = part.n_prompt;
    }
    for (int k = 0; k < STEPS; k++)
        if (part.got[k] != part.want[k])
            fail_msg("token %d: %d from the entry's first block, %d from the whole prompt", k, part.got[k],
                     part.want[k]);
    /* More tokens than the entry holds: that sequence fails, saying so. */
    seq_spec over = {.id = 4, .n_prompt = 150, .join_step = 1};
    memcpy(over.prompt, donor.prompt, sizeof over.prompt);
    build_plan(&b, 150, &over, 1, 1, 1);
    b.work[0].pos0 = 192;
    b.work[0].n_tokens = 1;
    b.work[0].prefix_entry = 1;
    assert_int_equal(stage_step(st, &b.plan, &r, &err), STRATA_OK);
    assert_int_equal(r.n_seqs, 1);
    if (r.seqs[0].status == STRATA_OK || !strstr(r.seqs[0].message, "holds 128 tokens; the plan takes 192"))
        fail_msg("%s", r.seqs[0].message);
    assert_true(r.seqs[0].prefix_failed);   /* the entry's fault: the coordinator forgets it */
    /* Started from the entry, then refused for its own plan (a sampler skip past what it fed):
     * the entry is not at fault. */
    over.id = 5;
    build_plan(&b, 151, &over, 1, 1, 1);
    b.work[0].pos0 = SHARED;
    b.work[0].n_tokens = 1;
    b.work[0].prefix_entry = 1;
    b.work[0].sampled_before = SHARED + 1;
    assert_int_equal(stage_step(st, &b.plan, &r, &err), STRATA_OK);
    assert_int_equal(r.n_seqs, 1);
    if (r.seqs[0].status == STRATA_OK || r.seqs[0].prefix_failed || !strstr(r.seqs[0].message, "sampled before"))
        fail_msg("status %d, prefix_failed %d: %s", r.seqs[0].status, r.seqs[0].prefix_failed, r.seqs[0].message);
    build_plan(&b, 152, &over, 1, 1, 0);
    b.freed[b.plan.n_free_seqs++] = 5;
    assert_int_equal(stage_step(st, &b.plan, &r, &err), STRATA_OK);

    /* Copies that cannot be made fail alone: entry 77 (its park failed), an entry never parked,
     * and entry 1 on the OTT stage (its park was refused); sequence 30 starts normally beside. */
    static const struct { uint64_t seq, entry; const char *why; } bad[] = {
        {20, 77, "not on this stage"}, {21, 5, "prefix entry 5 is not on this stage"}};
    for (size_t i = 0; i < 2; i++) {
        seq_spec q = {.id = bad[i].seq, .n_prompt = 140, .join_step = 1};
        seq_spec fresh = {.id = 30 + i, .n_prompt = 20, .join_step = 1};
        memcpy(q.prompt, user.prompt, sizeof q.prompt);
        memcpy(fresh.prompt, user.prompt, 20 * sizeof *fresh.prompt);
        seq_spec both[2] = {q, fresh};
        build_plan(&b, 100 + i, both, 2, 1, 1);
        b.work[0].pos0 = SHARED;
        b.work[0].n_tokens = 12;
        b.work[0].prefix_entry = bad[i].entry;
        assert_int_equal(stage_step(st, &b.plan, &r, &err), STRATA_OK);
        assert_int_equal(r.n_seqs, 2);
        for (size_t k = 0; k < 2; k++)
            if (r.seqs[k].seq_id == bad[i].seq) {
                assert_int_not_equal(r.seqs[k].status, STRATA_OK);
                assert_true(r.seqs[k].prefix_failed);
                if (!strstr(r.seqs[k].message, bad[i].why))
                    fail_msg("%s", r.seqs[k].message);
            } else {
                assert_int_equal(r.seqs[k].status, STRATA_OK);
                assert_false(r.seqs[k].prefix_failed);
                assert_true(r.seqs[k].sampled);
            }
    }
    seq_spec late = {.id = 40, .n_prompt = 140, .join_step = 1};
    memcpy(late.prompt, user.prompt, sizeof late.prompt);
    build_plan(&b, 200, &late, 1, 1, 1);
    b.work[0].pos0 = SHARED;
    b.work[0].n_tokens = 12;
    b.work[0].prefix_entry = 1;
    assert_int_equal(stage_step(st_ott, &b.plan, &r, &err), STRATA_OK);
    assert_int_equal(r.n_seqs, 1);
    if (!strstr(r.seqs[0].message, "OTT") || !r.seqs[0].prefix_failed)
        fail_msg("prefix_failed %d: %s", r.seqs[0].prefix_failed, r.seqs[0].message);
    /* Dropped: gone, its bytes returned; a copy of it now fails. */
    uint64_t drop[2] = {1, 77};
    build_plan(&b, 201, &user, 1, 1, 0);
    b.plan.drop_prefixes = drop;
    b.plan.n_drop_prefixes = 2;
    assert_int_equal(stage_step(st, &b.plan, &r, &err), STRATA_OK);
    stage_get_kv_usage(st, &u);
    assert_int_equal(u.prefix_entries, 0);
    assert_int_equal(u.prefix_bytes, 0);
    late.id = 41;
    build_plan(&b, 202, &late, 1, 1, 1);
    b.work[0].pos0 = SHARED;
    b.work[0].n_tokens = 12;
    b.work[0].prefix_entry = 1;
    assert_int_equal(stage_step(st, &b.plan, &r, &err), STRATA_OK);
    assert_int_equal(r.n_seqs, 1);
    assert_int_not_equal(r.seqs[0].status, STRATA_OK);
    stage_destroy(st);
    stage_destroy(st_ott);
}

static int setup(void **state)
{
    (void)state;
    strata_error err = {0};
    full = model_load(model_path(), 0, -1, &err);
    front = full ? model_load(model_path(), 0, 15, &err) : NULL;
    back = front ? model_load(model_path(), 15, -1, &err) : NULL;
    full_dev = back ? model_load_for_device(model_path(), 0, -1, &err) : NULL;
    front_dev = full_dev ? model_load_for_device(model_path(), 0, 15, &err) : NULL;
    back_dev = front_dev ? model_load_for_device(model_path(), 15, -1, &err) : NULL;
    if (!back_dev) {
        print_error("cannot load %s: %s (run scripts/setup.sh)\n", model_path(), err.msg);
        return -1;
    }
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    model_free(full);
    model_free(front);
    model_free(back);
    model_free(full_dev);
    model_free(front_dev);
    model_free(back_dev);
    return 0;
}

int main(void)
{
#ifdef STRATA_FAKE_CUDA
    /* test_stage_fake (tests/fakecuda): only the GPU stage, on the fake device; the rest is
     * test_stage's. */
    const struct CMUnitTest fake[] = {cmocka_unit_test(test_gpu_stage)};
    return cmocka_run_group_tests(fake, setup, teardown);
#endif
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_two_stages_equal_whole_model),
        cmocka_unit_test(test_rows_listed_twice),
        cmocka_unit_test(test_unfit_sequence_fails_alone),
        cmocka_unit_test(test_rows_past_a_sequence_missing_here),
        cmocka_unit_test(test_step_memory_checked),
        cmocka_unit_test(test_plan_lists_sequence_twice),
        cmocka_unit_test(test_gpu_stage),
        cmocka_unit_test(test_one_stage_tiers_preempt),
        cmocka_unit_test(test_migrate),
        cmocka_unit_test(test_prefix_entries),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
