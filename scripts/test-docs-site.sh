#!/usr/bin/env bash
# The documentation site as a person sees it: builds it (scripts/docs.sh), serves it locally and
# opens the home page and a guide page in headless Chromium (Debian's `chromium`, installed with
# apt as root when missing), saving screenshots in build/docs-site/; fails when the navigation,
# the search box or code highlighting is missing or raw Markdown shows (scripts/check_docs_site.py).
# Prints "test-docs-site: SKIPPED: <reason>" where Chromium cannot be installed.
# Usage: bash scripts/test-docs-site.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_uv.sh

chromium=$(command -v chromium || command -v chromium-browser || true)
if [ -z "$chromium" ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "test-docs-site: SKIPPED: chromium is not installed and installing it needs root (apt-get install chromium)"
        exit 0
    fi
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null 2>&1; then
        echo "test-docs-site: SKIPPED: apt-get install chromium failed"
        exit 0
    fi
    chromium=$(command -v chromium)
fi
bash scripts/docs.sh build/site >/dev/null
uv run --frozen python scripts/check_docs_site.py "$chromium" build/site build/docs-site
echo "test-docs-site: passed; screenshots in $(pwd)/build/docs-site/"
