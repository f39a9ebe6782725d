/* proto/: generated messages through grpc_byte_buffer, malformed input, status mapping, bearer
 * tokens, the send-queue and status-line helpers of grpc_call.h, GenerateRequest validation,
 * strict UTF-8 and the credential file reader.
 *
 * With STRATA_PROTO_INTEROP_DIR set (tests/proto/check_python.sh does it), only the interop group
 * runs: it decodes messages Python serialized into that folder, compares them with the same
 * values built here, and writes its own encodings for Python to check. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <grpc/byte_buffer.h>
#include <grpc/grpc.h>
#include <grpc/slice.h>
#include <grpc/support/log.h>

#include "proto/credential_file.h"
#include "proto/grpc_call.h"
#include "proto/grpc_log.h"
#include "proto/grpc_util.h"
#include "proto/strata.pb-c.h"
#include "proto/strata_internal.pb-c.h"
#include "proto/validate.h"

#define MAX_MSG PROTO_DEFAULT_MAX_MESSAGE_BYTES

static int grpc_setup(void **state)
{
    (void)state;
    grpc_init();
    return 0;
}

static int grpc_teardown(void **state)
{
    (void)state;
    grpc_shutdown();
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Generic message walking through protobuf-c descriptors: deep equality and "every field set". */

static size_t elem_size(ProtobufCType t)
{
    switch (t) {
    case PROTOBUF_C_TYPE_INT32:
    case PROTOBUF_C_TYPE_SINT32:
    case PROTOBUF_C_TYPE_SFIXED32:
    case PROTOBUF_C_TYPE_UINT32:
    case PROTOBUF_C_TYPE_FIXED32:
    case PROTOBUF_C_TYPE_FLOAT: return 4;
    case PROTOBUF_C_TYPE_INT64:
    case PROTOBUF_C_TYPE_SINT64:
    case PROTOBUF_C_TYPE_SFIXED64:
    case PROTOBUF_C_TYPE_UINT64:
    case PROTOBUF_C_TYPE_FIXED64:
    case PROTOBUF_C_TYPE_DOUBLE: return 8;
    case PROTOBUF_C_TYPE_BOOL: return sizeof(protobuf_c_boolean);
    case PROTOBUF_C_TYPE_ENUM: return sizeof(int);
    case PROTOBUF_C_TYPE_STRING: return sizeof(char *);
    case PROTOBUF_C_TYPE_BYTES: return sizeof(ProtobufCBinaryData);
    case PROTOBUF_C_TYPE_MESSAGE: return sizeof(ProtobufCMessage *);
    }
    fail_msg("unknown protobuf-c type %d", (int)t);
    return 0;
}

static bool messages_equal(const ProtobufCMessage *a, const ProtobufCMessage *b);

static bool elem_equal(ProtobufCType t, const void *x, const void *y)
{
    switch (t) {
    case PROTOBUF_C_TYPE_STRING: {
        const char *s = *(char *const *)x, *u = *(char *const *)y;
        return strcmp(s ? s : "", u ? u : "") == 0;
    }
    case PROTOBUF_C_TYPE_BYTES: {
        const ProtobufCBinaryData *p = x, *q = y;
        return p->len == q->len && (p->len == 0 || memcmp(p->data, q->data, p->len) == 0);
    }
    case PROTOBUF_C_TYPE_MESSAGE:
        return messages_equal(*(ProtobufCMessage *const *)x, *(ProtobufCMessage *const *)y);
    default:
        /* Scalars compare bitwise: a round trip must reproduce floats exactly. */
        return memcmp(x, y, elem_size(t)) == 0;
    }
}

static bool messages_equal(const ProtobufCMessage *a, const ProtobufCMessage *b)
{
    if (!a || !b)
        return a == b;
    if (a->descriptor != b->descriptor)
        return false;
    const ProtobufCMessageDescriptor *d = a->descriptor;
    const char *pa = (const char *)a, *pb = (const char *)b;
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &d->fields[i];
        if (f->label == PROTOBUF_C_LABEL_REPEATED) {
            size_t na = *(const size_t *)(pa + f->quantifier_offset);
            size_t nb = *(const size_t *)(pb + f->quantifier_offset);
            if (na != nb)
                return false;
            const char *ea = *(char *const *)(pa + f->offset), *eb = *(char *const *)(pb + f->offset);
            for (size_t k = 0; k < na; k++)
                if (!elem_equal(f->type, ea + k * elem_size(f->type), eb + k * elem_size(f->type)))
                    return false;
            continue;
        }
        if (f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) {
            uint32_t ca = *(const uint32_t *)(pa + f->quantifier_offset);
            uint32_t cb = *(const uint32_t *)(pb + f->quantifier_offset);
            if (ca != cb)
                return false;
            if (ca != f->id)
                continue;
        }
        if (!elem_equal(f->type, pa + f->offset, pb + f->offset))
            return false;
    }
    return true;
}

/* Descriptors seen by all_fields_set, to prove every message type was exercised. */
static const ProtobufCMessageDescriptor *seen[64];
static size_t n_seen;

static void mark_seen(const ProtobufCMessageDescriptor *d)
{
    for (size_t i = 0; i < n_seen; i++)
        if (seen[i] == d)
            return;
    assert_true(n_seen < sizeof seen / sizeof seen[0]);
    seen[n_seen++] = d;
}

static bool elem_set(ProtobufCType t, const void *x);

/* True when every field of m (and of its sub-messages) differs from its default, oneofs counting
 * only their chosen member: a round trip of such a message exercises every field. */
static bool all_fields_set(const ProtobufCMessage *m)
{
    if (!m)
        return false;
    const ProtobufCMessageDescriptor *d = m->descriptor;
    mark_seen(d);
    const char *p = (const char *)m;
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &d->fields[i];
        bool ok;
        if (f->label == PROTOBUF_C_LABEL_REPEATED) {
            size_t n = *(const size_t *)(p + f->quantifier_offset);
            const char *e = *(char *const *)(p + f->offset);
            ok = n > 0;
            for (size_t k = 0; ok && k < n; k++)
                ok = f->type != PROTOBUF_C_TYPE_MESSAGE || elem_set(f->type, e + k * elem_size(f->type));
        } else if (f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) {
            uint32_t c = *(const uint32_t *)(p + f->quantifier_offset);
            if (c == 0) {
                print_error("%s: oneof with %s not set\n", d->name, f->name);
                return false;
            }
            if (c != f->id)
                continue;
            ok = elem_set(f->type, p + f->offset);
        } else {
            ok = elem_set(f->type, p + f->offset);
        }
        if (!ok) {
            print_error("%s.%s is not set\n", d->name, f->name);
            return false;
        }
    }
    return true;
}

static bool elem_set(ProtobufCType t, const void *x)
{
    switch (t) {
    case PROTOBUF_C_TYPE_STRING: {
        const char *s = *(char *const *)x;
        return s && *s;
    }
    case PROTOBUF_C_TYPE_BYTES: return ((const ProtobufCBinaryData *)x)->len > 0;
    case PROTOBUF_C_TYPE_MESSAGE: return all_fields_set(*(ProtobufCMessage *const *)x);
    default: {
        static const unsigned char zero[8];
        return memcmp(x, zero, elem_size(t)) != 0;
    }
    }
}

/* ---------------------------------------------------------------------------------------------
 * Sample messages with every field set (values chosen to need multi-byte varints, non-ASCII
 * text, 64-bit extremes). */

static uint32_t req_stop_ids[] = {2, 128001};
static char *req_stops[] = {"\n\n", "END"};
static uint32_t req_token_ids[] = {1, 0, 4294967295u, 300};

static void fill_sampling(Strata__V1__SamplingParams *s)
{
    strata__v1__sampling_params__init(s);
    s->temperature = 0.7f;
    s->top_p = 0.9f;
    s->top_k = 40;
    s->seed = UINT64_MAX;
    s->max_tokens = 128;
    s->n_stop = 2;
    s->stop = req_stops;
    s->n_stop_token_ids = 2;
    s->stop_token_ids = req_stop_ids;
    s->ignore_eos = 1;
}

/* The interop request (tests/proto/interop.py builds the same one). */
static void fill_generate_text(Strata__V1__GenerateRequest *r, Strata__V1__SamplingParams *s)
{
    strata__v1__generate_request__init(r);
    fill_sampling(s);
    r->request_id = "req-42";
    r->input_case = STRATA__V1__GENERATE_REQUEST__INPUT_TEXT;
    r->text = "Gr\xc3\xbc\xc3\x9f" "e, \xe4\xb8\x96\xe7\x95\x8c! \xf0\x9f\x98\x80\nline2";
    r->sampling = s;
    r->kv_codec = "0-9:tada4,10-29:tada2";
}

static void fill_generate_tokens(Strata__V1__GenerateRequest *r, Strata__V1__SamplingParams *s,
                                 Strata__V1__TokenIds *t)
{
    fill_generate_text(r, s);
    strata__v1__token_ids__init(t);
    t->n_ids = sizeof req_token_ids / sizeof req_token_ids[0];
    t->ids = req_token_ids;
    r->input_case = STRATA__V1__GENERATE_REQUEST__INPUT_TOKEN_IDS;
    r->text = NULL;
    r->token_ids = t;
}

static void check_roundtrip(const ProtobufCMessage *m)
{
    assert_true(all_fields_set(m));
    strata_error err = {0};
    grpc_byte_buffer *bb = NULL;
    assert_int_equal(proto_pack(m, MAX_MSG, &bb, &err), STRATA_OK);
    assert_non_null(bb);
    assert_int_equal(grpc_byte_buffer_length(bb), protobuf_c_message_get_packed_size(m));
    ProtobufCMessage *back = NULL;
    assert_int_equal(proto_unpack(bb, m->descriptor, MAX_MSG, &back, &err), STRATA_OK);
    grpc_byte_buffer_destroy(bb);
    assert_non_null(back);
    assert_true(messages_equal(m, back));
    protobuf_c_message_free_unpacked(back, NULL);
}

