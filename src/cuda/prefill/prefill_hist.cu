/*
 * The fused prefill's histogram scheme (docs/math.md §12.1; prefill.cuh, EKV_PREFILL_TAU_HIST):
 * each row's tau from a list sized before it is filled, instead of candidate rounds.
 *   P1 (HIST_COUNT, every row): one sweep of the rows' z (tile_z, the kernel's one z function)
 *      for the row max M and a histogram of z on the absolute grid b(z) = floor(32 z): a ring
 *      of HB_SLOTS counts per row in shared memory holding the bins b(m) - HB_WIN .. b(m) of
 *      the running max m (lower z cannot be in the support: they are below M - 1). Its
 *      epilogue: the count bound (docs/math.md §9.1) over the bins' lower edges, a lower bound
 *      lb of tau on the grid (or M - 1), and n_lb, the count of the bins from lb's: exactly
 *      the number of z >= that edge. It marks the (row block, key tile) pairs where a row of
 *      a warp counted a z (tile_marker): P2's lists come from those tiles only. With ALiBi
 *      slopes the sweep stops where no key left can reach a row's window (row_reached).
 *   route (a thread a row): rows with n_lb <= row_cap get a slice of the list pool by a prefix
 *      sum of n_lb (ROW_LIST), then the longer rows, in row order, take what the pool has left
 *      (one block); the others go to the Newton passes from lb (ROW_NEWTON, on the list
 *      wlist_out), as the candidate scheme's overflowing rows.
 *   P2 (HIST_LIST, ROW_LIST rows): one more sweep, of P1's marked tiles (marked_tiles), appends
 *      every z >= the edge with its key to the row's slice; the same z as P1's, so the slice
 *      holds them exactly (a row that finds another count, or whose list's max is not P1's M,
 *      impossible but checked, goes to the Newton passes).
 *   tau (a warp per row): solve_tau from lb - M over the list, which holds the support, then
 *      the row's output gathered from the same list by the same warp (gather_row_output).
 * The other rows' outputs are swept (prefill_fused.cu, newton_and_outputs).
 */
#include "prefill_fused.cuh"

