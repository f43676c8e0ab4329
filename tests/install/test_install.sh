#!/bin/sh
# test_install.sh: `cmake --install` into a temporary prefix, then build and
# run a small program against the installed copy three ways: pkg-config
# (shared), pkg-config --static (libtensord.a alone), find_package(tensord);
# and against the build tree with README.md's one-line compile.
# Usage: test_install.sh BUILD_DIR LIBDIR CC [CFLAGS]
#   LIBDIR: CMAKE_INSTALL_LIBDIR (lib, or lib/<multiarch>)
#   CFLAGS: extra flags for compiling and linking (the sanitizers of the build)
set -eu
build=$1 libdir_rel=$2 cc=$3 cflags=${4:-}
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$here/../.." && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/td-install.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
step() { echo "-- $*"; }

prefix=$tmp/usr
libdir=$prefix/$libdir_rel
nosock=$tmp/nobody-listens.sock
warn="-std=c11 -Wall -Wextra -Werror -pedantic"

step "cmake --install $build --prefix $prefix"
cmake --install "$build" --prefix "$prefix" >"$tmp/install.log" ||
  { cat "$tmp/install.log"; fail "cmake --install"; }
for f in include/tensord.h bin/tensord bin/tensorctl \
         "$libdir_rel/libtensord.a" "$libdir_rel/pkgconfig/tensord.pc" \
         "$libdir_rel/cmake/tensord/tensordConfig.cmake" \
         "$libdir_rel/cmake/tensord/tensordConfigVersion.cmake" \
         share/doc/tensord/operations.md share/doc/tensord/containers.md; do
  [ -e "$prefix/$f" ] || fail "$f was not installed"
done
real=$(readlink -f "$libdir/libtensord.so")
[ -L "$libdir/libtensord.so" ] && [ -L "$libdir/libtensord.so.0" ] &&
  [ -f "$real" ] || fail "libtensord.so and .so.0 are not links to the library"
soname=$(readelf -d "$real" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
[ "$soname" = libtensord.so.0 ] || fail "SONAME is '$soname'"
[ "$(readlink -f "$libdir/libtensord.so.0")" = "$real" ] ||
  fail "libtensord.so.0 does not lead to $real"

export PKG_CONFIG_PATH="$libdir/pkgconfig"
version=$(pkg-config --modversion tensord) || fail "pkg-config tensord"
case "$real" in *".so.$version") ;; *) fail "pkg-config says $version, library is $real" ;; esac
# Only the installed copy: the source tree's include/ must not be needed.
case "$(pkg-config --cflags tensord)" in
  *"-I$prefix/include"*) ;;
  *) fail "pkg-config --cflags: $(pkg-config --cflags tensord)" ;;
esac

step "shared: cc prog.c \$(pkg-config --cflags --libs tensord)"
# shellcheck disable=SC2046,SC2086
"$cc" $warn $cflags "$here/prog.c" -o "$tmp/prog_shared" \
  $(pkg-config --cflags --libs tensord) || fail "shared build"
LD_LIBRARY_PATH=$libdir ldd "$tmp/prog_shared" | grep -q "libtensord.so.0 => $libdir/" ||
  fail "prog_shared does not load the installed libtensord.so.0"
LD_LIBRARY_PATH=$libdir "$tmp/prog_shared" "$nosock" || fail "prog_shared ran"

step "static: cc prog.c \$(pkg-config --static --cflags --libs tensord)"
# A prefix with only libtensord.a, so that -ltensord cannot pick the .so.
sprefix=$tmp/static
cp -a "$prefix" "$sprefix"
rm -f "$sprefix/$libdir_rel"/libtensord.so*
export PKG_CONFIG_PATH="$sprefix/$libdir_rel/pkgconfig"
sed -i "s|$prefix|$sprefix|g" "$sprefix/$libdir_rel/pkgconfig/tensord.pc"
# shellcheck disable=SC2046,SC2086
"$cc" $warn $cflags "$here/prog.c" -o "$tmp/prog_static" \
  $(pkg-config --static --cflags --libs tensord) || fail "static build"
readelf -d "$tmp/prog_static" | grep -q 'NEEDED.*libtensord' &&
  fail "prog_static needs libtensord.so"
"$tmp/prog_static" "$nosock" || fail "prog_static ran"

step "cmake: find_package(tensord) with tensord::tensord, tensord::tensord_static"
cmake -S "$here" -B "$tmp/consumer" -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_C_COMPILER="$cc" -DCMAKE_C_FLAGS="$warn $cflags" \
  -DCMAKE_EXE_LINKER_FLAGS="$cflags" >"$tmp/consumer.log" 2>&1 &&
  cmake --build "$tmp/consumer" >>"$tmp/consumer.log" 2>&1 ||
  { cat "$tmp/consumer.log"; fail "find_package(tensord) project"; }
ldd "$tmp/consumer/prog_shared" | grep -q "libtensord.so.0 => $libdir/" ||
  fail "the CMake prog_shared does not load the installed libtensord.so.0"
readelf -d "$tmp/consumer/prog_static" | grep -q 'NEEDED.*libtensord' &&
  fail "the CMake prog_static needs libtensord.so"
"$tmp/consumer/prog_shared" "$nosock" || fail "CMake prog_shared ran"
"$tmp/consumer/prog_static" "$nosock" || fail "CMake prog_static ran"

step "build tree: cc -I include prog.c build/client/libtensord.a -lprotobuf-c -ljansson"
# shellcheck disable=SC2086
(cd "$src" && "$cc" $warn $cflags -I include "$here/prog.c" \
  "$build/client/libtensord.a" -lprotobuf-c -ljansson -o "$tmp/prog_tree") ||
  fail "README's one-line compile against the build tree"
"$tmp/prog_tree" "$nosock" || fail "prog_tree ran"
echo "ok: installed $version; built and ran with pkg-config, pkg-config --static, find_package, the build tree"