static void test_roundtrip_public(void **state)
{
    (void)state;
    Strata__V1__SamplingParams sp;
    Strata__V1__GenerateRequest gr;
    Strata__V1__TokenIds tid;
    fill_generate_text(&gr, &sp);
    check_roundtrip(&gr.base);
    fill_generate_tokens(&gr, &sp, &tid);
    check_roundtrip(&gr.base);

    uint32_t chunk_ids[] = {9, 10, 70000};
    Strata__V1__Chunk chunk = STRATA__V1__CHUNK__INIT;
    chunk.n_token_ids = 3;
    chunk.token_ids = chunk_ids;
    chunk.text = "\xc3\xa9t\xc3\xa9";
    Strata__V1__GenerateResponse resp = STRATA__V1__GENERATE_RESPONSE__INIT;
    resp.request_id = "req-42";
    resp.kind_case = STRATA__V1__GENERATE_RESPONSE__KIND_CHUNK;
    resp.chunk = &chunk;
    check_roundtrip(&resp.base);

    Strata__V1__Complete done = STRATA__V1__COMPLETE__INIT;
    done.finish_reason = STRATA__V1__FINISH_REASON__FINISH_REASON_LENGTH;
    done.prompt_tokens = 5;
    done.completion_tokens = 700;
    done.cached_tokens = 64;
    resp.kind_case = STRATA__V1__GENERATE_RESPONSE__KIND_COMPLETE;
    resp.complete = &done;
    check_roundtrip(&resp.base);

    Strata__V1__Error error = STRATA__V1__ERROR__INIT;
    error.code = GRPC_STATUS_UNAVAILABLE;
    error.message = "worker 2 lost";
    resp.kind_case = STRATA__V1__GENERATE_RESPONSE__KIND_ERROR;
    resp.error = &error;
    check_roundtrip(&resp.base);

    Strata__V1__AbortRequest ab = STRATA__V1__ABORT_REQUEST__INIT;
    ab.request_id = "req-42";
    check_roundtrip(&ab.base);
    Strata__V1__AbortResponse abr = STRATA__V1__ABORT_RESPONSE__INIT;
    abr.found = 1;
    check_roundtrip(&abr.base);

    Strata__V1__HealthRequest hq = STRATA__V1__HEALTH_REQUEST__INIT;
    check_roundtrip(&hq.base);
    Strata__V1__HealthResponse hr = STRATA__V1__HEALTH_RESPONSE__INIT;
    hr.status = STRATA__V1__SERVING_STATUS__SERVING_STATUS_NOT_SERVING;
    hr.workers_ready = 3;
    hr.workers_total = 4;
    check_roundtrip(&hr.base);

    Strata__V1__ModelInfoRequest mq = STRATA__V1__MODEL_INFO_REQUEST__INIT;
    check_roundtrip(&mq.base);
    Strata__V1__ModelInfo mi = STRATA__V1__MODEL_INFO__INIT;
    mi.name = "SmolLM2-135M-Instruct";
    mi.arch = "llama";
    mi.n_layers = 30;
    mi.n_embd = 576;
    mi.n_heads = 9;
    mi.n_kv_heads = 3;
    mi.head_dim = 64;
    mi.n_vocab = 49152;
    mi.n_ctx = 8192;
    mi.default_kv_codec = "kivi4";
    char *offered[] = {"fp16", "0-14:kivi4,15-29:kivi2"};
    mi.n_kv_codecs = 2;
    mi.kv_codecs = offered;
    mi.replicas = 2;
    mi.stages_per_replica = 4;
    uint32_t stage_layers[] = {9, 9, 8, 4};
    mi.n_stage_layers = 4;
    mi.stage_layers = stage_layers;
    mi.block_tokens = 64;
    check_roundtrip(&mi.base);

    Strata__V1__StatsRequest sq = STRATA__V1__STATS_REQUEST__INIT;
    check_roundtrip(&sq.base);
    Strata__V1__DrainWorkerRequest dq = STRATA__V1__DRAIN_WORKER_REQUEST__INIT;
    dq.worker_name = "node3-gpu1";
    check_roundtrip(&dq.base);
    Strata__V1__DrainWorkerResponse dr = STRATA__V1__DRAIN_WORKER_RESPONSE__INIT;
    dr.done = 1;
    dr.replica = 1;
    dr.moved = 12;
    dr.remaining = 3;
    dr.failed = 1;
    dr.message = "replica 1 drained: 12 moved, 1 failed";
    check_roundtrip(&dr.base);
    Strata__V1__TierStats t0 = STRATA__V1__TIER_STATS__INIT, t1 = STRATA__V1__TIER_STATS__INIT;
    t0.name = "device";
    t0.blocks = 1000;
    t0.bytes = (uint64_t)3 << 30;
    t0.capacity_bytes = (uint64_t)80 << 30;
    t1.name = "nvme";
    t1.blocks = 1;
    t1.bytes = 1;
    t1.capacity_bytes = (uint64_t)1 << 40;
    Strata__V1__TierStats *tiers[] = {&t0, &t1};
    Strata__V1__Stats st = STRATA__V1__STATS__INIT;
    st.n_tiers = 2;
    st.tiers = tiers;
    st.kv_bytes_per_token = 3456.25;
    st.queue_depth = 7;
    st.running = 32;
    st.spills = 11;
    st.restores = 12;
    st.crc_failures = 1;
    st.requests_total = 1u << 20;
    st.tokens_generated = UINT64_MAX - 1;
    st.spill_failures = 3;
    st.restore_failures = 2;
    st.prefix_cache_entries = 4;
    st.prefix_cache_bytes = (uint64_t)3 << 30;
    st.prefix_cache_hits = 9;
    st.prefix_cache_hit_tokens = 1u << 21;
    st.requests_recovered = 3;
    check_roundtrip(&st.base);
}

static uint8_t proof_bytes[] = {0x00, 0x01, 'p', 'r', 'o', 'o', 'f', 0xff};
static uint8_t nonce_bytes[] = {0xfe, 'n', 'o', 'n', 'c', 'e', 0x00};

static void fill_join(Strata__Internal__V1__Join *j)
{
    strata__internal__v1__join__init(j);
    j->secret_proof.len = sizeof proof_bytes;
    j->secret_proof.data = proof_bytes;
    j->worker_nonce.len = sizeof nonce_bytes;
    j->worker_nonce.data = nonce_bytes;
    j->worker_name = "node1-gpu0";
    j->device = "cuda:0";
    j->device_kv_bytes = (uint64_t)60 << 30;
    j->host_kv_bytes = (uint64_t)200 << 30;
    j->nvme_kv_bytes = (uint64_t)1 << 40;
    j->data_addr = "10.0.0.2:7001";
    j->protocol_version = 3;
}

static uint32_t plan_tokens0[] = {1, 2, 3}, plan_tokens1[] = {5};
static uint64_t plan_free[] = {3}, plan_preempt[] = {4, 5}, plan_resume[] = {6}, plan_drop[] = {2, 1};
static Strata__Internal__V1__PrefixPark plan_park = {PROTOBUF_C_MESSAGE_INIT(&strata__internal__v1__prefix_park__descriptor),
                                                     .seq_id = 3, .n_tokens = 128};
static Strata__Internal__V1__PrefixPark *plan_parks[] = {&plan_park};

/* The interop step plan (tests/proto/interop.py builds the same one). */
static void fill_step_plan(Strata__Internal__V1__StepPlan *p, Strata__Internal__V1__SeqWork *w0,
                           Strata__Internal__V1__SeqWork *w1, Strata__Internal__V1__SeqWork **ws)
{
    strata__internal__v1__step_plan__init(p);
    strata__internal__v1__seq_work__init(w0);
    strata__internal__v1__seq_work__init(w1);
    w0->seq_id = 7;
    w0->n_tokens = 3;
    w0->tokens = plan_tokens0;
    w0->pos0 = 4096;
    w0->last_chunk_of_prompt = 1;
    w0->temperature = 0.5f;
    w0->top_p = 0.95f;
    w0->top_k = 20;
    w0->seed = 99;
    w0->sample = 1;
    w0->kv_plan = "kivi2";
    w0->prefix_entry = 3;
    w0->sampled_before = 17;
    w1->seq_id = 8;
    w1->n_tokens = 1;
    w1->tokens = plan_tokens1;
    w1->pos0 = 100;
    ws[0] = w0;
    ws[1] = w1;
    p->step = ((uint64_t)1 << 40) + 1;
    p->n_seqs = 2;
    p->seqs = ws;
    p->n_free_seqs = 1;
    p->free_seqs = plan_free;
    p->n_preempt_seqs = 2;
    p->preempt_seqs = plan_preempt;
    p->n_resume_seqs = 1;
    p->resume_seqs = plan_resume;
    p->n_park_prefixes = 1;
    p->park_prefixes = plan_parks;
    p->n_drop_prefixes = 2;
    p->drop_prefixes = plan_drop;
}

static void test_roundtrip_internal(void **state)
{
    (void)state;
    Strata__Internal__V1__WorkerMessage wm = STRATA__INTERNAL__V1__WORKER_MESSAGE__INIT;
    Strata__Internal__V1__Join join;
    fill_join(&join);
    wm.kind_case = STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_JOIN;
    wm.join = &join;
    check_roundtrip(&wm.base);

    Strata__Internal__V1__SeqResult r0 = STRATA__INTERNAL__V1__SEQ_RESULT__INIT;
    r0.seq_id = 7;
    r0.token = 49151;
    r0.status = STRATA_ECRC;
    r0.message = "block 3 of layer 12: crc mismatch";
    r0.prefix_failed = true;
    Strata__Internal__V1__SeqResult *rs[] = {&r0};
    Strata__Internal__V1__StepResult sr = STRATA__INTERNAL__V1__STEP_RESULT__INIT;
    sr.step = 12345;
    sr.n_results = 1;
    sr.results = rs;
    wm.kind_case = STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_STEP_RESULT;
    wm.step_result = &sr;
    check_roundtrip(&wm.base);

    Strata__Internal__V1__TierUsage tu = STRATA__INTERNAL__V1__TIER_USAGE__INIT;
    tu.name = "host";
    tu.blocks = 17;
    tu.bytes = 17 * 4096;
    tu.capacity_bytes = (uint64_t)64 << 30;
    Strata__Internal__V1__TierUsage *tus[] = {&tu};
    Strata__Internal__V1__KvReport kr = STRATA__INTERNAL__V1__KV_REPORT__INIT;
    kr.n_tiers = 1;
    kr.tiers = tus;
    kr.spills = 5;
    kr.restores = 4;
    kr.crc_failures = 2;
    kr.spill_failures = 6;
    kr.restore_failures = 1;
    kr.spill_error = "nvme tier: write of block 7 (/var/tmp/spill/slab-0000.kv): No space left on device";
    wm.kind_case = STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_KV_REPORT;
    wm.kv_report = &kr;
    check_roundtrip(&wm.base);

    Strata__Internal__V1__MigrateDone md = STRATA__INTERNAL__V1__MIGRATE_DONE__INIT;
    md.seq_id = 9;
    md.status = STRATA_EIO;
    md.message = "peer closed";
    wm.kind_case = STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_MIGRATE_DONE;
    wm.migrate_done = &md;
    check_roundtrip(&wm.base);

    Strata__Internal__V1__CoordinatorMessage cm = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__INIT;
    uint8_t nccl_id[128];
    for (size_t i = 0; i < sizeof nccl_id; i++)
        nccl_id[i] = (uint8_t)(i * 37 + 1);
    char *addrs[] = {"10.0.0.1:7001", "10.0.0.2:7001"};
    Strata__Internal__V1__Assignment as = STRATA__INTERNAL__V1__ASSIGNMENT__INIT;
    as.model_path = "/models/m.gguf";
    as.layer_begin = 15;
    as.layer_end = 30;
    as.n_layers_total = 30;
    as.replica = 1;
    as.stage = 1;
    as.n_stages = 2;
    as.nccl_unique_id.len = sizeof nccl_id;
    as.nccl_unique_id.data = nccl_id;
    as.n_stage_data_addrs = 2;
    as.stage_data_addrs = addrs;
    as.kv_plan = "0-14:tada4,15-29:tada2";
    char *others[] = {"fp16", "kivi2"};
    as.n_kv_plans = 2;
    as.kv_plans = others;
    as.block_tokens = 64;
    as.max_seq_tokens = 131072;
    as.device_kv_bytes = (uint64_t)40 << 30;
    as.host_kv_bytes = (uint64_t)100 << 30;
    as.nvme_kv_bytes = (uint64_t)500 << 30;
    as.max_batch_seqs = 256;
    as.max_batch_tokens = 8192;
    as.worker_id = 3;
    as.step_timeout_ms = 600000;
    cm.kind_case = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_ASSIGNMENT;
    cm.assignment = &as;
    check_roundtrip(&cm.base);

    Strata__Internal__V1__StepPlan plan;
    Strata__Internal__V1__SeqWork w0, w1, *ws[2];
    fill_step_plan(&plan, &w0, &w1, ws);
    w1 = w0; /* every field set in both entries for the all-fields check */
    w1.seq_id = 8;
    cm.kind_case = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_STEP_PLAN;
    cm.step_plan = &plan;
    check_roundtrip(&cm.base);

    Strata__Internal__V1__Migrate mg = STRATA__INTERNAL__V1__MIGRATE__INIT;
    mg.seq_id = 7;
    mg.peer_data_addr = "10.0.0.3:7001";
    mg.send = 1;
    cm.kind_case = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_MIGRATE;
    cm.migrate = &mg;
    check_roundtrip(&cm.base);

    Strata__Internal__V1__Shutdown sd = STRATA__INTERNAL__V1__SHUTDOWN__INIT;
    sd.drain = 1;
    cm.kind_case = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_SHUTDOWN;
    cm.shutdown = &sd;
    check_roundtrip(&cm.base);
}

