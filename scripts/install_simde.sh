#!/usr/bin/env bash
# SIMD Everywhere's headers (Debian/Ubuntu: libsimde-dev) for the emulated build of castspec's C code that the
# tests run on CPUs without AVX-512 (castspec/native/build.py). Optional: without them those tests are skipped.
set -u
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    if { apt-get install -y -qq libsimde-dev || { apt-get update -qq && apt-get install -y -qq libsimde-dev; }; } \
            >/dev/null 2>&1; then
        echo "installed libsimde-dev (emulated native-code tests)"
        exit 0
    fi
fi
echo "libsimde-dev is not installed (needs root and apt-get): the native-code tests will be skipped on CPUs" \
     "without AVX-512 BF16; install it with your package manager to run them"
exit 0
