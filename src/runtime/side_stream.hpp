// Work beside the caller's stream: the layers run the dispatch's copy CTAs beside the shared
// expert's GEMMs on disjoint SMs, the copies on a second stream that forks from the caller's and
// joins it again through events, so that a forward or backward stays one stream to its caller
// (and to a graph capture).
#pragma once

#include <cuda_runtime.h>

#include "mok/gemm.hpp"

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

// A layer's shared expert and its dispatch: with shared_sms > 0 (gemm_sms_beside_copy's), the
// dispatch (dispatch(side stream, true)) beside the shared expert (run_shared(gemm options on
// shared_sms SMs)), joined after it; else the shared expert first (when `shared`), then the
// dispatch on the stream (dispatch(stream, false)). mark() once the shared expert is enqueued.
template <class RunShared, class Dispatch, class Mark>
void shared_expert_and_dispatch(SideStream& side, cudaStream_t stream, bool shared, int shared_sms,
                                const gemm::LaunchOptions& gemm_options,
                                const RunShared& run_shared, const Dispatch& dispatch,
                                const Mark& mark) {
  if (shared_sms > 0) {
    dispatch(side.fork(stream), /*beside=*/true);
    gemm::LaunchOptions beside_copy = gemm_options;
    beside_copy.num_sms = shared_sms;
    run_shared(beside_copy);
    mark();
    side.join(stream);
  } else {
    if (shared) run_shared(gemm_options);
    mark();
    dispatch(stream, /*beside=*/false);
  }
}

}  // namespace mok