namespace {

enum {
    HB_SCALE = 32,      /* bins per unit of z: 32 z is exact in fp32, so are the bins' edges */
    HB_SLOTS = 64,      /* the ring of a row's bins */
    HB_WIN = 33,        /* bins counted below the running max's: every z > M - 1 is counted */
    HB_CLAMP = 1 << 20, /* |bin| clamped here (edges exact in fp32, hist_slot_byte's range); rows
                           near it swept */
    HB_RING_ALIGN = HB_SLOTS * 4, /* rings on this boundary: a slot's byte offset XORs in */
    HB_ROUTE_THREADS = 1024
};
enum { HIST_COUNT, HIST_LIST };

/* b(z) = floor(32 z) of a finite z, clamped (monotone: the order of the bins is z's). */
__device__ __forceinline__ int hist_bin(float z) {
    const float x = fminf(fmaxf((float)HB_SCALE * z, -(float)HB_CLAMP), (float)HB_CLAMP);
    return __float2int_rd(x);
}
/* The lower edge of bin b, exact for |b| <= HB_CLAMP. */
__device__ __forceinline__ float hist_edge(int b) { return (float)b * (1.f / HB_SCALE); }

/* A row's ring: HB_SLOTS counters from a shared address on an HB_RING_ALIGN boundary, slot s of
 * bin b (s = b mod HB_SLOTS) stored at s ^ swz. swz is the row's place among the 8 rows of a
 * warp's counting instruction (lane / 4), so those rows' same slot lies in 8 banks where their z
 * fall in the same bin (near rows of a flat head do). `at` is the ring's address with swz in its
 * slot bits: a slot's byte offset XORs into it (hist_count_tile's one LOP3 a z). */
struct hist_ring {
    unsigned *base;
    uint32_t at;
    int swz;
    __device__ __forceinline__ unsigned &slot(int b) const {
        return base[(b & (HB_SLOTS - 1)) ^ swz];
    }
};

/* The byte offset of a z's slot in a ring, 4 (b(z) mod HB_SLOTS), by one fma rounded down onto
 * 1.5 x 2^23: exactly 1.5 x 2^23 + floor(128 z) while |128 z| < 2^22, and floor(128 z) =
 * 4 floor(32 z) + r with r in 0..3, so its bits 2..7 are the bin's low bits (the float's low
 * bits are the integer's: its spacing there is 1). A z given here lies within HB_WIN + 4 bins of
 * the running max's, so in range for every row that hist_finish keeps (|b(m)| < HB_CLAMP - 2
 * HB_SLOTS); a row counted out of range ends out of it too, or its max rises more than HB_SLOTS
 * bins after, which zeroes every slot. Not hist_bin's conversion: a quarter-rate instruction
 * (F2I) a z. */
__device__ __forceinline__ uint32_t hist_slot_byte(float z) {
    return __float_as_uint(__fmaf_rd(z, 4.f * HB_SCALE, 12582912.f)) & ((HB_SLOTS - 1) << 2);
}

/* Whether a row whose max lies in bin bm is far enough from the clamp for its counts and edges
 * (else its bins are not z's: the row takes the Newton passes, and P1 sweeps all its keys). */
__device__ __forceinline__ bool hist_in_range(int bm) {
    return bm > -HB_CLAMP + 2 * HB_SLOTS && bm < HB_CLAMP - 2 * HB_SLOTS;
}

__device__ __forceinline__ int quad_max_int(int v) {
    return ekv_quad_fold(v, [](int a, int b) { return max(a, b); });
}

/* One tile's z of row k (the lane's s[n8][2 k + b]) into the row's ring (quad-uniform run, bm:
 * the running max and its bin). When the max's bin rises, the slots of the new top bins held
 * bins HB_SLOTS lower, which are below the window now: zeroed before anything is counted.
 * Every z counted is <= m, so never in a slot zeroed later. Returns whether a row of the warp
 * had a z to count (the tile's mark, tile_marker). Warp-uniform call. */
__device__ __forceinline__ bool hist_count_tile(const float (*s)[4], int k, bool on,
                                                const hist_ring &ring, float *run, int *bm) {
    const int q = threadIdx.x & 3;
    float mx = -CUDART_INF_F;
#pragma unroll
    for (int n8 = 0; n8 < PF_KEYS / 8; n8++) mx = fmaxf(mx, fmaxf(s[n8][2 * k], s[n8][2 * k + 1]));
    mx = quad_max(mx);
    if (mx > *run) {
        *run = mx;
        const int nb = hist_bin(mx);
        if (nb > *bm) {
            const int from = nb - *bm >= HB_SLOTS ? nb - HB_SLOTS + 1 : *bm + 1;
            for (int b = from + q; b <= nb; b += 4) ring.slot(b) = 0u;
            *bm = nb;
        }
    }
    __syncwarp(); /* the zeroed slots before the counts */
    const float lo = hist_edge(*bm - HB_WIN); /* z >= lo iff b(z) >= bm - HB_WIN */
    /* a tile where no row of the warp has a z to count (a peaked row past its support) skips
     * the per-z work */
    const bool counts = __any_sync(0xffffffffu, on && mx >= lo);
    if (counts) {
        /* Every z is added to a slot: a z below the window (or masked, -inf) as max(z, g), in a
         * bin from bm - HB_WIN - 1 - q to bm - HB_WIN - 1 (q: the lane's place in its quad, so
         * the quad's lanes add to four words there). Those bins are never read (hist_finish reads
         * from bm - 32 up) and their slots are zeroed before any bin read could take them: that
         * needs the max to rise at least HB_SLOTS - HB_WIN - 4 bins, and a rise zeroes the slots
         * of the bins it passes. So a z costs a max, an fma, a LOP3 and the add: no compare, no
         * select. A row the pass does not work on (padding) counts into its own ring, unread. */
        const float g = hist_edge(*bm - HB_WIN - 1 - q);
#pragma unroll
        for (int n8 = 0; n8 < PF_KEYS / 8; n8++)
#pragma unroll
            for (int b = 0; b < 2; b++)
                red_shared_add(hist_slot_byte(fmaxf(s[n8][2 * k + b], g)) ^ ring.at, 1u);
    }
    __syncwarp(); /* the counts before the next tile's zeroing */
    return counts;
}

/* The block's words of tile marks (fused_args.marks): P1's and P2's blocks are the same row
 * blocks (both over every row, block_tile). */
__device__ __forceinline__ uint32_t *block_marks(const fused_args &A) {
    return A.marks + ((int64_t)blockIdx.y * gridDim.x + block_tile(A)) * A.mark_words;
}

/* P1's marks (docs/math.md §12.1, "Tile marks"): a tile is marked where a row of the warp counted
 * a z in it (hist_count_tile). Every z that P2 lists is such a z: P2's edge e_c* >= e(b(M) - 32)
 * lies above the window's bottom e(b(m) - 33) of the running max m at every tile, so an unmarked
 * tile adds nothing to any list. The sweep goes down the tiles, so the warp keeps the bits of the
 * word of 32 tiles it is in and ORs them into the block's words when it leaves it (flush).
 * Warp-uniform calls. */
struct tile_marker {
    int word = -1;
    unsigned bits = 0u;
    __device__ __forceinline__ void flush(const fused_args &A) {
        if (bits && (threadIdx.x & 31) == 0) atomicOr(block_marks(A) + word, bits);
        bits = 0u;
    }
    __device__ __forceinline__ void mark(const fused_args &A, int64_t k0, bool counted) {
        if (!A.marks) return;
        const int t = (int)(k0 / PF_KEYS);
        if ((t >> 5) != word) {
            flush(A);
            word = t >> 5;
        }
        if (counted) bits |= 1u << (t & 31);
    }
};

/* The tiles P2 sweeps (sweep's tile order, as every_tile): the block's marked tiles, last first,
 * found one at a time as the next set bit at or below a cursor in the block's words (every
 * thread reads the same word: a broadcast); without marks (A.marks NULL) every tile. The count
 * is a block reduction: every thread constructs it. Tile indices in int (keys < 2^37), the
 * block's words found again from A where read: P2's registers are full (ptxas). */
struct marked_tiles {
    const fused_args &A;
    int64_t n;  /* tiles to sweep */
    int next;   /* the highest tile not yet issued */
    int ta, tb; /* the last two tiles issued (j even, odd): use_k0's */
    __device__ __forceinline__ marked_tiles(const fused_args &args, int64_t nk) : A(args) {
        __shared__ int scratch[32];
        n = ekv_prefill_tiles(nk);
        next = (int)n - 1;
        if (!A.marks) return; /* block-uniform */
        const uint32_t *words = block_marks(A);
        int c = 0;
        for (int64_t i = threadIdx.x; i < A.mark_words; i += blockDim.x) c += __popc(words[i]);
        n = ekv_block_sum(c, scratch);
    }
    __device__ __forceinline__ int64_t count() const { return n; }
    __device__ __forceinline__ int64_t issue_k0(int64_t j) {
        int t = next;
        if (A.marks) { /* a set bit remains at or below t: j < n */
            const uint32_t *words = block_marks(A);
            unsigned w = words[t >> 5] & (0xffffffffu >> (31 - (t & 31)));
            while (!w) {
                t = (t | 31) - 32; /* the last tile of the word below */
                w = words[t >> 5];
            }
            t = (t & ~31) + 31 - __clz(w);
        }
        next = t - 1;
        if (j & 1)
            tb = t;
        else
            ta = t;
        return (int64_t)t * PF_KEYS;
    }
    __device__ __forceinline__ int64_t use_k0(int64_t j) const {
        return (int64_t)(j & 1 ? tb : ta) * PF_KEYS;
    }
};

/* P1's epilogue for row k (the quad; warp-uniform call): the largest bin c in [bm - 32, bm]
 * whose edge e_c has sum_{j > c} count_j (e_j - e_c)^beta >= 1 (each z of bin j is >= e_j, so
 * F(e_c) >= 1 and e_c <= tau, docs/math.md §9.1), at least bm - 32 (e <= M - 1 <= tau); then
 * n_lb = the counts of the bins from it. pw[d] = (d / 32)^beta rounded down. A row whose bins
 * near the clamp or with no finite z gets n_lb = INT32_MAX (swept). */
__device__ __forceinline__ void hist_finish(const fused_args &A, const pf_lane &L, int k,
                                            const hist_ring &ring, const float *pw, float M,
                                            int bm) {
    const int q = threadIdx.x & 3;
    int found = INT_MIN;
    for (int c = bm - q; c >= bm - 32 && found == INT_MIN; c -= 4) {
        double f = 0;
        for (int j = c + 1; j <= bm; j++) f += (double)ring.slot(j) * (double)pw[j - c];
        if (f >= 1.0 + 1e-9) found = c; /* a margin for the sum's rounding */
    }
    found = quad_max_int(found);
    const int kb = found > bm - 32 ? found : bm - 32;
    int n = 0;
    for (int j = kb + q; j <= bm; j += 4) n += (int)ring.slot(j);
    n = ekv_quad_sum(n);
    const bool safe = isfinite(M) && hist_in_range(bm);
    if (q == 0 && L.on[k]) {
        A.rowm[L.row[k]] = M;
        A.thr[L.row[k]] = safe ? hist_edge(kb) : -CUDART_INF_F; /* else Newton from M - 1 */
        A.count[L.row[k]] = safe ? n : INT32_MAX;
    }
}

/* ALiBi's reach (docs/math.md §12.1): whether no key below k0 can give row k a z that P1 counts.
 * Every such key lies d = pos - (k0 - 1) or more from the row, so its z is at most sb - a m_h d
 * (sb: the row's bound on |s 2^-s|, A.qbound), which lies below the window's bottom e(bm -
 * HB_WIN) with room for the bias's and the fma's roundings (relative 2^-22 at most; the margins
 * are 10^-3). A row the pass does not work on has none to count; a row with a slope of 0, with
 * sb infinite (no bound) or with its max's bin clamped (its window's bottom is not below its
 * max then, and the Newton passes trust P1's max) is never done. */
__device__ __forceinline__ bool row_reached(const pf_lane &L, int k, float sb, int64_t k0, int bm) {
    if (!L.on[k]) return true;
    const int64_t d = L.pos[k] - (k0 - 1);
    const float lo = hist_edge(bm - HB_WIN);
    return L.am[k] > 0.f && d >= 0 && hist_in_range(bm) &&
           sb - L.am[k] * (float)d * 0.999f < lo - 1e-3f * (fabsf(lo) + sb);
}

/* P1: every row's max and histogram (rings: PF_ROWS rings of HB_SLOTS counts, on an HB_RING_ALIGN
 * boundary; pw: HB_WIN + 1 floats of shared memory after them), then hist_finish. */
template <typename T, int D, int NP>
__device__ void pass_hist(const fused_args &A, const pf_lane &L, const uint32_t (*qa)[D / 16][4],
                          unsigned char *stages, unsigned *rings, float *pw) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const double beta = 1.0 / (A.alpha - 1.0);
    for (int i = threadIdx.x; i < PF_ROWS * HB_SLOTS; i += PF_THREADS) rings[i] = 0u;
    for (int d = threadIdx.x; d <= HB_WIN; d += PF_THREADS) { /* rounded down: F stays below */
        const double x = (double)d / HB_SCALE;                /* exact */
        pw[d] = beta == 2.0   ? (float)(x * x)                /* exact (alpha 1.5) */
                : beta == 1.0 ? (float)x                      /* exact (alpha 2) */
                              : __double2float_rd(pow(x, beta) * (1.0 - 1e-15));
    }
    __syncthreads();
    hist_ring ring[2];
#pragma unroll
    for (int k = 0; k < 2; k++) {
        ring[k].base = rings + (warp * 16 + (lane >> 2) + 8 * k) * HB_SLOTS;
        ring[k].swz = lane >> 2;
        ring[k].at =
                (uint32_t)__cvta_generic_to_shared(ring[k].base) | (uint32_t)(ring[k].swz << 2);
    }
    float run[2] = {-CUDART_INF_F, -CUDART_INF_F}, sb[2];
    int bm[2] = {INT_MIN / 2, INT_MIN / 2};
    for (int k = 0; k < 2; k++) sb[k] = A.qbound && L.on[k] ? A.qbound[L.row[k]] : CUDART_INF_F;
    int bad = 0;
    tile_marker marker;
    /* last_k0: the tile just used, where the warp has a live row (its use runs: sweep_z_tiles;
     * a warp without one is done); swept: the tiles used, counted by every thread */
    int64_t last_k0 = 0, swept = 0;
    const int64_t nk = block_keys(A);
    sweep_z<T, D, NP, false>(
            A, L, qa, nk, stages, &bad,
            [&](int64_t k0, float(*s)[4], const unsigned char *) {
                bool counted = false;
#pragma unroll
                for (int k = 0; k < 2; k++)
                    counted |= hist_count_tile(s, k, L.on[k], ring[k], &run[k], &bm[k]);
                marker.mark(A, k0, counted);
                last_k0 = k0;
            },
            cp_async_until_of([&] {
                swept++;
                return !(row_reached(L, 0, sb[0], last_k0, bm[0]) &&
                         row_reached(L, 1, sb[1], last_k0, bm[1]));
            }));
    marker.flush(A);
    if (threadIdx.x == 0 && swept < ekv_prefill_tiles(nk))
        atomicAdd(A.rows + PF_UNREACHED_TILES, (unsigned long long)(ekv_prefill_tiles(nk) - swept));
    if (bad) atomicExch(A.bad, 1); /* |scale q.k| overflowed: the step fails (docs/math.md §6.2) */
    if (!__any_sync(0xffffffffu, L.on[0] || L.on[1])) return; /* sweep_z skipped this warp */
#pragma unroll
    for (int k = 0; k < 2; k++) hist_finish(A, L, k, ring[k], pw, run[k], bm[k]);
}

