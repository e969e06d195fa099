/* How the threads of a parallel region split their work (a product's panels, attention's work items): each starts
 * on its own contiguous share, and one that finishes early takes the rest of another's share from its far end.
 *
 * Why: a product of these forwards streams its weights from memory, and the two halves of a static split can
 * finish far apart on a shared machine (one core gets less of the memory's bandwidth than the other, and which
 * one changes from minute to minute), the early thread then idle (docs/performance.md). Taking work from the far
 * end keeps both threads streaming contiguous memory until their paths meet. Which thread computes a unit
 * changes no bits (gemm.c computes every output alike wherever it runs).
 */
#ifndef CASTSPEC_SHARE_H
#define CASTSPEC_SHARE_H

#include <stdint.h>

/* One thread's share of the units: [front, back), packed in one word so that its owner (from the front) and a
 * thief (from the back) claim units with one compare-and-swap; a cache line each, so that owners do not
 * contend. */
typedef struct {
    _Alignas(64) uint64_t span;
} Share;

/* A share of units [lo, hi). */
static inline void share_set(Share *s, int lo, int hi) { s->span = (uint64_t)lo << 32 | (uint32_t)hi; }

/* Splits units [0, units) into n contiguous shares of about equal counts. */
static inline void shares_init(Share *s, int n, int units) {
    for (int t = 0; t < n; ++t) share_set(&s[t], (int)((int64_t)units * t / n), (int)((int64_t)units * (t + 1) / n));
}

/* The next units for thread t of n, [first, *end): from the front of its own share a quarter of what is left of
 * it (at least one: few claims while much is left, single units near the end), then single units from the back
 * of the others' shares, in turn; -1 when every unit is taken. Every unit goes to exactly one caller, whatever
 * the team's size (a share whose owner is missing from the team is taken from its back). */
static inline int shares_take(Share *s, int n, int t, int *end) {
    for (int k = 0; k < n; ++k) {
        Share *sh = &s[(t + k) % n];
        uint64_t old = __atomic_load_n(&sh->span, __ATOMIC_RELAXED);
        for (;;) {
            const uint32_t front = (uint32_t)(old >> 32), back = (uint32_t)old;
            if (front >= back) break;
            const uint32_t take = k == 0 ? (back - front + 3) / 4 : 1;
            const uint64_t next = k == 0 ? (uint64_t)(front + take) << 32 | back : (uint64_t)front << 32 | (back - 1);
            if (__atomic_compare_exchange_n(&sh->span, &old, next, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
                *end = (int)(k == 0 ? front + take : back);
                return (int)(k == 0 ? front : back - 1);
            }
        }
    }
    return -1;
}

#endif
