/*
 * Dense prefill attention, fused (docs/math.md §12, "The fused kernel"): the rows of the GEMM
 * path (R = T*G per KV head g, row r = t*G + j, its queries split into np parts of K's dtype by
 * split_queries_kernel), but S and P never reach global memory. A block owns PF_ROWS rows (16
 * per warp, their q' parts in registers) and streams the K (and V) tiles of their causal prefix
 * through shared memory (cp.async, two stages), last tile first; every pass recomputes
 * z = 2^-s (sum over parts of q'_part . k) + a m_h (j - i) on tensor cores (mma.cuh,
 * each part's mma from zero, as decode's scores, §3.1; sm_90a code with one part at head dim
 * 64: one wgmma chain of the block's 64 rows, wgmma.cuh, the sum in the tensor core's fp32
 * accumulator), z = -inf for j > i. Each row is owned
 * by one block, so everything about a row is decided inside one block:
 *   1. candidates (PF_CANDS, round 0): the running max m of the row (so far in the sweep) and
 *      every z > m - 1 appended to the row's buffer (cand_cap kept, with its key): a superset
 *      of the candidates z > M - 1 (§0), M among them; a buffer about to overflow is compacted
 *      to the scores above its kept ones' threshold, a lower bound of tau, which becomes the
 *      row's threshold (compact_row_list). fused_tau_kernel then solves tau on them
 *      (tau_solve.cuh); a row with more than cand_cap takes the threshold of the kept ones, a
 *      lower bound on tau (§9.1), as its next threshold and runs the pass again (rounds
 *      1 .. PF_ROUNDS - 1, only such rows);
 *   2. a row still over after PF_ROUNDS (PF_NEWTON): its exact max by one more sweep, then
 *      the solver's own iteration (tau_step) from that lower bound, each step's sums over the
 *      row's keys by a sweep: exact without any buffer;
 *   3. output of a row solved from its candidates (gather_out_kernel): they hold its support,
 *      so o = sum p v / sum p over them, p = [z - tau]_+^beta, reads only the support's V rows
 *      (tens of keys where the prefix has up to a million): no second sweep;
 *   4. output of a row solved by Newton passes (PF_OUT, its list): a sweep, p as above, P split
 *      into np parts of V's dtype (times pscale, as the GEMM path does) and o += P V on tensor
 *      cores; o / sum p. Both write the [T][H][D] output.
 * The tau kernel is a warp per row (solve_tau<true>). The passes after round 0
 * (retries, Newton) work on a compact list of their rows per KV head, which the tau kernel
 * appends to (wlist/wcount), 64 to a block: a pass costs sweeps for the rows that need it, not
 * for every block that holds one of them (a block sweeps for its slowest row, and a few
 * overflowing rows are spread over most blocks). Blocks past the list's count exit.
 * Two forms beside the model's causal entmax, for the flash entry (flash_entmax.cu, docs/math.md
 * §13.1): rows that see every key (noncausal_keys; ALiBi -m_h |j - i| on both sides), and
 * softmax (alpha 1): no candidates, every row takes step 2 as one sweep for its max and one
 * for log-sum-exp, then step 4.
 * The histogram scheme (pf->tau_scheme, prefill_hist.cu, docs/math.md §12.1) replaces step 1:
 * every row's list is sized by a histogram pass and filled by one more sweep, rows too big for
 * a list go to step 2; steps 3 and 4 as here (newton_and_outputs).
 */
#include "prefill_fused.cuh"

