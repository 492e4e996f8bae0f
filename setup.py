"""Build ringdp and its native extension ringdp._C.

RINGDP_BUILD_CUDA=auto (default) builds the CUDA sources when torch is a CUDA build and nvcc
is present; 0 never; 1 always (fails without a CUDA toolchain).
"""
import glob
import os

from setuptools import find_packages, setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))


def rel(paths):
    return sorted(os.path.relpath(p, ROOT) for p in paths)


def want_cuda() -> bool:
    mode = os.environ.get("RINGDP_BUILD_CUDA", "auto").strip().lower()
    if mode in ("0", "no", "false", "off"):
        return False
    have = bool(__import__("torch").version.cuda) and cpp_extension.CUDA_HOME is not None
    if mode in ("1", "yes", "true", "on"):
        if not have:
            raise SystemExit("RINGDP_BUILD_CUDA=1 but torch is not a CUDA build or nvcc/CUDA_HOME is missing")
        return True
    return have


cpu_sources = rel(p for p in glob.glob(os.path.join(ROOT, "csrc", "**", "*.cpp"), recursive=True)
                  if os.sep + "cuda" + os.sep not in p)
cxx_flags = ["-O3", "-fno-math-errno", "-Wall", "-Wno-unused-function"]
define_macros = []
build_cuda = want_cuda()

if build_cuda:
    cuda_sources = rel(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu"))
                       + glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cpp")))
    define_macros.append(("RINGDP_WITH_CUDA", "1"))
    ext = cpp_extension.CUDAExtension(
        "ringdp._C",
        cpu_sources + cuda_sources,
        define_macros=define_macros,
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++17"]},
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
