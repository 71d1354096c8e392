/*
 * The screen kernel's arguments (kernels.h's screen_page member, written once in
 * screen_page.h; docs/math.md §10.2): one page as the screen sees it, the terms of its bound,
 * and the layout of its scratch. The screen stage (../stages/screen.c) fills them.
 */
#ifndef EKV_CPU_SCREEN_TYPES_H
#define EKV_CPU_SCREEN_TYPES_H
#include <stdint.h>

/* What the bound adds beyond the code error, kept apart so the tests can show each term is
 * needed (a halved code error or a dropped slack must produce a violation). Production
 * code passes ekv_screen_exact. */
typedef struct ekv_screen_terms {
    double code_error; /* multiplier of the s_c / 2 reconstruction error (1)              */
    int slack;         /* 1: the fp32 rounding slack of both scores and of the ALiBi term */
} ekv_screen_terms;

/* Below fp32's subnormals an exact product can vanish where the kernel's does not: every
 * channel and the sum get this absolute floor (docs/math.md §10.2). */
#define EKV_SCREEN_NU 0x1p-140

/* One page of one KV head, for the G query heads of its group. */
typedef struct ekv_screen_page {
    const float *kmin, *kmax; /* the page's stored range for this KV head [D]            */
    const uint8_t *codes;     /* the page's code block for this KV head (src/core/codes.h) */
    int32_t bits;
    int64_t D, page_size, ntok;     /* head dim; token slots of a block; valid tokens        */
    const float *bias0, *bias_step; /* [G] the ALiBi terms the score kernel gets, or NULL */
    const double *alibi_slack;      /* [G] 16u|a m_h| (|first - (N-1)| + page_size), or NULL */
} ekv_screen_page;

/* The scratch of one list's screen: ekv_screen_scratch_bytes(D, G) bytes, 8-byte aligned. */
static inline int64_t ekv_screen_scratch_bytes(int64_t D, int64_t G) {
    return (3 * D + 4 * G * D) * (int64_t)sizeof(float);
}
/* The scratch layout, written once: per channel of the page, the step, the centre and W [D
 * each] (the page box borrows the steps' slots for A), the code weights w' [G][D]; then what
 * ekv_cpu_screen_prepare keeps for the whole list: |q'|, and q''s positive and negative parts
 * (the page box) [G][D each]. */
typedef struct ekv_screen_scratch {
    float *step, *mid, *w, *wq, *qabs, *qpos, *qneg;
} ekv_screen_scratch;
static inline ekv_screen_scratch ekv_screen_scratch_of(void *scratch, int64_t D, int64_t G) {
    ekv_screen_scratch s;
    s.step = (float *)scratch;
    s.mid = s.step + D;
    s.w = s.mid + D;
    s.wq = s.w + D;
    s.qabs = s.wq + G * D;
    s.qpos = s.qabs + G * D;
    s.qneg = s.qpos + G * D;
    return s;
}
#endif