namespace {

/* A row's list about to overflow, compacted in place by its warp (warp-uniform call): the
 * threshold of its n kept candidates, a subset of the row's scores, is a lower bound of the
 * row's tau (docs/math.md §9.1), so the ones at or below it (as fp32: bound_f32) are outside the
 * support and leave the list, which keeps its order. Returns that bound; *n becomes the count
 * kept. Inlined: ptxas spilled more around a call (f16, D 64: 152 bytes of spill stores in the
 * candidate pass against 124 inlined). */
__device__ __forceinline__ float compact_row_list(const fused_args &A, int64_t row, int *n) {
    const int lane = threadIdx.x & 31;
    float *cz = A.cand + row * A.cap;
    int64_t *ck = A.cidx + row * A.cap;
    const float floor = bound_f32(subset_threshold<true>(cz, *n, A.alpha, NULL, NULL));
    int out = 0;
    for (int base = 0; base < *n; base += 32) {
        const int i = base + lane;
        const float z = i < *n ? cz[i] : -CUDART_INF_F;
        const int64_t key = i < *n ? ck[i] : 0;
        const unsigned keep = __ballot_sync(0xffffffffu, z > floor);
        __syncwarp(); /* every lane has read its entry before any writes below it */
        if (z > floor) {
            const int at = out + __popc(keep & ((1u << lane) - 1u));
            cz[at] = z;
            ck[at] = key;
        }
        out += __popc(keep);
    }
    __syncwarp();
    *n = out;
    return floor;
}

/* Step 1: the candidates of the rows in the round's state (round 0: every row, threshold the
 * running max - 1, less a slack for the float subtraction; later rounds: the row's thr). A row
 * belongs to one quad, so its count lives in the quad's registers and each tile's candidates
 * take consecutive slots by a prefix sum over the quad (no atomics: with heads without
 * position most keys lie within 1 of the max, one shared atomic per key was the old cost), in
 * a fixed order. A tile that would fill a row's list past compact_at first compacts it
 * (compact_row_list) and raises the row's threshold to the bound found: a head without position
 * has thousands of keys within 1 of its max but a support near 100, so its list then holds the
 * support and the row is solved without a retry sweep. A compaction that keeps more than half
 * of compact_at settles the row (the list fills to cap, and past it the row retries as before),
 * so compactions stay few. */
template <typename T, int D, int NP>
__device__ void pass_cands(const fused_args &A, const pf_lane &L, const uint32_t (*qa)[D / 16][4],
                           unsigned char *stages) {
    const int lane = threadIdx.x & 31;
    int n[2] = {0, 0}; /* the row's candidates so far, the same in its quad's lanes */
    float run[2] = {-CUDART_INF_F, -CUDART_INF_F}, thr[2];
    float floor[2] = {-CUDART_INF_F, -CUDART_INF_F}; /* bounds from compactions */
    bool settled[2] = {false, false}; /* no more compactions: one kept over half the list */
    float *stage = kept_stage<D, NP>(stages);
    for (int k = 0; k < 2; k++) thr[k] = A.round && L.on[k] ? A.thr[L.row[k]] : -CUDART_INF_F;
    int bad = 0;
    auto use = [&](int64_t k0, float(*s)[4], const unsigned char *) {
        if (!A.round) {
            float mx[2] = {-CUDART_INF_F, -CUDART_INF_F};
#pragma unroll
            for (int n8 = 0; n8 < PF_KEYS / 8; n8++)
#pragma unroll
                for (int i = 0; i < 4; i++) mx[i >> 1] = fmaxf(mx[i >> 1], s[n8][i]);
            for (int k = 0; k < 2; k++) {
                run[k] = fmaxf(run[k], quad_max(mx[k]));
                thr[k] = run[k] - 1.f - 1e-4f * (1.f + fabsf(run[k]));
            }
        }
#pragma unroll
        for (int k = 0; k < 2; k++) {
            /* the lane's candidates of row k in the tile: bit 2 n8 + b */
            auto tile_mask = [&]() {
                const float t = fmaxf(thr[k], floor[k]);
                unsigned m = 0;
#pragma unroll
                for (int n8 = 0; n8 < PF_KEYS / 8; n8++)
#pragma unroll
                    for (int b = 0; b < 2; b++)
                        m |= (unsigned)(L.on[k] && s[n8][2 * k + b] > t) << (2 * n8 + b);
                return m;
            };
            unsigned m = tile_mask();
            int total;
            int at = quad_exclusive(__popc(m), &total);
            const bool full =
                    !settled[k] && n[k] > 0 && n[k] <= A.cap && n[k] + total > A.compact_at;
            unsigned quads = __ballot_sync(0xffffffffu, full && (lane & 3) == 0);
            if (quads) {
                for (; quads; quads &= quads - 1) {
                    const int src = __ffs(quads) - 1;
                    int kept = __shfl_sync(0xffffffffu, n[k], src);
                    const float f =
                            compact_row_list(A, __shfl_sync(0xffffffffu, L.row[k], src), &kept);
                    if ((lane >> 2) == (src >> 2)) {
                        floor[k] = f;
                        settled[k] = 2 * kept > A.compact_at;
                        n[k] = kept;
                    }
                }
                m = tile_mask();
                at = quad_exclusive(__popc(m), &total);
            }
            at += n[k];
            n[k] += total;
            store_kept(A, m, at, A.cap, L.row[k] * A.cap, k, k0, s, stage);
        }
    };
    sweep_z<T, D, NP, false>(A, L, qa, block_keys(A), stages, &bad, use);
    if (bad) atomicExch(A.bad, 1); /* |scale q.k| overflowed: the step fails (docs/math.md §6.2) */
    if ((lane & 3) == 0)
        for (int k = 0; k < 2; k++)
            if (L.on[k]) {
                A.count[L.row[k]] = n[k];
                A.thr[L.row[k]] = fmaxf(A.round ? thr[k] : -CUDART_INF_F, floor[k]);
            }
    if (!A.round) { /* rows compacted, one atomic per warp */
        const unsigned c = __ballot_sync(0xffffffffu, (lane & 3) == 0 && floor[0] > -CUDART_INF_F),
                       d = __ballot_sync(0xffffffffu, (lane & 3) == 0 && floor[1] > -CUDART_INF_F);
        if (lane == 0 && (c | d))
            atomicAdd(A.rows + PF_COMPACTED, (unsigned long long)(__popc(c) + __popc(d)));
    }
}

/* Step 2: the rows in ROW_NEWTON, exactly: their max, then tau_step from their threshold, each
 * step's sums (the solver's cand_sums / cand_newton over every key of the row) by a sweep; the
 * four lanes of a row hold the same sums and take the same step. Softmax: tau - M =
 * log sum exp(z - M), exact after one sweep (docs/math.md §0). */
template <typename T, int D, int NP>
__device__ void pass_newton(const fused_args &A, const pf_lane &L, const uint32_t (*qa)[D / 16][4],
                            unsigned char *stages) {
    const int64_t nk = block_keys(A);
    const double beta = 1.0 / (A.alpha - 1.0);
    const bool softmax = A.alpha == 1.0;
    const bool sums = tau_by_moments(A.alpha); /* else F and F' (cand_newton) */
    int unused = 0; /* P1 (histogram scheme), round 0 or the max sweep checked every z */
    float m[2] = {-CUDART_INF_F, -CUDART_INF_F};
    for (int k = 0; k < 2; k++)
        if (A.max_known && L.on[k]) m[k] = A.rowm[L.row[k]];
    /* a sweep fewer where P1 found every row's max (the same z, so the same max bitwise) */
    if (!A.max_known || __syncthreads_or(isnan(m[0]) || isnan(m[1]))) {
        int bad = 0; /* softmax has no round 0, so its max sweep checks them */
        m[0] = m[1] = -CUDART_INF_F;
        sweep_z<T, D, NP, false>(A, L, qa, nk, stages, &bad,
                                 [&](int64_t, float(*s)[4], const unsigned char *) {
#pragma unroll
                                     for (int n8 = 0; n8 < PF_KEYS / 8; n8++)
#pragma unroll
                                         for (int i = 0; i < 4; i++)
                                             m[i >> 1] = fmaxf(m[i >> 1], s[n8][i]);
                                 });
        if (bad) atomicExch(A.bad, 1); /* |scale q.k| overflowed (docs/math.md §6.2) */
        for (int k = 0; k < 2; k++) m[k] = quad_max(m[k]);
    }
    tau_iter it[2];
    int done[2];
    for (int k = 0; k < 2; k++) {
        const double t0 = L.on[k] && !softmax ? (double)A.thr[L.row[k]] - (double)m[k] : -1.0;
        it[k] = tau_start(t0 > -1.0 ? t0 : -1.0);
        done[k] = !L.on[k];
    }
    const int cap = tau_max_iters(A.alpha);
    for (int n = 0; n < cap && __syncthreads_or(!done[0] || !done[1]); n++) {
        double c[2] = {0, 0}, s1[2] = {0, 0}, s2[2] = {0, 0}, mn[2] = {1e300, 1e300};
        double f[2] = {0, 0}, fp[2] = {0, 0};
        sweep_z<T, D, NP, false>(A, L, qa, nk, stages, &unused,
                                 [&](int64_t, float(*s)[4], const unsigned char *) {
#pragma unroll
                                     for (int n8 = 0; n8 < PF_KEYS / 8; n8++)
#pragma unroll
                                         for (int i = 0; i < 4; i++) {
                                             const int k = i >> 1;
                                             if (done[k]) continue;
                                             const double y = (double)s[n8][i] - (double)m[k];
                                             if (softmax) {
                                                 f[k] += exp(y); /* masked: exp(-inf) = 0 */
                                             } else if (sums && y > it[k].t) {
                                                 c[k] += 1;
                                                 s1[k] += y;
                                                 s2[k] += y * y;
                                                 mn[k] = y < mn[k] ? y : mn[k];
                                             } else if (!sums && y - it[k].t > 0) {
                                                 const double pb1 = pow(y - it[k].t, beta - 1.0);
                                                 f[k] += pb1 * (y - it[k].t);
                                                 fp[k] += pb1;
                                             }
                                         }
                                 });
        for (int k = 0; k < 2; k++) {
            const tau_sums S = {ekv_quad_sum(c[k]), ekv_quad_sum(s1[k]), ekv_quad_sum(s2[k]),
                                quad_min(mn[k])};
            const double F = ekv_quad_sum(f[k]) - 1.0, Fp = -beta * ekv_quad_sum(fp[k]);
            if (done[k]) continue;
            if (softmax) /* F + 1 = sum exp(z - M) >= 1: the max gives 1 */
                it[k].t = log(F + 1.0), done[k] = 1;
            else
                done[k] = tau_step(A.alpha, S, F, Fp, &it[k]);
        }
    }
    if (((threadIdx.x & 31) & 3) == 0)
        for (int k = 0; k < 2; k++)
            if (L.on[k]) {
                A.rowm[L.row[k]] = m[k];
                A.tau[L.row[k]] = it[k].t;
                A.state[L.row[k]] = ROW_SOLVED_NEWTON;
            }
}

/* Step 4, the rows solved by Newton passes: o = sum p v over the prefix, divided by sum p,
 * into att [T][H][D] (softmax: into ohat too, o-hat = o); with A.ohat_pass, o-hat =
 * sum w~ v / sum w~ into ohat instead (docs/math.md §13.3). w~ <= 1 where alpha <= 2 (as p, it
 * takes pscale); alpha > 2 has w~ >= 1 on the support, so no scale (f16: a w~ past 65504, a key
 * within ~1e-10 of tau, overflows, as the backward's ds does, §13.3 "f16's range"). */
template <typename T, int D, int NP>
__device__ void pass_out(const fused_args &A, const pf_lane &L, const uint32_t (*qa)[D / 16][4],
                         unsigned char *stages) {
    const int lane = threadIdx.x & 31;
    const double beta = 1.0 / (A.alpha - 1.0);
    const bool jw = A.ohat_pass;
    const float wscale = jw && A.alpha > 2.0 ? 1.f : A.pscale;
    int unused = 0; /* round 0 checked every z */
    double tau[2], sum[2] = {0, 0};
    for (int k = 0; k < 2; k++) /* p of a masked or padding key: [-inf - tau]_+ = 0 */
        tau[k] = L.on[k] ? (double)A.rowm[L.row[k]] + A.tau[L.row[k]] : 0.0;
    float o[D / 8][4];
    mma_zero<D / 8>(o);
    auto use = [&](int64_t, float(*s)[4], const unsigned char *vt) {
#pragma unroll
        for (int n8 = 0; n8 < PF_KEYS / 8; n8++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float p = jw ? attn_jweight(s[n8][i], tau[i >> 1], A.alpha, beta)
                                   : attn_weight(s[n8][i], tau[i >> 1], A.alpha, beta);
                sum[i >> 1] += p;
                s[n8][i] = p * wscale; /* within f16's range (above; docs/math.md §12) */
            }
#pragma unroll
        for (int q = 0; q < PF_KEYS / 16; q++)
            tile_pv<T, D, split_parts<T>()>(vt + q * 16 * D * 2, s + 2 * q, o);
    };
    sweep_z<T, D, NP, true>(A, L, qa, block_keys(A), stages, &unused, use);
    for (int k = 0; k < 2; k++) {
        const double tot = ekv_quad_sum(sum[k]);
        if (!L.on[k]) continue;
        const float f = (float)(1.0 / (tot * (double)wscale));
        const int64_t at = (L.t[k] * A.H + L.h[k]) * A.D + 2 * (lane & 3);
        float *dst = (jw ? A.ohat : A.att) + at;
        float *also = !jw && A.ohat && A.alpha == 1.0 ? A.ohat + at : NULL;
#pragma unroll
        for (int nt = 0; nt < D / 8; nt++) {
            const float2 x = make_float2(o[nt][2 * k] * f, o[nt][2 * k + 1] * f);
            *reinterpret_cast<float2 *>(dst + nt * 8) = x;
            if (also) *reinterpret_cast<float2 *>(also + nt * 8) = x;
        }
    }
}

template <typename T, int D, int NP, int MODE>
__global__ void __launch_bounds__(PF_THREADS, fused_min_blocks<MODE, NP>())
        fused_kernel(fused_args A) {
    ekv_grid_begin();
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int want = MODE == PF_OUT      ? ROW_SOLVED_NEWTON
                     : MODE == PF_NEWTON ? ROW_NEWTON
                     : A.round           ? ROW_RETRY
                                         : ROW_FRESH;
    const pf_lane L = lane_rows(A, want);
    if (!__syncthreads_or(L.on[0] || L.on[1])) return;
    uint32_t qa[NP][D / 16][4];
    load_queries<T, D, NP>(A, reinterpret_cast<T *>(smem_raw), qa);
    if (MODE == PF_CANDS) pass_cands<T, D, NP>(A, L, qa, smem_raw);
    if (MODE == PF_NEWTON) pass_newton<T, D, NP>(A, L, qa, smem_raw);
    if (MODE == PF_OUT) pass_out<T, D, NP>(A, L, qa, smem_raw);
}

/* A warp per row: tau of a row in the round's state from its candidates (docs/math.md §12):
 * all kept, the solve; else the kept ones' threshold (as fp32 just below it: bound_f32)
 * becomes the row's next threshold, and after the last round the row
 * takes Newton passes. A warp, not a block: a row has at most cap (4096) candidates, and a
 * block per row spent its time in barriers (ncu: as long as a sweep). The candidates are staged
 * in the warp's shared memory when they fit, else read from the buffer. Warp-uniform exits. */
__global__ void __launch_bounds__(PF_TAU_THREADS) fused_tau_kernel(fused_args A) {
    ekv_grid_begin();
    __shared__ float stage[PF_TAU_THREADS / 32][PF_TAU_STAGE];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t row = (int64_t)blockIdx.x * (PF_TAU_THREADS / 32) + warp;
    if (row >= A.Hk * A.R || A.state[row] != (A.round ? ROW_RETRY : ROW_FRESH)) return;
    const int64_t n = A.count[row], kept = n < A.cap ? n : A.cap;
    const float *cs = stage_list(A.cand + row * A.cap, kept, stage[warp]);
    if (n <= A.cap) { /* every candidate, the row's max among them */
        float M = -CUDART_INF_F;
        for (int64_t j = lane; j < n; j += 32) M = fmaxf(M, cs[j]);
        M = ekv_warp_max(M);
        const double t = solve_tau<true>(cs, n, M, A.alpha, NULL);
        if (lane == 0) {
            A.rowm[row] = M;
            A.tau[row] = t;
            A.state[row] = ROW_SOLVED;
        }
        return;
    }
    const double lb = subset_threshold<true>(cs, kept, A.alpha, NULL, NULL);
    if (lane == 0) {
        float thr = bound_f32(lb);
        if (A.thr[row] > thr) thr = A.thr[row]; /* pass_cands' bound, or the last round's */
        A.thr[row] = thr;
        A.state[row] = A.last ? ROW_NEWTON : ROW_RETRY;
        list_for_next_pass(A, row);
        if (!A.round) atomicAdd(A.rows + PF_RETRIED, 1ull);
        if (A.last) atomicAdd(A.rows + PF_NEWTONED, 1ull);
    }
}

/* Step 3, a warp per row solved from its candidates (ROW_SOLVED): gather_row_output over its
 * whole list (the tau kernel solved over all of it). Warp-uniform exits. */
template <typename T, int D, bool OHAT>
__global__ void __launch_bounds__(PF_GATHER_THREADS) gather_out_kernel(fused_args A) {
    ekv_grid_begin();
    const int64_t row = (int64_t)blockIdx.x * (PF_GATHER_THREADS / 32) + (threadIdx.x >> 5);
    if (row >= A.Hk * A.R || A.state[row] != ROW_SOLVED) return;
    gather_row_output<T, D, OHAT>(A, row, A.cand + list_at(A, row), A.cidx + list_at(A, row),
                                  A.count[row], (double)A.rowm[row] + A.tau[row]);
}

/* Every row of the block to state v (softmax: ROW_NEWTON, no candidate rounds). */
__global__ void set_rows_kernel(int32_t *state, int64_t rows, int32_t v) {
    ekv_grid_begin();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows) state[i] = v;
}

