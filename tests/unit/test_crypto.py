"""The runtime's cryptography (the handshake's HMAC-SHA256, nonces, constant-time comparison) is
OpenSSL's libcrypto, not code of its own: no hash is written out in the sources, and the built
runtime carries libcrypto with its symbols hidden (so TensorFlow's framework library, which
exports BoringSSL under the same names, cannot take the calls) or, where no static library was
found at build time, needs the shared one. The published test vectors are checked in C++
(tests/cpp/test_auth.cc, Sha256AndHmacMatchPublishedVectors)."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kungfu

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
# FIPS 180-4: SHA-256's first round constant and first initial hash word; HMAC's pad bytes.
WRITTEN_OUT = ("0x428a2f98", "0x6a09e667", "0x5c5c5c5c", "0x36363636")
OPENSSL_NAMES = {"HMAC", "EVP_sha256", "EVP_Digest", "RAND_bytes", "CRYPTO_memcmp"}


def test_no_hash_is_written_out_in_the_runtime():
    hits = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "srcs").rglob("*"))
            if p.suffix in (".cc", ".h")
            and any(c in p.read_text(errors="replace").lower() for c in WRITTEN_OUT)]
    assert hits == []


def _symbols(lib: Path, which: str) -> set:
    out = subprocess.run(["nm", "-D", which, str(lib)], capture_output=True, text=True,
                         check=True).stdout
    return {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()}


@pytest.mark.skipif(shutil.which("nm") is None or shutil.which("readelf") is None,
                    reason="binutils (nm, readelf) are not installed")
def test_the_runtime_takes_its_cryptography_from_libcrypto():
    lib = Path(kungfu.__file__).parent / "libkungfu_runtime.so"
    dynamic = subprocess.run(["readelf", "-dW", str(lib)], capture_output=True, text=True,
                             check=True).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic)
    exported = _symbols(lib, "--defined-only")
    undefined = _symbols(lib, "--undefined-only")
    assert not OPENSSL_NAMES & exported  # never offered to other libraries
    if any(n.startswith("libcrypto.so") for n in needed):  # the shared library
        assert {"HMAC", "RAND_bytes", "CRYPTO_memcmp"} <= undefined, sorted(undefined)
    else:  # linked in: libcrypto's code is inside, its names hidden
        assert not OPENSSL_NAMES & undefined, sorted(OPENSSL_NAMES & undefined)
        # (libcrypto's message for a broken invariant, OPENSSL_die, which every part reaches)
        assert b"OpenSSL internal error" in lib.read_bytes(), "no libcrypto inside"


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None
                    or not (Path(kungfu.__file__).parent / "libkungfu_tensorflow_ops.so").exists(),
                    reason="TensorFlow or kungfu's op library is not installed")
def test_no_call_of_the_runtime_binds_to_tensorflows_boringssl(tmp_path):
    # TensorFlow's framework library exports BoringSSL under OpenSSL's names; with the op library
    # loaded beside it, every binding the dynamic linker makes for the runtime (LD_BIND_NOW: all of
    # them at load) must leave OpenSSL's names alone. A runtime linked to the shared libcrypto had
    # them bound to TensorFlow's copies.
    env = dict(os.environ, LD_DEBUG="bindings", LD_BIND_NOW="1", TF_CPP_MIN_LOG_LEVEL="3",
               LD_DEBUG_OUTPUT=str(tmp_path / "ld"))
    subprocess.run([sys.executable, "-c", "import tensorflow, kungfu.tensorflow"], env=env,
                   check=True, timeout=100, capture_output=True)
    lines = [line for f in tmp_path.glob("ld.*") for line in f.read_text().splitlines()
             if "binding file " in line and "libkungfu_runtime.so" in line.split(" to ")[0]]
    assert lines, "no binding of the runtime was logged"
    assert any("libtensorflow_framework" in line.split(" to ")[-1] for line in lines), \
        "the runtime was not loaded beside TensorFlow's framework library"
    openssl = [line for line in lines
               if re.search(r"symbol `(HMAC|EVP_|RAND_|CRYPTO_|OPENSSL_|ERR_)", line)]
    assert openssl == [], ("OpenSSL's names bound outside the runtime (a shared libcrypto; "
                           f"install the static one, libssl-dev): {openssl[:5]}")


# The folders where FindOpenSSL looks on Linux; with them ignored, the system has no OpenSSL.
SYSTEM_DIRS = [f"{p}{d}" for p in ("", "/usr", "/usr/local")
               for d in ("/include", "/lib", "/lib64", "/lib/x86_64-linux-gnu",
                         "/lib/aarch64-linux-gnu")]


def _configure(build: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build), "-DKUNGFU_BUILD_PYTHON=OFF",
                           "-DCMAKE_IGNORE_PATH=" + ";".join(SYSTEM_DIRS), *args],
                          capture_output=True, text=True, timeout=100,
                          env={k: v for k, v in os.environ.items() if k != "OPENSSL_ROOT_DIR"})


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
def test_a_build_without_openssl_names_the_package_to_install(tmp_path):
    r = _configure(tmp_path / "build")
    assert r.returncode != 0
    message = " ".join((r.stdout + r.stderr).split())
    assert "OpenSSL's libcrypto (1.1.1 or later, headers and library) was not found" in message
    assert "Install libssl-dev" in message and "openssl-devel" in message, message


@pytest.mark.skipif(shutil.which("cmake") is None or not Path("/usr/include/openssl/evp.h").exists()
                    or not list(Path("/usr/lib").glob("*/libcrypto.a")),
                    reason="no system OpenSSL with a static libcrypto to copy")
def test_openssl_root_dir_names_an_installation_elsewhere(tmp_path):
    # scripts/gpu_check.sh's way on a machine without OpenSSL (scripts/openssl_from_debs.sh): an
    # installation in a folder of its own, named by OPENSSL_ROOT_DIR; here a copy of the
    # system's headers (the multiarch ones beside them) and static library.
    usr = tmp_path / "usr"
    shutil.copytree("/usr/include/openssl", usr / "include" / "openssl")
    for conf in Path("/usr/include").glob("*-linux-gnu/openssl/*.h"):
        shutil.copy(conf, usr / "include" / "openssl")
    (usr / "lib").mkdir()
    shutil.copy(next(Path("/usr/lib").glob("*/libcrypto.a")), usr / "lib")
    r = _configure(tmp_path / "build", f"-DOPENSSL_ROOT_DIR={usr}")
    assert r.returncode == 0, r.stdout + r.stderr
    cache = (tmp_path / "build" / "CMakeCache.txt").read_text()
    assert f"OPENSSL_CRYPTO_LIBRARY:FILEPATH={usr}/lib/libcrypto.a" in cache
    assert f"OPENSSL_INCLUDE_DIR:PATH={usr}/include" in cache
