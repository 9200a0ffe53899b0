"""Build the torch-free native libraries in native/.

They are plain C ABI shared objects (no Python or torch headers are used) that
zerotier loads with ctypes; setuptools' Extension machinery is only the compiler
driver. A compile error fails `pip install` loudly: there is no silent fallback
at build time. The pure-Python path is chosen at *run* time only when the user
sets ZEROTIER_NATIVE=0.
"""
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

COMMON = ["-O3", "-std=c++17", "-pthread", "-fvisibility=hidden", "-fno-math-errno", "-Wno-maybe-uninitialized"]


class BuildCLibs(build_ext):
    # The libraries are not Python modules: do not require a PyInit_ export.
    def get_export_symbols(self, ext):
        return []


setup(
    ext_modules=[
        Extension(
            "zerotier._zt_cpu",
            sources=["native/cpu/adam.cpp", "native/cpu/threadpool.cpp", "native/cpu/cpu_info.cpp"],
            include_dirs=["native"],
            extra_compile_args=COMMON,
            extra_link_args=["-pthread"],
            language="c++",
        ),
        Extension(
            "zerotier._zt_io",
            sources=["native/io/io_engine.cpp"],
            include_dirs=["native"],
            extra_compile_args=COMMON,
            extra_link_args=["-pthread"],
            language="c++",
        ),
    ],
    cmdclass={"build_ext": BuildCLibs},
)