cudaError_t launch_gather(ekv_dtype dt, const fused_args &A, cudaStream_t s) {
    constexpr int per = PF_GATHER_THREADS / 32;
    const unsigned blocks = (unsigned)((A.Hk * A.R + per - 1) / per);
    return with_gather_kernel(dt, A, [&](auto ty, auto d, auto ohat) {
        gather_out_kernel<typename decltype(ty)::type, decltype(d)::value, decltype(ohat)::value>
                <<<blocks, PF_GATHER_THREADS, 0, s>>>(A);
        return cudaGetLastError();
    });
}

template <typename T, int D, int NP, int MODE>
cudaError_t launch_pass(const fused_args &A, cudaStream_t s) {
    return launch_row_blocks<fused_kernel<T, D, NP, MODE>>(
            A, fused_smem_bytes<D, NP, MODE == PF_OUT>() + (MODE == PF_CANDS ? (size_t)PF_KEPT_BYTES : 0),
            s);
}

template <typename T, int NP>
cudaError_t launch_mode(const fused_args &A, int mode, cudaStream_t s) {
    if (A.D == 64)
        return mode == PF_CANDS    ? launch_pass<T, 64, NP, PF_CANDS>(A, s)
               : mode == PF_NEWTON ? launch_pass<T, 64, NP, PF_NEWTON>(A, s)
                                   : launch_pass<T, 64, NP, PF_OUT>(A, s);
    return mode == PF_CANDS    ? launch_pass<T, 128, NP, PF_CANDS>(A, s)
           : mode == PF_NEWTON ? launch_pass<T, 128, NP, PF_NEWTON>(A, s)
                               : launch_pass<T, 128, NP, PF_OUT>(A, s);
}

