# Sourced by scripts/gpu_check.sh (bash): makes OpenSSL's headers and static libcrypto available
# to the build on a machine that has none and cannot download them (the runtime's handshake needs
# libcrypto; CMakeLists.txt). Where the compiler already finds and links libcrypto, nothing
# happens. Otherwise the Debian packages carried in .deb/ (made on a Debian or Ubuntu machine
# with network: `mkdir -p .deb && (cd .deb && apt-get download libssl-dev)`; about 2.4 MB) are
# unpacked (dpkg -x, or ar and tar) into a folder of their own, never into /, and
# OPENSSL_ROOT_DIR, which CMake's FindOpenSSL reads from the environment, points at them.
# The static library is linked into the runtime, so nothing of it is needed at run time.
# $1: the folder to unpack into (default: a new temporary one).

openssl_links() {  # true if the C++ compiler finds OpenSSL's headers and links libcrypto
  local dir
  dir=$(mktemp -d) || return 1
  printf '%s\n' '#include <openssl/evp.h>' \
    'int main() { return EVP_sha256() == nullptr; }' > "$dir/probe.cc"
  "${CXX:-c++}" "$@" "$dir/probe.cc" -o "$dir/probe" -lcrypto -ldl -pthread > /dev/null 2>&1
  local rc=$?
  rm -rf "$dir"
  return $rc
}

openssl_from_debs() {
  if [ -n "${OPENSSL_ROOT_DIR:-}" ] || openssl_links; then
    return 0
  fi
  local debs root
  debs=$(ls .deb/libssl-dev_*.deb 2> /dev/null | head -n 1)
  if [ -z "$debs" ]; then
    echo "OpenSSL's headers or libcrypto are missing and no .deb/libssl-dev_*.deb was carried:" \
      "install libssl-dev, or run 'mkdir -p .deb && (cd .deb && apt-get download libssl-dev)'" \
      "on a machine with network and carry .deb" >&2
    return 1
  fi
  root=${1:-$(mktemp -d)}
  mkdir -p "$root"
  if command -v dpkg > /dev/null 2>&1; then
    dpkg -x "$debs" "$root" || return 1
  else  # a .deb is an ar archive holding data.tar.*
    (cd "$root" && ar x "$OLDPWD/$debs" && tar -xf data.tar.* && rm -f data.tar.* control.tar.* \
      debian-binary) || return 1
  fi
  # Debian's multiarch layout keeps opensslconf.h and configuration.h under
  # include/<triplet>/openssl and the libraries under lib/<triplet>, where the compiler and
  # FindOpenSSL look only in the system's own folders: copy them beside the other headers and
  # into lib/, the layout of an OpenSSL installed from source.
  local usr=$root/usr
  cp "$usr"/include/*-linux-gnu/openssl/*.h "$usr/include/openssl/" 2> /dev/null
  mkdir -p "$usr/lib"
  cp "$usr"/lib/*-linux-gnu/libcrypto.a "$usr/lib/" || return 1
  if ! openssl_links -I"$usr/include" -L"$usr/lib"; then
    echo "the unpacked $debs does not build here (see $root)" >&2
    return 1
  fi
  export OPENSSL_ROOT_DIR=$usr
  echo "OpenSSL from $(basename "$debs"), unpacked in $root (OPENSSL_ROOT_DIR=$usr)"
}
