/* Time helpers for the tests that wait on other threads or processes: a monotonic clock in
 * milliseconds and a sleep. */
#ifndef STRATA_TESTS_TEST_TIME_H
#define STRATA_TESTS_TEST_TIME_H

#include <stdint.h>
#include <time.h>

static inline int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static inline void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

#endif
