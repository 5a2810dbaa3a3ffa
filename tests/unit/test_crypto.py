"""The runtime's cryptography (the handshake's HMAC-SHA256, nonces, constant-time comparison) is
OpenSSL's libcrypto, not code of its own: no hash is written out in the sources, and the built
runtime carries libcrypto with its symbols hidden (so TensorFlow's framework library, which
exports BoringSSL under the same names, cannot take the calls) or, where no static library was
found at build time, needs the shared one. The published test vectors are checked in C++
(tests/cpp/test_auth.cc, Sha256AndHmacMatchPublishedVectors)."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

import kungfu

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