/* A listed row that P2 or its tau found other than P1 said (never, with one z function; checked):
 * ROW_NEWTON on the Newton passes' list, counted. */
__device__ __forceinline__ void send_to_newton(const fused_args &A, int64_t row) {
    A.state[row] = ROW_NEWTON;
    A.rowm[row] = CUDART_NAN_F; /* P1's max not trusted: the Newton pass sweeps for it */
    list_for_next_pass(A, row);
    atomicAdd(A.rows + PF_NEWTONED, 1ull);
}

/* P2: the ROW_LIST rows' z >= their edge (A.thr) with their keys into their slices (off, room
 * n_lb = A.count): each tile's by a prefix sum over the quad, as pass_cands appends (none past
 * the room). Writes the count found; a row that found other than n_lb goes to the Newton
 * passes, counted. */
template <typename T, int D, int NP>
__device__ void pass_list(const fused_args &A, const pf_lane &L, const uint32_t (*qa)[D / 16][4],
                          unsigned char *stages) {
    const int lane = threadIdx.x & 31;
    float edge[2];
    int64_t off[2];
    int room[2], n[2] = {0, 0};
    for (int k = 0; k < 2; k++) {
        edge[k] = L.on[k] ? A.thr[L.row[k]] : CUDART_INF_F;
        off[k] = L.on[k] ? A.off[L.row[k]] : 0;
        room[k] = L.on[k] ? A.count[L.row[k]] : 0;
    }
    float *stage = kept_stage<D, NP>(stages);
    int unused = 0; /* P1 checked every z */
    auto use = [&](int64_t k0, float(*s)[4], const unsigned char *) {
#pragma unroll
        for (int k = 0; k < 2; k++) {
            unsigned m = 0;
#pragma unroll
            for (int n8 = 0; n8 < PF_KEYS / 8; n8++)
#pragma unroll
                for (int b = 0; b < 2; b++)
                    m |= (unsigned)(s[n8][2 * k + b] >= edge[k]) << (2 * n8 + b);
            int total;
            const int at = n[k] + quad_exclusive(__popc(m), &total);
            n[k] += total;
            store_kept(A, m, at, room[k], off[k], k, k0, s, stage);
        }
    };
    const int64_t nk = block_keys(A);
    marked_tiles tiles(A, nk);
    const int64_t skipped = ekv_prefill_tiles(nk) - tiles.count();
    if (threadIdx.x == 0 && skipped)
        atomicAdd(A.rows + PF_SKIPPED_TILES, (unsigned long long)skipped);
    if (tiles.count()) /* block-uniform: none where no row of the block lists a key */
        sweep_z_tiles<T, D, NP, false>(A, L, qa, nk, tiles, stages, &unused, use);
    if ((lane & 3) == 0)
        for (int k = 0; k < 2; k++) {
            if (!L.on[k]) continue;
            A.count[L.row[k]] = n[k];
            if (n[k] == room[k]) continue;
            /* P1 counted other z than P2 saw (never, with one z function): the Newton passes */
            send_to_newton(A, L.row[k]);
        }
}

