#!/usr/bin/env sh
# Installs mlxserve and what it needs. `./install.sh --test` adds the test tools.
# On Linux it also installs OpenBLAS (Debian/Ubuntu: libopenblas0-pthread), which
# mlxserve loads so MLX's CPU backend multiplies float32 matrices ~30x faster.
set -e
cd "$(dirname "$0")"
if [ "$(uname -s)" = "Linux" ] && ! ls /usr/lib/*/libopenblas.so.0 >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
        SUDO=""; [ "$(id -u)" = "0" ] || SUDO="sudo"
        $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libopenblas0-pthread >/dev/null \
            || echo "note: could not install OpenBLAS; MLX's CPU backend will be slow" >&2
    else
        echo "note: install OpenBLAS (libopenblas.so.0) for a fast CPU backend" >&2
    fi
fi
extra=""
[ "${1:-}" = "--test" ] && extra="[test]"
python3 -m pip install -q ".${extra}"