/* The pass mode over the queries split for K's dtype dt. */
cudaError_t launch(ekv_dtype dt, const fused_args &A, int mode, cudaStream_t s) {
    return with_query_split(dt, A.nq, [&](auto q) {
        return launch_mode<typename decltype(q)::type, decltype(q)::np>(A, mode, s);
    });
}

/* The Newton rows' output sweep, then (entmax with o-hat asked for) their o-hat sweep. */
ekv_status newton_outputs(const ekv_cuda_prefill *pf, ekv_dtype dt, const fused_args &A) {
    GPU_TRY(pf, launch(dt, A, PF_OUT, pf->stream));
    if (!A.ohat || A.alpha == 1.0) return EKV_OK; /* softmax: the output sweep wrote o-hat = o */
    fused_args W = A;
    W.ohat_pass = 1;
    GPU_TRY(pf, launch(dt, W, PF_OUT, pf->stream));
    return EKV_OK;
}

/* The rows on A's list (wlist_in): their Newton passes, then their output (and o-hat) by a
 * sweep; every other row's output (and o-hat) from its list (gather_out_kernel), unless the
 * scheme's tau kernel gathered them already (`gathered`: the histogram scheme's hist_tau_kernel
 * outputs each row it solves). Both schemes end so. */
ekv_status newton_and_outputs(const ekv_cuda_prefill *pf, ekv_dtype dt, const fused_args &A,
                              bool gathered) {
    GPU_TRY(pf, launch(dt, A, PF_NEWTON, pf->stream));
    ekv_status st = newton_outputs(pf, dt, A);
    if (st) return st;
    if (!gathered) GPU_TRY(pf, launch_gather(dt, A, pf->stream));
    return EKV_OK;
}

} // namespace