/* P1's stages, rings (aligned: the slack) and pw; P2 (HIST_LIST) its stages and kept_stage. */
template <int D, int NP, int MODE> constexpr size_t hist_smem_bytes() {
    return fused_smem_bytes<D, NP, false>() +
           (MODE == HIST_COUNT ? HB_RING_ALIGN + (size_t)PF_ROWS * HB_SLOTS * 4 + (HB_WIN + 1) * 4
                               : (size_t)PF_KEPT_BYTES);
}

/* P1 (every row) or P2 (the ROW_LIST rows) over a block's rows; as many blocks per SM as the
 * candidate pass (fused_min_blocks). */
template <typename T, int D, int NP, int MODE>
__global__ void __launch_bounds__(PF_THREADS, fused_min_blocks<PF_CANDS, NP>())
        hist_kernel(fused_args A) {
    ekv_grid_begin();
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const pf_lane L = lane_rows(A, MODE == HIST_COUNT ? -1 : ROW_LIST);
    if (!__syncthreads_or(L.on[0] || L.on[1])) return;
    uint32_t qa[NP][D / 16][4];
    load_queries<T, D, NP>(A, reinterpret_cast<T *>(smem_raw), qa);
    if (MODE == HIST_LIST) {
        pass_list<T, D, NP>(A, L, qa, smem_raw);
        return;
    }
    unsigned *rings = reinterpret_cast<unsigned *>(
            smem_aligned<HB_RING_ALIGN>(smem_raw + fused_smem_bytes<D, NP, false>()));
    pass_hist<T, D, NP>(A, L, qa, smem_raw, rings,
                        reinterpret_cast<float *>(rings + PF_ROWS * HB_SLOTS));
}

