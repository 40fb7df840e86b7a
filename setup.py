"""Builds the two native modules.

shadecache._core  the shared-memory cache engine (csrc/cache, csrc/common) and the peer layer's
                  frames (csrc/net; links OpenSSL's libcrypto, from libssl-dev, and intel-ipsec-mb
                  from libipsec-mb-dev when found)
shadecache._io    the packed-store batch reader (csrc/io, csrc/common); uses liburing when found

SHADECACHE_BUILD_ONLY=_io (or _core) builds one of them: a development convenience so that work on
one layer does not wait for the other to compile.
SHADECACHE_NO_LIBURING=1 builds _io without io_uring (pread pool only), as on a machine without it;
SHADECACHE_NO_IPSEC_MB=1 builds _core with libcrypto's AES-256-GCM only.
"""
import glob
import os
import shutil
import subprocess
import tempfile

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

CXXFLAGS = ["-O3", "-Wall", "-Wextra", "-Wno-unused-parameter", "-fvisibility=hidden"]


def links(program: str, lib: str, off_env: str) -> bool:
    """True when the small C `program` compiles and links with -l`lib` (and $`off_env` is unset)."""
    if os.environ.get(off_env):
        return False
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write(program)
        res = subprocess.run([cc, src, "-o", os.path.join(tmp, "probe"), "-l" + lib],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return res.returncode == 0


def have_liburing() -> bool:
    return links("#include <liburing.h>\nint main(void){struct io_uring r;"
                 " return io_uring_queue_init(1,&r,0) > 1;}\n", "uring", "SHADECACHE_NO_LIBURING")


def have_ipsec_mb() -> bool:
    """intel-ipsec-mb (libipsec-mb-dev): the peer layer's faster AES-256-GCM (csrc/net/aead.h)."""
    return links("#include <intel-ipsec-mb.h>\nint main(void){IMB_MGR *m = alloc_mb_mgr(0);"
                 " free_mb_mgr(m); return 0;}\n", "IPSec_MB", "SHADECACHE_NO_IPSEC_MB")


def sources(*patterns):
    out = []
    for p in patterns:
        out.extend(sorted(glob.glob(p)))
    return out


common = sources("csrc/common/*.cc", "csrc/bindings/errors.cc", "csrc/bindings/ids.cc", "csrc/bindings/convert.cc")
# Every header: setuptools rebuilds an extension only when a listed file is newer than it, and a
# change to an inline function in a header (the cache's read path lives in cache.h) must rebuild.
headers = sources("csrc/*/*.h", "csrc/*/*/*.h")
core_macros, core_libs = [], ["rt", "pthread", "crypto"]
if have_ipsec_mb():
    core_macros.append(("SHADECACHE_HAVE_IPSEC_MB", "1"))
    core_libs.append("IPSec_MB")
else:
    print("shadecache: intel-ipsec-mb not found; the peer layer seals with libcrypto only")
core = Pybind11Extension(
    "shadecache._core",
    common + sources("csrc/cache/*.cc", "csrc/cache/policies/*.cc", "csrc/net/*.cc", "csrc/bindings/core_module.cc",
                     "csrc/bindings/cache_reads.cc", "csrc/bindings/sample_view.cc", "csrc/bindings/test_hooks.cc", "csrc/bindings/next_use_bindings.cc",
                     "csrc/bindings/batch_gather.cc", "csrc/bindings/peer_io.cc", "csrc/bindings/peer_costs.cc"),
    depends=headers,
    include_dirs=["csrc"],
    cxx_std=17,
    extra_compile_args=CXXFLAGS,
    # libcrypto (OpenSSL): the peer layer's AES-256-GCM frames and HKDF (csrc/net/aead.h);
    # intel-ipsec-mb, when found, seals and opens the frames faster
    define_macros=core_macros,
    libraries=core_libs,
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
                     "csrc/bindings/read_stream_bindings.cc", "csrc/bindings/tier_io.cc",
                     "csrc/bindings/store_directory_bindings.cc"),
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
