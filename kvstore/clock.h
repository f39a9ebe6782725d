/* The monotonic clock as the code measures elapsed time and deadlines with it, and the
 * CLOCK_REALTIME instant pthread_cond_timedwait wants. Header-only. */
#ifndef STRATA_KVSTORE_CLOCK_H
#define STRATA_KVSTORE_CLOCK_H

#include <stdint.h>
#include <time.h>

/* CLOCK_MONOTONIC in seconds, milliseconds and nanoseconds. */
static inline double strata_mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline int64_t strata_mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static inline uint64_t strata_mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* CLOCK_REALTIME ms (>= 0) from now: a pthread_cond_timedwait deadline. */
static inline struct timespec strata_realtime_after_ms(long ms)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    t.tv_sec += ms / 1000;
    t.tv_nsec += (ms % 1000) * 1000000L;
    if (t.tv_nsec >= 1000000000L) {
        t.tv_sec++;
        t.tv_nsec -= 1000000000L;
    }
    return t;
}

#endif
