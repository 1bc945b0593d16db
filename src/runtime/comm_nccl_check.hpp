// Error checks for NCCL calls in host code: a failure becomes mok::Error("comm", ...) naming the
// call, NCCL's reason and its last error message.
#pragma once

#if defined(MOK_WITH_NCCL)
#include <nccl.h>

#include "mok/error.hpp"

#define MOK_NCCL_CHECK(call, comm)                                                                \
  do {                                                                                            \
    const ncclResult_t mok_nccl_status_ = (call);                                                 \
    if (mok_nccl_status_ != ncclSuccess) {                                                        \
      const char* mok_nccl_last_ = (comm) != nullptr ? ncclGetLastError(comm) : "";               \
      throw ::mok::Error(                                                                         \
          "comm", ::mok::detail::concat(#call, " failed: ", ncclGetErrorString(mok_nccl_status_), \
                                        (mok_nccl_last_ && *mok_nccl_last_)                       \
                                            ? std::string(" (") + mok_nccl_last_ + ")"            \
                                            : std::string(),                                      \
                                        " at ", __FILE__, ":", __LINE__));                        \
    }                                                                                             \
  } while (0)
#endif
