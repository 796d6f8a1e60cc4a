#!/usr/bin/env bash
# Set up and run the whole test suite on a fresh machine (no GPU): the README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0 -e ".[dev]"
# pytest exits 5 when it collected no test: that must fail here, not pass silently.
python3 -m pytest -q "$@"
