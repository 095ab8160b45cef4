"""The password of an external Redis: where it may be kept, and its redaction from everything written or logged.

Why: a run directory sits on storage that a Slurm cluster shares between users, and its files (``config.yaml``,
events, summaries, logs, sbatch scripts) are read by people and tools that need no password. So the password of
an external Redis lives only in an owner-only file (0600 or stricter), and every other place that writes the URL
writes it through :func:`redact` (one function, used everywhere: the config's serializer, error messages).

Where the password comes from, first found wins:

1. ``redis.password_file``: a file of the user's, readable by its owner only (checked: :func:`read_password_file`);
   read at every start and every resume, never copied;
2. the password in ``redis.url`` (``redis://:PASSWORD@host:port/db``): at the run's start it is copied into the
   run's own ``redis/password`` (0600, in the 0700 ``redis/`` directory), and ``config.yaml`` holds the URL with
   :data:`REDACTED` in its place;
3. a redacted URL (a resume, a Slurm component reading ``config.yaml``): the run's own ``redis/password``.

Not the environment: a variable is visible to every process of the job's step and in ``/proc/<pid>/environ`` of a
rank, and a resume days later in another shell would not have it; the run's 0600 file is always there.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from urllib.parse import unquote, urlparse

from dynaresize import atomic

REDACTED = "***"  # what a password is replaced with
PASSWORD_FILE = "password"  # the run's own copy, in <run_dir>/redis/ (the embedded server keeps its password there too)

# scheme://[user]:password@ in any text; the password runs to the last '@' before a '/', a blank or a quote (a raw
# '@' in a password is not valid in a URL, but is seen in the wild: its tail must not leak either)
_URL_PASSWORD = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s'\"]*:)(?P<pw>[^\s'\"/]*)@")


class SecretError(ValueError):
    """A password that cannot be used safely or found (the message names the file or key, and what to do)."""


def redact(text: str) -> str:
    """``text`` with the password of every URL in it (``scheme://user:password@host``) replaced by ``***``."""
    if not text or "://" not in text:
        return text
    return _URL_PASSWORD.sub(lambda m: m.group("head") + REDACTED + "@", text)


def url_password(url: str | None) -> str | None:
    """The password in ``url`` (decoded), or None when it has none or it is redacted."""
    if not url:
        return None
    pw = urlparse(url).password
    if pw is None or pw == "":
        return None
    pw = unquote(pw)
    return None if pw == REDACTED else pw


def is_redacted(url: str | None) -> bool:
    return bool(url) and urlparse(url).password == REDACTED


def read_password_file(path: str | Path, key: str = "redis.password_file") -> str:
    """The password in ``path``, which must be a regular file of this user readable by nobody else (mode 0600 or
    stricter): a password in a file that others can read is no longer a secret."""
    p = Path(path).expanduser()
    try:
        st = os.stat(p)
    except OSError as e:
        raise SecretError(f"{key}={str(path)!r}: cannot read it: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise SecretError(f"{key}={str(path)!r}: not a regular file")
    if st.st_uid != os.getuid():
        raise SecretError(f"{key}={str(path)!r}: owned by uid {st.st_uid}, not by this user (uid {os.getuid()}); "
                          "a password file must be the user's own")
    if st.st_mode & 0o077:
        raise SecretError(f"{key}={str(path)!r}: mode {stat.S_IMODE(st.st_mode):04o} lets other users read or change "
                          f"it; a password file must be readable by its owner only (chmod 600 {p})")
    try:
        pw = p.read_text().strip()
    except OSError as e:
        raise SecretError(f"{key}={str(path)!r}: cannot read it: {e.strerror or e}") from None
    if not pw:
        raise SecretError(f"{key}={str(path)!r}: the file is empty")
    return pw


def run_password_file(run_dir: str | Path) -> Path:
    return Path(run_dir) / "redis" / PASSWORD_FILE


def keep_url_password(url: str | None, run_dir: str | Path) -> None:
    """Copy the password of ``url`` (if any, not redacted) into the run's own 0600 ``redis/password`` (its folder
    0700), so that the run can be resumed from a ``config.yaml`` that holds the URL redacted."""
    pw = url_password(url)
    if pw is None:
        return
    d = Path(run_dir) / "redis"
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    atomic.write_text(d / PASSWORD_FILE, pw + "\n", mode=0o600)


def external_password(url: str | None, password_file: str | None, run_dir: str | Path) -> str | None:
    """The password of the external Redis at ``url`` (see the module docstring for the order); None when it
    needs none. Raises :class:`SecretError` when the URL is redacted and the run holds no copy."""
    if password_file:
        return read_password_file(password_file)
    pw = url_password(url)
    if pw is not None:
        return pw
    if is_redacted(url):
        own = run_password_file(run_dir)
        if not own.exists():
            raise SecretError(f"redis.url={redact(url or '')!r}: the password is redacted and {own} does not exist; "
                              "give it with redis.password_file (a 0600 file)")
        return read_password_file(own, key=f"the run's copy of the redis.url password ({own.name})")
    return None