/* Runs after both round-trip tests: every message type of both files went through. */
static void test_roundtrip_covered_every_message(void **state)
{
    (void)state;
    static const ProtobufCMessageDescriptor *const all[] = {
        &strata__v1__generate_request__descriptor,
        &strata__v1__token_ids__descriptor,
        &strata__v1__sampling_params__descriptor,
        &strata__v1__generate_response__descriptor,
        &strata__v1__chunk__descriptor,
        &strata__v1__complete__descriptor,
        &strata__v1__error__descriptor,
        &strata__v1__abort_request__descriptor,
        &strata__v1__abort_response__descriptor,
        &strata__v1__health_request__descriptor,
        &strata__v1__health_response__descriptor,
        &strata__v1__model_info_request__descriptor,
        &strata__v1__model_info__descriptor,
        &strata__v1__stats_request__descriptor,
        &strata__v1__tier_stats__descriptor,
        &strata__v1__stats__descriptor,
        &strata__v1__drain_worker_request__descriptor,
        &strata__v1__drain_worker_response__descriptor,
        &strata__internal__v1__worker_message__descriptor,
        &strata__internal__v1__join__descriptor,
        &strata__internal__v1__step_result__descriptor,
        &strata__internal__v1__seq_result__descriptor,
        &strata__internal__v1__kv_report__descriptor,
        &strata__internal__v1__tier_usage__descriptor,
        &strata__internal__v1__migrate_done__descriptor,
        &strata__internal__v1__coordinator_message__descriptor,
        &strata__internal__v1__assignment__descriptor,
        &strata__internal__v1__step_plan__descriptor,
        &strata__internal__v1__seq_work__descriptor,
        &strata__internal__v1__prefix_park__descriptor,
        &strata__internal__v1__migrate__descriptor,
        &strata__internal__v1__shutdown__descriptor,
    };
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
        bool found = false;
        for (size_t k = 0; k < n_seen; k++)
            found |= seen[k] == all[i];
        if (!found)
            fail_msg("message %s was not round-tripped", all[i]->name);
    }
    assert_int_equal(n_seen, sizeof all / sizeof all[0]);
    /* Every method of both services takes and returns one of these. */
    const ProtobufCServiceDescriptor *svcs[] = {&strata__v1__strata__descriptor,
                                                &strata__internal__v1__worker_control__descriptor};
    for (size_t s = 0; s < 2; s++)
        for (unsigned m = 0; m < svcs[s]->n_methods; m++) {
            bool in = false, out = false;
            for (size_t k = 0; k < n_seen; k++) {
                in |= seen[k] == svcs[s]->methods[m].input;
                out |= seen[k] == svcs[s]->methods[m].output;
            }
            assert_true(in && out);
        }
}

/* ---------------------------------------------------------------------------------------------
 * Pack / unpack failures. */

static void test_pack_limits_and_bad_args(void **state)
{
    (void)state;
    Strata__V1__SamplingParams sp;
    Strata__V1__GenerateRequest gr;
    fill_generate_text(&gr, &sp);
    size_t n = protobuf_c_message_get_packed_size(&gr.base);
    strata_error err = {0};
    grpc_byte_buffer *bb = (grpc_byte_buffer *)&err; /* must be reset to NULL on failure */
    assert_int_equal(proto_pack(&gr.base, n - 1, &bb, &err), STRATA_EFULL);
    assert_null(bb);
    assert_non_null(strstr(err.msg, "strata.v1.GenerateRequest"));
    assert_int_equal(proto_pack(&gr.base, n, &bb, &err), STRATA_OK);

    ProtobufCMessage *m = (ProtobufCMessage *)&err;
    assert_int_equal(proto_unpack(bb, &strata__v1__generate_request__descriptor, n - 1, &m, &err), STRATA_EFULL);
    assert_null(m);
    assert_non_null(strstr(err.msg, "above the limit"));
    assert_int_equal(proto_unpack(bb, &strata__v1__generate_request__descriptor, n, &m, &err), STRATA_OK);
    protobuf_c_message_free_unpacked(m, NULL);
    grpc_byte_buffer_destroy(bb);

    /* A repeated field with a count but no array would make protobuf-c read through NULL. */
    Strata__V1__TokenIds t = STRATA__V1__TOKEN_IDS__INIT;
    t.n_ids = 3;
    assert_int_equal(proto_pack(&t.base, MAX_MSG, &bb, &err), STRATA_EINVAL);
    assert_null(bb);
    assert_non_null(strstr(err.msg, "strata.v1.TokenIds"));
    /* The same one level down, inside a oneof member. */
    Strata__V1__GenerateRequest nested = STRATA__V1__GENERATE_REQUEST__INIT;
    nested.input_case = STRATA__V1__GENERATE_REQUEST__INPUT_TOKEN_IDS;
    nested.token_ids = &t;
    assert_int_equal(proto_pack(&nested.base, MAX_MSG, &bb, &err), STRATA_EINVAL);
    /* A NULL proto3 string is fine: protobuf-c packs it as empty. */
    Strata__V1__AbortRequest ab = STRATA__V1__ABORT_REQUEST__INIT;
    ab.request_id = NULL;
    assert_int_equal(proto_pack(&ab.base, MAX_MSG, &bb, &err), STRATA_OK);
    assert_int_equal(grpc_byte_buffer_length(bb), 0);
    grpc_byte_buffer_destroy(bb);

    assert_int_equal(proto_pack(NULL, MAX_MSG, &bb, &err), STRATA_EINVAL);
    assert_int_equal(proto_pack(&gr.base, MAX_MSG, NULL, &err), STRATA_EINVAL);
    assert_int_equal(proto_unpack(NULL, &strata__v1__generate_request__descriptor, MAX_MSG, &m, &err),
                     STRATA_EINVAL);
    assert_int_equal(proto_unpack_bytes("x", 1, NULL, MAX_MSG, &m, &err), STRATA_EINVAL);
    assert_int_equal(proto_unpack_bytes(NULL, 1, &strata__v1__generate_request__descriptor, MAX_MSG, &m, &err),
                     STRATA_EINVAL);

    /* An empty message packs to zero bytes and unpacks to all defaults, through gRPC too. */
    Strata__V1__HealthRequest hq = STRATA__V1__HEALTH_REQUEST__INIT;
    assert_int_equal(proto_pack(&hq.base, 0, &bb, &err), STRATA_OK);
    assert_int_equal(grpc_byte_buffer_length(bb), 0);
    assert_int_equal(proto_unpack(bb, &strata__v1__health_request__descriptor, 0, &m, &err), STRATA_OK);
    protobuf_c_message_free_unpacked(m, NULL);
    grpc_byte_buffer_destroy(bb);
    assert_int_equal(proto_unpack_bytes(NULL, 0, &strata__v1__generate_request__descriptor, 0, &m, &err),
                     STRATA_OK);
    assert_int_equal(((Strata__V1__GenerateRequest *)m)->input_case, STRATA__V1__GENERATE_REQUEST__INPUT__NOT_SET);
    protobuf_c_message_free_unpacked(m, NULL);

    /* A multi-slice buffer (as gRPC delivers large messages) is read whole. */
    uint8_t flat[1024];
    assert_true(n <= sizeof flat);
    assert_int_equal(protobuf_c_message_pack(&gr.base, flat), n);
    grpc_slice parts[3] = {grpc_slice_from_copied_buffer((const char *)flat, 5),
                           grpc_slice_from_copied_buffer((const char *)flat + 5, n / 2 - 5),
                           grpc_slice_from_copied_buffer((const char *)flat + n / 2, n - n / 2)};
    bb = grpc_raw_byte_buffer_create(parts, 3);
    for (int i = 0; i < 3; i++)
        grpc_slice_unref(parts[i]);
    assert_int_equal(proto_unpack(bb, &strata__v1__generate_request__descriptor, MAX_MSG, &m, &err), STRATA_OK);
    assert_true(messages_equal(&gr.base, m));
    protobuf_c_message_free_unpacked(m, NULL);
    grpc_byte_buffer_destroy(bb);
}

static grpc_byte_buffer *buffer_of(const void *data, size_t len)
{
    grpc_slice s = grpc_slice_from_copied_buffer(data, len);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    return bb;
}

/* Every prefix of a real encoding either fails with EFORMAT or, when it ends exactly at a field
 * boundary, is itself a valid message that re-encodes to that very prefix. Never anything else. */
