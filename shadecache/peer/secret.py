"""The secret every node of a job shares: where it comes from, what is strong enough, how to make one.

The peer layer always needs one, loopback included (another user of the same node can reach
127.0.0.1 too). It is at least 16 random bytes, given as the bytes themselves or as their hex or
base64 text (`shadecache secret` prints 32 fresh ones as hex). A password is refused: one sniffed
handshake lets anyone test guesses offline, as fast as they can compute HKDF, so only a secret
too large to guess keeps the traffic safe.

What is refused, judged first by the text given, then by the bytes it decodes to:
  - printable text (in any script) that is neither hex nor base64 as an encoder writes random
    bytes (canonical, with as many distinct characters as random text shows);
  - fewer than 16 decoded bytes, or bytes that repeat themselves (few distinct values);
  - decoded bytes that one of the descriptions below writes in SAVED_BITS (24) fewer bits than
    the 8 per byte random bytes take: they are text (a password behind hex, base64 or a stray
    byte), steps (counting, a constant, a constant stride) or repeats. Each description is a
    code, so random bytes are written that much shorter with odds of at most 2^-24 by any of
    them, and under 1e-8 for all of them together in fact (see SAVED_BITS).
Random bytes given raw (not as hex or base64 text) that happen to read as printable UTF-8 text are
refused as text too: with odds of about 3e-6 at 16 bytes, 9e-8 at 20, 4e-9 at 24 and 6e-12 at 32
(counted over UTF-8's printable characters; 2.7e-6 measured over 3 million 16-byte draws). Hex
and base64 forms, and `shadecache secret`'s 32 bytes, never meet this.
A password is found by these marks; randomness cannot be proven (a long passphrase of varied
letters and digits can pass as base64): make the secret with `shadecache secret`.

Where it comes from, in order: `secret=` (a Python argument: never a command line, where `ps`
shows it to every user), then $SHADECACHE_SECRET, then the file named by $SHADECACHE_SECRET_FILE,
which must be a regular file of this user that nobody else may read or write (0600).
"""
import base64
import binascii
import math
import os
import secrets
import stat
import zlib

ENV = "SHADECACHE_SECRET"
ENV_FILE = "SHADECACHE_SECRET_FILE"
MIN_BYTES = 16
HOW = ("make one with `shadecache secret --out FILE` (a 0600 file) and name it in $SHADECACHE_SECRET_FILE "
       "(or put `shadecache secret`'s output in $SHADECACHE_SECRET, or pass it as secret=)")
RAW_AS_TEXT = (" (random raw bytes read as printable text with odds of about 3e-6 at 16 bytes and "
               "4e-9 at 24: if these are random, give them as hex)")


class SecretError(ValueError):
    """No secret, or one that is not at least 16 random bytes, or a secret file others can read."""


def new_secret() -> str:
    """32 fresh random bytes from the operating system's CSPRNG, as 64 hex digits."""
    return secrets.token_hex(32)


def resolve(secret=None) -> bytes:
    """The key: `secret` when given, else $SHADECACHE_SECRET, else the file $SHADECACHE_SECRET_FILE
    names; checked by `check`. SecretError when there is none."""
    if secret is None:
        secret = os.environ.get(ENV) or None
    if secret is None and os.environ.get(ENV_FILE):
        secret = read_file(os.environ[ENV_FILE])
    if secret is None:
        raise SecretError(f"the peer layer needs a secret shared by every node (loopback included): {HOW}")
    return check(secret)


def read_file(path: str) -> bytes:
    """The secret in `path` (surrounding whitespace removed): a regular file owned by this user,
    mode 0600 or stricter, not a symbolic link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise SecretError(f"secret file {path!r}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SecretError(f"secret file {path!r} is not a regular file")
        if st.st_uid != os.geteuid():
            raise SecretError(f"secret file {path!r} belongs to uid {st.st_uid}, not to this user "
                              f"(uid {os.geteuid()})")
        if st.st_mode & 0o077:
            raise SecretError(f"secret file {path!r} has mode {stat.S_IMODE(st.st_mode):04o}: others may "
                              f"read or change it; chmod 600 it")
        data = os.read(fd, 4097)
    finally:
        os.close(fd)
    if len(data) > 4096:
        raise SecretError(f"secret file {path!r} is larger than 4 KiB: not a secret")
    return data.strip()


def write_file(path: str, secret: str) -> None:
    """Writes `secret` to a new file `path`, mode 0600 (never over an existing file or link)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, secret.encode() + b"\n")
    finally:
        os.close(fd)


def check(secret) -> bytes:
    """The key bytes of `secret` (a str as UTF-8, bytes as given) when it is at least 16 random
    bytes: raw bytes, or their hex or base64 text. TypeError for another type, SecretError for a
    secret that is too short or not random."""
    if isinstance(secret, str):
        key = secret.encode("utf-8")
    elif isinstance(secret, (bytes, bytearray, memoryview)):
        key = bytes(secret)
    else:
        raise TypeError(f"secret must be str or bytes, got {type(secret).__name__}")
    raw = _decoded(key)
    if raw is None:
        given_raw = not isinstance(secret, str)
        raise SecretError(f"the secret is text that is neither hex nor random base64: a password, not "
                          f"random bytes{RAW_AS_TEXT if given_raw else ''}; {HOW}")
    if len(raw) < MIN_BYTES:
        raise SecretError(f"the secret holds {len(raw)} random bytes; at least {MIN_BYTES} are needed; {HOW}")
    if len(set(raw)) < _min_distinct(len(raw)):
        raise SecretError(f"the secret repeats itself ({len(set(raw))} distinct byte values in {len(raw)}): "
                          f"not random bytes; {HOW}")
    name, bits = _shortest_description(raw)
    if bits <= 8 * len(raw) - SAVED_BITS:
        raise SecretError(f"the secret's {len(raw)} bytes read as {name}: written as such in {bits:.0f} bits, not "
                          f"the {8 * len(raw)} of random bytes (an estimate of how few guesses find it); {HOW}")
    return key


