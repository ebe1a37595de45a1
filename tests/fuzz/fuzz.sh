#!/bin/sh
# libFuzzer starts itself again to merge corpora (`-merge=1`): this is the command it runs,
# the Python that run.py runs under (FUZZ_PYTHON, which run.py sets), from the repository root.
cd "$(dirname "$0")/../.." && exec "${FUZZ_PYTHON:-python3}" -m tests.fuzz.run "$@"