static void check_truncations(const ProtobufCMessage *msg)
{
    size_t n = protobuf_c_message_get_packed_size(msg);
    uint8_t *full = malloc(n);
    assert_non_null(full);
    assert_int_equal(protobuf_c_message_pack(msg, full), n);
    size_t rejected = 0, accepted = 0;
    for (size_t len = 0; len < n; len++) {
        /* A fresh heap copy of exactly len bytes, so ASan flags any read past the end. */
        uint8_t *cut = malloc(len ? len : 1);
        assert_non_null(cut);
        memcpy(cut, full, len);
        grpc_byte_buffer *bb = buffer_of(cut, len);
        ProtobufCMessage *m = NULL;
        strata_error err = {0};
        int rc = proto_unpack(bb, msg->descriptor, MAX_MSG, &m, &err);
        /* The plain-bytes entry point agrees with the byte-buffer one. */
        ProtobufCMessage *m2 = NULL;
        int rc2 = proto_unpack_bytes(cut, len, msg->descriptor, MAX_MSG, &m2, NULL);
        assert_int_equal(rc2, rc);
        if (m2)
            protobuf_c_message_free_unpacked(m2, NULL);
        if (rc == STRATA_OK) {
            accepted++;
            size_t rn = protobuf_c_message_get_packed_size(m);
            assert_int_equal(rn, len);
            uint8_t *again = malloc(rn ? rn : 1);
            assert_non_null(again);
            protobuf_c_message_pack(m, again);
            assert_memory_equal(again, cut, len);
            free(again);
            protobuf_c_message_free_unpacked(m, NULL);
        } else {
            assert_int_equal(rc, STRATA_EFORMAT);
            assert_null(m);
            assert_non_null(strstr(err.msg, "malformed"));
            rejected++;
        }
        grpc_byte_buffer_destroy(bb);
        free(cut);
    }
    free(full);
    /* Most cuts land inside a field. */
    assert_true(rejected > accepted);
    assert_true(accepted >= 1); /* at least the empty prefix */
}

/* Fields the schema does not know are dropped at decoding, in the message and in the messages
 * it holds: protobuf-c keeps a record and a copy of each (a 4 MiB request of two-byte unknown
 * fields took ~120 MiB for its whole life). The known fields are intact. */
static void test_unknown_fields_dropped(void **state)
{
    (void)state;
    Strata__V1__TokenIds ids = STRATA__V1__TOKEN_IDS__INIT;
    uint32_t id_values[2] = {7, 9};
    ids.n_ids = 2;
    ids.ids = id_values;
    Strata__V1__SamplingParams sp = STRATA__V1__SAMPLING_PARAMS__INIT;
    sp.max_tokens = 5;
    /* A GenerateRequest {token_ids, sampling} written by hand with unknown fields (field 15,
     * varint 0: 0x78 0x00) appended at every level, inside each sub-message too. */
    enum { PAD = 1000 };
    uint8_t sub_ids[16 + 2 * PAD], sub_sp[16 + 2 * PAD];
    size_t n_ids = protobuf_c_message_pack(&ids.base, sub_ids), n_sp = protobuf_c_message_pack(&sp.base, sub_sp);
    for (size_t k = 0; k < PAD; k++) {
        sub_ids[n_ids++] = 0x78, sub_ids[n_ids++] = 0x00;
        sub_sp[n_sp++] = 0x78, sub_sp[n_sp++] = 0x00;
    }
    uint8_t buf[64 + 6 * PAD];
    size_t len = 0;
    buf[len++] = 0x1a;   /* token_ids: field 3, length-delimited */
    /* lengths below 16384 take two varint bytes */
    buf[len++] = (uint8_t)(0x80 | (n_ids & 0x7f)), buf[len++] = (uint8_t)(n_ids >> 7);
    memcpy(buf + len, sub_ids, n_ids), len += n_ids;
    buf[len++] = 0x22;   /* sampling: field 4 */
    buf[len++] = (uint8_t)(0x80 | (n_sp & 0x7f)), buf[len++] = (uint8_t)(n_sp >> 7);
    memcpy(buf + len, sub_sp, n_sp), len += n_sp;
    for (size_t k = 0; k < PAD; k++)
        buf[len++] = 0x78, buf[len++] = 0x00;
    ProtobufCMessage *m = NULL;
    strata_error err = {0};
    assert_int_equal(proto_unpack_bytes(buf, len, &strata__v1__generate_request__descriptor, MAX_MSG, &m, &err),
                     STRATA_OK);
    const Strata__V1__GenerateRequest *got = (const Strata__V1__GenerateRequest *)m;
    assert_int_equal(got->base.n_unknown_fields, 0);
    assert_int_equal(got->input_case, STRATA__V1__GENERATE_REQUEST__INPUT_TOKEN_IDS);
    assert_non_null(got->token_ids);
    assert_int_equal(got->token_ids->base.n_unknown_fields, 0);
    assert_int_equal(got->token_ids->n_ids, 2);
    assert_int_equal(got->token_ids->ids[1], 9);
    assert_non_null(got->sampling);
    assert_int_equal(got->sampling->base.n_unknown_fields, 0);
    assert_int_equal(got->sampling->max_tokens, 5);
    protobuf_c_message_free_unpacked(m, NULL);
}

/* protobuf-c hands strings over NUL-terminated: a string holding U+0000 would be cut there without
 * a word (a prompt losing its end, a stop string never matching). Decoding refuses it, at any
 * depth, naming the field; zeros elsewhere (ids, numbers) are fine. */
static void test_nul_in_strings_rejected(void **state)
{
    (void)state;
    static const struct {
        uint8_t wire[16];
        size_t len;
        const char *field;   /* NULL: accepted */
    } cases[] = {
        {{0x12, 0x05, 'a', 'b', 0x00, 'c', 'd'}, 7, "text"},
        {{0x12, 0x01, 0x00}, 3, "text"},
        {{0x0a, 0x02, 'r', 0x00, 0x12, 0x01, 'x'}, 7, "request_id"},
        {{0x12, 0x02, 'h', 'i', 0x22, 0x04, 0x32, 0x02, 'x', 0x00}, 10, "stop"},
        {{0x12, 0x02, 'h', 'i', 0x2a, 0x03, 'k', 0x00, '2'}, 9, "kv_codec"},
        {{0x12, 0x02, 'h', 'i'}, 4, NULL},
        {{0x1a, 0x04, 0x0a, 0x02, 0x00, 0x05, 0x22, 0x02, 0x28, 0x00}, 10, NULL},   /* ids 0, 5; max_tokens 0 */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        ProtobufCMessage *m = NULL;
        strata_error err = {0};
        int rc = proto_unpack_bytes(cases[i].wire, cases[i].len, &strata__v1__generate_request__descriptor, MAX_MSG,
                                    &m, &err);
        if (!cases[i].field) {
            if (rc != STRATA_OK)
                fail_msg("case %zu: %s", i, err.msg);
            protobuf_c_message_free_unpacked(m, NULL);
            continue;
        }
        assert_int_equal(rc, STRATA_EINVAL);
        assert_null(m);
        char want[64];
        snprintf(want, sizeof want, "field %s contains a NUL byte", cases[i].field);
        if (!strstr(err.msg, want))
            fail_msg("case %zu: expected '%s' in: %s", i, want, err.msg);
    }
}

static void test_truncated_messages_rejected(void **state)
{
    (void)state;
    Strata__V1__SamplingParams sp;
    Strata__V1__GenerateRequest gr;
    Strata__V1__TokenIds tid;
    fill_generate_text(&gr, &sp);
    check_truncations(&gr.base);
    fill_generate_tokens(&gr, &sp, &tid);
    check_truncations(&gr.base);
    Strata__Internal__V1__StepPlan plan;
    Strata__Internal__V1__SeqWork w0, w1, *ws[2];
    fill_step_plan(&plan, &w0, &w1, ws);
    Strata__Internal__V1__CoordinatorMessage cm = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__INIT;
    cm.kind_case = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_STEP_PLAN;
    cm.step_plan = &plan;
    check_truncations(&cm.base);
}

static void expect_format_error(const ProtobufCMessageDescriptor *d, const void *bytes, size_t len)
{
    ProtobufCMessage *m = NULL;
    strata_error err = {0};
    grpc_byte_buffer *bb = buffer_of(bytes, len);
    assert_int_equal(proto_unpack(bb, d, MAX_MSG, &m, &err), STRATA_EFORMAT);
    assert_null(m);
    assert_int_equal(err.code, STRATA_EFORMAT);
    grpc_byte_buffer_destroy(bb);
}

static void test_garbage_rejected(void **state)
{
    (void)state;
    const ProtobufCMessageDescriptor *gen = &strata__v1__generate_request__descriptor;
    expect_format_error(gen, "\x0f", 1);                   /* field 1, wire type 7 */
    expect_format_error(gen, "\x00", 1);                   /* field number 0 */
    expect_format_error(gen, "\x0a\x05" "ab", 4);          /* length 5, 2 bytes follow */
    expect_format_error(gen, "\x0a\xff\xff\xff\xff\x0f", 6); /* length 4 GiB */
    expect_format_error(gen, "\x30\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 12); /* 11-byte varint */
    expect_format_error(gen, "\x08\x01", 2);               /* request_id (string) sent as a varint */
    expect_format_error(gen, "\x22\x03\x0d\x00\x00", 5);   /* sampling: truncated fixed32 inside */
    expect_format_error(&strata__v1__stats__descriptor, "\x11\x00\x00", 3); /* truncated double */

    /* A buffer marked gzip-compressed whose bytes are not gzip. */
    grpc_slice s = grpc_slice_from_static_string("definitely not gzip");
    grpc_byte_buffer *bb = grpc_raw_compressed_byte_buffer_create(&s, 1, GRPC_COMPRESS_GZIP);
    ProtobufCMessage *m = NULL;
    strata_error err = {0};
    int rc = proto_unpack(bb, gen, MAX_MSG, &m, &err);
    assert_int_equal(rc, STRATA_EFORMAT);
    assert_null(m);
    grpc_byte_buffer_destroy(bb);

    /* Random bytes into every top-level type: a status, never a crash or leak (ASan). */
    const ProtobufCMessageDescriptor *tops[] = {gen,
                                                &strata__v1__generate_response__descriptor,
                                                &strata__v1__stats__descriptor,
                                                &strata__v1__model_info__descriptor,
                                                &strata__internal__v1__worker_message__descriptor,
                                                &strata__internal__v1__coordinator_message__descriptor};
    uint64_t x = 0x9e3779b97f4a7c15u;
    size_t ok = 0, bad = 0;
    for (int iter = 0; iter < 3000; iter++) {
        uint8_t buf[96];
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        size_t len = (size_t)(x % sizeof buf);
        for (size_t i = 0; i < len; i++) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            /* Bias towards small tags and lengths so some inputs get deep into the parser. */
            buf[i] = (uint8_t)((x & 3) == 0 ? (x >> 8) % 0x40 : x >> 24);
        }
        for (size_t t = 0; t < sizeof tops / sizeof tops[0]; t++) {
            m = NULL;
            rc = proto_unpack_bytes(buf, len, tops[t], MAX_MSG, &m, NULL);
            if (rc == STRATA_OK) {
                ok++;
                protobuf_c_message_free_unpacked(m, NULL);
            } else {
                assert_int_equal(rc, STRATA_EFORMAT);
                assert_null(m);
                bad++;
            }
        }
    }
    assert_true(bad > 0);
    (void)ok;
}

