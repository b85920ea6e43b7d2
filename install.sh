#!/usr/bin/env sh
# Installs mlxserve and what it needs. `./install.sh --test` adds the test tools (and, where npm
# is, the Claude Code and Codex CLIs).
# On Linux it also installs OpenBLAS (Debian/Ubuntu: libopenblas0-pthread), which
# mlxserve loads so MLX's CPU backend multiplies float32 matrices ~30x faster.
# With --test on Debian/Ubuntu it also installs the distribution's Chromium, which the
# web page's browser test drives through Playwright (no browser download from Playwright).
set -e
cd "$(dirname "$0")"
packages=""
if [ "$(uname -s)" = "Linux" ] && ! ls /usr/lib/*/libopenblas.so.0 >/dev/null 2>&1; then
    packages="libopenblas0-pthread"
fi
if [ "${1:-}" = "--test" ] && [ "$(uname -s)" = "Linux" ] \
        && ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
    packages="$packages chromium"
fi
if [ -n "$packages" ]; then
    if command -v apt-get >/dev/null 2>&1; then
        SUDO=""; [ "$(id -u)" = "0" ] || SUDO="sudo"
        # One package at a time: one the distribution lacks (Ubuntu ships Chromium as a snap)
        # must not cost the others.
        $SUDO apt-get update -qq || true
        for p in $packages; do
            $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$p" >/dev/null \
                || echo "note: could not install $p (OpenBLAS: MLX's CPU backend will be slow;" \
                        "chromium: the browser test will skip)" >&2
        done
    else
        echo "note: install $packages for a fast CPU backend / the browser test" >&2
    fi
fi
extra=""
[ "${1:-}" = "--test" ] && extra="[test]"
python3 -m pip install -q ".${extra}"
# With --test, the agent CLIs that tests/test_agent_cli.py runs against a live server, where npm
# is (the test skips without them). Claude Code asks for Node 22 and runs on 20 with a warning.
if [ "${1:-}" = "--test" ] && command -v npm >/dev/null 2>&1 \
        && { ! command -v claude >/dev/null 2>&1 || ! command -v codex >/dev/null 2>&1; }; then
    npm install -g -s @anthropic-ai/claude-code@2.1.332 @openai/codex@0.171.0 >/dev/null 2>&1 \
        || echo "note: could not install the agent CLIs with npm: their live test will skip" >&2
fi
