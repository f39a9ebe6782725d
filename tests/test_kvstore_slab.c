/* The slab books against a model that keeps every taken slot as a byte range: random takes and
 * gives over three slot sizes must never hand out overlapping or out-of-region bytes, must take a
 * fresh slab only when the class has no free slot in its slabs, must fail exactly when the model
 * has no room, and must report the same room, free slots and owners as the model after each
 * operation. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kvstore/slab.h"
#include "test_rng.h"

typedef struct taken {
    size_t offset;
    int cls;
    void *owner;
} taken;

/* The model's view of one slab: its class (-1 free) and how many of its slots are taken. */
static void model_slabs(const kv_slabs *s, const taken *t, size_t n, int *cls_of, size_t *used_of)
{
    const size_t n_slabs = kv_slabs_count(s), slab = kv_slabs_slab_bytes(s);
    for (size_t i = 0; i < n_slabs; i++) {
        cls_of[i] = -1;
        used_of[i] = 0;
    }
    for (size_t i = 0; i < n; i++) {
        size_t b = t[i].offset / slab;
        assert_true(cls_of[b] == -1 || cls_of[b] == t[i].cls);   /* a slab serves one class */
        cls_of[b] = t[i].cls;
        used_of[b]++;
    }
}

static void check_against_model(const kv_slabs *s, const taken *t, size_t n)
{
    const size_t n_slabs = kv_slabs_count(s), slab = kv_slabs_slab_bytes(s);
    int cls_of[64];
    size_t used_of[64];
    assert_true(n_slabs <= 64);
    model_slabs(s, t, n, cls_of, used_of);
    size_t free_slabs = 0;
    for (size_t i = 0; i < n_slabs; i++) {
        free_slabs += cls_of[i] == -1;
        assert_int_equal(kv_slabs_slab_class(s, i), cls_of[i]);
        size_t offs[KV_SLABS_MAX_PER_SLAB];
        assert_int_equal(kv_slabs_slab_used(s, i, offs), used_of[i]);
    }
    assert_int_equal(kv_slabs_free_slabs(s), free_slabs);
    for (int c = 0; c < kv_slabs_n_classes(s); c++) {
        size_t used = 0, free_in_held = 0;
        for (size_t i = 0; i < n; i++)
            used += t[i].cls == c;
        for (size_t i = 0; i < n_slabs; i++)
            if (cls_of[i] == c)
                free_in_held += kv_slabs_per_slab(s, c) - used_of[i];
        assert_int_equal(kv_slabs_used_slots(s, c), used);
        assert_int_equal(kv_slabs_free_slots(s, c), free_in_held);
        assert_int_equal(kv_slabs_room(s, c), free_in_held + free_slabs * kv_slabs_per_slab(s, c));
    }
    for (size_t i = 0; i < n; i++) {
        const size_t end = t[i].offset + kv_slabs_slot_bytes(s, t[i].cls);
        assert_true(end <= n_slabs * slab);
        assert_true(t[i].offset / slab == (end - 1) / slab);   /* inside one slab */
        assert_ptr_equal(kv_slabs_owner(s, t[i].offset), t[i].owner);
        for (size_t j = i + 1; j < n; j++) {
            const size_t end_j = t[j].offset + kv_slabs_slot_bytes(s, t[j].cls);
            assert_true(end <= t[j].offset || end_j <= t[i].offset);
        }
    }
}