/* ---------------------------------------------------------------------------------------------
 * Status mapping. */

static void test_status_mapping(void **state)
{
    (void)state;
    static const struct {
        int strata;
        grpc_status_code grpc;
        const char *name;
    } table[] = {
        {STRATA_OK, GRPC_STATUS_OK, "OK"},
        {STRATA_EINVAL, GRPC_STATUS_INVALID_ARGUMENT, "INVALID_ARGUMENT"},
        {STRATA_ENOMEM, GRPC_STATUS_RESOURCE_EXHAUSTED, "RESOURCE_EXHAUSTED"},
        {STRATA_EIO, GRPC_STATUS_UNAVAILABLE, "UNAVAILABLE"},
        {STRATA_EFORMAT, GRPC_STATUS_INTERNAL, "INTERNAL"},
        {STRATA_ECRC, GRPC_STATUS_UNAVAILABLE, "UNAVAILABLE"},
        {STRATA_EFULL, GRPC_STATUS_RESOURCE_EXHAUSTED, "RESOURCE_EXHAUSTED"},
        {STRATA_EUNSUPPORTED, GRPC_STATUS_UNIMPLEMENTED, "UNIMPLEMENTED"},
        {-1, GRPC_STATUS_UNKNOWN, "UNKNOWN"},
        {1000, GRPC_STATUS_UNKNOWN, "UNKNOWN"},
    };
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) {
        assert_int_equal(proto_grpc_status(table[i].strata), table[i].grpc);
        assert_string_equal(proto_grpc_status_name(proto_grpc_status(table[i].strata)), table[i].name);
    }
    assert_string_equal(proto_grpc_status_name(GRPC_STATUS_CANCELLED), "CANCELLED");
    assert_string_equal(proto_grpc_status_name(GRPC_STATUS_DATA_LOSS), "DATA_LOSS");
    assert_string_equal(proto_grpc_status_name(GRPC_STATUS_UNAUTHENTICATED), "UNAUTHENTICATED");
    assert_string_equal(proto_grpc_status_name(GRPC_STATUS_PERMISSION_DENIED), "PERMISSION_DENIED");
    assert_string_equal(proto_grpc_status_name(17), "UNKNOWN_STATUS_CODE");
    assert_string_equal(proto_grpc_status_name(-1), "UNKNOWN_STATUS_CODE");
}

/* ---------------------------------------------------------------------------------------------
 * grpc_call.h: the parts that need no live call (the servers' tests drive the rest). */

static void test_call_helpers(void **state)
{
    (void)state;
    char line[8];
    proto_status_line(line, sizeof line, "a\r\nb");
    assert_string_equal(line, "a  b");
    proto_status_line(line, sizeof line, NULL);
    assert_string_equal(line, "");
    proto_status_line(line, sizeof line, "abcdefghij"); /* cut to cap - 1 */
    assert_string_equal(line, "abcdefg");
    proto_status_line(line, sizeof line, "abcdef\xc3\xa9"); /* a 2-byte character cut in half */
    assert_string_equal(line, "abcdef");
    proto_status_line(line, sizeof line, "ab\xff" "cd"); /* cut at the first bad byte */
    assert_string_equal(line, "ab");

    grpc_arg a = proto_int_arg(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, 77);
    assert_int_equal(a.type, GRPC_ARG_INTEGER);
    assert_string_equal(a.key, GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH);
    assert_int_equal(a.value.integer, 77);

    /* Queue bookkeeping: push, status once, drop, and a dead queue that starts nothing. */
    Strata__V1__AbortRequest req = STRATA__V1__ABORT_REQUEST__INIT;
    req.request_id = "r-1";
    proto_msg *m = NULL;
    strata_error err = {0};
    assert_int_equal(proto_msg_pack(&req.base, 3, &m, &err), STRATA_EFULL);
    assert_null(m);
    proto_sendq q;
    proto_sendq_init(&q, NULL, NULL);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(proto_msg_pack(&req.base, MAX_MSG, &m, &err), STRATA_OK);
        proto_sendq_push(&q, m);
    }
    assert_int_equal(q.queued, 3);
    assert_true(proto_sendq_set_status(&q, GRPC_STATUS_UNAVAILABLE, "bye"));
    assert_false(proto_sendq_set_status(&q, GRPC_STATUS_OK, NULL));
    assert_int_equal(q.status, GRPC_STATUS_UNAVAILABLE);
    assert_true(q.status_has_details);
    assert_int_equal(GRPC_SLICE_LENGTH(q.status_details), 3);
    q.dead = true;
    grpc_call_error e = GRPC_CALL_ERROR;
    assert_int_equal(proto_sendq_pump(&q, &e), PROTO_SENDQ_IDLE);
    assert_int_equal(e, GRPC_CALL_OK);
    assert_int_equal(q.queued, 0);
    assert_null(q.head);
    assert_false(q.status_started);
    assert_int_equal(proto_msg_pack(&req.base, MAX_MSG, &m, &err), STRATA_OK);
    proto_sendq_push(&q, m);
    proto_sendq_clear(&q);
    assert_int_equal(q.queued, 0);
    assert_int_equal(GRPC_SLICE_LENGTH(q.status_details), 0);
    proto_msg_free(NULL);
}

/* ---------------------------------------------------------------------------------------------
 * Metadata and bearer tokens. */

typedef struct md_set {
    grpc_metadata entries[4];
    grpc_metadata_array arr;
} md_set;

/* Builds a metadata array from key/value pairs (static strings; slices need no unref). */
static void md_build(md_set *s, size_t n, const char *const *kv)
{
    memset(s, 0, sizeof *s);
    assert_true(n <= 4);
    for (size_t i = 0; i < n; i++) {
        s->entries[i].key = grpc_slice_from_static_string(kv[2 * i]);
        s->entries[i].value = grpc_slice_from_static_string(kv[2 * i + 1]);
    }
    s->arr.count = n;
    s->arr.capacity = 4;
    s->arr.metadata = s->entries;
}

static bool bearer(size_t n, const char *const *kv, const char *token, const char **why)
{
    md_set s;
    md_build(&s, n, kv);
    return proto_bearer_ok(&s.arr, token, why);
}

static void test_metadata_and_bearer(void **state)
{
    (void)state;
    const char *why = NULL;
    const char *ok[] = {"user-agent", "grpc-c/1.51", "authorization", "Bearer s3cret-token"};
    assert_true(bearer(2, ok, "s3cret-token", &why));
    assert_null(why);

    const char *lower[] = {"authorization", "bearer s3cret-token"};
    assert_true(bearer(1, lower, "s3cret-token", NULL));
    const char *upper_key[] = {"Authorization", "BEARER s3cret-token"};
    assert_true(bearer(1, upper_key, "s3cret-token", NULL));

    const char *wrong[] = {"authorization", "Bearer s3cret-tokem"};
    assert_false(bearer(1, wrong, "s3cret-token", &why));
    assert_string_equal(why, "bearer token does not match");
    assert_null(strstr(why, "s3cret"));
    const char *prefix[] = {"authorization", "Bearer s3cret"};
    assert_false(bearer(1, prefix, "s3cret-token", &why));
    const char *longer[] = {"authorization", "Bearer s3cret-token2"};
    assert_false(bearer(1, longer, "s3cret-token", &why));
    const char *empty_tok[] = {"authorization", "Bearer "};
    assert_false(bearer(1, empty_tok, "s3cret-token", &why));
    const char *no_space[] = {"authorization", "Bearers3cret-token"};
    assert_false(bearer(1, no_space, "s3cret-token", &why));
    const char *basic[] = {"authorization", "Basic s3cret-token"};
    assert_false(bearer(1, basic, "s3cret-token", &why));
    assert_non_null(strstr(why, "not \"Bearer <token>\""));
    const char *bare[] = {"authorization", "s3cret-token"};
    assert_false(bearer(1, bare, "s3cret-token", &why));
    const char *shorter_than_scheme[] = {"authorization", "Bea"};
    assert_false(bearer(1, shorter_than_scheme, "s3cret-token", &why));

    const char *missing[] = {"user-agent", "x"};
    assert_false(bearer(1, missing, "s3cret-token", &why));
    assert_non_null(strstr(why, "missing"));
    assert_false(bearer(0, missing, "s3cret-token", &why));
    const char *twice[] = {"authorization", "Bearer s3cret-token", "authorization", "Bearer other"};
    assert_false(bearer(2, twice, "s3cret-token", &why));
    assert_non_null(strstr(why, "more than one"));
    /* No configured token never authenticates anyone, even an empty bearer. */
    assert_false(bearer(1, empty_tok, "", &why));
    assert_false(bearer(1, ok + 2, NULL, &why));
    assert_false(proto_bearer_ok(NULL, "s3cret-token", &why));

    /* proto_metadata_find itself. */
    md_set s;
    const char *kv[] = {"a", "1", "x-key", "first", "X-KEY", "second"};
    md_build(&s, 3, kv);
    const char *v;
    size_t len;
    assert_int_equal(proto_metadata_find(&s.arr, "x-key", &v, &len), 2);
    assert_int_equal(len, 5);
    assert_memory_equal(v, "first", 5);
    assert_int_equal(proto_metadata_find(&s.arr, "x-ke", &v, &len), 0);
    assert_null(v);
    assert_int_equal(len, 0);
    assert_int_equal(proto_metadata_find(&s.arr, "a", NULL, NULL), 1);
    assert_int_equal(proto_metadata_find(NULL, "a", &v, &len), 0);

    /* proto_secret_equal, including binary secrets with NULs. */
    assert_true(proto_secret_equal("abc", 3, "abc", 3));
    assert_false(proto_secret_equal("abd", 3, "abc", 3));
    assert_false(proto_secret_equal("ab", 2, "abc", 3));
    assert_false(proto_secret_equal("abc\0", 4, "abc", 3));
    assert_false(proto_secret_equal("", 0, "abc", 3));
    assert_false(proto_secret_equal(NULL, 3, "\0\0\0", 3));
    assert_true(proto_secret_equal(NULL, 0, NULL, 0));
    assert_true(proto_secret_equal("a\0b", 3, "a\0b", 3));
    assert_false(proto_secret_equal("a\0c", 3, "a\0b", 3));
}

