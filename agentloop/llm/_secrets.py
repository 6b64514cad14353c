"""Credentials of an adapter: checked once when it is built, kept out of what it shows.

An adapter's secrets are its API key, the values of its secret-looking headers and the
userinfo or secret query parameters of its base URL. :class:`Secrets` replaces every occurrence
of one (also in the escaped forms JSON, ``repr`` and percent-encoding give it) with ``***``.
"""

from __future__ import annotations

import json
import re
import unicodedata
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import Any

from .._errors import ConfigError

__all__ = [
    "MASK",
    "Secrets",
    "check_api_key",
    "check_headers",
    "is_secret_header",
    "shown_url",
]

MASK = "***"

_SECRET_HEADERS = frozenset({"authorization", "proxy-authorization", "api-key", "x-api-key"})
_SECRET_WORDS = ("key", "token", "secret", "auth")
# Shorter values guard nothing, and masking every occurrence of them would garble messages.
_MIN_SECRET = 4
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_USERINFO = re.compile(r"(?<=//)[^/?#@]*@")
_LINE_BREAKS = "\r\n\x85\u2028\u2029"


def is_secret_header(name: str) -> bool:
    """Whether a header's value is treated as a credential (matched case-insensitively)."""
    lowered = name.lower()
    return lowered in _SECRET_HEADERS or any(word in lowered for word in _SECRET_WORDS)


def shown_url(url: str) -> str:
    """``url`` as messages and reprs show it: with any userinfo (``user:password@``) masked."""
    return _USERINFO.sub(f"{MASK}@", url)


def _char(ch: str) -> str:
    name = unicodedata.name(ch, "")
    return f"U+{ord(ch):04X}" + (f" {name}" if name else "")


def _shows(ch: str) -> bool:
    return ch.isprintable() and not ch.isspace()


def _flaw(value: str, *, blanks_inside: bool) -> str | None:
    """What makes ``value`` unusable in an HTTP header, without quoting any of it."""

    def where(index: int) -> str:
        if not any(_shows(ch) for ch in value[index:]):
            return "at its end"
        if not any(_shows(ch) for ch in value[: index + 1]):
            return "at its start"
        return "inside it"

    for index, ch in enumerate(value):
        if ch in _LINE_BREAKS:
            hint = " (a trailing newline from a key file?)" if where(index) == "at its end" else ""
            return f"contains a line break {where(index)}{hint}"
    for index, ch in enumerate(value):
        if ch == "\ufeff":
            return f"contains a byte-order mark {where(index)} (a key file saved with a BOM?)"
        if ch not in " \t" and (ch.isspace() or unicodedata.category(ch).startswith("C")):
            kind = "whitespace" if ch.isspace() else "an invisible control character"
            return f"contains {kind} ({_char(ch)}) {where(index)}"
    for index, ch in enumerate(value):
        if not ch.isascii():
            return f"contains a non-ASCII character {where(index)}"
    for index, ch in enumerate(value):
        if ch in " \t" and (not blanks_inside or where(index) != "inside it"):
            return f"contains whitespace ({_char(ch)}) {where(index)}"
    return None


def check_api_key(api_key: object, *, where: str) -> None:
    """Refuse an API key that cannot be sent as is.

    A bad key is refused rather than cleaned up: a key silently stripped of a newline hides a
    broken key file (or secret store) that will bite elsewhere. The message says what is wrong
    and where, never any part of the key.
    """
    if api_key is None:
        return
    if not isinstance(api_key, str):
        raise ConfigError(f"api_key for {where} must be a string, got {type(api_key).__name__}")
    flaw = _flaw(api_key, blanks_inside=False)
    if flaw is not None:
        hint = ""
        if api_key[:7].lower() == "bearer ":
            hint = "; give the key alone, the adapter adds the 'Bearer' scheme itself"
        raise ConfigError(f"api_key for {where} {flaw}{hint}")


def check_headers(headers: Mapping[Any, object] | None, *, where: str) -> None:
    """Refuse header names and values that are not valid HTTP, never quoting a value."""
    for position, (name, value) in enumerate((headers or {}).items(), 1):
        if not isinstance(name, str) or not _TOKEN.fullmatch(name):
            # An invalid name may be a whole "Name: value" line pasted in, so it is not shown.
            raise ConfigError(
                f"header #{position} for {where} has a name that is not a valid HTTP field name"
            )
        if not isinstance(value, str):
            raise ConfigError(
                f"header {name!r} for {where} must have a string value, got {type(value).__name__}"
            )
        flaw = _flaw(value, blanks_inside=True)
        if flaw is not None:
            raise ConfigError(f"header {name!r} for {where}: its value {flaw}")


