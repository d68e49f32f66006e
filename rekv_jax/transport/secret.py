"""The job's key: a secret the two sides of a pair share and nobody else holds. It reaches each
side privately (from a file only its operator can read, or, on one machine, as an argument of
the spawned process) and never crosses a wire: the control connection opens with a mutual
challenge-response over it (`prove`, `check`), and the transfer server's pull ids are keyed by
a key derived from it (`JobKey.derive`). The coordinator's store never sees it."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

KEY_BYTES = 32
NONCE_BYTES = 32
PROOF_BYTES = 32  # an HMAC-SHA256
MIN_FILE_BYTES = 16  # a key file shorter than this is refused as too weak
SECRET_FILE_ENV = "REKV_SECRET_FILE"  # the default of `--secret-file`


@dataclasses.dataclass(frozen=True)
class JobKey:
    """A per-job secret (its bytes are never printed: `repr` hides them)."""

    secret: bytes = dataclasses.field(repr=False)

    @classmethod
    def new(cls) -> JobKey:
        """A fresh random key (one machine: the launcher makes it for both sides)."""
        return cls(secrets.token_bytes(KEY_BYTES))

    @classmethod
    def from_file(cls, path: str | Path) -> JobKey:
        """The key in `path` (its bytes, hashed: any length of at least MIN_FILE_BYTES). A
        ValueError, one line, if it cannot be read, is too short, or others may read it."""
        data = read_private(path, "the secret file")
        if len(data.strip()) < MIN_FILE_BYTES:
            raise ValueError(f"the secret file {path} holds {len(data.strip())} bytes; a key "
                             f"needs at least {MIN_FILE_BYTES} (e.g. head -c 32 /dev/urandom)")
        return cls(hashlib.sha256(b"rekv job key\0" + data.strip()).digest())

    def derive(self, purpose: str) -> bytes:
        """A key for one use only (domain-separated: knowing one reveals neither the job's key
        nor another purpose's)."""
        return hmac.new(self.secret, b"rekv/" + purpose.encode(), hashlib.sha256).digest()


def read_private(path: str | Path, what: str) -> bytes:
    """The bytes of `path`, a file only its owner may read (`what` names it in the one-line
    ValueError if it cannot be read or others may read it)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {what} {path}: {e.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{what} {path} may be read by others (mode "
                         f"{stat.S_IMODE(mode):o}): chmod 600 {path}")
    return data


def job_key(secret_file: str | None, what: str, otherwise: str = "") -> JobKey:
    """The key of a process started on its own (a run across nodes): from `secret_file`, else
    the file $REKV_SECRET_FILE names. A ValueError (one line) names the way out when there is
    neither (`otherwise`: another way, appended)."""
    path = secret_file or os.environ.get(SECRET_FILE_ENV)
    if not path:
        raise ValueError(f"{what} needs the job's key: --secret-file PATH or ${SECRET_FILE_ENV} "
                         f"(the same file on every node, readable by its owner only){otherwise}")
    return JobKey.from_file(path)


def key_of(secret_file: str | None, insecure: bool, what: str) -> JobKey | None:
    """`job_key`, or None if there is none and `insecure` (`--insecure`)."""
    if insecure and not (secret_file or os.environ.get(SECRET_FILE_ENV)):
        return None
    return job_key(secret_file, what, ", or --insecure to run without one")


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def prove(key: bytes, who: str, nonces: bytes) -> bytes:
    """`who`'s proof that it holds `key`, over both sides' fresh nonces (the connector's, then
    the listener's). The two sides' proofs differ by `who`, so neither can be replayed as the
    other's, and fresh nonces from both make every proof good for one connection only."""
    return hmac.new(key, f"rekv control {who}\0".encode() + nonces, hashlib.sha256).digest()


def check(key: bytes, who: str, nonces: bytes, proof: bytes) -> bool:
    """Whether `proof` is `who`'s (`prove`), in constant time."""
    return hmac.compare_digest(prove(key, who, nonces), proof)
