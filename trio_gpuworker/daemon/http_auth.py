"""API keys: bearer tokens from `http.api_keys_file` and `$GPUWORKER_API_KEYS`, checked in constant time.

Only the sha256 of each key is kept. A presented token is hashed and compared with every stored digest by
`hmac.compare_digest`, without stopping at a match, so the time taken tells neither whether a key matched nor
which one, nor anything of its length.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from .._errors import ConfigError

KEYS_ENV = "GPUWORKER_API_KEYS"
MIN_KEY_CHARS = 16
# RFC 6750's b64token: what may follow "Bearer " in an Authorization header
_TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
_SEPARATORS = re.compile(r"[\s,]+")
REALM = "gpuworkerd"


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def _checked(keys: Iterable[str], where: str) -> list[str]:
    out = []
    for i, key in enumerate(keys):
        if not _TOKEN.fullmatch(key):
            raise ConfigError(f"{where}: key {i + 1} holds characters a bearer token cannot carry "
                              "(letters, digits and -._~+/ , then '=' padding)")
        if len(key) < MIN_KEY_CHARS:
            raise ConfigError(f"{where}: key {i + 1} has {len(key)} characters; at least {MIN_KEY_CHARS}")
        out.append(key)
    return out


def load_api_keys(keys_file: str, base: Path, env: Mapping[str, str]) -> frozenset[bytes]:
    """The digests of the keys in `keys_file` (one per line; blank lines and `#` comments skipped) and in
    `$GPUWORKER_API_KEYS` (separated by commas or whitespace). Both may be given: either's keys are accepted."""
    keys: list[str] = []
    if keys_file:
        path = Path(keys_file) if Path(keys_file).is_absolute() else base / keys_file
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"http.api_keys_file: cannot read {path}: {exc}") from exc
        lines = [ln.strip() for ln in text.splitlines()]
        found = _checked([ln for ln in lines if ln and not ln.startswith("#")], f"http.api_keys_file ({path})")
        if not found:
            raise ConfigError(f"http.api_keys_file: {path} holds no key")
        keys += found
    if env.get(KEYS_ENV, "").strip():
        keys += _checked([k for k in _SEPARATORS.split(env[KEYS_ENV].strip()) if k], f"${KEYS_ENV}")
    return frozenset(_digest(k) for k in keys)


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, if there is one."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return None


def key_matches(token: str | None, digests: frozenset[bytes]) -> bool:
    if token is None:
        return False
    presented = _digest(token)
    matched = False
    for digest in digests:  # every digest, always: no early exit
        matched |= hmac.compare_digest(presented, digest)
    return matched


def challenge(token_given: bool) -> str:
    """The WWW-Authenticate value of a 401 (RFC 6750: `invalid_token` when a token was presented)."""
    return f'Bearer realm="{REALM}"' + (', error="invalid_token"' if token_given else "")
