/* Quantize-on-append on a CUDA device: full blocks written in place in device memory from the
 * fp16 rows of the tail, byte for byte the block kv_block_encode writes on the CPU from the same
 * values (header, section table, sections, padding and both CRC32Cs). The quantizer's rounding
 * and the CRC arithmetic are the CPU's own inline functions (kvstore/quant_math.h,
 * kvstore/crc32c_math.h) compiled for the device, so equality is by construction and is tested.
 *
 * Supported codecs: fp16, KIVI, TaDA, GEAR (its outliers and per-head low-rank fit, the CPU's
 * own fp64 arithmetic from kvstore/gear_math.h, built without FMA contraction so the bytes match)
 * and OTT (the pool update of kvstore/ott_math.h run on the tracker state each job points at, in
 * device memory, then the pooled tokens taken out of the quantized groups and kept in fp16; the
 * block's size follows its number of entries, so its header is completed per block).
 * Status: compiled in every build with nvcc; see docs/benchmarks.md for whether it has run. */
#ifndef STRATA_KERNELS_CUDA_KV_ENCODE_H
#define STRATA_KERNELS_CUDA_KV_ENCODE_H

#include <stdint.h>

#include "kernels/cuda_kv_attention.h"
#include "kvstore/error.h"

#ifdef __cplusplus
extern "C" {
#endif

#define CUDA_KV_MAX_HEADER 256

/* Everything the kernel needs about the pool's blocks: the section layout and the header bytes
 * every block shares (all fields but layer, first position and the CRCs, which it fills in). */
typedef struct cuda_kv_encoder {
    cuda_kv_layout layout;
    uint32_t header_bytes;
    uint8_t header[CUDA_KV_MAX_HEADER];
    /* GEAR with outliers or a low rank (gear = 1): this encoder's counts, where their sections sit,
     * and the scratch each job needs (cuda_kv_encode_job.work). */
    int gear, rank, k_sparse, v_sparse, power_iters;
    uint32_t off_k_sparse, off_v_sparse, off_k_lowrank, off_v_lowrank;
    uint64_t work_bytes;
    /* OTT with a pool (ott = 1): pool tokens and auxiliary tokens per head, the OTT_TOKENS
     * section's offset and its table entry's place, the slot size (the largest block, zeroed
     * first), and the tracker state bytes of one (sequence, layer) (cuda_kv_encode_job.ott_state). */
    int ott, ott_pool, ott_aux;
    uint32_t off_ott, ott_entry_at, slot_bytes;
    uint64_t ott_state_bytes;
} cuda_kv_encoder;

/* From the pool's codec and geometry (one zero block encoded on the CPU gives the header). */
struct kv_codec_params;
struct kv_geometry;
int cuda_kv_encoder_init(const struct kv_codec_params *p, const struct kv_geometry *g, cuda_kv_encoder *out,
                         strata_error *err);
/* The same for GEAR blocks of another low rank than the decode rank kv_block_desc_init gives (the
 * CPU pool writes blocks made only of prompt tokens at rank_prompt); rank < 0: that default. */
int cuda_kv_encoder_init_rank(const struct kv_codec_params *p, const struct kv_geometry *g, int rank,
                              cuda_kv_encoder *out, strata_error *err);

/* One block to write. */
typedef struct cuda_kv_encode_job {
    const uint16_t *k;   /* device fp16 [block_tokens][n_kv_heads][head_dim] (the tail's layout) */
    const uint16_t *v;
    uint8_t *dst;        /* device slot of layout.block_bytes bytes, 16-byte aligned */
    uint64_t first_pos;  /* position of the block's first token */
    uint32_t layer;
    void *work;          /* GEAR, OTT: enc.work_bytes of device scratch, 8-byte aligned, this job's own;
                          * NULL for the other codecs */
    void *ott_state;     /* OTT: the (sequence, layer)'s tracker (enc.ott_state_bytes, 8-byte aligned,
                          * zeroed before its first block); updated by the job, so jobs of one
                          * launch must name different trackers */
} cuda_kv_encode_job;

/* Writes n_jobs blocks (d_jobs: device array), one thread block each, asynchronously on stream.
 * STRATA_EINVAL for bad arguments, STRATA_EIO when the launch fails. */
int cuda_kv_encode_blocks(const cuda_kv_encoder *enc, const cuda_kv_encode_job *d_jobs, int n_jobs,
                          strata_cuda_stream stream, strata_error *err);

#ifdef __cplusplus
}
#endif

#endif
