/* The last step of every certified page bound, CPU and CUDA (docs/math.md §9.5, "Overflow"). */
#ifndef EKV_MATH_PAGE_BOUND_H
#define EKV_MATH_PAGE_BOUND_H
#include "hd.h"
#include <math.h>

/* A page bound that is NaN or -inf is no bound: it becomes +inf, which rules out nothing.
 * Keys near the top of fp32 overflow a page's centre norm or radius (stored as +inf), and then
 * ||q'|| * r is 0 * inf = NaN for a zero query; a NaN never exceeds tau, so the page was
 * dropped although every one of its tokens is in the support. An overflowed fp32 partial sum
 * can likewise give -inf where the true value is finite. */
EKV_HD double ekv_page_bound_or_inf(double u) {
    return u > -(double)INFINITY ? u : (double)INFINITY;
}
#endif /* EKV_MATH_PAGE_BOUND_H */