/* Row i (live: i < rows) onto its KV head's Newton list (the route's other rows): the list of
 * list_for_next_pass, one atomic per warp and head (a warp's consecutive rows span two heads at
 * most where R >= 32; any number is handled). Every lane calls. */
__device__ __forceinline__ void route_newton(const fused_args &A, int64_t i, bool live) {
    const int lane = threadIdx.x & 31;
    const int64_t g = live ? i / A.R : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, (long long)g);
    const int leader = __ffs(peers) - 1;
    int base = 0;
    if (live && lane == leader) base = atomicAdd(A.wcount_out + g, __popc(peers));
    base = __shfl_sync(0xffffffffu, base, leader);
    if (live)
        A.wlist_out[g * A.R + base + __popc(peers & ((1u << lane) - 1u))] = (int32_t)(i % A.R);
}

/* Row i's route, decided (every thread of the block calls it): a list slice at pool entry `at`
 * (ROW_LIST), or the Newton list (ROW_NEWTON, route_newton); the block's Newton rows counted.
 * Returns that count; its barrier orders the block's reads before what follows. The rule of
 * both route kernels. */
__device__ __forceinline__ int route_row(const fused_args &A, int64_t i, bool listed, long long at,
                                         bool newton) {
    if (listed) {
        A.off[i] = at;
        A.state[i] = ROW_LIST;
    }
    if (newton) A.state[i] = ROW_NEWTON;
    route_newton(A, i, newton);
    const int n = __syncthreads_count(newton);
    if (threadIdx.x == 0 && n) atomicAdd(A.rows + PF_NEWTONED, (unsigned long long)n);
    return n;
}

