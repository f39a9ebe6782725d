/* Host side of the CUDA KV kernels: the pool's block layout, the attention's split plan and the
 * encoder's shared header. Plain C so that it is checked by the C compiler's warnings and runs in
 * the CPU tests without a GPU. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda_kv_attention.h"
#include "kernels/cuda/kv_attention_mma.h"
#include "kernels/cuda/kv_encode_block.h"
#include "kernels/cuda_kv_encode.h"
#include "kvstore/block.h"

enum { MAX_HEAD_DIM = 256, MAX_Q_PER_KV = 16, MAX_GRID_Y = 65535, CTAS_PER_SM = 2 };

static int section_place(const kv_block *b, uint16_t id, uint32_t *off, uint32_t *len, strata_error *err)
{
    for (int i = 0; i < b->n_sections; i++) {
        if (b->sections[i].id == id) {
            *off = b->sections[i].offset;
            *len = b->sections[i].length;
            return STRATA_OK;
        }
    }
    return strata_fail(err, STRATA_EFORMAT, "block has no %s section", kv_section_name(id));
}

int cuda_kv_layout_from_block(const kv_block *b, cuda_kv_layout *out, strata_error *err)
{
    if (!b || !out)
        return strata_fail(err, STRATA_EINVAL, "cuda_kv_layout_from_block: NULL argument");
    const kv_block_desc *d = &b->desc;
    if (d->codec < KV_CODEC_FP16 || d->codec > KV_CODEC_TADA)
        return strata_fail(err, STRATA_EUNSUPPORTED, "codec %d", d->codec);
    if (d->head_dim < 1 || d->head_dim > MAX_HEAD_DIM)
        return strata_fail(err, STRATA_EINVAL, "head_dim %d: the CUDA attention kernel handles 1..%d",
                           d->head_dim, MAX_HEAD_DIM);
    cuda_kv_layout l = {
        .codec = d->codec,
        .k_bits = d->k_bits,
        .v_bits = d->v_bits,
        .k_group = d->k_group,
        .v_group = d->v_group,
        .block_tokens = (int)d->n_tokens,
        .n_kv_heads = d->n_kv_heads,
        .head_dim = d->head_dim,
        .layer = d->layer,
        .block_bytes = b->block_bytes,
    };
    int rc;
    uint32_t mean_len;
    if (d->codec == KV_CODEC_FP16) {
        if ((rc = section_place(b, KV_SEC_K_FP16, &l.off_k, &l.len_k, err)) != STRATA_OK ||
            (rc = section_place(b, KV_SEC_V_FP16, &l.off_v, &l.len_v, err)) != STRATA_OK)
            return rc;
    } else {
        if ((rc = section_place(b, KV_SEC_K_CODES, &l.off_k, &l.len_k, err)) != STRATA_OK ||
            (rc = section_place(b, KV_SEC_K_SCALES, &l.off_k_scales, &l.len_k_scales, err)) != STRATA_OK ||
            (rc = section_place(b, KV_SEC_V_CODES, &l.off_v, &l.len_v, err)) != STRATA_OK ||
            (rc = section_place(b, KV_SEC_V_SCALES, &l.off_v_scales, &l.len_v_scales, err)) != STRATA_OK)
            return rc;
        if (d->codec == KV_CODEC_TADA &&
            ((rc = section_place(b, KV_SEC_TADA_K_MEAN, &l.off_k_mean, &mean_len, err)) != STRATA_OK ||
             (rc = section_place(b, KV_SEC_TADA_V_MEAN, &l.off_v_mean, &mean_len, err)) != STRATA_OK))
            return rc;
    }
    *out = l;
    return STRATA_OK;
}

int cuda_kv_attention_plan(const cuda_kv_layout *layout, int n_seqs, int n_q_heads, int max_blocks,
                           int sm_count, cuda_kv_plan *plan, strata_error *err)
{
    if (!layout || !plan)
        return strata_fail(err, STRATA_EINVAL, "cuda_kv_attention_plan: NULL argument");
    if (n_seqs < 1 || max_blocks < 0 || layout->n_kv_heads < 1)
        return strata_fail(err, STRATA_EINVAL, "cuda_kv_attention_plan: %d sequences, %d blocks", n_seqs,
                           max_blocks);
    if (n_q_heads < layout->n_kv_heads || n_q_heads % layout->n_kv_heads != 0)
        return strata_fail(err, STRATA_EINVAL, "%d query heads are not a multiple of %d KV heads", n_q_heads,
                           layout->n_kv_heads);
    if (n_q_heads / layout->n_kv_heads > MAX_Q_PER_KV)
        return strata_fail(err, STRATA_EINVAL, "%d query heads per KV head: the CUDA kernel handles up to %d",
                           n_q_heads / layout->n_kv_heads, MAX_Q_PER_KV);
    if (n_seqs > MAX_GRID_Y)
        return strata_fail(err, STRATA_EINVAL, "%d sequences in one launch: at most %d", n_seqs, MAX_GRID_Y);
    /* The tail is one more unit of work after the blocks. */
    const long units = (long)max_blocks + 1;
    const long rows = (long)n_seqs * layout->n_kv_heads;
    long splits;
    if (kv_mma_eligible(layout, n_q_heads / layout->n_kv_heads)) {
        /* The tensor-core kernel: its four warps each take blocks of a split, so a split holds at
         * least one block a warp. Thread blocks run in waves of (multiprocessors x what fits one);
         * the time goes as waves x blocks a split, so the splits are chosen for the fewest of that
         * (a half-empty last wave costs as much as a full one). */
        const long slots = (long)(sm_count > 0 ? sm_count : 1) *
                           kv_mma_ctas_per_sm(layout->head_dim, layout->k_bits, layout->k_group, layout->codec);
        long most = (units + KV_MMA_WARPS - 1) / KV_MMA_WARPS;
        if (most > MAX_GRID_Y)
            most = MAX_GRID_Y;
        long best_cost = -1;
        splits = 1;
        for (long s = 1; s <= most; s++) {
            const long per = (units + s - 1) / s, used = (units + per - 1) / per;
            const long cost = ((rows * used + slots - 1) / slots) * per;
            if (best_cost < 0 || cost < best_cost) {
                best_cost = cost;
                splits = used;
            }
            if (rows * s >= 4 * slots)   /* past four full waves, more splits only add merging */
                break;
        }
    } else {
        /* The others: enough splits that the grid gives every multiprocessor CTAS_PER_SM thread
         * blocks, never more splits than units. */
        const long target = (long)(sm_count > 0 ? sm_count : 1) * CTAS_PER_SM;
        splits = (target + rows - 1) / rows;
        if (splits > units)
            splits = units;
        if (splits > MAX_GRID_Y)
            splits = MAX_GRID_Y;
    }
    const long per_split = (units + splits - 1) / splits;
    *plan = (cuda_kv_plan){
        .n_seqs = n_seqs,
        .n_q_heads = n_q_heads,
        .max_blocks = max_blocks,
        .blocks_per_split = (int)per_split,
        .n_splits = (int)((units + per_split - 1) / per_split),
    };
    return STRATA_OK;
}

