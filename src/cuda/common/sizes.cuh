/*
 * The CUDA backend's fixed sizes: the threads of most blocks, the default length of a tau
 * candidate list, the largest GQA group and head dim the kernels compile for, the screen's
 * retry grid and tau(l)'s short list, the bins of tau's count bound, the screen's row chunks and
 * the fused attend's shapes, the select kernels' blocks and the split top-k's digits.
 */
#pragma once

enum {
    EKV_CUDA_THREADS = 256,    /* threads of the attend/bound/select blocks              */
    EKV_CUDA_CAND_CAP = 16384, /* tau candidates (and support rows) listed per query head */
    EKV_CUDA_MAX_GROUP = 16,   /* GQA group sizes the register tiles hold               */
    EKV_CUDA_MAX_DIM = 512,
    EKV_SCREEN_GRID = 64, /* thresholds M - 1 + k / 64 of the screen's retry (screen.cu)     */
    EKV_SCREEN_SOLVE_MAX = 32768, /* l values tau(l)'s solve lists and keeps in shared memory */
    EKV_CUDA_TAU_HIST_BINS = 2048, /* bins of y = z - M in [-1, 0] of tau's count bound      */
    EKV_CUDA_ROW_CHUNK_WORDS = 256, /* survivor bitmap words per block of the rows kernels  */
    EKV_CUDA_FUSED_GROUPS = 8, /* (sequence, KV head) pairs of a fused attend step at most  */
    EKV_CUDA_FUSED_GROUP = 8,  /* and query heads a KV head (stages/attend_fused.cu)        */
    EKV_CUDA_FUSED_PER_SM = 2, /* its blocks per SM at most: short barriers, one wave       */
    EKV_CUDA_FUSED_NEAR_CAP = 2048 /* its first round's scores near tau listed per row     */
};

/* The select kernels (select/select.cu) and the split top-k (select/select_parts.cuh). */
enum {
    EKV_CUDA_SEL_THREADS = 1024,    /* threads of a select block                           */
    EKV_CUDA_SEL_BLOCKS_PER_SM = 2, /* of them resident at most (2048 threads an SM; each
                                       kernel's occupancy decides, select/select.cu)     */
    EKV_CUDA_SEL_DIGITS = 4,        /* radix digits of 8 bits of the fp32 ranking keys     */
    EKV_CUDA_SEL_HISTS = 5,         /* a list's summed histograms: the digits', and the second
                                       digit's counted with the first under its guess     */
    EKV_CUDA_SEL_PART_PAGES = 2048, /* default pages of a list one top-k block ranks       */
    EKV_CUDA_TAU_SPREAD_MIN = 4096, /* default candidates past which a tau cluster solves a
                                       head (ekv_cuda_plan_params.tau_spread_min)         */
    EKV_CUDA_SEL_MIN_PARTS = 6      /* a list shorter than this many parts takes one block:
                                       the parts' barriers cost more than they save
                                       (bench/RESULTS.md, 2026-12-06 third session: 2 and 4
                                       parts lost 8-23 us at 64K and 128K tokens, 8 parts
                                       won at 256K)                                       */
};