static void test_random_against_model(void **state)
{
    (void)state;
    /* An fp16 block of SmolLM2's shape (49,152 bytes with its header rounded) as the slab; kivi2-
     * and kivi4-sized slots: 4 and 2 per slab, with a remainder. */
    const size_t slab = 49216, sizes[3] = {49216, 12288, 22080};
    enum { SLABS = 12, MAX_TAKEN = SLABS * 4 };
    kv_slabs *s = kv_slabs_create(slab, SLABS, sizes, 3, NULL);
    assert_non_null(s);
    assert_int_equal(kv_slabs_per_slab(s, 0), 1);
    assert_int_equal(kv_slabs_per_slab(s, 1), 4);
    assert_int_equal(kv_slabs_per_slab(s, 2), 2);
    taken t[MAX_TAKEN];
    size_t n = 0;
    char owners[MAX_TAKEN * 8];
    uint64_t rng = 0x51ab5;
    size_t fails = 0, takes = 0;
    size_t evacuations = 0;
    for (int op = 0; op < 20000; op++) {
        const double what = rng_uniform(&rng);
        if (what < 0.05) {   /* compaction of one class's sparsest slab */
            int c = (int)(rng_next(&rng) % 3);
            const size_t free_before = kv_slabs_free_slabs(s), used_before = kv_slabs_used_slots(s, c);
            const bool can = kv_slabs_per_slab(s, c) > 1 && kv_slabs_free_slots(s, c) >= kv_slabs_per_slab(s, c);
            size_t victim = kv_slabs_sparsest(s, c, NULL, NULL), src[KV_SLABS_MAX_PER_SLAB],
                   dst[KV_SLABS_MAX_PER_SLAB], moved = 0;
            if (!can) {
                if (victim != SIZE_MAX)
                    assert_false(kv_slabs_evacuate(s, victim, src, dst, &moved));
                continue;
            }
            assert_true(victim != SIZE_MAX);
            size_t scratch[KV_SLABS_MAX_PER_SLAB];
            const size_t victim_used = kv_slabs_slab_used(s, victim, scratch);
            for (size_t i = 0; i < kv_slabs_count(s); i++)   /* the sparsest of the class */
                if (kv_slabs_slab_class(s, i) == c)
                    assert_true(victim_used <= kv_slabs_slab_used(s, i, scratch));
            assert_true(kv_slabs_evacuate(s, victim, src, dst, &moved));
            assert_int_equal(kv_slabs_free_slabs(s), free_before + 1);
            assert_int_equal(kv_slabs_used_slots(s, c), used_before);
            assert_int_equal(kv_slabs_slab_class(s, victim), -1);
            for (size_t i = 0; i < moved; i++) {
                assert_int_equal(kv_slabs_slab_of(s, src[i]), victim);
                assert_true(kv_slabs_slab_of(s, dst[i]) != victim);
                size_t k = 0;
                while (k < n && t[k].offset != src[i])
                    k++;
                assert_true(k < n);
                t[k].offset = dst[i];
            }
            evacuations++;
        } else if (n > 0 && (n == MAX_TAKEN || what < 0.45)) {
            size_t i = (size_t)(rng_next(&rng) % n);
            kv_slabs_give(s, t[i].offset);
            t[i] = t[--n];
        } else {
            int c = (int)(rng_next(&rng) % 3);
            size_t room = kv_slabs_room(s, c), held = kv_slabs_free_slots(s, c), free_slabs = kv_slabs_free_slabs(s);
            size_t off = 0;
            void *owner = &owners[rng_next(&rng) % sizeof owners];
            bool ok = kv_slabs_take(s, c, owner, &off);
            assert_int_equal(ok, room > 0);
            if (!ok) {
                fails++;
                continue;
            }
            takes++;
            /* a fresh slab only when the class's own slabs are full */
            assert_int_equal(kv_slabs_free_slabs(s), held > 0 ? free_slabs : free_slabs - 1);
            t[n++] = (taken){off, c, owner};
        }
        check_against_model(s, t, n);
    }
    assert_true(fails > 100 && takes > 5000 && evacuations > 50);   /* every outcome was exercised */
    while (n > 0)
        kv_slabs_give(s, t[--n].offset);
    assert_int_equal(kv_slabs_free_slabs(s), SLABS);
    kv_slabs_destroy(s);
}

