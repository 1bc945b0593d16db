// Emulated expert parallelism (Communicator::emulate) runs every rank's kernels on one GPU at once,
// some of them waiting for a peer's. Two CUDA defaults let such a wait block the very kernel it
// waits for, so the GPU tests run with both set (a caller's own environment value wins;
// Communicator::emulate refuses to run without them):
//   CUDA_MODULE_LOADING=EAGER        lazy loading may load a kernel on its first launch only once
//                                    the kernels already running have finished (the CUDA
//                                    programming guide, "Lazy Loading", potential hazards);
//   CUDA_DEVICE_MAX_CONNECTIONS=32   the streams share 8 hardware queues by default, in creation
//                                    order: two ranks' streams in one queue run in that queue's
//                                    order, and a rank's kernel waited behind a peer's waiting one
//                                    until it timed out (phase gather, 10 s; only after other
//                                    tests had made streams, which moved the ranks' queues).
// Setting them from a static initializer proved too late for the second (the EP 4/8 test still
// timed out in a full run): when either is missing, the process sets both and executes itself
// again, so that they are in place before the CUDA libraries load.
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace {

bool restart_with_cuda_environment() {
  if (std::getenv("CUDA_MODULE_LOADING") != nullptr &&
      std::getenv("CUDA_DEVICE_MAX_CONNECTIONS") != nullptr) {
    return false;
  }
  setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0);
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", /*overwrite=*/0);
  std::ifstream file("/proc/self/cmdline", std::ios::binary);
  const std::string cmdline{std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>()};
  std::vector<std::string> args;
  for (size_t start = 0; start < cmdline.size();) {
    const size_t end = cmdline.find('\0', start);
    args.push_back(cmdline.substr(start, end - start));
    if (end == std::string::npos) break;
    start = end + 1;
  }
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  if (!args.empty()) execv("/proc/self/exe", argv.data());
  return false;  // (exec failed: go on with the variables set from here on)
}

const bool kRestarted = restart_with_cuda_environment();

}  // namespace
