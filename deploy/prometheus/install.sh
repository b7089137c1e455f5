#!/usr/bin/env bash
# Install Debian's prometheus package (the server `make observe` runs) when it is missing.
set -euo pipefail
command -v prometheus >/dev/null && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    echo "prometheus is not on PATH: install Debian's package as root ('apt-get install" \
         "prometheus') or put a prometheus binary (2.x) on PATH" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends prometheus >/dev/null
prometheus --version | head -1
