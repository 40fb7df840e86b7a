"""Builds the two native modules.

shadecache._core  the shared-memory cache engine (csrc/cache, csrc/common) and the peer layer's
                  frames (csrc/net; links OpenSSL's libcrypto, from libssl-dev)
shadecache._io    the packed-store batch reader (csrc/io, csrc/common); uses liburing when found

SHADECACHE_BUILD_ONLY=_io (or _core) builds one of them: a development convenience so that work on
one layer does not wait for the other to compile.
SHADECACHE_NO_LIBURING=1 builds _io without io_uring (pread pool only), as on a machine without it.
"""
import glob
import os
import shutil
import subprocess
import tempfile

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

CXXFLAGS = ["-O3", "-Wall", "-Wextra", "-Wno-unused-parameter", "-fvisibility=hidden"]


def have_liburing() -> bool:
    """True when a small program including liburing.h links with -luring."""
    if os.environ.get("SHADECACHE_NO_LIBURING"):
        return False
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write("#include <liburing.h>\nint main(void){struct io_uring r;"
                    " return io_uring_queue_init(1,&r,0) > 1;}\n")
        res = subprocess.run([cc, src, "-o", os.path.join(tmp, "probe"), "-luring"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return res.returncode == 0


def sources(*patterns):
    out = []
    for p in patterns:
        out.extend(sorted(glob.glob(p)))
    return out


common = sources("csrc/common/*.cc", "csrc/bindings/errors.cc", "csrc/bindings/ids.cc", "csrc/bindings/convert.cc")
# Every header: setuptools rebuilds an extension only when a listed file is newer than it, and a
# change to an inline function in a header (the cache's read path lives in cache.h) must rebuild.
headers = sources("csrc/*/*.h", "csrc/*/*/*.h")
core = Pybind11Extension(
    "shadecache._core",
    common + sources("csrc/cache/*.cc", "csrc/cache/policies/*.cc", "csrc/net/*.cc", "csrc/bindings/core_module.cc",
                     "csrc/bindings/cache_reads.cc", "csrc/bindings/sample_view.cc", "csrc/bindings/test_hooks.cc", "csrc/bindings/next_use_bindings.cc",
                     "csrc/bindings/batch_gather.cc", "csrc/bindings/peer_io.cc"),
    depends=headers,
    include_dirs=["csrc"],
    cxx_std=17,
    extra_compile_args=CXXFLAGS,
    # libcrypto (OpenSSL): the peer layer's AES-256-GCM frames and HKDF (csrc/net/aead.h)
    libraries=["rt", "pthread", "crypto"],
)
io_macros, io_libs = [], ["pthread"]
if have_liburing():
    io_macros.append(("SHADECACHE_HAVE_LIBURING", "1"))
    io_libs.append("uring")
else:
    print("shadecache: liburing not found; _io builds with the pread backend only")
io = Pybind11Extension(
    "shadecache._io",
    common + sources("csrc/io/*.cc", "csrc/bindings/io_module.cc",
                     "csrc/bindings/read_stream_bindings.cc", "csrc/bindings/tier_io.cc"),
    depends=headers,
    include_dirs=["csrc"],
    cxx_std=17,
    extra_compile_args=CXXFLAGS,
    define_macros=io_macros,
    libraries=io_libs,
)
only = os.environ.get("SHADECACHE_BUILD_ONLY")
exts = [e for e in (core, io) if not only or e.name.endswith(only)]

setup(ext_modules=exts, cmdclass={"build_ext": build_ext})
