#!/usr/bin/env bash
# Installs flotilla into a temporary prefix and builds examples/consumer against it with
# find_package(flotilla), as a downstream project would; then runs both the consumer (which must
# train to a high accuracy) and the installed CLI outside the build tree.
#   install_test.sh BUILD_DIR CONSUMER_SOURCE_DIR BUILT_LIBRARY_DIR BUILT_CLI CXX_COMPILER
set -euo pipefail

build_dir=$1 consumer_src=$2 built_lib_dir=$3 built_cli=$4 cxx=$5

fail() {
  echo "install_test: FAIL: $*" >&2
  exit 1
}

# README.md shows the consumer's program whole: the block after its marker is this file.
readme=$consumer_src/../../README.md
awk '/^<!-- examples\/consumer\/main.cpp -->$/ { marked = 1; next }
     marked && /^```cpp$/ { inside = 1; next }
     inside && /^```$/ { exit }
     inside { print }' "$readme" | cmp -s - "$consumer_src/main.cpp" ||
  fail "README.md's program (after <!-- examples/consumer/main.cpp -->) differs from $consumer_src/main.cpp"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/flotilla-install-test.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix

cmake --install "$build_dir" --prefix "$prefix" >"$tmp/install.log" ||
  { cat "$tmp/install.log"; fail "cmake --install $build_dir failed"; }

config=$(find "$prefix" -name flotillaConfig.cmake)
[ -n "$config" ] || fail "no flotillaConfig.cmake under $prefix"
for f in flotillaConfigVersion.cmake flotillaTargets.cmake; do
  [ -f "$(dirname "$config")/$f" ] || fail "$f is not next to $config"
done
# One static library per module (docs/architecture.md), each the one that was built.
for module in base cluster collective strategy data checkpoint train profile; do
  lib=$(find "$prefix" -name "libflotilla_$module.a")
  [ -n "$lib" ] || fail "no libflotilla_$module.a under $prefix"
  cmp -s "$lib" "$built_lib_dir/libflotilla_$module.a" ||
    fail "$lib differs from the built $built_lib_dir/libflotilla_$module.a"
done