/* ---------------------------------------------------------------------------------------------
 * UTF-8. */

/* Reference: decodes one sequence the slow, obvious way (value, then range and minimal-length
 * checks) and says whether s[0..n) is exactly one valid scalar value. */
static bool ref_utf8_one(const uint8_t *s, size_t n)
{
    if (n == 1)
        return s[0] < 0x80;
    size_t need;
    uint32_t cp;
    if ((s[0] & 0xE0) == 0xC0) {
        need = 2;
        cp = s[0] & 0x1F;
    } else if ((s[0] & 0xF0) == 0xE0) {
        need = 3;
        cp = s[0] & 0x0F;
    } else if ((s[0] & 0xF8) == 0xF0) {
        need = 4;
        cp = s[0] & 0x07;
    } else {
        return false;
    }
    if (n != need)
        return false;
    for (size_t i = 1; i < n; i++) {
        if ((s[i] & 0xC0) != 0x80)
            return false;
        cp = cp << 6 | (s[i] & 0x3F);
    }
    static const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
    return cp >= min_cp[n] && cp <= 0x10FFFF && !(cp >= 0xD800 && cp <= 0xDFFF);
}

static void test_utf8(void **state)
{
    (void)state;
    static const char *const good[] = {
        "", "a", "\x7f", "\xc2\x80", "\xdf\xbf", "\xe0\xa0\x80", "\xed\x9f\xbf", "\xee\x80\x80",
        "\xef\xbf\xbf", "\xf0\x90\x80\x80", "\xf4\x8f\xbf\xbf", "\xf0\x9f\x98\x80",
        "Gr\xc3\xbc\xc3\x9f" "e \xe4\xb8\x96\xe7\x95\x8c", "\xef\xbb\xbf" "bom",
    };
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++)
        assert_true(proto_utf8_valid(good[i], strlen(good[i])));
    assert_true(proto_utf8_valid("a\0b", 3)); /* U+0000 is UTF-8 */

    static const struct {
        const char *s;
        size_t bad_at;
    } bad[] = {
        {"\x80", 0},                 /* stray continuation */
        {"a\xbf", 1},
        {"\xc0\x80", 0},             /* overlong U+0000 */
        {"\xc1\xbf", 0},             /* overlong U+007F */
        {"\xe0\x80\x80", 0},         /* overlong 3-byte */
        {"\xe0\x9f\xbf", 0},         /* overlong U+07FF */
        {"\xf0\x80\x80\x80", 0},     /* overlong 4-byte */
        {"\xf0\x8f\xbf\xbf", 0},     /* overlong U+FFFF */
        {"\xed\xa0\x80", 0},         /* U+D800 */
        {"\xed\xbf\xbf", 0},         /* U+DFFF */
        {"\xed\xa0\xbd\xed\xb8\x80", 0}, /* CESU-8 surrogate pair */
        {"\xf4\x90\x80\x80", 0},     /* U+110000 */
        {"\xf5\x80\x80\x80", 0},
        {"\xf8\x88\x80\x80\x80", 0}, /* 5-byte form */
        {"\xfe", 0},
        {"\xff", 0},
        {"\xc2", 0},                 /* cut short */
        {"\xe2\x82", 0},
        {"\xf0\x9f\x98", 0},
        {"\xe2\x28\xa1", 0},         /* bad continuation */
        {"\xc2\x41", 0},
        {"\xf0\x9f\x98\x41", 0},
        {"ab\xe2\x82\xac\xe2\x82", 5},
        {"ok \xc3\xa9 \xc3", 6},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        size_t n = strlen(bad[i].s);
        assert_false(proto_utf8_valid(bad[i].s, n));
        if (proto_utf8_check(bad[i].s, n) != bad[i].bad_at)
            fail_msg("case %zu: first bad byte at %zu, expected %zu", i, proto_utf8_check(bad[i].s, n),
                     bad[i].bad_at);
    }

    /* Every code point encodes to valid UTF-8 unless it is a surrogate. */
    for (uint32_t cp = 0; cp <= 0x10FFFF; cp++) {
        uint8_t b[4];
        size_t n;
        if (cp < 0x80) {
            b[0] = (uint8_t)cp;
            n = 1;
        } else if (cp < 0x800) {
            b[0] = (uint8_t)(0xC0 | cp >> 6);
            b[1] = (uint8_t)(0x80 | (cp & 0x3F));
            n = 2;
        } else if (cp < 0x10000) {
            b[0] = (uint8_t)(0xE0 | cp >> 12);
            b[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
            b[2] = (uint8_t)(0x80 | (cp & 0x3F));
            n = 3;
        } else {
            b[0] = (uint8_t)(0xF0 | cp >> 18);
            b[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
            b[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
            b[3] = (uint8_t)(0x80 | (cp & 0x3F));
            n = 4;
        }
        bool surrogate = cp >= 0xD800 && cp <= 0xDFFF;
        if (proto_utf8_valid(b, n) == surrogate)
            fail_msg("U+%04X: validator says %d", cp, !surrogate ? 0 : 1);
    }

    /* Every 1-, 2- and 3-byte string agrees with the reference, and 4-byte strings over all lead
     * and second bytes with edge-case tails. */
    uint8_t b[4];
    for (unsigned x = 0; x < 256; x++) {
        b[0] = (uint8_t)x;
        assert_int_equal(proto_utf8_valid(b, 1), ref_utf8_one(b, 1));
        for (unsigned y = 0; y < 256; y++) {
            b[1] = (uint8_t)y;
            assert_int_equal(proto_utf8_valid(b, 2), ref_utf8_one(b, 2) || (x < 0x80 && y < 0x80));
            for (unsigned z = 0; z < 256; z++) {
                b[2] = (uint8_t)z;
                bool ref3 = ref_utf8_one(b, 3) || (x < 0x80 && y < 0x80 && z < 0x80) ||
                            (x < 0x80 && ref_utf8_one(b + 1, 2)) || (ref_utf8_one(b, 2) && z < 0x80);
                if (proto_utf8_valid(b, 3) != ref3)
                    fail_msg("%02x %02x %02x: expected %d", x, y, z, ref3);
            }
        }
    }
    static const uint8_t tails[] = {0x00, 0x7f, 0x80, 0x8f, 0x90, 0x9f, 0xa0, 0xbf, 0xc0, 0xff};
    for (unsigned x = 0xF0; x < 256; x++)
        for (unsigned y = 0; y < 256; y++)
            for (size_t i = 0; i < sizeof tails; i++)
                for (size_t k = 0; k < sizeof tails; k++) {
                    b[0] = (uint8_t)x;
                    b[1] = (uint8_t)y;
                    b[2] = tails[i];
                    b[3] = tails[k];
                    assert_int_equal(proto_utf8_valid(b, 4), ref_utf8_one(b, 4));
                }
}

/* ---------------------------------------------------------------------------------------------
 * GenerateRequest validation. */

typedef struct req_fixture {
    Strata__V1__GenerateRequest req;
    Strata__V1__SamplingParams sp;
    Strata__V1__TokenIds tids;
    proto_generate_limits lim;
} req_fixture;

static void fixture_init(req_fixture *f)
{
    fill_generate_text(&f->req, &f->sp);
    f->lim = proto_generate_limits_default(8192, 200000);
}

/* Expects rejection with STRATA_EINVAL and a message containing field. */
static void expect_reject(const req_fixture *f, const char *field)
{
    strata_error err = {0};
    int rc = proto_validate_generate(&f->req, &f->lim, &err);
    if (rc != STRATA_EINVAL)
        fail_msg("expected EINVAL naming %s, got %d", field, rc);
    assert_int_equal(err.code, STRATA_EINVAL);
    if (!strstr(err.msg, field))
        fail_msg("message \"%s\" does not name %s", err.msg, field);
}

static void expect_accept(const req_fixture *f)
{
    strata_error err = {0};
    int rc = proto_validate_generate(&f->req, &f->lim, &err);
    if (rc != STRATA_OK)
        fail_msg("rejected: %s", err.msg);
}

static void test_validate_request_id_and_input(void **state)
{
    (void)state;
    req_fixture f;
    fixture_init(&f);
    expect_accept(&f);
    assert_int_equal(proto_validate_generate(NULL, &f.lim, NULL), STRATA_EINVAL);
    assert_int_equal(proto_validate_generate(&f.req, NULL, NULL), STRATA_EINVAL);

    /* request_id */
    char id[PROTO_MAX_REQUEST_ID_BYTES + 2];
    memset(id, 'x', sizeof id);
    id[PROTO_MAX_REQUEST_ID_BYTES] = '\0';
    f.req.request_id = id;
    expect_accept(&f);
    id[PROTO_MAX_REQUEST_ID_BYTES] = 'x';
    id[PROTO_MAX_REQUEST_ID_BYTES + 1] = '\0';
    expect_reject(&f, "request_id");
    f.req.request_id = "";
    expect_accept(&f); /* the server assigns one */
    f.req.request_id = NULL;
    expect_accept(&f);
    f.req.request_id = "!~azAZ09-_.:/";
    expect_accept(&f);
    static const char *const bad_ids[] = {"has space", "tab\t", "del\x7f", "caf\xc3\xa9", "nl\n"};
    for (size_t i = 0; i < sizeof bad_ids / sizeof bad_ids[0]; i++) {
        f.req.request_id = (char *)bad_ids[i];
        expect_reject(&f, "request_id");
    }
    f.req.request_id = "ok";
    assert_int_equal(proto_validate_request_id("", false, NULL), STRATA_EINVAL);
    assert_int_equal(proto_validate_request_id(NULL, false, NULL), STRATA_EINVAL);
    assert_int_equal(proto_validate_request_id("r1", false, NULL), STRATA_OK);

    /* input */
    f.req.input_case = STRATA__V1__GENERATE_REQUEST__INPUT__NOT_SET;
    expect_reject(&f, "input");
    f.req.input_case = STRATA__V1__GENERATE_REQUEST__INPUT_TEXT;
    f.req.text = "";
    expect_reject(&f, "input.text");
    f.req.text = "\xed\xa0\x80";
    expect_reject(&f, "input.text");
    f.req.text = "fine \xc3\xa9\xf0\x9f\x98\x80";
    expect_accept(&f);
    f.lim.max_text_bytes = 8;
    f.req.text = "12345678";
    expect_accept(&f);
    f.req.text = "123456789";
    expect_reject(&f, "input.text");
    f.lim = proto_generate_limits_default(8192, 200000);

    /* the default text limit: 1 MiB exactly passes, one more byte does not */
    size_t big = (size_t)1 << 20;
    char *text = malloc(big + 2);
    assert_non_null(text);
    memset(text, 'a', big + 1);
    text[big] = '\0';
    f.req.text = text;
    expect_accept(&f);
    text[big] = 'a';
    text[big + 1] = '\0';
    expect_reject(&f, "input.text");
    free(text);

    fill_generate_tokens(&f.req, &f.sp, &f.tids);
    f.lim.n_vocab = 0;
    expect_accept(&f); /* ids include 4294967295: fine with n_vocab unchecked */
    f.lim.n_vocab = 200000;
    expect_reject(&f, "input.token_ids[2]");
    uint32_t ids[4] = {0, 1, 199999, 5};
    f.tids.ids = ids;
    f.tids.n_ids = 4;
    expect_accept(&f);
    ids[2] = 200000;
    expect_reject(&f, "input.token_ids[2]");
    ids[2] = 7;
    f.lim.max_input_tokens = 4;
    expect_accept(&f);
    f.lim.max_input_tokens = 3;
    expect_reject(&f, "input.token_ids");
    f.lim.max_input_tokens = 100;
    f.tids.n_ids = 0;
    expect_reject(&f, "input.token_ids");
    f.req.token_ids = NULL;
    expect_reject(&f, "input.token_ids");
}

static void test_validate_sampling(void **state)
{
    (void)state;
    req_fixture f;
    fixture_init(&f);

    /* temperature */
    const float temps_ok[] = {0.0f, -0.0f, 1e-30f, 1.0f, 100.0f, 3.4e38f};
    for (size_t i = 0; i < sizeof temps_ok / sizeof temps_ok[0]; i++) {
        f.sp.temperature = temps_ok[i];
        expect_accept(&f);
    }
    const float temps_bad[] = {-1e-30f, -1.0f, NAN, INFINITY, -INFINITY};
    for (size_t i = 0; i < sizeof temps_bad / sizeof temps_bad[0]; i++) {
        f.sp.temperature = temps_bad[i];
        expect_reject(&f, "sampling.temperature");
    }
    f.sp.temperature = 0.7f;

    /* top_p: 0 (unset) and (0, 1] accepted */
    const float top_ok[] = {0.0f, 1e-6f, 0.5f, 1.0f};
    for (size_t i = 0; i < sizeof top_ok / sizeof top_ok[0]; i++) {
        f.sp.top_p = top_ok[i];
        expect_accept(&f);
    }
    const float top_bad[] = {-0.1f, 1.0001f, 2.0f, NAN, INFINITY};
    for (size_t i = 0; i < sizeof top_bad / sizeof top_bad[0]; i++) {
        f.sp.top_p = top_bad[i];
        expect_reject(&f, "sampling.top_p");
    }
    f.sp.top_p = 0.9f;
    assert_true(proto_effective_top_p(0.0f) == 1.0f);
    assert_true(proto_effective_top_p(0.25f) == 0.25f);

    /* max_tokens in 1..limit */
    f.sp.max_tokens = 0;
    expect_reject(&f, "sampling.max_tokens");
    f.sp.max_tokens = 1;
    expect_accept(&f);
    f.sp.max_tokens = 8192;
    expect_accept(&f);
    f.sp.max_tokens = 8193;
    expect_reject(&f, "sampling.max_tokens");
    f.sp.max_tokens = UINT32_MAX;
    expect_reject(&f, "sampling.max_tokens");
    f.sp.max_tokens = 16;

    /* no sampling message at all: all zeros, so max_tokens is missing */
    f.req.sampling = NULL;
    expect_reject(&f, "sampling.max_tokens");
    f.req.sampling = &f.sp;

    /* stop strings: count, empty, length, UTF-8 */
    char *stops[17];
    for (size_t i = 0; i < 17; i++)
        stops[i] = "s";
    f.sp.stop = stops;
    f.sp.n_stop = 16;
    expect_accept(&f);
    f.sp.n_stop = 17;
    expect_reject(&f, "sampling.stop");
    f.sp.n_stop = 3;
    stops[2] = "";
    expect_reject(&f, "sampling.stop[2]");
    char long_stop[258];
    memset(long_stop, 'z', 256);
    long_stop[256] = '\0';
    stops[2] = long_stop;
    expect_accept(&f);
    long_stop[256] = 'z';
    long_stop[257] = '\0';
    expect_reject(&f, "sampling.stop[2]");
    stops[2] = "\xc3";
    expect_reject(&f, "sampling.stop[2]");
    stops[2] = "\xe2\x80\x94";
    expect_accept(&f);
    f.sp.stop = NULL;
    expect_reject(&f, "sampling.stop");
    f.sp.n_stop = 0;
    expect_accept(&f);

    /* stop token ids: count and vocabulary */
    uint32_t sids[65] = {0};
    f.sp.stop_token_ids = sids;
    f.sp.n_stop_token_ids = 64;
    expect_accept(&f);
    f.sp.n_stop_token_ids = 65;
    expect_reject(&f, "sampling.stop_token_ids");
    f.sp.n_stop_token_ids = 2;
    sids[1] = 199999;
    expect_accept(&f);
    sids[1] = 200000;
    expect_reject(&f, "sampling.stop_token_ids[1]");
    f.lim.n_vocab = 0;
    expect_accept(&f);

    /* top_k, seed and ignore_eos take any value */
    f.sp.top_k = UINT32_MAX;
    f.sp.seed = 0;
    f.sp.ignore_eos = 0;
    expect_accept(&f);
}

static void test_validate_kv_codec(void **state)
{
    (void)state;
    req_fixture f;
    fixture_init(&f);
    static const char *const ok[] = {"", "kivi2", "fp16", "tada", "gear4-s1.5-p8", "0-9:tada4,10-29:tada2",
                                     "ott2-n3-a32"};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        f.req.kv_codec = (char *)ok[i];
        expect_accept(&f);
    }
    f.req.kv_codec = NULL;
    expect_accept(&f);
    static const char *const bad[] = {"../plan.txt", "/etc/passwd", "plan.txt ", "Kivi2", "kivi2\n",
                                      "~/p", "0-9:tada4;rm", "kivi2#x", "k\xc3\xa9"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        f.req.kv_codec = (char *)bad[i];
        expect_reject(&f, "kv_codec");
    }
    char codec[1026];
    memset(codec, 'a', sizeof codec);
    codec[1024] = '\0';
    f.req.kv_codec = codec;
    expect_accept(&f);
    codec[1024] = 'a';
    codec[1025] = '\0';
    expect_reject(&f, "kv_codec");
}

/* A request that went through the wire is validated the same (the server's real order:
 * unpack, then validate). */
static void test_validate_after_unpack(void **state)
{
    (void)state;
    Strata__V1__SamplingParams sp;
    Strata__V1__GenerateRequest gr;
    fill_generate_text(&gr, &sp);
    grpc_byte_buffer *bb;
    strata_error err = {0};
    assert_int_equal(proto_pack(&gr.base, MAX_MSG, &bb, &err), STRATA_OK);
    ProtobufCMessage *m;
    assert_int_equal(proto_unpack(bb, &strata__v1__generate_request__descriptor, MAX_MSG, &m, &err), STRATA_OK);
    grpc_byte_buffer_destroy(bb);
    proto_generate_limits lim = proto_generate_limits_default(8192, 200000);
    assert_int_equal(proto_validate_generate((Strata__V1__GenerateRequest *)m, &lim, &err), STRATA_OK);
    protobuf_c_message_free_unpacked(m, NULL);

    /* A text field holding invalid UTF-8 arrives intact (protobuf-c does not check) and is
     * caught by validation. */
    gr.text = "bad \xc0\xaf";
    assert_int_equal(proto_pack(&gr.base, MAX_MSG, &bb, &err), STRATA_OK);
    assert_int_equal(proto_unpack(bb, &strata__v1__generate_request__descriptor, MAX_MSG, &m, &err), STRATA_OK);
    grpc_byte_buffer_destroy(bb);
    assert_int_equal(proto_validate_generate((Strata__V1__GenerateRequest *)m, &lim, &err), STRATA_EINVAL);
    assert_non_null(strstr(err.msg, "input.text is not valid UTF-8 (byte 0xc0 at offset 4)"));
    protobuf_c_message_free_unpacked(m, NULL);
}

/* ---------------------------------------------------------------------------------------------
 * Interop with Python's protobuf (only under tests/proto/check_python.sh). */

static const char *interop_dir(void)
{
    return getenv("STRATA_PROTO_INTEROP_DIR");
}

static uint8_t *read_whole(const char *name, size_t *len)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", interop_dir(), name);
    FILE *fp = fopen(path, "rb");
    if (!fp)
        fail_msg("cannot open %s", path);
    uint8_t *buf = malloc(1 << 16);
    assert_non_null(buf);
    *len = fread(buf, 1, 1 << 16, fp);
    assert_true(*len < (1 << 16));
    fclose(fp);
    return buf;
}

