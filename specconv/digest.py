"""The sha256 of a file's bytes: one reader for `verify` (reports record what they verified) and the Hub
pipeline (staged files, reports matched to the files an upload publishes). A leaf module, so the Hub
commands do not import the verifier (and torch) to hash a file."""

from __future__ import annotations

import hashlib


def sha256_file(path) -> bytes:
    """The sha256 digest of a file's bytes, read in 8 MB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(8 << 20), b""):
            digest.update(block)
    return digest.digest()
