/*
 * The entmax weight of a score, p = [z - tau]_+^beta (docs/math.md §0, §6.2), as every path that
 * forms it computes it: the values stage, the sharded plan's support, the prefill.
 */
#pragma once

/* p = [z - tau]_+^beta as every values path computes it (double, then rounded), with
 * tau = m + t: (z - m) is exact in double for fp32 z and m, so the weights keep their precision
 * at any score scale when m is the head's max (docs/math.md §6.2) */
__device__ __forceinline__ double entmax_x(float z, float m, double t) {
    return ((double)z - (double)m) - t;
}
__device__ __forceinline__ float entmax_p_split(float z, float m, double t, double beta) {
    const double x = entmax_x(z, m, t);
    if (!(x > 0)) return 0.f;
    return beta == 2.0 ? (float)(x * x) : beta == 1.0 ? (float)x : (float)pow(x, beta);
}
__device__ __forceinline__ float entmax_p(float z, double tau, double beta) {
    return entmax_p_split(z, 0.f, tau, beta);
}
/* p of a score given tau for any alpha: softmax's exp(z - tau) (alpha 1: tau is log-sum-exp,
 * docs/math.md §0), else entmax_p. exp(-inf) = 0 for a masked score. */
__device__ __forceinline__ float attn_weight(float z, double tau, double alpha, double beta) {
    return alpha == 1.0 ? (float)exp((double)z - tau) : entmax_p(z, tau, beta);
}
/* w~ = p~^(2 - alpha) of a score given tau: the weight of the entmax Jacobian (docs/math.md
 * §13.2), x^(beta - 1) on the support (x = z - tau: entmax_x, as entmax_p's), 0 outside; softmax
 * (alpha 1): w = p. The forward's o-hat = sum w v / sum w takes it (§13.3). */
__device__ __forceinline__ float attn_jweight(float z, double tau, double alpha, double beta) {
    if (alpha == 1.0) return attn_weight(z, tau, alpha, beta); /* w = p */
    const double x = entmax_x(z, 0.f, tau);
    if (!(x > 0)) return 0.f;
    return beta == 2.0 ? (float)x : beta == 1.0 ? 1.f : (float)pow(x, beta - 1.0);
}
