#!/usr/bin/env bash
# The Debian package, as a user on another machine gets it: cpack builds flotilla_<v>_amd64.deb
# from the build tree; mmdebstrap makes a fresh Debian 12 root from Debian's archive; apt
# installs the .deb there with whatever its Depends pull in (and nothing else but the
# Fashion-MNIST dataset it recommends); the installed flotilla runs the 2-worker job in that
# root, and examples/consumer is configured, built and run there against the installed package
# with Debian's compiler and CMake (and the -dev packages the package's CMake config finds);
# apt removes it and nothing of it is left. Root; exit 77 (skipped) without mmdebstrap or
# without the Debian archive.
#   package_test.sh BUILD_DIR
set -euo pipefail
build_dir=$(cd "$1" && pwd)

fail() {
  echo "package_test: FAIL: $*" >&2
  exit 1
}
skip() {
  echo "package_test: SKIPPED: $*"
  exit 77
}
[ "$(id -u)" -eq 0 ] || skip "needs root (mmdebstrap's chroot)"
command -v mmdebstrap >/dev/null || skip "mmdebstrap is not installed (apt install mmdebstrap)"
command -v cpack >/dev/null || skip "cpack is not installed"
mirror=${FLOTILLA_DEBIAN_MIRROR:-http://deb.debian.org/debian}

tmp=$(mktemp -d "${TMPDIR:-/tmp}/flotilla-package-test.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

cpack --config "$build_dir/CPackConfig.cmake" -G DEB -B "$tmp/pkg" >"$tmp/cpack.log" 2>&1 ||
  { tail -n 20 "$tmp/cpack.log"; fail "cpack -G DEB failed"; }
deb=$(ls "$tmp"/pkg/flotilla_*_amd64.deb 2>/dev/null | head -n 1)
[ -n "$deb" ] || fail "cpack made no flotilla_*_amd64.deb in $tmp/pkg"
version=$("$build_dir/flotilla" --version | awk '{print $2}')
[ "$(dpkg-deb -f "$deb" Package)" = flotilla ] || fail "the package is not named flotilla"
[ "$(dpkg-deb -f "$deb" Version)" = "$version" ] ||
  fail "package version $(dpkg-deb -f "$deb" Version), the CLI says $version"
contents=$(dpkg-deb -c "$deb" | awk '{print $6}')
for f in ./usr/bin/flotilla ./usr/lib/flotilla/libtorch/torch/lib/libtorch_cpu.so \
  ./usr/lib/cmake/flotilla/flotillaConfig.cmake ./usr/include/flotilla/train/model.h \
  ./usr/share/doc/flotilla/LICENSE; do
  grep -qx "$f" <<<"$contents" || fail "the package lacks $f"
done
echo "package_test: $(basename "$deb"), $(du -m "$deb" | cut -f1) MiB; Depends: $(dpkg-deb -f "$deb" Depends)"

# A fresh root from Debian's archive: apt alone, then the .deb through apt (its Depends from the
# archive), then the job, then the removal. Each hook runs in mmdebstrap's chroot. The 2 GB .deb
# is linked into the root, not copied (the root is in $tmp too), and dpkg skips its fsyncs
# (force-unsafe-io): what is installed is the same, written sooner.
job='cd /tmp && flotilla launch --workers 2 -- flotilla train --model mlp --epochs 1 --steps-per-epoch 10 --batch-per-replica 32'
# What a C++ program needs to build against the package: a compiler, CMake, and the -dev
# packages of what libflotilla's static libraries link (the package Suggests them).
build_deps=g++,cmake,ninja-build,libprotobuf-dev,nlohmann-json3-dev,zlib1g-dev,libjpeg62-turbo-dev,libpng-dev,libssl-dev,libcurl4-openssl-dev
consumer='cmake -S /tmp/consumer -B /tmp/consumer-build -G Ninja -DCMAKE_BUILD_TYPE=Release && cmake --build /tmp/consumer-build -j 2 && /tmp/consumer-build/consumer'
left='test ! -e /usr/bin/flotilla && test ! -e /usr/lib/flotilla && test ! -e /usr/include/flotilla'
status=0
export FLOTILLA_TEST_DEB=$deb # read by the first hooks, whatever the paths hold
FLOTILLA_TEST_CONSUMER=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$build_dir/CMakeCache.txt")/examples/consumer
export FLOTILLA_TEST_CONSUMER
mmdebstrap --variant=apt --include=dataset-fashion-mnist,$build_deps --dpkgopt=force-unsafe-io \
  --customize-hook='ln "$FLOTILLA_TEST_DEB" "$1/tmp/flotilla.deb" || cp "$FLOTILLA_TEST_DEB" "$1/tmp/flotilla.deb"' \
  --customize-hook='cp -r "$FLOTILLA_TEST_CONSUMER" "$1/tmp/consumer"' \
  --customize-hook='chroot "$1" apt-get install -y -q /tmp/flotilla.deb' \
  --customize-hook="chroot \"\$1\" sh -c '$job'" \
  --customize-hook="chroot \"\$1\" sh -c '$consumer'" \
  --customize-hook='chroot "$1" apt-get remove -y -q flotilla' \
  --customize-hook="chroot \"\$1\" sh -c '$left'" \
  bookworm "$tmp/root" "$mirror" >"$tmp/mmdebstrap.log" 2>&1 || status=$?
if [ "$status" -ne 0 ]; then
  if grep -q -e "Failed to fetch" -e "Temporary failure resolving" -e "Could not resolve" \
    "$tmp/mmdebstrap.log" && ! grep -q "Setting up flotilla" "$tmp/mmdebstrap.log"; then
    skip "Debian's archive ($mirror) is not reachable: $(grep -m1 -e 'Failed to fetch' -e 'resolv' "$tmp/mmdebstrap.log")"
  fi
  tail -n 30 "$tmp/mmdebstrap.log"
  fail "mmdebstrap with the package failed (exit $status)"
fi
grep -q "Setting up flotilla ($version)" "$tmp/mmdebstrap.log" || fail "apt did not set flotilla up"
grep -q "Test: loss: " "$tmp/mmdebstrap.log" || { tail -n 30 "$tmp/mmdebstrap.log"; fail "the job gave no test result"; }
grep -q "Removing flotilla ($version)" "$tmp/mmdebstrap.log" || fail "apt did not remove flotilla"
echo "package_test: in a fresh Debian root, 2 workers: $(grep -o 'Test: .*' "$tmp/mmdebstrap.log" | head -n 1)"
version_line=$("$build_dir/flotilla" --version)
accuracy=$(sed -n "s/^$version_line accuracy //p" "$tmp/mmdebstrap.log" | head -n 1)
awk -v a="$accuracy" 'BEGIN { exit !(a + 0 > 0.9 && a + 0 <= 1) }' ||
  { tail -n 30 "$tmp/mmdebstrap.log"; fail "examples/consumer, built in the root against the package, gave accuracy '$accuracy', not in (0.9, 1]"; }
echo "package_test: examples/consumer built there with Debian's g++ and CMake against the package: accuracy $accuracy"
echo "package_test: OK"