bool ekv_cuda_prefill_fused_applies(ekv_dtype kv, int64_t head_dim) {
    return (kv == EKV_DTYPE_F16 || kv == EKV_DTYPE_BF16) && (head_dim == 64 || head_dim == 128);
}

ekv_status ekv_cuda_prefill_fused(const ekv_cuda_prefill *pf, const ekv_cuda_prefill_block *b,
                                  const prefill_args &P) {
    fused_args A;
    static_cast<prefill_args &>(A) = P;
    A.k = b->k;
    A.v = b->v;
    A.kstride = P.Hk * P.D;
    A.noncausal_keys = b->noncausal_keys;
    A.cap = pf->cand_cap;
    A.compact_at = pf->compact_at < pf->cand_cap ? pf->compact_at : pf->cand_cap;
    A.cand = pf->cand;
    A.cidx = pf->cidx;
    A.count = pf->count;
    A.state = pf->state;
    A.thr = pf->thr;
    A.rowm = pf->m;
    A.tau = pf->tau;
    A.rows = b->counters;
    A.off = NULL; /* the candidate scheme: row * cap */
    A.pool = 0;
    A.pool_used = NULL;
    A.row_cap = 0;
    A.max_known = 0;
    A.ohat_pass = 0;
    A.marks = NULL; /* the histogram scheme's, below */
    A.mark_words = 0;
    const int64_t rows = P.Hk * P.R;
    const ekv_dtype dt = b->dtype;
    if (b->alpha == 1.0) { /* softmax: every row's max and log-sum-exp by sweeps, then its output */
        set_rows_kernel<<<(unsigned)((rows + 255) / 256), 256, 0, pf->stream>>>(A.state, rows,
                                                                                ROW_NEWTON);
        GPU_LAUNCHED(pf);
        A.wlist_in = NULL;
        A.wcount_in = NULL;
        GPU_TRY(pf, launch(dt, A, PF_NEWTON, pf->stream));
        return newton_outputs(pf, dt, A);
    }
    if (pf->tau_scheme == EKV_PREFILL_TAU_HIST) { /* docs/math.md §12.1 */
        A.round = A.last = 0;
        A.off = pf->off;
        A.pool = rows * (int64_t)pf->cand_cap;
        A.pool_used = pf->pool_used;
        const int32_t cap = ekv_prefill_row_cap(pf->row_cap);
        A.row_cap = cap < pf->cand_cap ? cap : pf->cand_cap; /* lists within the pool's share */
        A.max_known = 1;                                     /* P1's (prefill_hist.cu) */
        const int64_t keys = b->noncausal_keys ? b->noncausal_keys : P.nk;
        if (pf->marks && keys <= pf->key_cap) { /* the layout's room: else every tile */
            A.marks = pf->marks;
            A.mark_words = ekv_prefill_mark_words(keys);
        }
        A.wlist_in = NULL;
        A.wcount_in = NULL;
        A.wlist_out = pf->wlist;
        A.wcount_out = pf->wcount;
        GPU_TRY(pf, prefill_hist_lists(dt, A, pf->stream));
        A.wlist_in = pf->wlist;
        A.wcount_in = pf->wcount;
        return newton_and_outputs(pf, dt, A, true);
    }
    /* every row ROW_FRESH; a pass writes the counts of the rows it works on */
    GPU_TRY(pf, cudaMemsetAsync(A.state, 0, (size_t)rows * 4, pf->stream));
    /* the row lists, two in turn: round r's tau kernel writes list r % 2, which round r + 1's
     * candidates pass (or, after the last round, the Newton pass) reads */
    int32_t *list[2] = {pf->wlist, pf->wlist + rows};
    int32_t *count[2] = {pf->wcount, pf->wcount + P.Hk};
    for (int round = 0; round < PF_ROUNDS; round++) {
        A.round = round;
        A.last = round == PF_ROUNDS - 1;
        A.wlist_in = round ? list[(round - 1) % 2] : NULL; /* round 0: every row */
        A.wcount_in = round ? count[(round - 1) % 2] : NULL;
        A.wlist_out = list[round % 2];
        A.wcount_out = count[round % 2];
        GPU_TRY(pf, launch(dt, A, PF_CANDS, pf->stream));
        GPU_TRY(pf, cudaMemsetAsync(A.wcount_out, 0, (size_t)P.Hk * 4, pf->stream));
        fused_tau_kernel<<<(unsigned)((rows + PF_TAU_THREADS / 32 - 1) / (PF_TAU_THREADS / 32)),
                           PF_TAU_THREADS, 0, pf->stream>>>(A);
        GPU_LAUNCHED(pf);
    }
    /* the rows left after the last round */
    A.wlist_in = list[(PF_ROUNDS - 1) % 2];
    A.wcount_in = count[(PF_ROUNDS - 1) % 2];
    return newton_and_outputs(pf, dt, A, false);
}
