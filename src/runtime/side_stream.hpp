// Work beside the caller's stream: the layers run the dispatch's copy CTAs beside the shared
// expert's GEMMs on disjoint SMs, the copies on a second stream that forks from the caller's and
// joins it again through events, so that a forward or backward stays one stream to its caller
// (and to a graph capture).
#pragma once

#include <cuda_runtime.h>

namespace mok {

class SideStream {
 public:
  // A non-blocking stream and two events on the current device (a layer's member declared after
  // its CommWorkspace, which selects the rank's device).
  SideStream();
  ~SideStream();
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;

  // The side stream, ordered after everything enqueued on `stream` so far.
  cudaStream_t fork(cudaStream_t stream);
  // Orders what is enqueued on `stream` from now on after everything enqueued on the side stream
  // so far.
  void join(cudaStream_t stream);

 private:
  cudaStream_t side_ = nullptr;
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
};

// SMs for the shared expert's GEMMs beside `copy_ctas` copy CTAs on a share of `num_sms` SMs: the
// others, at most gemm_sms when it is positive; 0 when the two cannot run side by side (no copy
// CTAs, or as many as SMs).
inline int gemm_sms_beside_copy(int num_sms, int copy_ctas, int gemm_sms) {
  if (copy_ctas <= 0 || copy_ctas >= num_sms) return 0;
  const int free_sms = num_sms - copy_ctas;
  return gemm_sms > 0 && gemm_sms < free_sms ? gemm_sms : free_sms;
}

}  // namespace mok