/* The route, a thread per row (coalesced; was one block whose threads walked runs of rows, 0.29
 * ms a pass at 32K): the rows of at most row_cap list entries get slices of the list pool by a
 * block scan of their n_lb and one atomic a block on the pool's cursor, so a slice is exactly its
 * row's size (no overflow, no retry) and the slices are disjoint (their order among blocks is the
 * atomics', which changes nothing computed, though the pool's layout varies run to run); rows
 * past the pool and rows P1 could not bound (n_lb INT32_MAX) go to the Newton list. None is past
 * the pool while row_cap <= the pool's share of a row (ekv_cuda_prefill_fused caps it so). The
 * longer rows are left to hist_route_long_kernel. */
__global__ void __launch_bounds__(HB_ROUTE_THREADS) hist_route_kernel(fused_args A) {
    ekv_grid_begin();
    __shared__ long long wsum[HB_ROUTE_THREADS / 32];
    __shared__ long long base;
    const int64_t rows = A.Hk * A.R, i = (int64_t)blockIdx.x * HB_ROUTE_THREADS + threadIdx.x;
    const int c = i < rows ? A.count[i] : 0;
    const bool bounded = i < rows && c != INT32_MAX, fits = bounded && c <= A.row_cap;
    long long total;
    const long long at = ekv_block_exclusive_scan(fits ? (long long)c : 0ll, wsum, &total);
    if (threadIdx.x == 0) base = (long long)atomicAdd(A.pool_used, (unsigned long long)total);
    __syncthreads();
    const bool listed = fits && base + at + c <= A.pool;
    route_row(A, i, listed, base + at, (fits && !listed) || (i < rows && !bounded));
}

