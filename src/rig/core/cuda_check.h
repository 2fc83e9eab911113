// One checking macro family for CUDA, cuBLAS(Lt) and NCCL calls: the message records the
// statement, file:line and rank.
#pragma once
#ifdef RIG_WITH_CUDA
#include <cublasLt.h>
#include <cuda_runtime.h>

#include "rig/core/error.h"

#define RIG_CUDA_CHECK(stmt)                                                         \
  do {                                                                               \
    cudaError_t rig_e_ = (stmt);                                                     \
    if (rig_e_ != cudaSuccess)                                                       \
      ::rig::fail("{}", ::rig::call_site(#stmt, __FILE__, __LINE__,                  \
                                         std::string("CUDA error ") +                \
                                             cudaGetErrorString(rig_e_)));           \
  } while (0)

#define RIG_CUBLAS_CHECK(stmt)                                                       \
  do {                                                                               \
    cublasStatus_t rig_s_ = (stmt);                                                  \
    if (rig_s_ != CUBLAS_STATUS_SUCCESS)                                             \
      ::rig::fail("{}", ::rig::call_site(#stmt, __FILE__, __LINE__,                  \
                                         fmt::format("cuBLAS status {}", int(rig_s_)))); \
  } while (0)

#ifdef RIG_WITH_NCCL
#include <nccl.h>
#define RIG_NCCL_CHECK(stmt)                                                         \
  do {                                                                               \
    ncclResult_t rig_r_ = (stmt);                                                    \
    if (rig_r_ != ncclSuccess)                                                       \
      ::rig::fail("{}", ::rig::call_site(#stmt, __FILE__, __LINE__,                  \
                                         std::string("NCCL error ") +                \
                                             ncclGetErrorString(rig_r_)));           \
  } while (0)
#endif
#endif
