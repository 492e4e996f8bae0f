"""Build ringdp and its native extension ringdp._C.

RINGDP_BUILD_CUDA=auto (default) builds the CUDA sources when torch is a CUDA build and nvcc
is present; 0 never; 1 always (fails without a CUDA toolchain).
"""
import glob
import os

from setuptools import find_packages, setup

try:
    from torch.utils import cpp_extension
except ImportError as e:  # pip's default isolated build has setuptools alone
    raise SystemExit(f"ringdp builds against the torch it will run with, and this build cannot import torch ({e}). "
                     "Install torch first, then build without isolation: "
                     "pip install torch==2.13.0 && pip install --no-build-isolation .") from None

ROOT = os.path.dirname(os.path.abspath(__file__))


def rel(paths):
    return sorted(os.path.relpath(p, ROOT) for p in paths)


def want_cuda() -> bool:
    mode = os.environ.get("RINGDP_BUILD_CUDA", "auto").strip().lower()
    if mode in ("0", "no", "false", "off"):
        return False
    home = cpp_extension.CUDA_HOME
    nvcc = bool(home) and os.path.exists(os.path.join(home, "bin", "nvcc"))
    have = bool(__import__("torch").version.cuda) and nvcc
    if mode in ("1", "yes", "true", "on"):
        if not have:
            raise SystemExit("RINGDP_BUILD_CUDA=1 but torch is not a CUDA build or nvcc is missing "
                             f"(CUDA_HOME={home})")
        return True
    return have


def set_cuda_archs():
    """TORCH_CUDA_ARCH_LIST if set, else the visible GPUs, else sm_80 and sm_90 with PTX."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return
    import torch

    try:
        if torch.cuda.is_available():
            caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
            os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(f"{a}.{b}" for a, b in caps)
            return
    except Exception:
        pass
    os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0+PTX"


cpu_sources = rel(p for p in glob.glob(os.path.join(ROOT, "csrc", "**", "*.cpp"), recursive=True)
                  if os.sep + "cuda" + os.sep not in p)
cxx_flags = ["-O3", "-fno-math-errno", "-Wall", "-Wno-unused-function"]
define_macros = []
build_cuda = want_cuda()

if build_cuda:
    set_cuda_archs()
    # not recursive: csrc/cuda/sim/ holds a host-only protocol simulator with its own main()
    cuda_sources = rel(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu"))
                       + glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cpp")))
    define_macros.append(("RINGDP_WITH_CUDA", "1"))
    ext = cpp_extension.CUDAExtension(
        "ringdp._C",
        cpu_sources + cuda_sources,
        define_macros=define_macros,
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++17", "-lineinfo"]},
        libraries=["dl"],
    )
else:
    ext = cpp_extension.CppExtension("ringdp._C", cpu_sources, define_macros=define_macros,
                                     extra_compile_args=cxx_flags)

setup(
    name="ringdp",
    version="0.1.0",
    description="Chunked, pipelined ring all-reduce for PyTorch data parallelism",
    packages=find_packages(include=["ringdp", "ringdp.*"]),
    ext_modules=[ext],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.9",
    install_requires=["numpy"],  # torch is deliberately not listed: see README (install torch first)
)
