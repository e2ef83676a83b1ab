"""Where the API keys come from: DEEPSERVE_API_KEY (comma-separated), `--api-key-file` (one per line) and
`--api-key`, all accepted together. Shared by `deepserve serve` and `deepserve router`, so both read keys
the same way; light (no fastapi, no engine), so the router process does not load the server to read them.

The first two keep keys out of the process's command line, which every user of the machine can read (`ps`).
"""

from __future__ import annotations

import argparse
import logging
import os
import stat

from deepserve import envs

logger = logging.getLogger(__name__)


def api_keys(args: argparse.Namespace) -> list[str]:
    """The keys of all three sources (flags, files, DEEPSERVE_API_KEY), each once, in that order."""
    if args.api_keys:
        logger.warning("a key given with --api-key is visible to every user of this machine (ps); "
                       "prefer DEEPSERVE_API_KEY or --api-key-file")
    keys = list(args.api_keys)
    for path in args.api_key_files:
        keys += read_api_key_file(path)
    keys += envs.DEEPSERVE_API_KEY
    return list(dict.fromkeys(keys))


def read_api_key_file(path: str) -> list[str]:
    """One key per line; blank lines and lines starting with # are skipped. A file with no key is an error:
    the server would otherwise run without authentication, which is not what naming a key file asks for."""
    with open(path, encoding="utf-8") as f:
        keys = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ValueError(f"--api-key-file {path} holds no key")
    if os.stat(path).st_mode & (stat.S_IRGRP | stat.S_IROTH):
        logger.warning("%s is readable by other users; `chmod 600 %s` keeps the keys private", path, path)
    return keys