# Every header a consumer can reach must be installed: a quoted include names a file under
# include/ (not models/ or src/, which stay in the source tree).
headers=$(cd "$prefix/include" && find . -name '*.h' | sort)
[ "$(echo "$headers" | wc -l)" -ge 20 ] || fail "only these headers were installed: $headers"
for h in $headers; do
  for inc in $(sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\([^"]*\)".*/\1/p' \
                 "$prefix/include/$h"); do
    [ -f "$prefix/include/$inc" ] || fail "installed $h includes \"$inc\", which is not installed"
  done
done

# LibTorch came along (lib/flotilla/libtorch), and the CLI finds it relative to itself.
bundled=$prefix/lib/flotilla/libtorch
[ -f "$bundled/torch/share/cmake/Torch/TorchConfig.cmake" ] ||
  fail "no LibTorch CMake package under $bundled (FLOTILLA_INSTALL_LIBTORCH?)"
[ -f "$bundled/torch/lib/libtorch_cpu.so" ] || fail "no libtorch_cpu.so under $bundled"
runpath=$(readelf -d "$prefix/bin/flotilla" | sed -n 's/.*R\(UN\)\{0,1\}PATH.*\[\(.*\)\]/\2/p')
case "$runpath" in
  '$ORIGIN/../lib/flotilla/libtorch/torch/lib':*) ;;
  *) fail "the installed CLI's RUNPATH is '$runpath', not relative to itself" ;;
esac
# Every library it loads comes from the prefix or from the system's own directories (Debian's
# packages): none from the checkout, its .venv, or /usr/local.
outside=$(ldd "$prefix/bin/flotilla" | awk '/=> \// {print $3}' |
  grep -v -e "^$prefix/" -e '^/lib/' -e '^/lib64/' -e '^/usr/lib/' -e '^/usr/lib64/' || true)
[ -z "$outside" ] || fail "the installed CLI loads libraries from elsewhere: $outside"

# The installed CLI finds LibTorch by itself (its RPATH), not through the build tree.
want_version=$("$built_cli" --version)
got_version=$(env -u LD_LIBRARY_PATH "$prefix/bin/flotilla" --version) ||
  fail "the installed $prefix/bin/flotilla does not run"
[ "$got_version" = "$want_version" ] ||
  fail "installed CLI says '$got_version', the built one '$want_version'"

# Nothing in the prefix names this machine's paths: not the checkout, not its build tree or
# .venv (flotilla's exported targets once linked the venv's libc10.so by its absolute path), and
# flotilla's own files not the CUDA toolkit found at configure time either (LibTorch's own CMake
# files list /usr/local/cuda among their search paths, as the wheel ships them).
checkout=$(cd "$consumer_src/../.." && pwd)
build_abs=$(cd "$build_dir" && pwd)
named=$(grep -rIl -F -e "$checkout" -e "$build_abs" "$prefix" || true)
[ -z "$named" ] || fail "these installed files name the checkout or the build tree: $named"
# (Its libraries, that is: the directories CMake found them in, as written and resolved.
# flotillaConfig.cmake looks for nvcc in /usr/local/cuda/bin, as LibTorch's package does, and
# a toolkit whose nvcc is /usr/local/bin/nvcc has the root /usr/local, so the root is no test.)
cuda_root=$(sed -n 's/^CUDA_TOOLKIT_ROOT_DIR:PATH=//p' "$build_dir/CMakeCache.txt")
cuda_dirs=()
while IFS= read -r lib; do
  dir=$(dirname "$lib")
  cuda_dirs+=(-e "$dir/" -e "$(readlink -f "$dir")/")
done < <(sed -n -E 's/^CUDA_[A-Za-z0-9_]+_LIBRARY:FILEPATH=(\/.*)$/\1/p' "$build_dir/CMakeCache.txt" | sort -u)
if [ ${#cuda_dirs[@]} -gt 0 ]; then
  named=$(grep -rIl -F "${cuda_dirs[@]}" "$prefix/lib/cmake/flotilla" "$prefix/include/flotilla" || true)
  [ -z "$named" ] || fail "flotilla's installed files name the CUDA toolkit's library directories: $named"
fi

# From here on the checkout (with its build tree and .venv) is hidden where we can hide it: a
# mount namespace with an empty tmpfs over it. The consumer is configured and built, and it and
# a 2-worker job of the installed CLI run, from the prefix alone, as on a machine that never
# had the checkout.
hide=()
if [ "$(id -u)" -eq 0 ] && unshare -m true 2>/dev/null; then
  hide=(unshare -m sh -c 'mount -t tmpfs none "$0" && exec "$@"' "$checkout")
  echo "install_test: building and running against the prefix with $checkout hidden"
else
  echo "install_test: cannot hide $checkout here (needs root and unshare -m); running with it"
fi
# The consumer's source, copied out of the checkout first.
cp -r "$consumer_src" "$tmp/consumer"
launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  # Paths under the temporary dir are rewritten relative, so reruns hit the cache.
  export CCACHE_BASEDIR=$tmp
fi
# LibTorch's package otherwise compiles and runs a GPU probe (the consumer has no CUDA code).
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
"${hide[@]}" cmake -S "$tmp/consumer" -B "$tmp/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_PREFIX_PATH="$prefix" "${launcher[@]}" \
  >"$tmp/configure.log" 2>&1 || { cat "$tmp/configure.log"; fail "configuring the consumer failed"; }
"${hide[@]}" cmake --build "$tmp/build" -j 2 >"$tmp/build.log" 2>&1 ||
  { cat "$tmp/build.log"; fail "building the consumer failed"; }

grep -q "^Torch_DIR:PATH=$bundled/" "$tmp/build/CMakeCache.txt" ||
  fail "the consumer found another LibTorch: $(grep '^Torch_DIR' "$tmp/build/CMakeCache.txt")"
# What it links, it links from the prefix or the system's directories, or from this machine's
# CUDA toolkit where LibTorch's package finds one (it links its libcudart; a machine without
# one links none). A path counts where it ends at a space, ';', ':', '"' or the line's end: this
# directory's random name begins with "a" or "so" one time in about 60, and its ".a..." was once
# read as a library.
outside=$(grep -o -E '(/[^ ;"$]+)+\.(so|a)(\.[0-9]+)*([ ;:"]|$)' "$tmp/build/build.ninja" |
  sed -E 's/[ ;:"]$//' | grep -v -e "^$prefix/" -e '^/lib/' -e '^/usr/lib/' ${cuda_root:+-e "^$cuda_root/"} | sort -u || true)
[ -z "$outside" ] || fail "the consumer links libraries from outside the prefix: $outside"

job=$(cd "$tmp" && env -u LD_LIBRARY_PATH "${hide[@]}" "$prefix/bin/flotilla" launch --workers 2 -- \
  "$prefix/bin/flotilla" train --model mlp --epochs 1 --steps-per-epoch 10 \
  --batch-per-replica 32 2>&1) || { echo "$job" | tail -n 20; fail "the installed CLI's 2-worker job failed"; }
echo "$job" | grep -q "Test: loss: " || { echo "$job" | tail -n 20; fail "the 2-worker job gave no test result"; }
echo "install_test: installed CLI, 2 workers: $(echo "$job" | grep -o 'Test: .*' | head -n 1)"

status=0
out=$(env -u LD_LIBRARY_PATH "${hide[@]}" "$tmp/build/consumer" 2>&1) || status=$?
echo "$out"
[ "$status" -eq 0 ] || fail "the consumer exited with $status"
# Its last line: flotilla <version> accuracy <value>.
last=$(echo "$out" | tail -n 1)
[ "$last" != "${last#"$want_version accuracy "}" ] ||
  fail "the consumer's last line '$last' is not '$want_version accuracy <value>'"
accuracy=${last#"$want_version accuracy "}
awk -v a="$accuracy" 'BEGIN { exit !(a + 0 > 0.9 && a + 0 <= 1) }' ||
  fail "accuracy $accuracy is not in (0.9, 1]"
echo "install_test: OK ($want_version, consumer accuracy $accuracy)"
