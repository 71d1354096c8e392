/*
 * The Gaussian-aware selector on the GPU (mirrors src/cpu/select/gaussian.c; docs/math.md §4.2-4.9,
 * exact tau mode): pages whose upper score quantile a (mu_p + z_page sigma_p) clears the floor
 * tau-hat - a max(margin sigma_g, rho (theta - u_avg)) for some query head of the group.
 *   moments: one warp per (page, KV head): mu_p = <q', kmean_p>, sigma_p^2 =
 *            sum_d q'_d^2 max(M2_pd / n_p, 1e-12), in fp32 like the CPU, per group head;
 *   stats:   one block per (sequence, query head): the mixture's global moments by block
 *            reductions, tau-hat from the single-Gaussian solver (src/math/gaussian_core.h,
 *            the CPU's own code);
 *   rule:    one block per (sequence, KV head), or per query head with per_query_head: the
 *            margin (the user's, or with auto_margin from the batch's sigma-bar, §4.5), a
 *            threshold and an ordered compaction.
 * With ALiBi the stats kernel shifts the page means to their centres and solves the mixture
 * (§4.4) by block reductions. Not on the GPU: the fixed/corrected tau modes
 * (EKV_ERR_UNSUPPORTED).
 * A shard of the sharded plan (docs/math.md §11) splits the stats kernel: its partial sums
 * (over its own stats pages, with its pages and tokens per sequence), the plan's allreduce-sum,
 * then the same finish per head (store_gstat) from the global sums; its moments and rule cover
 * its own pages, a shard before the last ranking its last page too (shard_pos).
 */
#include "gaussian.cuh"
#include "../common/launch.cuh"
#include "../common/lists.cuh"
#include "../common/plan.cuh"
#include "../common/reduce.cuh"
#include "../common/sizes.cuh"
#include "../common/splits.cuh"
#include "../../core/geometry.h"
#include "../../math/gaussian_core.h"
extern "C" {
#include "../../math/gaussian.h" /* ekv_normal_quantile */
}
#include "../../math/shard_select.h"
#include <math_constants.h>