static void write_whole(const char *name, const ProtobufCMessage *m)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", interop_dir(), name);
    size_t n = protobuf_c_message_get_packed_size(m);
    uint8_t *buf = malloc(n ? n : 1);
    assert_non_null(buf);
    assert_int_equal(protobuf_c_message_pack(m, buf), n);
    FILE *fp = fopen(path, "wb");
    if (!fp)
        fail_msg("cannot create %s", path);
    assert_int_equal(fwrite(buf, 1, n, fp), n);
    assert_int_equal(fclose(fp), 0);
    free(buf);
}

/* Decodes py_<name> through a grpc_byte_buffer, compares it with expected, writes c_<name>. */
static void interop_one(const char *name, const ProtobufCMessage *expected)
{
    char file[256];
    snprintf(file, sizeof file, "py_%s", name);
    size_t len;
    uint8_t *bytes = read_whole(file, &len);
    grpc_byte_buffer *bb = buffer_of(bytes, len);
    free(bytes);
    ProtobufCMessage *m = NULL;
    strata_error err = {0};
    assert_int_equal(proto_unpack(bb, expected->descriptor, MAX_MSG, &m, &err), STRATA_OK);
    grpc_byte_buffer_destroy(bb);
    if (!messages_equal(expected, m))
        fail_msg("%s: Python's encoding decodes to a different message", name);
    protobuf_c_message_free_unpacked(m, NULL);
    snprintf(file, sizeof file, "c_%s", name);
    write_whole(file, expected);
}

