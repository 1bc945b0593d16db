#include "runtime/device_memory.hpp"

#include <algorithm>

namespace mok {
namespace {

__global__ void write_single_group_offsets_kernel(int32_t* offsets, int32_t rows) {
  offsets[0] = 0;
  offsets[1] = rows;
}

// splitmix64's finaliser: a bijection of 64-bit words.
__device__ uint64_t mix(uint64_t value) {
  value ^= value >> 30;
  value *= 0xbf58476d1ce4e5b9ULL;
  value ^= value >> 27;
  value *= 0x94d049bb133111ebULL;
  return value ^ (value >> 31);
}

__global__ void fingerprint_kernel(const uint64_t* words, int64_t count, int tail_bytes,
                                   unsigned long long* sum) {
  uint64_t partial = 0;
  if (blockIdx.x == 0 && threadIdx.x == 0 && tail_bytes > 0) {  // the last bytes, as a word
    const auto* tail = reinterpret_cast<const unsigned char*>(words + count);
    uint64_t word = 0;
    for (int byte = 0; byte < tail_bytes; ++byte)
      word |= static_cast<uint64_t>(tail[byte]) << (8 * byte);
    partial += mix(word ^ mix(static_cast<uint64_t>(count) + 0x9e3779b97f4a7c15ULL));
  }
  for (int64_t index = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; index < count;
       index += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    partial += mix(words[index] ^ mix(static_cast<uint64_t>(index) + 0x9e3779b97f4a7c15ULL));
  }
  atomicAdd(sum, static_cast<unsigned long long>(partial));  // (a sum: any order, one result)
}

}  // namespace

int current_device_sm_count() {
  int device = 0;
  MOK_CUDA_CHECK(cudaGetDevice(&device));
  int count = 0;
  MOK_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

uint64_t device_fingerprint(const void* data, int64_t bytes, cudaStream_t stream) {
  MOK_CHECK_ARG(reinterpret_cast<uintptr_t>(data) % 8 == 0 && bytes >= 0, "data",
                "a fingerprint reads 8-byte aligned memory");
  unsigned long long* sum = device_alloc<unsigned long long>(1);
  MOK_CUDA_CHECK(cudaMemsetAsync(sum, 0, sizeof(*sum), stream));
  const int64_t words = bytes / 8;
  const int ctas = static_cast<int>(std::min<int64_t>(std::max<int64_t>((words + 255) / 256, 1),
                                                      int64_t{4} * current_device_sm_count()));
  fingerprint_kernel<<<ctas, 256, 0, stream>>>(static_cast<const uint64_t*>(data), words,
                                               static_cast<int>(bytes % 8), sum);
  MOK_CUDA_CHECK_LAUNCH();
  unsigned long long result = 0;
  MOK_CUDA_CHECK(cudaMemcpyAsync(&result, sum, sizeof(result), cudaMemcpyDeviceToHost, stream));
  MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
  MOK_CUDA_CHECK(cudaFree(sum));
  return result;
}

void write_single_group_offsets(int32_t* offsets, int32_t rows, cudaStream_t stream) {
  write_single_group_offsets_kernel<<<1, 1, 0, stream>>>(offsets, rows);
  MOK_CUDA_CHECK_LAUNCH();
}

}  // namespace mok
