"""The exporter's TLS and basic auth, from a web config file in the exporter-toolkit format.

node_exporter, Prometheus and the other Prometheus exporters read `--web.config.file`
(github.com/prometheus/exporter-toolkit, docs/web-configuration.md); `apply --web-config
FILE` reads the same file, so one file secures them all:

    tls_server_config:
      cert_file: server.crt          # relative paths are relative to the file's folder
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert   # optional: mutual TLS
      client_ca_file: clients-ca.crt
      min_version: TLS12             # TLS10..TLS13; TLS12 by default, as the toolkit's
    basic_auth_users:
      prometheus: $2b$12$...         # a bcrypt hash (htpasswd -nBC 12 "" | tr -d ':\\n')

A key of the format that this exporter does not implement (`cipher_suites`,
`http_server_config`, ...) is refused by name rather than ignored: the file would not
secure what its author believes. Checking bcrypt hashes needs the `bcrypt` package
(`pip install 'hookpolicy[web]'`); a file with users and no bcrypt is refused the same way.

`load_web_config` raises `WebConfigError` (one `Problem` per thing wrong, with file, line
and what is expected); `Credentials.check` is what the exporter asks of each request.
`LiveWebConfig` reads the file again when it or a file it names changes (a renewed
certificate, a changed user), as exporter-toolkit does, so a long job needs no restart.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from ..errors import HookPolicyError, PolicyError, Problem
from ..policy.document import Document, JsonPath
from ..policy.loader import read_document
from ..process import Once
from ..say import say

__all__ = ["Credentials", "LiveWebConfig", "WebConfig", "WebConfigError", "load_web_config"]

#: exporter-toolkit's TLS versions by name, and the one it picks when none is given.
TLS_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
                "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
DEFAULT_MIN_VERSION = "TLS12"

#: exporter-toolkit's client_auth_type values Python's ssl module can implement (it cannot
#: ask for a client certificate without verifying it: RequestClientCert, RequireAnyClientCert).
CLIENT_AUTH = {"NoClientCert": ssl.CERT_NONE, "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
               "RequireAndVerifyClientCert": ssl.CERT_REQUIRED}
_UNVERIFIED_CLIENT_AUTH = ("RequestClientCert", "RequireAnyClientCert")

_TLS_KEYS = ("cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version", "max_version")
#: Keys of the format this exporter does not implement: refused by name, never ignored.
_NOT_IMPLEMENTED: dict[JsonPath, str] = {
    ("tls_server_config", "cipher_suites"): "the cipher suites are Python's ssl defaults",
    ("tls_server_config", "curve_preferences"): "the curves are Python's ssl defaults",
    ("tls_server_config", "prefer_server_cipher_suites"): "the cipher order is Python's ssl default",
    ("tls_server_config", "client_allowed_sans"): "client certificates are verified against client_ca_file only",
    ("tls_server_config", "cert", "key"): "give the certificate and key as files (cert_file, key_file)",
    ("http_server_config",): "the exporter speaks HTTP/1.1 and sets no extra headers",
}
_TOP_KEYS = ("tls_server_config", "basic_auth_users")
#: A bcrypt hash as htpasswd -B and Python's bcrypt write it: $2a$, $2b$ or $2y$, cost, 53 characters.
_BCRYPT = re.compile(r"\$2[aby]\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}\Z")
#: Successful checks remembered (a bcrypt check takes 50-300 ms of CPU; Prometheus
#: sends the same password every scrape). Failures are never remembered.
_REMEMBERED = 16


class WebConfigError(HookPolicyError, ValueError):
    """A web config file that cannot secure the exporter; `problems` says each thing wrong."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = tuple(sorted(problems))
        super().__init__("\n".join(str(p) for p in self.problems))


