// Emulated expert parallelism (Communicator::emulate) runs every rank's kernels on one GPU at once,
// some of them waiting for a peer's. CUDA's lazy loading may load a kernel on its first launch
// only once the kernels already running have finished (the CUDA programming guide, "Lazy Loading",
// potential hazards), which such a wait never allows: a rank's first launch of a kernel stalled
// until its peer timed out (phase gather, 10 s). The GPU tests therefore load every kernel when
// CUDA starts, before main() and before any CUDA call; a caller's own environment value wins.
#include <cstdlib>

namespace {

const int kEagerModuleLoading = setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0);

}  // namespace