def _forms(secret: str) -> set[str]:
    # A secret echoed back can arrive escaped: in a JSON body, the repr of a str or bytes
    # (as protocol errors quote lines), or percent-encoded in a URL.
    backslashed = secret.replace("\\", "\\\\")
    forms = {
        secret,
        json.dumps(secret)[1:-1],
        json.dumps(secret)[1:-1].replace("/", "\\/"),
        backslashed.replace("'", "\\'"),
        backslashed.replace('"', '\\"'),
        urllib.parse.quote(secret, safe=""),
        urllib.parse.quote_plus(secret, safe=""),
    }
    for quoted in (repr(secret), ascii(secret)):
        forms.add(quoted[1:-1])
    return {form for form in forms if len(form) >= _MIN_SECRET}


class Secrets:
    """The secrets of one adapter; masks them in text and in exceptions."""

    __slots__ = ("_forms", "_pattern")

    def __init__(self, values: Iterable[str]) -> None:
        forms: set[str] = set()
        for value in values:
            forms |= _forms(value)
        # Longest first, so a secret containing another is masked whole.
        self._forms = tuple(sorted(forms, key=lambda form: (-len(form), form)))
        self._pattern = re.compile("|".join(map(re.escape, self._forms))) if forms else None

    @classmethod
    def of(cls, api_key: str | None, headers: Mapping[str, str], base_url: str) -> Secrets:
        """The secrets of an adapter configured with these (already checked) values."""
        values = [api_key] if api_key else []
        for name, value in headers.items():
            if is_secret_header(name):
                values.append(value)
                # "Bearer <token>": a server may echo the token without its scheme.
                values.extend(value.split(None, 1)[1:])
        parts = urllib.parse.urlsplit(base_url)
        # Without a password, the user part is the credential (``https://<token>@host``).
        credential = parts.password or parts.username
        if credential:
            values += [credential, urllib.parse.unquote(credential)]
        for name, value in urllib.parse.parse_qsl(parts.query):
            if is_secret_header(name):
                values.append(value)
        return cls(values)

    def __repr__(self) -> str:
        return f"Secrets(<{len(self._forms)} forms>)"

    def scrub(self, text: str) -> str:
        """``text`` with every secret replaced by ``***``."""
        return self._pattern.sub(MASK, text) if self._pattern is not None else text

    def leaks(self, text: str) -> bool:
        """Whether ``text`` shows a secret."""
        return self._pattern is not None and self._pattern.search(text) is not None

    def scrub_chain(self, exc: BaseException) -> BaseException | None:
        """Scrub ``exc`` and the exceptions it chains to, in place; None if ``exc`` stays unsafe.

        String arguments are rewritten; an exception whose text still shows a secret after
        that (an ``OSError`` formats from its attributes, not its arguments) is cut out of the
        chain together with everything behind it.
        """
        if self._pattern is None:
            return exc
        return exc if self._clean(exc, set()) else None

    def _clean(self, exc: BaseException, seen: set[int]) -> bool:
        if id(exc) in seen:
            return True
        seen.add(id(exc))
        exc.args = tuple(self._clean_arg(arg, seen) for arg in exc.args)
        if isinstance(exc, BaseExceptionGroup) and not all(
            self._clean(inner, seen) for inner in exc.exceptions
        ):
            return False
        suppress = exc.__suppress_context__
        if exc.__cause__ is not None and not self._clean(exc.__cause__, seen):
            exc.__cause__ = None
        if exc.__context__ is not None and not self._clean(exc.__context__, seen):
            exc.__context__ = None
        exc.__suppress_context__ = suppress
        try:
            shown = f"{exc}\n{exc!r}"
        except Exception:  # noqa: BLE001 - an exception that cannot be shown shows nothing
            return True
        return not self.leaks(shown)

    def _clean_arg(self, arg: object, seen: set[int]) -> object:
        if isinstance(arg, str):
            return self.scrub(arg)
        if isinstance(arg, bytes | bytearray):
            text = bytes(arg).decode("latin-1")
            return self.scrub(text).encode("latin-1") if self.leaks(text) else arg
        if isinstance(arg, BaseException) and not self._clean(arg, seen):
            return MASK
        return arg