static void test_interop_python(void **state)
{
    (void)state;
    Strata__V1__SamplingParams sp;
    Strata__V1__GenerateRequest gr;
    Strata__V1__TokenIds tid;
    fill_generate_text(&gr, &sp);
    interop_one("generate_request_text.bin", &gr.base);
    proto_generate_limits lim = proto_generate_limits_default(8192, 200000);
    strata_error err = {0};
    assert_int_equal(proto_validate_generate(&gr, &lim, &err), STRATA_OK);

    fill_generate_tokens(&gr, &sp, &tid);
    gr.request_id = "";
    Strata__V1__SamplingParams only_max = STRATA__V1__SAMPLING_PARAMS__INIT;
    only_max.max_tokens = 1;
    gr.sampling = &only_max;
    gr.kv_codec = "";
    interop_one("generate_request_tokens.bin", &gr.base);

    Strata__V1__Complete done = STRATA__V1__COMPLETE__INIT;
    done.finish_reason = STRATA__V1__FINISH_REASON__FINISH_REASON_LENGTH;
    done.prompt_tokens = 5;
    done.completion_tokens = 7;
    Strata__V1__GenerateResponse resp = STRATA__V1__GENERATE_RESPONSE__INIT;
    resp.request_id = "r";
    resp.kind_case = STRATA__V1__GENERATE_RESPONSE__KIND_COMPLETE;
    resp.complete = &done;
    interop_one("generate_response_complete.bin", &resp.base);

    Strata__Internal__V1__StepPlan plan;
    Strata__Internal__V1__SeqWork w0, w1, *ws[2];
    fill_step_plan(&plan, &w0, &w1, ws);
    Strata__Internal__V1__CoordinatorMessage cm = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__INIT;
    cm.kind_case = STRATA__INTERNAL__V1__COORDINATOR_MESSAGE__KIND_STEP_PLAN;
    cm.step_plan = &plan;
    interop_one("coordinator_step_plan.bin", &cm.base);

    Strata__Internal__V1__Join join;
    fill_join(&join);
    Strata__Internal__V1__WorkerMessage wm = STRATA__INTERNAL__V1__WORKER_MESSAGE__INIT;
    wm.kind_case = STRATA__INTERNAL__V1__WORKER_MESSAGE__KIND_JOIN;
    wm.join = &join;
    interop_one("worker_join.bin", &wm.base);
}

/* credential_file_read: the bound is exact (max bytes read, max + 1 refused), only trailing CR/LF
 * go and only with trim, an empty file reads as empty, a missing file and a folder give the
 * system's reason, and a FIFO with a writer (process substitution) is read. */
static void write_file(const char *path, const char *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(data, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

/* Runs fn with stderr sent to a file; returns what it wrote (static buffer). */
static const char *stderr_of(void (*fn)(void))
{
    static char out[4096];
    fflush(stderr);
    FILE *f = tmpfile();
    assert_non_null(f);
    const int saved = dup(2);
    assert_true(saved >= 0);
    assert_int_equal(dup2(fileno(f), 2), 2);
    fn();
    fflush(stderr);
    assert_int_equal(dup2(saved, 2), 2);
    close(saved);
    rewind(f);
    const size_t n = fread(out, 1, sizeof out - 1, f);
    out[n] = '\0';
    fclose(f);
    return out;
}

static char captured_reason[256];

static void log_captured(void)
{
    proto_grpc_log_capture_begin();
    gpr_log(GPR_ERROR, "%s", "UNKNOWN:Name or service not known {file:\"error_utils.cc\", grpc_status:2}");
    gpr_log(GPR_ERROR, "%s", "UNKNOWN:a second line {}");   /* only the first is kept */
    proto_grpc_log_capture_end(captured_reason, sizeof captured_reason);
}

static void log_uncaptured(void)
{
    gpr_log("src/core/some_file.cc", 42, GPR_LOG_SEVERITY_ERROR, "%s", "a runtime error");
}

static void log_other(void)
{
    gpr_log("src/core/other.cc", 7, GPR_LOG_SEVERITY_ERROR, "%s", "another error");
}

static void log_stamped(void)   /* the same record, stamped a moment later */
{
    static int n;
    gpr_log("src/core/other.cc", 9, GPR_LOG_SEVERITY_ERROR, "UNKNOWN:failed {created_time:\"2026-12-07T17:24:15.%d\", "
            "file_line:9}", n++);
}

/* gRPC's log sink: the reasons in gRPC 1.51's own error texts (as it logged them for a taken
 * port, a host that does not resolve, a malformed address), a captured line kept off stderr and
 * turned into its reason, an uncaptured one printed once in the sink's format. */
static void test_grpc_log(void **state)
{
    (void)state;
    static const struct {
        const char *text, *want;
    } cases[] = {
        {"UNKNOWN:No address added out of total 1 resolved for '127.0.0.1:35867' {file:\"./src/core/ext/transport/"
         "chttp2/server/chttp2_server.cc\", file_line:960, children:[UNKNOWN:Unable to configure socket {fd:10, "
         "file_line:219, children:[UNKNOWN:Address already in use {file_line:193, errno:98, os_error:\"Address "
         "already in use\", syscall:\"bind\"}]}]}",
         "bind: Address already in use"},
        {"UNKNOWN:Name or service not known {file:\"./src/core/lib/transport/error_utils.cc\", file_line:153, "
         "grpc_status:2}",
         "Name or service not known"},
        {"UNKNOWN:unparseable host:port {grpc_status:2, file_line:153}", "unparseable host:port"},
        {"UNKNOWN:outer {children:[INTERNAL:inner reason {grpc_status:13}]}", "inner reason"},
        {"{os_error:\"Permission denied\"}", "Permission denied"},
        {"plain text", "plain text"},
        {"", ""},
    };
    char out[64];
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        proto_grpc_error_reason(cases[i].text, out, sizeof out);
        assert_string_equal(out, cases[i].want);
    }
    proto_grpc_error_reason(NULL, out, sizeof out);
    assert_string_equal(out, "");
    proto_grpc_error_reason("UNKNOWN:a reason longer than the room {}", out, 9);
    assert_string_equal(out, "a reason");
    proto_grpc_error_reason("x", NULL, 0);   /* no room: nothing written, no crash */

    proto_grpc_init();
    assert_string_equal(stderr_of(log_captured), "");
    assert_string_equal(captured_reason, "Name or service not known");
    char want[256];
    snprintf(want, sizeof want, "%s: gRPC error (some_file.cc:42): a runtime error\n", program_invocation_short_name);
    assert_string_equal(stderr_of(log_uncaptured), want);
    /* The same line again (gRPC retrying a connection): counted, not printed; the count comes
     * before the next different line. */
    assert_string_equal(stderr_of(log_uncaptured), "");
    assert_string_equal(stderr_of(log_uncaptured), "");
    snprintf(want, sizeof want, "%s: gRPC: the line before came 2 more times\n%s: gRPC error (other.cc:7): another error\n",
             program_invocation_short_name, program_invocation_short_name);
    assert_string_equal(stderr_of(log_other), want);
    /* Error records that differ only in their timestamps are the same line. */
    assert_non_null(strstr(stderr_of(log_stamped), "UNKNOWN:failed {created_time:\"2026-12-07T17:24:15.0\""));
    assert_string_equal(stderr_of(log_stamped), "");
    grpc_shutdown();
}

static void test_credential_file(void **state)
{
    (void)state;
    char dir[] = "/tmp/strata-cred-XXXXXX", path[128];
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/secret", dir);
    strata_error err = {0};
    char *out = NULL;
    size_t len = 99;

    write_file(path, "0123456789abcdef\r\n\n", 19);
    assert_int_equal(credential_file_read(path, 19, true, &out, &len, &err), STRATA_OK);
    assert_int_equal(len, 16);
    assert_string_equal(out, "0123456789abcdef");
    free(out);
    assert_int_equal(credential_file_read(path, 19, false, &out, &len, &err), STRATA_OK);
    assert_int_equal(len, 19);
    assert_memory_equal(out, "0123456789abcdef\r\n\n", 20);   /* with its NUL */
    free(out);
    assert_int_equal(credential_file_read(path, 18, true, &out, &len, &err), STRATA_EINVAL);
    assert_null(out);
    assert_string_equal(err.msg, "larger than 18 bytes");

    write_file(path, "\n in the middle\n stays\n", 23);
    assert_int_equal(credential_file_read(path, 64, true, &out, &len, &err), STRATA_OK);
    assert_string_equal(out, "\n in the middle\n stays");
    free(out);

    write_file(path, "", 0);
    assert_int_equal(credential_file_read(path, 64, true, &out, &len, &err), STRATA_OK);
    assert_int_equal(len, 0);
    assert_string_equal(out, "");
    free(out);

    assert_int_equal(credential_file_read(dir, 64, true, &out, &len, &err), STRATA_EIO);
    assert_null(out);
    assert_string_equal(err.msg, "Is a directory");
    unlink(path);
    assert_int_equal(credential_file_read(path, 64, true, &out, &len, &err), STRATA_EIO);
    assert_string_equal(err.msg, "No such file or directory");

    assert_int_equal(mkfifo(path, 0600), 0);
    const pid_t child = fork();
    assert_true(child >= 0);
    if (child == 0) {
        FILE *f = fopen(path, "wb");
        _exit(f && fputs("from a pipe\n", f) >= 0 && fclose(f) == 0 ? 0 : 1);
    }
    assert_int_equal(credential_file_read(path, 64, true, &out, &len, &err), STRATA_OK);
    assert_string_equal(out, "from a pipe");
    free(out);
    int status = -1;
    assert_int_equal(waitpid(child, &status, 0), child);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    unlink(path);
    assert_int_equal(rmdir(dir), 0);
}

int main(void)
{
    if (interop_dir()) {
        const struct CMUnitTest interop[] = {cmocka_unit_test(test_interop_python)};
        return cmocka_run_group_tests(interop, grpc_setup, grpc_teardown);
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip_public),
        cmocka_unit_test(test_roundtrip_internal),
        cmocka_unit_test(test_roundtrip_covered_every_message),
        cmocka_unit_test(test_pack_limits_and_bad_args),
        cmocka_unit_test(test_unknown_fields_dropped),
        cmocka_unit_test(test_nul_in_strings_rejected),
        cmocka_unit_test(test_truncated_messages_rejected),
        cmocka_unit_test(test_garbage_rejected),
        cmocka_unit_test(test_status_mapping),
        cmocka_unit_test(test_call_helpers),
        cmocka_unit_test(test_metadata_and_bearer),
        cmocka_unit_test(test_utf8),
        cmocka_unit_test(test_validate_request_id_and_input),
        cmocka_unit_test(test_validate_sampling),
        cmocka_unit_test(test_validate_kv_codec),
        cmocka_unit_test(test_validate_after_unpack),
        cmocka_unit_test(test_credential_file),
        cmocka_unit_test(test_grpc_log),
    };
    return cmocka_run_group_tests(tests, grpc_setup, grpc_teardown);
}
