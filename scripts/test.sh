#!/usr/bin/env bash
# Set up and run the whole test suite on a fresh machine (no GPU): the README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."
# The tested set (requirements/lock.txt, made by scripts/lock.sh) as constraints; ORCA_LAB_LOCK=
# (empty) installs the newest versions pyproject.toml allows instead: scripts/test_newest.sh does.
lock=${ORCA_LAB_LOCK-requirements/lock.txt}
python3 -m pip install -q ${lock:+-c "$lock"} torch==2.13.0 -e ".[dev]"
# GPT-2's BPE ranks (whisper/assets/gpt2.tiktoken) for the gpt2 tokenizer; whisper itself is never
# imported, so none of its dependencies (numba, ...) is needed.
python3 -m pip install -q --no-deps openai-whisper==20250625
# Chromium lets kaleido export PNG/SVG/PDF and lets the browser test drive JupyterLab.
if ! command -v chromium >/dev/null; then
    if [ "$(id -u)" = 0 ]; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
            || echo "scripts/test.sh: could not install chromium; tests that need it will say so and skip"
    else
        echo "scripts/test.sh: not root, chromium not installed; tests that need it will say so and skip"
    fi
fi
# pytest exits 5 when it collected no test: that must fail here, not pass silently.
python3 -m pytest -q "$@"