namespace {

struct gm_args : ekv_cuda_shape {
    int shard_pos; /* EKV_SHARD_*: a shard before the last has moments for its last page too */
    ekv_page_stats st;
    const float *q;
    double scale;
    double *mu, *sig;
};

enum { GM_WARPS = EKV_CUDA_THREADS / 32, GM_PAGES = 128, GR_THREADS = 1024, GR_UNROLL = 8 };

__global__ void __launch_bounds__(EKV_CUDA_THREADS) gauss_moments_kernel(gm_args A) {
    ekv_grid_begin();
    extern __shared__ float qs[];
    const int row = blockIdx.y, b = row / A.Hk, kvh = row % A.Hk, G = A.G, D = A.D;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const ekv_seq_geom sg = ekv_seq(A.t, b, A.ps);
    for (int i = threadIdx.x; i < G * D; i += blockDim.x)
        qs[i] = (float)(A.scale * A.q[((int64_t)b * A.H + kvh * G + i / D) * D + i % D]);
    __syncthreads();
    const int64_t Ps = ekv_shard_stats_pages(sg.P, A.shard_pos);
    const int64_t pend =
            ((int64_t)blockIdx.x + 1) * GM_PAGES < Ps ? ((int64_t)blockIdx.x + 1) * GM_PAGES : Ps;
    for (int64_t p = (int64_t)blockIdx.x * GM_PAGES + warp; p < pend; p += GM_WARPS) {
        const int64_t page = A.t.indices[sg.first + p], so = (page * A.Hk + kvh) * D;
        const int32_t cnt = A.st.count[page];
        const float finv = cnt > 0 ? 1.0f / (float)cnt : 0.0f;
        float m[EKV_CUDA_MAX_GROUP], v[EKV_CUDA_MAX_GROUP];
#pragma unroll
        for (int g = 0; g < EKV_CUDA_MAX_GROUP; g++) m[g] = v[g] = 0.f;
        for (int d = lane; d < D; d += 32) {
            const float mean = A.st.kmean[so + d];
            float var = A.st.km2[so + d] * finv;
            var = var > 1e-12f ? var : 1e-12f;
#pragma unroll
            for (int g = 0; g < EKV_CUDA_MAX_GROUP; g++)
                if (g < G) {
                    const float qd = qs[g * D + d];
                    m[g] += qd * mean;
                    v[g] += qd * qd * var;
                }
        }
#pragma unroll
        for (int g = 0; g < EKV_CUDA_MAX_GROUP; g++)
            if (g < G) {
                const float mm = ekv_warp_sum(m[g]), vv = ekv_warp_sum(v[g]);
                if (lane == 0) {
                    const int64_t bh = (int64_t)b * A.H + kvh * G + g;
                    A.mu[bh * A.cap_pages + p] = mm;
                    A.sig[bh * A.cap_pages + p] = sqrt((double)vv);
                }
            }
    }
}

/* ---- the rule, in two launches: each head's global statistics, then the page rule (which
 * needs the batch's sigma-bar for auto_margin) ---- */
struct gr_args : ekv_cuda_shape {
    int shard_pos; /* EKV_SHARD_*: which pages the rule ranks and whether the last is forced */
    int reference_m3, auto_margin, batch;
    double alpha, a, excess;
    double margin_z, zpage; /* the user's margin and the z of the user's q_max   */
    double zpage_auto[2];   /* auto_margin: z of q_max 0.99 and 0.995 (§4.5)      */
    double *mu;         /* with ALiBi the stats kernel shifts the means in place (§4.4)    */
    const double *sig;
    const float *slopes; /* device [H] or NULL */
    double *gstat; /* [B*H][3]: tau-hat, sigma_g, u_avg of each query head                */
    double *red;   /* a shard: [B*H][4] its partial sums, then [B][2] its pages and tokens */
    ekv_cuda_lists out; /* per KV head, or per query head (per_query_head)                */
};

/* The ALiBi mixture of one head's pages (docs/math.md §4.4): equal weights ps, the means
 * shifted to their page centres; F by block reductions (every thread calls it). */
struct mixture_pages {
    const double *mu, *sig;
    int64_t n;
    double alpha, w;
    int reference_m3;
    double *scratch; /* shared, >= 32 */
};

__device__ double mixture_F_block(void *vp, double tau, double *F1, double *F2) {
    const mixture_pages *m = static_cast<const mixture_pages *>(vp);
    double f = 0, d1 = 0, d2 = 0;
    for (int64_t p = threadIdx.x; p < m->n; p += blockDim.x) {
        double a, b, c;
        ekv_gauss_term_core(m->alpha, m->mu[p], fmax(m->sig[p], 1e-6), tau, m->reference_m3, &a,
                            &b, &c);
        f += a;
        d1 += b;
        d2 += c;
    }
    f = ekv_block_sum(f, m->scratch);
    if (F1) *F1 = m->w * ekv_block_sum(d1, m->scratch);
    if (F2) *F2 = m->w * ekv_block_sum(d2, m->scratch);
    return m->w * f - 1;
}

/* ALiBi (as src/cpu/select/gaussian.c): shift head bh's page means to their centres' bias, then
 * tau-hat of the mixture and u_avg over the shifted means. Block-wide. */
__device__ double alibi_tau(const gr_args &A, int64_t bh, int64_t h, const ekv_seq_geom &sg,
                            int64_t Ps, int64_t n, double *scratch, double *uavg) {
    double *mu = A.mu + bh * A.cap_pages;
    const double *sgm = A.sig + bh * A.cap_pages, m_h = A.slopes[h], a = A.a;
    double ymax = -CUDART_INF, smax = 1e-6, s_u = 0;
    for (int64_t p = threadIdx.x; p < Ps; p += blockDim.x) {
        const double m = ekv_gauss_alibi_mean(mu[p], p, A.ps, n, sg.N, m_h);
        mu[p] = m;
        ymax = fmax(ymax, a * m);
        smax = fmax(smax, a * fmax(sgm[p], 1e-6));
        s_u += m + 1.5 * sgm[p];
    }
    ymax = ekv_block_max(ymax, scratch, -CUDART_INF);
    smax = ekv_block_max(smax, scratch, 1e-6);
    *uavg = ekv_block_sum(s_u, scratch) / (double)Ps; /* the barriers publish the shifted mu */
    mixture_pages env = {mu, sgm, Ps, A.alpha, (double)A.ps, A.reference_m3, scratch};
    return ekv_gauss_tau_mixture_core(ymax, smax, fmax((double)Ps * A.ps, 1.0), mixture_F_block,
                                      &env);
}

/* Head bh's sums over its first Ps pages of mu_p, sigma_p^2, mu_p^2 and mu_p + 1.5 sigma_p
 * (docs/math.md §4.3), by block reductions: sums[0..3], the same in every thread. */
__device__ void head_sums(const gr_args &A, int64_t bh, int64_t Ps, double *scratch, double *sums) {
    const double *mu = A.mu + bh * A.cap_pages, *sgm = A.sig + bh * A.cap_pages;
    double s_mu = 0, s_var = 0, s_mu2 = 0, s_u = 0;
    /* GR_UNROLL pages in flight per thread: one block per list is latency-bound */
    for (int64_t p0 = threadIdx.x; p0 < Ps; p0 += (int64_t)blockDim.x * GR_UNROLL) {
        double m[GR_UNROLL], sd[GR_UNROLL];
#pragma unroll
        for (int u = 0; u < GR_UNROLL; u++) {
            const int64_t p = p0 + (int64_t)u * blockDim.x;
            m[u] = p < Ps ? mu[p] : 0.0;
            sd[u] = p < Ps ? sgm[p] : 0.0;
        }
#pragma unroll
        for (int u = 0; u < GR_UNROLL; u++) {
            if (p0 + (int64_t)u * blockDim.x < Ps) {
                s_mu += m[u];
                s_var += sd[u] * sd[u];
                s_mu2 += m[u] * m[u];
                s_u += m[u] + 1.5 * sd[u];
            }
        }
    }
    sums[0] = ekv_block_sum(s_mu, scratch);
    sums[1] = ekv_block_sum(s_var, scratch);
    sums[2] = ekv_block_sum(s_mu2, scratch);
    sums[3] = ekv_block_sum(s_u, scratch);
}

/* Head bh's tau-hat, sigma_g and u_avg from its sums over the Ps stats pages of a sequence
 * whose single Gaussian models n tokens (one thread): the global moments, then tau-hat from
 * the single-Gaussian solver, or the ALiBi mixture's tau_mix (src/math/gaussian_core.h). */
__device__ void store_gstat(const gr_args &A, int64_t bh, const double *sums, double uavg,
                            double Ps, double n, const double *tau_mix) {
    double mug, sgg;
    ekv_gauss_global_moments(sums[0], sums[1], sums[2], Ps, &mug, &sgg);
    A.gstat[bh * 3] =
            tau_mix ? *tau_mix : ekv_gauss_tau_single_core(A.alpha, mug, sgg, n, A.reference_m3);
    A.gstat[bh * 3 + 1] = sgg;
    A.gstat[bh * 3 + 2] = uavg;
}

/* tau-hat, sigma_g and u_avg of query head bh = blockIdx.x (one block per head: the heads are
 * independent, and a block per list walked its G heads' pages in turn, latency-bound at long
 * context, where the ALiBi mixture's solve sweeps every page per iteration): the mixture's
 * global moments by block reductions, tau-hat from the single-Gaussian solver or, with ALiBi,
 * the mixture's (src/math/gaussian_core.h, the CPU's own code). */
__global__ void __launch_bounds__(GR_THREADS) gauss_stats_kernel(gr_args A) {
    ekv_grid_begin();
    __shared__ double scratch[32];
    const int64_t bh = blockIdx.x, b = bh / A.H, h = bh % A.H;
    const ekv_seq_geom sg = ekv_seq(A.t, (int)b, A.ps);
    const int64_t P = sg.P, Ps = P > 1 ? P - 1 : 1, n = P > 1 ? Ps * A.ps : sg.N;
    double sums[4];
    head_sums(A, bh, Ps, scratch, sums);
    double uavg = sums[3] / (double)Ps, tau_mix = 0;
    if (A.slopes) tau_mix = alibi_tau(A, bh, h, sg, Ps, n, scratch, &uavg);
    if (threadIdx.x == 0)
        store_gstat(A, bh, sums, uavg, (double)Ps, (double)n, A.slopes ? &tau_mix : nullptr);
}

/* A shard's part of the stats (docs/math.md §11, "Gaussian selector across shards"): its heads'
 * sums over its own stats pages into red[4 bh ..], and (KV head 0) its pages and tokens of each
 * sequence into red[4 B H + 2 b ..], for one allreduce-sum. One block per (sequence, KV head). */
__global__ void __launch_bounds__(GR_THREADS) gauss_partial_kernel(gr_args A) {
    ekv_grid_begin();
    __shared__ double scratch[32];
    const int row = blockIdx.x, b = row / A.Hk, kvh = row % A.Hk;
    const ekv_seq_geom sg = ekv_seq(A.t, b, A.ps);
    const int64_t Ps = ekv_shard_stats_pages(sg.P, A.shard_pos), BH = (int64_t)A.batch * A.H;
    for (int g = 0; g < A.G; g++) {
        const int64_t bh = (int64_t)b * A.H + kvh * A.G + g;
        double sums[4];
        head_sums(A, bh, Ps, scratch, sums);
        if (threadIdx.x < 4) A.red[4 * bh + threadIdx.x] = sums[threadIdx.x];
    }
    if (kvh == 0 && threadIdx.x == 0) {
        A.red[4 * BH + 2 * b] = (double)sg.P;
        A.red[4 * BH + 2 * b + 1] = (double)sg.N;
    }
}

/* After the allreduce: every head's global stats from the summed sums, with the sequence's
 * pages and tokens summed over the shards (what one device reads from its table). One thread
 * per head. */
__global__ void gauss_finish_kernel(gr_args A) {
    ekv_grid_begin();
    const int64_t BH = (int64_t)A.batch * A.H, bh = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (bh >= BH) return;
    const int64_t b = bh / A.H;
    const int64_t P = (int64_t)A.red[4 * BH + 2 * b], N = (int64_t)A.red[4 * BH + 2 * b + 1];
    const int64_t Ps = ekv_shard_stats_pages(P, EKV_SHARD_WHOLE), n = P > 1 ? Ps * A.ps : N;
    const double *sums = A.red + 4 * bh;
    store_gstat(A, bh, sums, sums[3] / (double)Ps, (double)Ps, (double)n, nullptr);
}

/* The page rule (one block per list): a page is taken when a (mu_p + z_page sigma_p) clears
 * tau-hat - a max(margin sigma_g, rho (theta - u_avg)) for a head of the group; then an
 * ordered compaction. */
__global__ void __launch_bounds__(GR_THREADS) gauss_rule_kernel(gr_args A) {
    ekv_grid_begin();
    __shared__ double scratch[32];
    __shared__ double tfloor[EKV_CUDA_MAX_GROUP];
    __shared__ int wsum[32];
    const int row = blockIdx.x, b = row / A.out.lps, nh = A.out.lh;
    const int64_t h0 = (int64_t)b * A.H + (row % A.out.lps) * nh; /* the list's heads */
    const ekv_seq_geom sg = ekv_seq(A.t, b, A.ps);
    const int64_t P = sg.P;
    double margin_z = A.margin_z, zpage = A.zpage;
    if (A.auto_margin) { /* one sigma-bar for the whole batch, summed in one order by every block */
        const int64_t BH = (int64_t)A.batch * A.H;
        double s = 0;
        for (int64_t i = threadIdx.x; i < BH; i += blockDim.x) s += A.gstat[i * 3 + 1];
        double q_max;
        ekv_gauss_auto_margin(ekv_block_sum(s, scratch) / (double)BH, &margin_z, &q_max);
        zpage = A.zpage_auto[q_max > 0.99];
    }
    if (threadIdx.x < nh) {
        const int64_t bh = h0 + threadIdx.x;
        const double tau = A.gstat[bh * 3], sgg = A.gstat[bh * 3 + 1], uavg = A.gstat[bh * 3 + 2];
        tfloor[threadIdx.x] = ekv_gauss_floor(tau, A.a, uavg, margin_z, sgg, A.excess);
    }
    __syncthreads();
    const int64_t nsc = ekv_shard_ranked_pages(P, A.shard_pos); /* pages the rule may take */
    auto take = [&](int64_t p) {
        for (int g = 0; g < nh; g++) {
            const int64_t bh = h0 + g;
            if (ekv_gauss_page_taken(A.a, A.mu[bh * A.cap_pages + p],
                                     A.sig[bh * A.cap_pages + p], zpage, tfloor[g]))
                return true;
        }
        return false;
    };
    /* ordered compaction in tiles of GR_THREADS x GR_UNROLL pages, each thread GR_UNROLL
     * consecutive ones and one block scan per tile (as the top-k select) */
    int32_t *out = A.out.pages + (int64_t)row * A.cap_pages;
    uint8_t *in = A.out.in + (int64_t)row * A.cap_pages;
    int written = 0;
    for (int64_t t0 = 0; t0 < nsc; t0 += (int64_t)blockDim.x * GR_UNROLL) {
        const int64_t lo = t0 + (int64_t)threadIdx.x * GR_UNROLL;
        bool tk[GR_UNROLL];
#pragma unroll
        for (int u = 0; u < GR_UNROLL; u++) tk[u] = lo + u < nsc && take(lo + u);
        ekv_compact_tile<GR_UNROLL>(tk, lo, nsc, out, in, &written, wsum);
    }
    if (threadIdx.x == 0) ekv_close_shard_list(out, in, written, P, A.out.count, row, A.shard_pos);
}

/* z of a page's quantile: a page of ps tokens stays below it with probability q_max (§4.9). */
double page_z(double q_max, int ps) { return ekv_normal_quantile(pow(q_max, 1.0 / (double)ps)); }

} // namespace