@dataclass
class Credentials:
    """The `basic_auth_users` of a web config: user -> bcrypt hash.

    `check(header)` takes a request's Authorization header (None when absent) and says
    whether it names a user with the right password. An unknown user costs a bcrypt check
    too (against another user's hash), so the answer's time does not tell which users exist.
    """

    users: Mapping[str, bytes]
    _good: dict[bytes, None] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def check(self, header: Optional[str]) -> bool:
        user_password = _basic(header)
        if user_password is None:
            return False
        user, password = user_password
        key = hashlib.sha256(user.encode() + b"\0" + password).digest()
        with self._lock:
            if key in self._good:
                return True
        import bcrypt  # present: load_web_config refuses users without it

        known = self.users.get(user)
        hashed = known if known is not None else next(iter(self.users.values()))
        try:
            good = bool(bcrypt.checkpw(password, hashed)) and known is not None
        except ValueError:  # a password bcrypt refuses (a NUL byte, over 72 bytes in bcrypt 5)
            return False
        if good:
            with self._lock:
                if len(self._good) >= _REMEMBERED:
                    self._good.clear()
                self._good[key] = None
        return good

    def remembered(self, header: Optional[str]) -> bool:
        """Whether `check(header)` is known true without a bcrypt check."""
        user_password = _basic(header)
        if user_password is None:
            return False
        key = hashlib.sha256(user_password[0].encode() + b"\0" + user_password[1]).digest()
        with self._lock:
            return key in self._good