/* Row i's list size where it is one of hist_route_long_kernel's (bounded, over row_cap, so at
 * least 1), else 0 (also for i past the rows). */
__device__ __forceinline__ int route_long_count(const fused_args &A, int64_t i, int64_t rows) {
    const int c = i < rows ? A.count[i] : 0;
    return c != INT32_MAX && c > A.row_cap ? c : 0;
}

/* hist_route_long_kernel's chunk of HB_ROUTE_THREADS rows from i0, a thread a row: its long rows
 * in row order take the pool from *base while it lasts; *base then moves past them, or past the
 * pool once one did not fit. */
__device__ __forceinline__ void route_long_chunk(const fused_args &A, int64_t i0, int64_t rows,
                                                 long long *wsum, long long *base) {
    const int64_t i = i0 + threadIdx.x;
    const int c = route_long_count(A, i, rows);
    const bool wants = c > 0;
    long long total; /* the scan's barriers order the last write of *base */
    const long long at = ekv_block_exclusive_scan((long long)c, wsum, &total);
    const long long b = *base;
    const bool listed = wants && b + at + c <= A.pool;
    route_row(A, i, listed, b + at, wants && !listed); /* its barrier: every thread read b */
    if (threadIdx.x == 0) *base = b + total <= A.pool ? b + total : A.pool + 1; /* else full */
}

/* The rows over row_cap, after hist_route_kernel: in row order, each takes the room the short
 * rows left in the pool while it lasts (a flat head's long list then costs a list, not Newton
 * sweeps); from the first that does not fit on, the rest go to the Newton list (the cursor is
 * then put past the pool). One block, so which rows get lists does not depend on timing (the
 * same rows, and the same bits, every run). The block first finds which chunks of a span of 32
 * hold a long row (32 independent loads a thread), then routes only those, in order: a chunk
 * without one routes nothing and leaves the cursor as it is, and walking every chunk cost ~3 us
 * a chunk (0.15 ms a forward at 8K, rows x 3 heads x 2 KV heads, when no row is long). */
__global__ void __launch_bounds__(HB_ROUTE_THREADS) hist_route_long_kernel(fused_args A) {
    ekv_grid_begin();
    __shared__ long long wsum[HB_ROUTE_THREADS / 32];
    __shared__ long long base;
    __shared__ unsigned chunks;
    const int64_t rows = A.Hk * A.R;
    /* the short rows' total (may be past the pool: then no long row fits, c > row_cap >= 0) */
    if (threadIdx.x == 0) base = (long long)*A.pool_used;
    for (int64_t s0 = 0; s0 < rows; s0 += 32 * HB_ROUTE_THREADS) {
        if (threadIdx.x == 0) chunks = 0u;
        __syncthreads();
        unsigned mine = 0u;
#pragma unroll
        for (int k = 0; k < 32; k++) {
            const int64_t i = s0 + (int64_t)k * HB_ROUTE_THREADS + threadIdx.x;
            if (route_long_count(A, i, rows) > 0) mine |= 1u << k;
        }
        if (mine) atomicOr(&chunks, mine);
        __syncthreads();
        for (unsigned m = chunks; m; m &= m - 1u) /* the same m in every thread */
            route_long_chunk(A, s0 + (int64_t)(__ffs((int)m) - 1) * HB_ROUTE_THREADS, rows, wsum,
                             &base);
        __syncthreads(); /* every thread read chunks before the next span's reset */
    }
}

