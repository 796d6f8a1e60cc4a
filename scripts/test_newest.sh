#!/usr/bin/env bash
# Drift, caught on purpose: the suite on the newest versions pyproject.toml's ranges allow, in a
# throwaway virtual environment (the lock is not used). Run it before moving the lock forward
# (scripts/lock.sh), and whenever a dependency releases: a failure here names the package that broke
# before a fresh machine finds it. Arguments go to pytest, as with scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d)/newest
python3 -m venv "$venv"
trap 'rm -rf "$(dirname "$venv")"' EXIT
status=0
PATH="$venv/bin:$PATH" ORCA_LAB_LOCK= bash scripts/test.sh "$@" || status=$?
echo "scripts/test_newest.sh: versions that differ from requirements/lock.txt (newest, locked):"
"$venv/bin/python" -m pip freeze --exclude-editable | python3 scripts/lock_diff.py requirements/lock.txt
exit $status