/* The moments kernel of a step (the per-page mu_p, sigma_p). */
static void launch_moments(ekv_cuda_plan *pl, const ekv_decode_params *prm, const ekv_paged_kv *kv,
                           const ekv_page_stats *st, const ekv_page_table *t, const float *q,
                           int batch) {
    gm_args M;
    ekv_cuda_set_shape(M, pl, t);
    M.shard_pos = pl->shard_pos;
    M.st = *st;
    M.q = q;
    M.scale = ekv_effective_scale(prm->scale, kv->head_dim);
    M.mu = pl->gmu;
    M.sig = pl->gsig;
    dim3 grid((unsigned)((pl->cap_pages + GM_PAGES - 1) / GM_PAGES), batch * M.Hk);
    ekv_launch(ekv_plan_stream(pl), gauss_moments_kernel, grid, EKV_CUDA_THREADS,
               (size_t)M.G * M.D * sizeof(float), M);
}

/* The stats and rule kernels' arguments. */
static gr_args rule_args(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                         const ekv_select_params *sel, const ekv_page_table *t, int batch,
                         int per_head) {
    gr_args R;
    ekv_cuda_set_shape(R, pl, t);
    R.shard_pos = pl->shard_pos;
    R.reference_m3 = sel->reference_m3;
    R.auto_margin = sel->auto_margin;
    R.batch = batch;
    R.alpha = prm->alpha;
    R.a = prm->alpha - 1.0;
    R.excess = sel->excess_fraction;
    R.margin_z = sel->margin_z;
    R.zpage = page_z(sel->max_quantile, R.ps);
    R.zpage_auto[0] = page_z(0.99, R.ps);
    R.zpage_auto[1] = page_z(0.995, R.ps);
    R.mu = pl->gmu;
    R.sig = pl->gsig;
    R.slopes = prm->alibi_slopes;
    R.gstat = pl->gstat;
    R.red = NULL;
    R.out = ekv_cuda_lists_of(pl, per_head);
    return R;
}