static void test_small_slots_fill_a_slab(void **state)
{
    (void)state;
    const size_t sizes[2] = {4096, 1000};
    kv_slabs *s = kv_slabs_create(4096, 2, sizes, 2, NULL);
    assert_non_null(s);
    assert_int_equal(kv_slabs_class_of(s, 1000), 1);
    assert_int_equal(kv_slabs_class_of(s, 999), -1);
    int a;
    size_t offs[5];
    for (int i = 0; i < 4; i++)
        assert_true(kv_slabs_take(s, 1, &a, &offs[i]));
    assert_int_equal(kv_slabs_free_slabs(s), 1);   /* four 1000-byte slots share one slab */
    assert_true(kv_slabs_take(s, 0, &a, &offs[4]));
    size_t spare;
    assert_false(kv_slabs_take(s, 1, &a, &spare));   /* region full: nothing changes */
    assert_false(kv_slabs_take(s, 0, &a, &spare));
    assert_int_equal(kv_slabs_used_slots(s, 1), 4);
    kv_slabs_give(s, offs[2]);
    kv_slabs_give(s, offs[2]);       /* twice: ignored */
    kv_slabs_give(s, offs[2] + 1);   /* not a slot: ignored */
    assert_int_equal(kv_slabs_used_slots(s, 1), 3);
    assert_false(kv_slabs_take(s, 0, &a, &spare));   /* the slab still holds three */
    assert_true(kv_slabs_take(s, 1, &a, &spare));
    assert_int_equal(spare, offs[2]);
    for (int i = 0; i < 4; i++)
        kv_slabs_give(s, offs[i]);
    assert_int_equal(kv_slabs_free_slabs(s), 1);   /* empty again: free for the other class */
    assert_true(kv_slabs_take(s, 0, &a, &spare));
    assert_null(kv_slabs_owner(s, 1000));
    kv_slabs_destroy(s);
}

static void test_many_tiny_slots_capped(void **state)
{
    (void)state;
    const size_t sizes[1] = {64};
    kv_slabs *s = kv_slabs_create(64 * 100, 1, sizes, 1, NULL);
    assert_non_null(s);
    assert_int_equal(kv_slabs_per_slab(s, 0), KV_SLABS_MAX_PER_SLAB);
    int a;
    size_t off;
    for (int i = 0; i < KV_SLABS_MAX_PER_SLAB; i++) {
        assert_true(kv_slabs_take(s, 0, &a, &off));
        assert_int_equal(off, (size_t)i * 64);
    }
    assert_false(kv_slabs_take(s, 0, &a, &off));
    size_t used[KV_SLABS_MAX_PER_SLAB];
    assert_int_equal(kv_slabs_slab_used(s, 0, used), KV_SLABS_MAX_PER_SLAB);
    kv_slabs_destroy(s);
}

static void test_bad_arguments(void **state)
{
    (void)state;
    strata_error err = {0};
    const size_t twice[2] = {512, 512}, big[1] = {8192}, zero[1] = {0}, ok[1] = {512};
    assert_null(kv_slabs_create(4096, 4, twice, 2, &err));
    assert_non_null(strstr(err.msg, "twice"));
    assert_null(kv_slabs_create(4096, 4, big, 1, &err));
    assert_non_null(strstr(err.msg, "does not fit"));
    assert_null(kv_slabs_create(4096, 4, zero, 1, &err));
    assert_null(kv_slabs_create(4096, 0, ok, 1, &err));
    assert_null(kv_slabs_create(0, 4, ok, 1, &err));
    assert_null(kv_slabs_create(4096, SIZE_MAX / 2, ok, 1, &err));
    assert_int_equal(err.code, STRATA_ENOMEM);
    kv_slabs *s = kv_slabs_create(4096, 1, ok, 1, &err);
    assert_non_null(s);
    size_t off;
    assert_false(kv_slabs_take(s, 1, &err, &off));   /* no such class */
    assert_false(kv_slabs_take(s, 0, NULL, &off));   /* an owner is required */
    kv_slabs_give(s, 1u << 30);                     /* outside the region: ignored */
    kv_slabs_destroy(s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_random_against_model),
        cmocka_unit_test(test_small_slots_fill_a_slab),
        cmocka_unit_test(test_many_tiny_slots_capped),
        cmocka_unit_test(test_bad_arguments),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