/* A warp per ROW_LIST row: tau from its list, which holds every z >= e (e <= tau: the support),
 * from e - M (a lower bound; -1 at least), M from P1; then the row's output (and o-hat) from the
 * same list (gather_row_output: its z staged, its keys), so no later kernel reads the list again.
 * P1's M must be the list's max bitwise (the same z function, docs/math.md §12.1); a row whose
 * list says otherwise is not trusted: it goes to the Newton passes, counted (tests where every
 * row fits a list require none). Warp-uniform exits. */
template <typename T, int D, bool OHAT>
__global__ void __launch_bounds__(PF_TAU_THREADS) hist_tau_kernel(fused_args A) {
    ekv_grid_begin();
    __shared__ float stage[PF_TAU_THREADS / 32][PF_TAU_STAGE];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t row = (int64_t)blockIdx.x * (PF_TAU_THREADS / 32) + warp;
    if (row >= A.Hk * A.R || A.state[row] != ROW_LIST) return;
    const int64_t n = A.count[row];
    const float *cs = stage_list(A.cand + A.off[row], n, stage[warp]);
    const float M = A.rowm[row];
    float mx = -CUDART_INF_F;
    for (int64_t j = lane; j < n; j += 32) mx = fmaxf(mx, cs[j]);
    if (ekv_warp_max(mx) != M) {
        if (lane == 0) send_to_newton(A, row);
        return;
    }
    const double t0 = fmax((double)A.thr[row] - (double)M, -1.0);
    const double t = solve_tau<true>(cs, n, M, A.alpha, NULL, t0);
    if (lane == 0) {
        A.tau[row] = t;
        A.state[row] = ROW_SOLVED;
    }
    gather_row_output<T, D, OHAT>(A, row, cs, A.cidx + A.off[row], n, (double)M + t);
}

template <int MODE> cudaError_t launch_hist(ekv_dtype dt, const fused_args &A, cudaStream_t s) {
    return with_query_split(dt, A.nq, [&](auto q) {
        typedef typename decltype(q)::type T;
        constexpr int NP = decltype(q)::np;
        if (A.D == 64)
            return launch_row_blocks<hist_kernel<T, 64, NP, MODE>>(
                    A, hist_smem_bytes<64, NP, MODE>(), s);
        return launch_row_blocks<hist_kernel<T, 128, NP, MODE>>(
                A, hist_smem_bytes<128, NP, MODE>(), s);
    });
}

} // namespace

cudaError_t prefill_hist_lists(ekv_dtype dt, const fused_args &A, cudaStream_t s) {
    const int64_t rows = A.Hk * A.R;
    cudaError_t e = cudaMemsetAsync(A.wcount_out, 0, (size_t)A.Hk * 4, s);
    if (e == cudaSuccess) e = cudaMemsetAsync(A.pool_used, 0, 8, s);
    if (e == cudaSuccess && A.marks) /* P1 ORs its marks in */
        e = cudaMemsetAsync(A.marks, 0,
                            (size_t)(A.Hk * ekv_prefill_row_blocks(A.R) * A.mark_words * 4), s);
    if (e == cudaSuccess) e = launch_hist<HIST_COUNT>(dt, A, s);
    if (e == cudaSuccess) {
        const int64_t blocks = (rows + HB_ROUTE_THREADS - 1) / HB_ROUTE_THREADS;
        hist_route_kernel<<<(unsigned)blocks, HB_ROUTE_THREADS, 0, s>>>(A);
        e = cudaGetLastError();
    }
    if (e == cudaSuccess) {
        hist_route_long_kernel<<<1, HB_ROUTE_THREADS, 0, s>>>(A);
        e = cudaGetLastError();
    }
    if (e == cudaSuccess) e = launch_hist<HIST_LIST>(dt, A, s);
    if (e == cudaSuccess) {
        constexpr int per = PF_TAU_THREADS / 32;
        const unsigned blocks = (unsigned)((rows + per - 1) / per);
        e = with_gather_kernel(dt, A, [&](auto ty, auto d, auto ohat) {
            hist_tau_kernel<typename decltype(ty)::type, decltype(d)::value, decltype(ohat)::value>
                    <<<blocks, PF_TAU_THREADS, 0, s>>>(A);
            return cudaGetLastError();
        });
    }
    return e;
}