def _decoded(key: bytes):
    """The random bytes `key` stands for: the bytes of its hex text, or of its base64 text when it
    reads as random base64 (_base64); else the bytes themselves, unless they are printable text
    in any script (a password, then None): UTF-8 text beyond ASCII is text, not raw bytes."""
    try:
        text = key.decode("utf-8").strip()
    except UnicodeDecodeError:
        return key                       # raw bytes
    if text and len(text) % 2 == 0 and all(c in "0123456789abcdefABCDEF" for c in text):
        return binascii.unhexlify(text)
    raw = _base64(text)
    if raw is not None:
        return raw
    return None if text.isprintable() else key


def _base64(text: str):
    """The bytes of `text` when it is base64 (standard or URL-safe, padded or not) as an encoder
    writes it: canonical (its last character carries no stray bits: "hunter2...2h" and most other
    passwords of letters and digits that happen to decode are not) and with as many distinct
    characters as random base64 of its length shows (_min_distinct). Else None.
    A long passphrase of varied letters and digits can still pass: this check finds passwords,
    it cannot prove randomness."""
    padded = text + "=" * (-len(text) % 4)
    body = text.rstrip("=")
    for alphabet, altchars in ((_B64, None), (_B64URL, b"-_")):
        if not text or not all(c in alphabet for c in padded):
            continue
        try:
            raw = base64.b64decode(padded, altchars=altchars, validate=True)
        except ValueError:
            continue
        if len(raw) < MIN_BYTES:   # too short anyway: check() says so
            return raw
        if base64.b64encode(raw, altchars=altchars).decode("ascii") == padded \
                and len(set(body)) >= _min_distinct(len(body), symbols=64, share=0.5):
            return raw
    return None


_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/="
_B64URL = _B64[:62] + "-_="


def _min_distinct(n: int, symbols: int = 256, share: float = 0.6) -> int:
    """The fewest distinct values `n` random draws from `symbols` show, with a margin: `share` of
    the number expected (symbols (1 - (1 - 1/symbols)^n)). Random input falls below it with odds
    under 1e-8: 60% for bytes (from 16 on), 50% for base64 characters (from 22 on)."""
    return math.ceil(share * symbols * (1 - (1 - 1 / symbols) ** n))


# ---- the entropy of the decoded bytes -------------------------------------------------------------
#
# Each description below is a prefix code over byte strings: the bits it needs to write `raw`. A code
# writes at most 2^(8n - k) of the 2^(8n) strings of n bytes in 8n - k bits or fewer, so random bytes
# are written SAVED_BITS shorter with odds of at most 2^-24 (6e-8) per description. The actual odds
# are lower, computed exactly over the lengths of random bytes (each description's costs summed
# byte by byte): text at most 4.3e-9 (the worst lengths, 20-24 bytes; 1e-10 from 48), steps at most
# 2.7e-9 (17 bytes); repeats need a run of bytes seen before, which random bytes of these lengths
# almost never hold (deflate stores them). Together under 1e-8 for any random secret.
SAVED_BITS = 24

# Text as people type it: each character's class, then the character within its class. Multi-byte
# UTF-8 characters are one symbol; a byte that is neither printable ASCII nor part of a valid UTF-8
# character is "other". The class probabilities sum to one.
_TEXT_CLASSES = (   # (probability of the class, number of symbols in it)
    ("lower", 0.45, 26), ("upper", 0.12, 26), ("digit", 0.16, 10), ("punct", 0.12, 33),
    ("utf8-2", 0.04, 1920), ("utf8-3", 0.025, 61440), ("utf8-4", 0.005, 1048576), ("other", 0.08, 161))
_TEXT_BITS = {name: math.log2(n / p) for name, p, n in _TEXT_CLASSES}


def _ascii_class(b: int) -> str:
    if 0x61 <= b <= 0x7A:
        return "lower"
    if 0x41 <= b <= 0x5A:
        return "upper"
    if 0x30 <= b <= 0x39:
        return "digit"
    return "punct" if 0x20 <= b <= 0x7E else "other"


def _text_bits(raw: bytes) -> float:
    bits, k = 0.0, 0
    while k < len(raw):
        b = raw[k]
        width = 2 if 0xC2 <= b <= 0xDF else 3 if 0xE0 <= b <= 0xEF else 4 if 0xF0 <= b <= 0xF4 else 1
        if width > 1:
            try:
                raw[k:k + width].decode("utf-8")
            except UnicodeDecodeError:
                width = 1
        if width > 1:
            bits += _TEXT_BITS[f"utf8-{width}"]
        else:
            bits += _TEXT_BITS[_ascii_class(b)]
        k += width
    return bits


def _step_bits(raw: bytes) -> float:
    """The first byte and the first step (8 bits each), then per byte one bit that says "the same
    step as before", or that bit and the new step (9 bits): counting, constants and strides."""
    steps = [(raw[k + 1] - raw[k]) & 0xFF for k in range(len(raw) - 1)]
    return 16 + sum(1 if s == p else 9 for p, s in zip(steps, steps[1:]))


def _repeat_bits(raw: bytes) -> float:
    """Raw deflate at level 9: repeated runs of bytes."""
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    return 8 * len(c.compress(raw) + c.flush())


def _shortest_description(raw: bytes) -> tuple:
    """(name, bits) of the description that writes `raw` in the fewest bits."""
    return min((("text", _text_bits(raw)), ("steps", _step_bits(raw)), ("repeats", _repeat_bits(raw))),
               key=lambda d: d[1])
