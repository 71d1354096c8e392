/* Per-token score bounds from the key codes (screen.c, docs/math.md §10.2). */
#ifndef EKV_CPU_SCREEN_H
#define EKV_CPU_SCREEN_H
#include "kernels.h"

/* What the bound adds beyond the code error, kept apart so the tests can show each term is
 * needed (a halved code error or a dropped slack must produce a violation). Production
 * code passes ekv_screen_exact. */
typedef struct ekv_screen_terms {
    double code_error; /* multiplier of the s_c / 2 reconstruction error (1)              */
    int slack;         /* 1: the fp32 rounding slack of both scores and of the ALiBi term */
} ekv_screen_terms;
extern const ekv_screen_terms ekv_screen_exact;

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

/*
 * lo[g*ld + t] <= z_t,g <= hi[g*ld + t] for every token t < ntok and head g < G, where z is
 * the fp32 score the score kernels compute from the scaled queries qs [G][D] (ldq apart).
 * The page's bound runs on kern->screen_page. scratch: ekv_screen_scratch_bytes(D, G)
 * bytes, 8-byte aligned, prepared for these queries by ekv_cpu_screen_prepare (once per
 * list: what depends on the queries alone is not redone per page).
 */
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
void ekv_cpu_screen_prepare(const float *qs, int64_t ldq, int G, int64_t D, void *scratch);
/* The page test before the codes (docs/math.md §10.4): u[g] >= every fp32 score of the page's
 * tokens for head g, from the page's range (the box) with the rounding of the box and of the
 * scores, and the ALiBi term of its last token. Same scratch; it uses the per-channel slots. */
void ekv_cpu_screen_page_box(const ekv_cpu_kernels *kern, const ekv_screen_page *pg, int G,
                             void *scratch, double *u);
void ekv_cpu_screen_page(const ekv_cpu_kernels *kern, const ekv_screen_page *pg, const float *qs,
                         int64_t ldq, int G, const ekv_screen_terms *terms, void *scratch,
                         float *lo, float *hi, int64_t ld);
#endif
