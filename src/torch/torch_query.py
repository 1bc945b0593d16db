"""What the MOK_BUILD_TORCH block of CMakeLists.txt needs to know about the installed torch, one
item per line, lists joined by ',', '-' for none: include dirs, library dirs,
_GLIBCXX_USE_CXX11_ABI, torch.version.cuda (none: a CPU-only torch), and the folder of the NCCL
that torch loads (nvidia.nccl, with include/ and lib/)."""

import torch
import torch.utils.cpp_extension as extension


def nccl_root():
    try:
        import nvidia.nccl as nccl
    except ImportError:
        return None
    return list(nccl.__path__)[0]


for item in (",".join(extension.include_paths()), ",".join(extension.library_paths()),
             int(torch._C._GLIBCXX_USE_CXX11_ABI), torch.version.cuda, nccl_root()):
    print("-" if item in (None, "") else item)
