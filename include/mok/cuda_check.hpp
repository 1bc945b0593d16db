// Error checks for CUDA runtime calls in host code: every call's status is checked and a failure
// becomes a mok::Error naming the call and the file:line.
#pragma once

#include <cuda_runtime.h>

#include "mok/error.hpp"

#define MOK_CUDA_CHECK(call)                                                                 \
  do {                                                                                       \
    const cudaError_t mok_status_ = (call);                                                  \
    if (mok_status_ != cudaSuccess) {                                                        \
      throw ::mok::Error(                                                                    \
          "cuda", ::mok::detail::concat(#call, " failed: ", cudaGetErrorString(mok_status_), \
                                        " at ", __FILE__, ":", __LINE__));                   \
    }                                                                                        \
  } while (0)

// After a kernel launch: the launch's own error, without synchronising.
#define MOK_CUDA_CHECK_LAUNCH() MOK_CUDA_CHECK(cudaGetLastError())
