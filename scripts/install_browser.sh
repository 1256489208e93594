#!/bin/sh
# The browser end-to-end tests (tests/e2e) drive Debian's Chromium through
# Playwright; no browser is ever downloaded by Playwright itself. Install
# /usr/bin/chromium from the distribution when it is missing and we are root;
# otherwise say why the e2e tests will be skipped and carry on.
set -eu
if [ -x /usr/bin/chromium ]; then
    exit 0
fi
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install_browser: /usr/bin/chromium is missing (install the 'chromium' package as root); e2e tests will skip" >&2
    exit 0
fi
echo "install_browser: installing chromium from the distribution" >&2
apt-get update -q
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium
