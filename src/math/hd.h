/* EKV_HD: a function of the scalar math headers shared by the CPU and the CUDA backend
 * (gaussian_core.h, shard_agree.h): static inline, and __host__ __device__ under nvcc. */
#ifndef EKV_MATH_HD_H
#define EKV_MATH_HD_H
#ifdef __CUDACC__
#define EKV_HD static inline __host__ __device__
#else
#define EKV_HD static inline
#endif
#endif /* EKV_MATH_HD_H */
