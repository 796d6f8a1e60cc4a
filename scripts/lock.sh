#!/usr/bin/env bash
# Regenerate requirements/lock.txt: every package version of the tested set, resolved by pip-compile
# from pyproject.toml's ranges (all extras, through "dev") and requirements/torch.in. Run it when
# scripts/test_newest.sh has passed on newer versions, then run scripts/test.sh and commit the lock
# with what it changed. scripts/test.sh and the README's commands install with it as constraints.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d)/pip-tools
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q pip-tools==7.6.2
{
    echo "# The tested set: every version the suite passed with. Made by scripts/lock.sh (pip-compile $("$venv/bin/pip-compile" --version | awk '{print $3}'),"
    echo "# from pyproject.toml's dev extra and requirements/torch.in); do not edit by hand. Used as"
    echo "# constraints: pip install -c requirements/lock.txt torch==2.13.0 -e \".[dev]\""
    # No index URLs (a machine's own pip config says where packages come from), no line for this
    # project (its own extras name it), and torch without the local label of the CPU build, so the
    # pin holds whichever index serves 2.13.0.
    "$venv/bin/pip-compile" -q --extra dev --strip-extras --allow-unsafe --no-header \
        --no-emit-index-url --no-emit-find-links -o - pyproject.toml requirements/torch.in \
        2>/dev/null | grep -v '^orca-lab @ ' | sed -E 's/^torch==([0-9.]+)\+cpu$/torch==\1/'
} > requirements/lock.txt
rm -rf "$(dirname "$venv")"
echo "requirements/lock.txt: $(grep -c '^[a-zA-Z]' requirements/lock.txt) packages"
