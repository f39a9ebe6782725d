/* A step's small host-to-device uploads (block-table rows, encoder jobs) without stalling the
 * device: each is copied into a pinned buffer and sent with cudaMemcpyAsync on the legacy default
 * stream, where the forward pass runs, so it lands in stream order before the kernels enqueued
 * after it. A synchronous copy from pageable memory waits for all the work enqueued before it, so
 * uploading per layer emptied the device's queue once per layer.
 *
 * The buffer is filled front to back and never reused within a step: a copy still in flight
 * reads bytes nobody writes. cuda_uploads_begin starts a step once the device has finished the
 * previous one's copies. An upload that does not fit is copied synchronously (correct, slower),
 * and the next step's buffer is sized to what this one wanted. */
#ifndef STRATA_WORKER_CUDA_UPLOADS_H
#define STRATA_WORKER_CUDA_UPLOADS_H

#include <stddef.h>
#include <stdint.h>

#include "kvstore/error.h"

typedef struct cuda_uploads {
    uint8_t *pinned;     /* cudaHostAlloc'd */
    size_t cap, used;    /* bytes */
    size_t wanted;       /* bytes asked for since the step began, fitting or not */
    size_t sync_copies;  /* uploads that did not fit, since creation */
    size_t failed_grows; /* steps whose larger buffer could not be allocated (the old one kept) */
    size_t refused;      /* the last size refused: asked again only for a step wanting more */
} cuda_uploads;

/* A new step: waits for the device if the last step's uploads may still be in flight, grows the
 * buffer to what the last step wanted (keeping the old one when pinned memory is short), and
 * empties it. */
int cuda_uploads_begin(cuda_uploads *u, strata_error *err);

/* n bytes from host src to device dst, in stream order on the legacy default stream. src may be
 * reused as soon as this returns. what names the data in an error. */
int cuda_uploads_copy(cuda_uploads *u, void *dst, const void *src, size_t n, const char *what, strata_error *err);

void cuda_uploads_free(cuda_uploads *u);

#endif