size_t cuda_kv_attention_workspace(const cuda_kv_layout *layout, const cuda_kv_plan *plan)
{
    if (!layout || !plan)
        return 0;
    /* Per (sequence, query head, split): head_dim partial value sums, then the running max and
     * normalizer. */
    const size_t partials = (size_t)plan->n_seqs * (size_t)plan->n_q_heads * (size_t)plan->n_splits;
    return partials * ((size_t)layout->head_dim + 2) * sizeof(float);
}

/* A section's offset, 0 when the block has none. */
static uint32_t section_at(const kv_block *b, uint16_t id)
{
    uint32_t off = 0, len;
    return section_place(b, id, &off, &len, NULL) == STRATA_OK ? off : 0;
}

/* OTT: where the OTT_TOKENS section goes and how the header changes with the number of entries
 * (kv_enc_ott_patch_header), checked against the CPU writer's headers for one and for the most
 * entries a block can hold, so that a change of the block format fails here, by name, rather
 * than as different bytes on the device. */
static int ott_template(const kv_codec_params *p, const kv_geometry *g, const kv_block_desc *d0, const kv_block *b0,
                        cuda_kv_encoder *out, strata_error *err)
{
    out->ott = 1;
    out->ott_pool = p->pool_tokens;
    out->ott_aux = p->aux_tokens;
    out->off_ott = b0->block_bytes;   /* the next 64-byte boundary after the KIVI sections */
    out->ott_entry_at = KV_BLOCK_FIXED_BYTES + (uint32_t)b0->n_sections * KV_BLOCK_SECTION_ENTRY_BYTES;
    out->slot_bytes = (uint32_t)kv_block_size(p, g);
    out->work_bytes = kv_enc_ott_work_bytes(out);
    out->ott_state_bytes = kv_enc_ott_state_bytes(out);
    const int most = p->pool_tokens * g->n_kv_heads < g->block_tokens * g->n_kv_heads
                         ? p->pool_tokens * g->n_kv_heads
                         : g->block_tokens * g->n_kv_heads;
    const size_t rows = (size_t)g->block_tokens * (size_t)g->n_kv_heads * (size_t)g->head_dim;
    kv_ott_entry *entries = calloc((size_t)most, sizeof *entries);
    float *zeros = calloc(rows, sizeof *zeros);
    uint8_t *block = calloc(1, out->slot_bytes), hdr[CUDA_KV_MAX_HEADER];
    int rc = entries && zeros && block ? STRATA_OK : strata_fail(err, STRATA_ENOMEM, "out of memory");
    for (int i = 0; rc == STRATA_OK && i < most; i++)   /* (token, head) order */
        entries[i] = (kv_ott_entry){(uint16_t)(i % g->n_kv_heads), (uint16_t)(i / g->n_kv_heads)};
    const int counts[2] = {1, most};
    for (int c = 0; c < 2 && rc == STRATA_OK; c++) {
        kv_block_desc d = *d0;
        d.ott_tokens = counts[c];
        const kv_block_extra extra = {entries};
        kv_block b;
        rc = kv_block_encode_ex(&d, zeros, zeros, &extra, block, out->slot_bytes, NULL, err);
        if (rc == STRATA_OK)
            rc = kv_block_parse(block, out->slot_bytes, &b, err);
        if (rc != STRATA_OK)
            break;
        memcpy(hdr, out->header, out->header_bytes);
        kv_enc_ott_patch_header(out, hdr, (uint32_t)counts[c]);
        memset(block + KV_HDR_LAYER, 0, 4);
        memset(block + KV_HDR_FIRST_POS, 0, 8);
        memset(block + KV_HDR_PAYLOAD_CRC, 0, 8);
        if (b.header_bytes != out->header_bytes || memcmp(hdr, block, out->header_bytes) != 0)
            rc = strata_fail(err, STRATA_EFORMAT, "the CUDA encoder's OTT header for %d entries does not match the "
                             "CPU writer's (block format changed?)", counts[c]);
    }
    free(entries);
    free(zeros);
    free(block);
    return rc;
}

