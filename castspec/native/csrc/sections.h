/* Where a forward's time goes, section by section (native/sections.py, scripts/forward_sections.py).
 *
 * In a library built with CASTSPEC_SECTIONS (native/build.py builds one where CASTSPEC_SECTIONS=1 is set) each
 * mark adds the time since the previous mark to its section, in one table for target forwards (step.c) and one
 * for drafter passes (draft.c); in every other build the marks compile to nothing. Marks sit between parallel
 * regions, on the thread that called the forward, so a section's time is the whole team's wall time, waits
 * included: a product's section holds its region from fork to join, the rows' entry (rounding or quantizing)
 * goes to SEC_OTHER. The order of the sections is native/sections.py's SECTIONS.
 */
#ifndef CASTSPEC_SECTIONS_H
#define CASTSPEC_SECTIONS_H

enum {
    SEC_OTHER,     /* norms, residuals, rows entering products, embeddings, the rest */
    SEC_FC,        /* a drafter's context fusion */
    SEC_QKV,       /* products */
    SEC_ROPE_KV,   /* per-head norms, RoPE, cache writes */
    SEC_ATTENTION, /* scores, softmax, weighted values */
    SEC_O,         /* products */
    SEC_GATE_UP,
    SEC_SILU,      /* silu(gate) * up, and its rows entering the down product */
    SEC_DOWN,
    SEC_HEAD,      /* the lm_head, or a drafter's draft-vocabulary head */
    SEC_COUNT
};
enum { SEC_TARGET, SEC_DRAFTER };

#ifdef CASTSPEC_SECTIONS
#include <time.h>

extern double castspec_sections[2][SEC_COUNT]; /* seconds, [SEC_TARGET / SEC_DRAFTER][section] */
extern double castspec_section_mark;           /* when the last mark was made */
extern int castspec_section_table;             /* the table marks add to */

static inline double section_clock(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
/* From now on marks add to `table`; what came before is not counted. */
#define SECTIONS_BEGIN(table) (castspec_section_table = (table), castspec_section_mark = section_clock())
/* The time since the last mark goes to section `s`. */
#define SECTION_END(s)                                                                        \
    do {                                                                                      \
        const double now_ = section_clock();                                                  \
        castspec_sections[castspec_section_table][s] += now_ - castspec_section_mark;         \
        castspec_section_mark = now_;                                                         \
    } while (0)
#else
#define SECTIONS_BEGIN(table) ((void)0)
#define SECTION_END(s) ((void)0)
#endif

#endif