ekv_status ekv_cuda_launch_gaussian(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                    const ekv_select_params *sel, const ekv_paged_kv *kv,
                                    const ekv_page_stats *st, const ekv_page_table *t,
                                    const float *q, int batch, int per_head) {
    launch_moments(pl, prm, kv, st, t, q, batch);
    EKV_CUDA_LAUNCHED(pl);
    const gr_args R = rule_args(pl, prm, sel, t, batch, per_head);
    ekv_launch(ekv_plan_stream(pl), gauss_stats_kernel, batch * R.H, GR_THREADS, 0, R);
    EKV_CUDA_LAUNCHED(pl);
    ekv_launch(ekv_plan_stream(pl), gauss_rule_kernel, batch * R.out.lps, GR_THREADS, 0, R);
    EKV_CUDA_LAUNCHED(pl);
    return EKV_OK;
}

ekv_status ekv_cuda_launch_gaussian_shard(ekv_cuda_plan *pl, const ekv_decode_params *prm,
                                          const ekv_select_params *sel, const ekv_paged_kv *kv,
                                          const ekv_page_stats *st, const ekv_page_table *t,
                                          const float *q, int batch, int per_head, int part,
                                          double *red) {
    gr_args R = rule_args(pl, prm, sel, t, batch, per_head);
    R.red = red;
    if (part == 0) {
        launch_moments(pl, prm, kv, st, t, q, batch);
        EKV_CUDA_LAUNCHED(pl);
        ekv_launch(ekv_plan_stream(pl), gauss_partial_kernel, batch * R.Hk, GR_THREADS, 0, R);
        EKV_CUDA_LAUNCHED(pl);
        return EKV_OK;
    }
    const int64_t BH = (int64_t)batch * R.H;
    ekv_launch(ekv_plan_stream(pl), gauss_finish_kernel, (unsigned)((BH + 127) / 128), 128, 0, R);
    EKV_CUDA_LAUNCHED(pl);
    ekv_launch(ekv_plan_stream(pl), gauss_rule_kernel, batch * R.out.lps, GR_THREADS, 0, R);
    EKV_CUDA_LAUNCHED(pl);
    return EKV_OK;
}
