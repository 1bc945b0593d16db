// SideStream (side_stream.hpp).
#include "runtime/side_stream.hpp"

#include "mok/cuda_check.hpp"

namespace mok {

SideStream::SideStream() {
  MOK_CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
  MOK_CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
  MOK_CUDA_CHECK(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming));
}

SideStream::~SideStream() {  // (errors cannot be reported from a destructor)
  if (fork_ != nullptr) cudaEventDestroy(fork_);
  if (join_ != nullptr) cudaEventDestroy(join_);
  if (side_ != nullptr) cudaStreamDestroy(side_);
}

cudaStream_t SideStream::fork(cudaStream_t stream) {
  MOK_CUDA_CHECK(cudaEventRecord(fork_, stream));
  MOK_CUDA_CHECK(cudaStreamWaitEvent(side_, fork_, 0));
  return side_;
}

void SideStream::join(cudaStream_t stream) {
  MOK_CUDA_CHECK(cudaEventRecord(join_, side_));
  MOK_CUDA_CHECK(cudaStreamWaitEvent(stream, join_, 0));
}

}  // namespace mok