int cuda_kv_encoder_init_rank(const kv_codec_params *p, const kv_geometry *g, int rank, cuda_kv_encoder *out,
                              strata_error *err)
{
    if (!p || !g || !out)
        return strata_fail(err, STRATA_EINVAL, "cuda_kv_encoder_init: NULL argument");
    int rc = kv_codec_validate(p, g, err);
    if (rc != STRATA_OK)
        return rc;
    kv_block_desc d;
    kv_block_desc_init(&d, p, g, 0, 0);
    if (rank >= 0 && p->codec == KV_CODEC_GEAR)
        d.rank = rank;
    const size_t bytes = kv_block_bytes(&d);
    if (bytes == 0)
        return strata_fail(err, STRATA_EINVAL, "rank %d: not a valid block", rank);
    const size_t rows = (size_t)g->block_tokens * (size_t)g->n_kv_heads * (size_t)g->head_dim;
    uint8_t *block = calloc(1, bytes);
    float *zeros = calloc(rows ? rows : 1, sizeof *zeros);
    if (!block || !zeros) {
        free(block);
        free(zeros);
        return strata_fail(err, STRATA_ENOMEM, "cuda_kv_encoder_init: out of memory");
    }
    kv_block b;
    memset(out, 0, sizeof *out);
    rc = kv_block_encode(&d, zeros, zeros, block, bytes, NULL, err);
    if (rc == STRATA_OK)
        rc = kv_block_parse(block, bytes, &b, err);
    if (rc == STRATA_OK)
        rc = cuda_kv_layout_from_block(&b, &out->layout, err);
    if (rc == STRATA_OK && b.header_bytes > CUDA_KV_MAX_HEADER)
        rc = strata_fail(err, STRATA_EUNSUPPORTED, "a %u-byte block header (at most %d)", b.header_bytes,
                         CUDA_KV_MAX_HEADER);
    if (rc == STRATA_OK) {
        out->header_bytes = b.header_bytes;
        memcpy(out->header, block, b.header_bytes);
        /* Filled per block by the kernel. */
        memset(out->header + KV_HDR_LAYER, 0, 4);
        memset(out->header + KV_HDR_FIRST_POS, 0, 8);
        memset(out->header + KV_HDR_PAYLOAD_CRC, 0, 8);
        if (d.codec == KV_CODEC_GEAR && (d.rank || d.k_sparse || d.v_sparse)) {
            out->gear = 1;
            out->rank = d.rank;
            out->power_iters = d.power_iters;
            out->k_sparse = d.k_sparse;
            out->v_sparse = d.v_sparse;
            out->off_k_sparse = section_at(&b, KV_SEC_GEAR_K_SPARSE);
            out->off_v_sparse = section_at(&b, KV_SEC_GEAR_V_SPARSE);
            out->off_k_lowrank = section_at(&b, KV_SEC_GEAR_K_LOWRANK);
            out->off_v_lowrank = section_at(&b, KV_SEC_GEAR_V_LOWRANK);
            out->work_bytes = kv_enc_gear_work_bytes(out);
        }
        out->slot_bytes = out->layout.block_bytes;
        if (d.codec == KV_CODEC_OTT && p->pool_tokens > 0)
            rc = ott_template(p, g, &d, &b, out, err);
    }
    free(block);
    free(zeros);
    return rc;
}

int cuda_kv_encoder_init(const kv_codec_params *p, const kv_geometry *g, cuda_kv_encoder *out, strata_error *err)
{
    return cuda_kv_encoder_init_rank(p, g, -1, out, err);
}
