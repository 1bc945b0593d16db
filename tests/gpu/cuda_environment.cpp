// Emulated expert parallelism (Communicator::emulate) runs every rank's kernels on one GPU at once,
// some of them waiting for a peer's. Two CUDA defaults let such a wait block the very kernel it
// waits for, so the GPU tests set both when CUDA starts, before main() and before any CUDA call (a
// caller's own environment value wins; Communicator::emulate refuses to run without them):
//   CUDA_MODULE_LOADING=EAGER        lazy loading may load a kernel on its first launch only once
//                                    the kernels already running have finished (the CUDA
//                                    programming guide, "Lazy Loading", potential hazards);
//   CUDA_DEVICE_MAX_CONNECTIONS=32   the streams share 8 hardware queues by default, in creation
//                                    order: two ranks' streams in one queue run in that queue's
//                                    order, and a rank's kernel waited behind a peer's waiting one
//                                    until it timed out (phase gather, 10 s; only after other
//                                    tests had made streams, which moved the ranks' queues).
#include <cstdlib>

namespace {

const int kEagerModuleLoading = setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0);
const int kHardwareQueues = setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", /*overwrite=*/0);

}  // namespace
