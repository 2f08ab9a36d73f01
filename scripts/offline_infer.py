"""Offline batch inference: `python scripts/offline_infer.py IN.jsonl OUT.jsonl [--model DIR]`.

The same as `jpaged batch`; see jpaged/entrypoints/batch.py for the file formats.
"""

import sys

from jpaged.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["batch", *sys.argv[1:]]))