def _basic(header: Optional[str]) -> Optional[tuple[str, bytes]]:
    """`Basic base64(user:password)` -> (user, password); None for anything else."""
    if header is None:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        raw = base64.b64decode(token.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    user, sep, password = raw.partition(b":")
    if not sep:
        return None
    return user.decode("utf-8", "replace"), password


@dataclass(frozen=True)
class WebConfig:
    """A loaded web config: the TLS context (None: plain HTTP) and the users (None: no auth)."""

    file: str
    tls: Optional[ssl.SSLContext]
    credentials: Optional[Credentials]
    #: the files it was read from: the config itself, then the certificate, key and client CA files
    files: tuple[str, ...] = ()

    def describe(self) -> str:
        parts = []
        if self.tls is not None:
            mutual = self.tls.verify_mode == ssl.CERT_REQUIRED
            parts.append("TLS with client certificates" if mutual else "TLS")
        if self.credentials is not None:
            parts.append(f"basic auth ({len(self.credentials.users)} user(s))")
        return " and ".join(parts)


def load_web_config(file: str) -> WebConfig:
    """Read `file` (exporter-toolkit's format) into a WebConfig; raises WebConfigError."""
    try:
        document = read_document(file)
    except PolicyError as exc:
        if any("holds no policy" in p.message for p in exc.problems):
            raise WebConfigError([Problem(file, 0, 0, "$", _EMPTY)]) from None
        raise WebConfigError([_reworded(p) for p in exc.problems]) from None
    problems: list[Problem] = []
    data = document.data
    folder = os.path.dirname(os.path.abspath(file))
    for key in data:
        if (key,) in _NOT_IMPLEMENTED:
            problems.append(document.problem((key,), _not_implemented((key,)), key=True))
        elif key not in _TOP_KEYS:
            problems.append(document.problem(
                (key,), f"unknown key {key!r}; a web config holds {' and '.join(_TOP_KEYS)}", key=True))
    if not any(key in data for key in _TOP_KEYS) and not problems:
        problems.append(Problem(file, 1, 1, "$", _EMPTY))
    files: list[str] = [file]
    tls = (_tls(document, data.get("tls_server_config"), folder, problems, files)
           if "tls_server_config" in data else None)
    credentials = (_credentials(document, data.get("basic_auth_users"), problems)
                   if "basic_auth_users" in data else None)
    if problems:
        raise WebConfigError(problems)
    return WebConfig(file, tls, credentials, tuple(files))


#: Seconds between two looks at a live web config's files (a `stat` each).
CHECK_INTERVAL = 1.0


def _fingerprint(files: tuple[str, ...]) -> tuple[Optional[tuple[int, int, int]], ...]:
    """What changes when a file is rewritten or replaced (a Kubernetes Secret's `..data` swap too)."""
    prints: list[Optional[tuple[int, int, int]]] = []
    for name in files:
        try:
            st = os.stat(name)
        except OSError:
            prints.append(None)
        else:
            prints.append((st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(prints)


class LiveWebConfig:
    """A web config read again when one of its files changes, looked at most every `interval` seconds.

    A new version that does not load, or that would switch between TLS and plain HTTP
    (the listening socket's protocol is fixed), is said once and not taken: the endpoint
    keeps the version it serves, never less secured than before.
    """

    def __init__(self, config: WebConfig, interval: float = CHECK_INTERVAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._config, self._interval, self._clock = config, interval, clock
        self._seen = _fingerprint(config.files)
        self._checked = clock()
        self._lock = threading.Lock()
        self._said = Once(limit=16)

    def current(self) -> WebConfig:
        with self._lock:
            now = self._clock()
            if now - self._checked < self._interval:
                return self._config
            self._checked = now
            seen = _fingerprint(self._config.files)
            if seen == self._seen:
                return self._config
            self._seen = seen
            try:
                new = load_web_config(self._config.file)
            except WebConfigError as exc:
                reason = "; ".join(str(p) for p in exc.problems)
                if self._said(reason):
                    say(f"web config {self._config.file} changed but does not load, the metrics endpoint keeps the "
                        f"previous one: {reason}")
                return self._config
            if (new.tls is None) != (self._config.tls is None):
                if self._said("tls"):
                    say(f"web config {self._config.file} changed between TLS and plain HTTP, which takes a restart; "
                        f"the metrics endpoint keeps the previous one")
                return self._config
            self._config, self._seen = new, _fingerprint(new.files)
            say(f"web config {new.file} read again: {new.describe()}")
            return new


_EMPTY = ("the web config sets neither tls_server_config nor basic_auth_users: the exporter would serve "
          "plain, open HTTP as without --web-config")


def _reworded(problem: Problem) -> Problem:
    """The YAML loader's problems, with the policy-specific words of its top-level message put right."""
    if "top level must be a mapping" in problem.message:
        return Problem(problem.file, problem.line, problem.column, problem.path,
                       "the top level must be a mapping with tls_server_config and/or basic_auth_users")
    return problem


def _not_implemented(path: JsonPath) -> str:
    name = ".".join(str(p) for p in path)
    return (f"{name} is exporter-toolkit's, but hookpolicy's exporter does not implement it "
            f"({_NOT_IMPLEMENTED[path]}); remove it rather than have it ignored")


def _tls(document: Document, section: Any, folder: str, problems: list[Problem],
         files: list[str]) -> Optional[ssl.SSLContext]:
    at: JsonPath = ("tls_server_config",)
    if not isinstance(section, dict):
        problems.append(document.problem(at, "tls_server_config must be a mapping with cert_file and key_file"))
        return None
    before = len(problems)
    for key in section:
        if at + (key,) in _NOT_IMPLEMENTED:
            problems.append(document.problem(at + (key,), _not_implemented(at + (key,)), key=True))
        elif key not in _TLS_KEYS:
            problems.append(document.problem(
                at + (key,), f"unknown key {key!r}; tls_server_config holds {', '.join(_TLS_KEYS)}", key=True))
    paths: dict[str, str] = {}
    for key in ("cert_file", "key_file", "client_ca_file"):
        value = section.get(key)
        if value is None:
            if key != "client_ca_file":
                problems.append(document.problem(at, f"tls_server_config needs {key} (a PEM file)"))
        elif not isinstance(value, str) or not value:
            problems.append(document.problem(at + (key,), f"{key} must be a file name"))
        else:
            paths[key] = os.path.join(folder, value)  # an absolute value stays absolute
    auth = section.get("client_auth_type", "NoClientCert")
    if auth in _UNVERIFIED_CLIENT_AUTH:
        problems.append(document.problem(at + ("client_auth_type",), (
            f"client_auth_type {auth} asks for a client certificate without verifying it, which Python's ssl "
            f"module cannot do; use VerifyClientCertIfGiven or RequireAndVerifyClientCert with client_ca_file")))
    elif auth not in CLIENT_AUTH:
        problems.append(document.problem(at + ("client_auth_type",), (
            f"client_auth_type must be one of {', '.join(CLIENT_AUTH)}, not {auth!r}")))
    elif auth == "NoClientCert" and "client_ca_file" in section:
        problems.append(document.problem(at + ("client_ca_file",), (
            "client_ca_file is set but client_auth_type is NoClientCert: no client certificate would be asked for; "
            "set client_auth_type: RequireAndVerifyClientCert (or VerifyClientCertIfGiven)")))
    elif auth != "NoClientCert" and "client_ca_file" not in section:
        problems.append(document.problem(at + ("client_auth_type",), (
            f"client_auth_type {auth} verifies client certificates against client_ca_file, which is not set")))
    versions: dict[str, ssl.TLSVersion] = {}
    for key, default in (("min_version", DEFAULT_MIN_VERSION), ("max_version", None)):
        name = section.get(key, default)
        if name is None:
            continue
        if name not in TLS_VERSIONS:
            problems.append(document.problem(at + (key,), f"{key} must be one of {', '.join(TLS_VERSIONS)}, not {name!r}"))
        else:
            versions[key] = TLS_VERSIONS[name]
    if "min_version" in versions and "max_version" in versions and versions["min_version"] > versions["max_version"]:
        problems.append(document.problem(at + ("max_version",), "max_version is below min_version"))
    if len(problems) > before:
        return None
    files.extend(paths.values())
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = versions["min_version"]
    if "max_version" in versions:
        context.maximum_version = versions["max_version"]
    for key in ("cert_file", "client_ca_file"):
        try:
            if key == "cert_file":
                context.load_cert_chain(paths["cert_file"], paths["key_file"], password=_no_password)
            elif key in paths:
                context.load_verify_locations(cafile=paths[key])
        except (OSError, ssl.SSLError) as exc:
            what = ("cert_file and key_file must be a PEM certificate and its unencrypted PEM private key"
                    if key == "cert_file" else "client_ca_file must be PEM CA certificates")
            named = f"{paths['cert_file']}, {paths['key_file']}" if key == "cert_file" else paths[key]
            problems.append(document.problem(at + (key,), f"cannot load {named}: {_reason(exc)}; {what}"))
            return None
    context.verify_mode = CLIENT_AUTH[auth]
    return context


def _no_password() -> str:
    """An encrypted key would make OpenSSL ask for its passphrase on the terminal: refuse it instead."""
    raise ssl.SSLError("the private key is encrypted")


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        reason = getattr(exc, "reason", None) or (exc.args[-1] if exc.args else None)
        return str(reason) if reason else str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)


def _credentials(document: Document, section: Any, problems: list[Problem]) -> Optional[Credentials]:
    at: JsonPath = ("basic_auth_users",)
    if not isinstance(section, dict) or not section:
        problems.append(document.problem(at, "basic_auth_users must map each user name to a bcrypt hash"))
        return None
    users: dict[str, bytes] = {}
    for user, hashed in section.items():
        if not isinstance(hashed, str) or not _BCRYPT.match(hashed):
            problems.append(document.problem(at + (user,), (
                f"user {user!r}: the password must be a bcrypt hash ($2b$<cost>$ and 53 characters; "
                f"htpasswd -nBC 12 \"\" | tr -d ':\\n' makes one), never the password itself")))
        else:
            users[str(user)] = hashed.encode("ascii")
    try:
        import bcrypt  # noqa: F401 - only asked whether it is there
    except ImportError:
        problems.append(document.problem(at, (
            "checking basic_auth_users' bcrypt hashes needs the bcrypt package, which is not installed: "
            "pip install 'hookpolicy[web]'")))
    if len(users) != len(section):
        return None
    return Credentials(users)
