"""Build the torch-free native libraries in native/.

They are plain C ABI shared objects (no Python or torch headers are used) that
zerotier loads with ctypes; setuptools' Extension machinery is only the compiler
driver. A compile error fails `pip install` loudly: there is no silent fallback
at build time. The pure-Python path is chosen at *run* time only when the user
sets ZEROTIER_NATIVE=0.
"""
import shutil
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

COMMON = ["-O3", "-std=c++17", "-pthread", "-fvisibility=hidden", "-fno-math-errno", "-Wno-maybe-uninitialized"]


class BuildCLibs(build_ext):
    # The libraries are not Python modules: do not require a PyInit_ export.
    def get_export_symbols(self, ext):
        return []


class BuildPyWithDemo(build_py):
    # `zerotier demo` runs examples/train_gpt.py; an installed package (not a checkout) carries
    # a copy of it as zerotier/_examples/train_gpt.py (zerotier/demo.py looks there first).
    def run(self):
        super().run()
        target = Path(self.build_lib) / "zerotier" / "_examples"
        target.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(__file__).parent / "examples" / "train_gpt.py", target / "train_gpt.py")


setup(
    ext_modules=[
        Extension(
            "zerotier._zt_cpu",
            sources=["native/cpu/adam.cpp", "native/cpu/threadpool.cpp", "native/cpu/cpu_info.cpp"],
            depends=["native/cpu/adam_simd.inc", "native/cpu/avx512_lanes.inc", "native/cpu/vbmi_tables.inc", "native/cpu/lion.inc", "native/cpu/lion_simd.inc", "native/cpu/sumsq_simd.inc", "native/cpu/threadpool.h", "native/zt_api.h"],
            include_dirs=["native"],
            # no a*b+c contraction: the kernels equal the Python reference bit for bit
            # ([Note: one rounding per operation] in native/cpu/adam.cpp)
            extra_compile_args=COMMON + ["-ffp-contract=off"],
            extra_link_args=["-pthread"],
            language="c++",
        ),
        Extension(
            "zerotier._zt_io",
            sources=["native/io/io_engine.cpp", "native/io/threads_engine.cpp", "native/io/uring_engine.cpp"],
            include_dirs=["native"],
            extra_compile_args=COMMON,
            extra_link_args=["-pthread"],
            language="c++",
        ),
    ],
    cmdclass={"build_ext": BuildCLibs, "build_py": BuildPyWithDemo},
)
