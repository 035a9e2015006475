#!/usr/bin/env bash
# Screenshots of each console page, taken by headless Chromium during the console's
# browser tests (a real `tessera serve`, real SMTP), into docs/console/ for docs/console.md.
# Needs chromium, chromium-driver and aiosmtpd (.ci/run installs them).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-docs/console}"
mkdir -p "$out"
TESSERA_SCREENSHOTS="$(cd "$out" && pwd)" cargo test -p tessera-e2e --test console --test console_billing -- --nocapture
ls -1 "$out"/*.png
