// The device error word of the communication kernels. A device-side fault (an expert id out of
// range or repeated in a row, a peer that never arrives) is recorded here and ends the kernel
// instead of hanging or writing out of bounds; the host reads the record after the stream and
// turns it into a mok::Error that names the rank, the phase and what was waited for.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MOK_COMM_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MOK_COMM_HOST_DEVICE inline
#endif

namespace mok::comm {

enum class ErrorCode : uint32_t {
  kNone = 0,
  kClaimed = 1,           // a thread is filling in the record
  kTimeout = 2,           // a flag did not reach the call's epoch in time
  kExpertOutOfRange = 3,  // topk_idx holds an id outside [-1, E)
  kTokenCountOutOfRange = 4,
  kTaskTimeout = 5,     // a fused-forward task waited too long for a row block's counter, or a
                        // grid barrier for a CTA
  kExpertRepeated = 6,  // a row of topk_idx holds an expert id twice (-1 may repeat)
};

enum class Phase : uint32_t {
  kGather = 0,    // all-gather of topk_idx
  kSchedule = 1,  // counting and ordering the rows of the local experts
  kDispatch = 2,
  kCombine = 3,  // pushing expert output rows to their owners
  kReduce = 4,   // the owner's fixed-order sum over its combine slots
  kBarrier = 5,
  kExperts = 6,  // the fused forward's expert GEMM tasks waiting on each other
};

MOK_COMM_HOST_DEVICE const char* phase_name(Phase phase) {
  switch (phase) {
    case Phase::kGather:
      return "gather";
    case Phase::kSchedule:
      return "schedule";
    case Phase::kDispatch:
      return "dispatch";
    case Phase::kCombine:
      return "combine";
    case Phase::kReduce:
      return "reduce";
    case Phase::kBarrier:
      return "barrier";
    case Phase::kExperts:
      return "experts";
  }
  return "unknown";
}

// First error wins; later ones are dropped (the first is the cause, the rest its echoes).
struct ErrorRecord {
  uint32_t code;       // ErrorCode; kNone while healthy
  uint32_t rank;       // the rank that saw the fault
  uint32_t phase;      // Phase
  uint32_t peer;       // kTimeout: the rank waited for; kExpert*: the token's rank
  int32_t token;       // kExpert*: token index on `peer`
  int32_t slot;        // kExpert*: top-k slot (kExpertRepeated: the later of the two)
  int32_t value;       // the bad id / token count, or the flag value seen at the timeout
  uint32_t expected;   // kTimeout: the epoch waited for; kExpertOutOfRange: E;
                       // kExpertRepeated: the earlier slot holding the same id
  uint32_t flag_kind;  // kTimeout: which FlagKind
};

#if defined(__CUDACC__)
struct ErrorDetail {
  Phase phase;
  uint32_t peer = 0;
  int32_t token = -1, slot = -1, value = 0;
  uint32_t expected = 0, flag_kind = 0;
};

__device__ __forceinline__ bool has_error(const ErrorRecord* record) {
  return *reinterpret_cast<const volatile uint32_t*>(&record->code) != 0;
}

__device__ __forceinline__ void raise_error(ErrorRecord* record, ErrorCode code, uint32_t rank,
                                            const ErrorDetail& detail) {
  if (atomicCAS(&record->code, 0u, static_cast<uint32_t>(ErrorCode::kClaimed)) != 0u) return;
  record->rank = rank;
  record->phase = static_cast<uint32_t>(detail.phase);
  record->peer = detail.peer;
  record->token = detail.token;
  record->slot = detail.slot;
  record->value = detail.value;
  record->expected = detail.expected;
  record->flag_kind = detail.flag_kind;
  __threadfence();
  atomicExch(&record->code, static_cast<uint32_t>(code));
}
#endif

}  // namespace mok::comm
