"""Opening connections to the jobd schema, directly or through a transaction-mode pooler.

jobd's own connections run with ``search_path`` set to the jobd schema, so the named queries
in ``jobd/sql/queries.sql`` use unqualified names and work for any schema name, and with the
session settings of :class:`SessionSettings` (timeouts). How they get there depends on what
is at the other end of the URL (``database.pooler``, docs/pooler.md):

* a PostgreSQL server (``none``): as startup parameters (``options=-c name=value``), once per
  connection, at no cost per statement;
* a transaction-mode pooler such as PgBouncer (``transaction``), which refuses ``options`` and
  hands each transaction a server session another client may have used: as
  ``set_config(name, value, true)`` at the start of every transaction, the same exchange as
  the transaction's first statement (:class:`PooledConnection`). Nothing lives on the session:
  no prepared statements (psycopg's automatic ones are off, the fast path sends unnamed
  ones), no session-level ``SET``;
* ``auto`` (the default): directly, unless the server refuses the startup parameters the way
  a pooler does, after which that URL is treated as pooled for the life of the process.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import shlex
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import psycopg
import structlog
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import tuple_row

from jobd.errors import DatabaseUnavailable, InvalidDatabaseUrl, JobdError, UsageError
from jobd.queries import query

T = TypeVar("T")
log = structlog.get_logger("jobd.db")
RECONNECT_DELAY = 0.5  # seconds before the second attempt after a loss; doubles per failure
# The longest wait between attempts. It is also how long a connection may stay down after
# the database is back (a restart, a failover): attempts cost the server next to nothing
# (one refused startup), a stall of the node's pickup does not.
RECONNECT_DELAY_CAP = 5.0
# While attempts keep failing, the log says so this often, not at every attempt: one line
# when the connection is lost, one when it is restored, one a minute between.
UNAVAILABLE_REMINDER = 60.0
_OPEN_TRANSACTION = (psycopg.pq.TransactionStatus.INTRANS, psycopg.pq.TransactionStatus.INERROR)

DEFAULT_SCHEMA = "jobd"
# The zone of a worker's own sessions (worker_session).
UTC_ZONE = "UTC"
DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
CONNECT_TIMEOUT_SECONDS = 5
KEEPALIVE = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5,
             "keepalives_count": 3, "tcp_user_timeout": 30_000}
APPLICATION_NAME_MAX = 63  # PostgreSQL keeps NAMEDATALEN - 1 bytes of it
# How long past its statement_timeout jobd waits for the server's answer before it gives the
# connection up (:class:`BoundedConnection`). The server ends a statement at its timeout and
# says so; an answer later than this is not coming over any working network.
REPLY_GRACE = 5.0

_SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")

POOLER_MODES = ("auto", "none", "transaction")
# How PgBouncer (and poolers modelled on it) refuse a startup parameter they do not track.
_REFUSED_PARAMETER = "unsupported startup parameter"
# URLs whose server refused jobd's startup parameters (pooler: auto): pooled from then on.
_refusing_urls: set[str] = set()


@dataclass(frozen=True, slots=True)
class SessionSettings:
    """How jobd opens its own sessions (``database:`` in the config): what sits between it
    and PostgreSQL (``pooler``) and the server settings every session runs with. Timeouts
    are seconds; 0 turns one off, None leaves it to the server (role, database defaults)."""

    pooler: str = "auto"
    statement_timeout: float | None = 60.0
    lock_timeout: float | None = 10.0
    idle_in_transaction_session_timeout: float | None = 60.0
    jit: bool = True
    seqscan: bool = True  # enable_seqscan; the workers' own sessions turn it off
    time_zone: str | None = None  # TimeZone; None leaves it to the server (workers: UTC)
    # The longest wait for an answer whatever the statement_timeout: a caller that must
    # show signs of life within a bound of its own (a worker's loop, worker_reply_cap).
    reply_cap: float | None = None

    def reply_timeout(self) -> float | None:
        """How long a statement's answer may take before the connection is given up: the
        statement_timeout and :data:`REPLY_GRACE`, at most ``reply_cap``. None where neither
        bounds it (no statement_timeout, off or left to the server: no answer is overdue)."""
        bound = (None if self.statement_timeout is None or self.statement_timeout <= 0
                 else self.statement_timeout + REPLY_GRACE)
        if self.reply_cap is None:
            return bound
        return self.reply_cap if bound is None else min(bound, self.reply_cap)

    def bounded(self, statement_timeout: float, lock_timeout: float) -> SessionSettings:
        """These settings with timeouts no longer than the given ones (a caller that must
        never wait long, the supervisor's loop)."""
        return replace(self, statement_timeout=_tighter(self.statement_timeout,
                                                        statement_timeout),
                       lock_timeout=_tighter(self.lock_timeout, lock_timeout))

    def gucs(self, schema: str | None) -> dict[str, str]:
        """The server settings, by name, as PostgreSQL takes them."""
        gucs = {} if schema is None else {"search_path": validate_schema(schema)}
        timeouts = {"statement_timeout": self.statement_timeout,
                    "lock_timeout": self.lock_timeout,
                    "idle_in_transaction_session_timeout":
                        self.idle_in_transaction_session_timeout}
        gucs.update({name: _milliseconds(value) for name, value in timeouts.items()
                     if value is not None})
        if not self.jit:
            gucs["jit"] = "off"
        if not self.seqscan:
            gucs["enable_seqscan"] = "off"
        if self.time_zone is not None:
            gucs["TimeZone"] = self.time_zone
        return gucs


# What jobd's processes (daemon, CLI) run with unless database: says otherwise.
DEFAULT_SESSION = SessionSettings()
# connect() called from code (tests, benchmarks, scripts): the server's settings, as before
# the session settings existed.
SERVER_DEFAULTS = SessionSettings(statement_timeout=None, lock_timeout=None,
                                  idle_in_transaction_session_timeout=None)


def _tighter(current: float | None, bound: float) -> float:
    return bound if current is None or current <= 0 else min(current, bound)


def _milliseconds(seconds: float) -> str:
    return str(max(0, round(seconds * 1000)))


def application_name(role: str, *, node: str | None = None, detail: str = "") -> str:
    """``jobd <role> [detail] node=<node>``, cut to what PostgreSQL keeps. The node name is
    what gets cut: the role and detail (a lane and slot) tell processes of one node apart."""
    head = " ".join(part for part in (f"jobd {role}", detail) if part)
    if node is None:
        return head[:APPLICATION_NAME_MAX]
    return f"{head} node={node}"[:APPLICATION_NAME_MAX]


def validate_schema(schema: str) -> str:
    if not _SCHEMA_NAME.fullmatch(schema):
        raise UsageError(
            f"invalid schema name {schema!r}: use lower-case letters, digits and _ "
            "(at most 63, not starting with a digit)"
        )
    if schema.startswith("pg_") or schema == "information_schema":
        # PostgreSQL's own: pg_* names are reserved (pg_catalog, pg_toast, pg_temp) and
        # pg_dump leaves information_schema out, so jobd's tables there would be lost on a
        # restore from a dump.
        raise UsageError(f"invalid schema name {schema!r}: it is PostgreSQL's own; give "
                         "jobd a schema of its own (the default is jobd)")
    return schema


def resolve_url(cli_url: str | None, env_url: str | None, config_url: str | None) -> str:
    """``--database-url``, else ``JOBD_DATABASE_URL``, else the config's ``database.url``,
    else the local default."""
    return cli_url or env_url or config_url or DEFAULT_URL


def conninfo(url: str, schema: str | None, application_name: str = "jobd",
             gucs: Mapping[str, str] | None = None) -> str:
    """Connection parameters for ``url``. With a ``schema``, the connection's search_path is
    that schema alone (jobd's own connections: they see only jobd's objects and pg_catalog);
    with None it is left to the server, database and role defaults (handlers' connections).
    ``gucs`` are further server settings passed as startup parameters; None for a pooled
    connection, which takes neither (see :class:`PooledConnection`)."""
    if _SECOND_AT.match(url):
        # libpq ends the password at the first @: the rest of it would be taken for the
        # host, and named in the error that it cannot be resolved.
        raise InvalidDatabaseUrl("invalid database URL: more than one @ before its host "
                                 "(write an @ in the user name or password as %40)")
    try:
        params = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        raise InvalidDatabaseUrl(f"invalid database URL: {_parse_error(url)}") from None
    params.setdefault("application_name", application_name)
    params.setdefault("connect_timeout", CONNECT_TIMEOUT_SECONDS)
    # A peer that vanished without closing (a partition, a frozen host) must not hold a
    # blocking call for the kernel's default of hours: keepalives notice it in about 25 s,
    # and unacknowledged writes give up after 30 s.
    for key, value in KEEPALIVE.items():
        params.setdefault(key, value)
    settings = dict(gucs or {})
    if schema is not None:
        settings["search_path"] = validate_schema(schema)
    if settings:
        options = params.get("options", "")
        extra = " ".join(f"-c {name}={value}" for name, value in settings.items())
        params["options"] = f"{options} {extra}".strip()
    return make_conninfo("", **params)


# psycopg's Connection.wait takes a timeout from 3.3.6 on. With an older psycopg (an
# application's pin), only jobd's own waits (jobd.fastpath: the workers' claims and
# settles) are bounded; the other statements wait as psycopg does.
WAIT_TAKES_TIMEOUT = "timeout" in inspect.signature(psycopg.Connection.wait).parameters


class BoundedConnection(psycopg.Connection[Any]):
    """A connection whose every wait for the server ends by ``reply_timeout`` seconds
    (None: no bound), after which the connection is closed and the call raises
    :class:`psycopg.OperationalError`: the connection is lost, and the caller's reconnect
    logic takes it from there.

    The kernel's keepalives and ``tcp_user_timeout`` (:data:`KEEPALIVE`) notice a peer that
    stopped acknowledging, but not one that acknowledges and never answers: a frozen load
    balancer or pooler, a proxy cut from the server. The server's statement_timeout does not
    help there either, as the statement may never have reached it. Without this bound a
    statement waited for as long as the silence lasted, its caller (a worker's loop, a duty,
    the CLI) with it."""

    reply_timeout: float | None = None

    def wait(self, gen: Any, interval: float = 0.1, timeout: float | None = None) -> Any:
        if timeout is not None:  # psycopg's own bounded waits (it passes it from 3.3.6 on)
            return super().wait(gen, interval, timeout)
        bound = self.reply_timeout
        if bound is None or not WAIT_TAKES_TIMEOUT:
            return super().wait(gen, interval)
        try:
            return super().wait(gen, interval, bound)
        except psycopg.errors._WaitTimeout:
            # The protocol state is unknown (a statement half sent, an answer half read):
            # nothing but a new connection is safe.
            self.pgconn.finish()
            raise NoAnswer(bound) from None


@contextlib.contextmanager
def unbounded_replies(conn: psycopg.Connection) -> Iterator[None]:
    """Within: ``conn``'s waits are not bounded by its ``reply_timeout``, for statements the
    server is told to let run past the session's statement_timeout (``jobd migrate``'s, which
    may rewrite or index a large table). The network is then the kernel's to watch."""
    if not isinstance(conn, BoundedConnection):
        yield
        return
    bound, conn.reply_timeout = conn.reply_timeout, None
    try:
        yield
    finally:
        conn.reply_timeout = bound


class NoAnswer(psycopg.OperationalError):
    """The server did not answer within a connection's ``reply_timeout``; the connection is
    closed."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"no answer from the database in {seconds:g} s (the network or "
                         "something on the way stopped passing it): connection closed")


class PooledCursor(psycopg.Cursor[Any]):
    """A cursor of a :class:`PooledConnection`: a statement that starts a transaction runs
    after ``set_config(..., true)`` of the session's settings, in that transaction, on
    whichever server session the pooler lends it.

    On an autocommit connection both go in one pipeline (one round trip; the statement is
    the whole transaction). A transaction that stays open (a connection that is not
    autocommit) gets the settings in a round trip of their own: left idle after a pipeline,
    PostgreSQL 15 does not arm the idle_in_transaction_session_timeout it sets."""

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> PooledCursor:
        conn = self.connection
        if not isinstance(conn, PooledConnection) or not conn.starts_transaction():
            super().execute(query, params, **kwargs)
        elif conn.autocommit:
            with conn.pipeline():
                conn.apply_settings()
                super().execute(query, params, **kwargs)
        else:
            conn.apply_settings()
            super().execute(query, params, **kwargs)
        return self

    def executemany(self, query: Any, params_seq: Any, **kwargs: Any) -> None:
        conn = self.connection
        if not isinstance(conn, PooledConnection) or not conn.starts_transaction():
            super().executemany(query, params_seq, **kwargs)
        elif conn.autocommit:
            # Its statements as one transaction, so that they all run with the settings.
            with conn.transaction():
                super().executemany(query, params_seq, **kwargs)
        else:
            conn.apply_settings()
            super().executemany(query, params_seq, **kwargs)


class PooledConnection(BoundedConnection):
    """A connection through a transaction-mode pooler (``database.pooler``). Its server
    settings are applied per transaction (:class:`PooledCursor`, :meth:`transaction`), as
    the pooler may hand the next transaction to a server session another client set up."""

    session_gucs: dict[str, str]

    def starts_transaction(self) -> bool:
        return self.info.transaction_status == psycopg.pq.TransactionStatus.IDLE

    def apply_settings(self) -> None:
        names = list(self.session_gucs)
        psycopg.Cursor(self).execute(query("session_local"), {
            "names": names, "values": [self.session_gucs[n] for n in names]})

    @contextlib.contextmanager
    def transaction(self, savepoint_name: str | None = None,
                    force_rollback: bool = False) -> Iterator[psycopg.Transaction]:
        outermost = self.starts_transaction()
        with super().transaction(savepoint_name, force_rollback) as tx:
            if outermost:
                self.apply_settings()
            yield tx


def is_pooled(conn: psycopg.Connection) -> bool:
    return isinstance(conn, PooledConnection)


def connection_lost(conn: psycopg.Connection) -> bool:
    """Whether a failed statement took ``conn`` with it. A deadlock, a serialization
    failure or a timeout is an OperationalError too, but leaves the connection usable."""
    return conn.closed or conn.broken


def connect(
    url: str,
    schema: str = DEFAULT_SCHEMA,
    *,
    autocommit: bool = True,
    application_name: str = "jobd",
    session: SessionSettings = SERVER_DEFAULTS,
) -> psycopg.Connection:
    """A connection whose search_path is ``schema``, with ``session``'s settings, directly or
    through a pooler as ``session.pooler`` says; autocommit unless asked otherwise."""
    gucs = session.gucs(schema)
    if session.pooler == "none" or (session.pooler == "auto" and url not in _refusing_urls):
        try:
            conn = BoundedConnection.connect(conninfo(url, None, application_name, gucs),
                                             autocommit=autocommit)
        except psycopg.OperationalError as exc:
            if session.pooler == "none" or _REFUSED_PARAMETER not in str(exc):
                raise _refused(url, exc) from None
            # No log here: the CLI's output is its own. The daemon's connections say it
            # (ManagedConnection).
            _refusing_urls.add(url)
        else:
            conn.reply_timeout = session.reply_timeout()
            try:
                applied = _options_applied(conn, gucs)
            except psycopg.OperationalError as exc:
                # Lost before it served (terminated, the network): the next attempt's to
                # make. Raised as it was, it ended the supervisor whose connection it was.
                conn.close()
                raise _unavailable(url, exc) from None
            if applied:
                return conn
            # A pooler that drops the options instead of refusing them (PgBouncer with
            # ignore_startup_parameters = options): nothing of the session was set, and a
            # LISTEN there would hear nothing.
            conn.close()
            if session.pooler == "none":
                raise UsageError(
                    f"the database at {redact(url)} ignored the connection's options (a "
                    "pooler with ignore_startup_parameters = options?): set "
                    "database.pooler: transaction, or use a direct connection")
            _refusing_urls.add(url)
    return _connect_pooled(url, application_name, autocommit, gucs, session.reply_timeout())


def _options_applied(conn: psycopg.Connection, gucs: Mapping[str, str]) -> bool:
    """Whether the startup options reached the server: its search_path is the one they
    set (jobd's own connections set one; others are not checked)."""
    wanted = gucs.get("search_path")
    if wanted is None:
        return True
    row = conn.execute(query("search_path_setting")).fetchone()
    if not conn.autocommit:
        conn.rollback()
    return row is not None and row[0] == wanted


def _connect_pooled(url: str, application_name: str, autocommit: bool,
                    gucs: dict[str, str], reply_timeout: float | None) -> PooledConnection:
    # The URL's own `options` would be refused like jobd's: its settings join the ones
    # applied per transaction (jobd's win where both set one).
    params = conninfo_to_dict(conninfo(url, None, application_name))
    gucs = {**options_settings(str(params.pop("options", ""))), **gucs}
    # No prepare_threshold: psycopg's automatic prepared statements live on a server
    # session, and the next transaction may run on another one ("_pg3_0 does not exist").
    try:
        conn = PooledConnection.connect(
            make_conninfo("", **params), autocommit=autocommit,
            prepare_threshold=None, cursor_factory=PooledCursor)
    except psycopg.OperationalError as exc:
        raise _refused(url, exc) from None
    conn.session_gucs = gucs
    conn.reply_timeout = reply_timeout
    return conn


def options_settings(options: str) -> dict[str, str]:
    """The server settings of a libpq ``options`` value (``-c name=value``, ``-cname=value``,
    ``--name=value``); anything else there has no per-transaction equivalent."""
    settings: dict[str, str] = {}
    tokens = iter(shlex.split(options))
    for token in tokens:
        if token == "-c":
            token = next(tokens, "")
        elif token.startswith("-c") or token.startswith("--"):
            token = token[2:]
        else:
            raise UsageError(f"the database URL's options {options!r} cannot pass a "
                             "transaction-mode pooler: use -c name=value settings only")
        name, sep, value = token.partition("=")
        if not sep or not name:
            raise UsageError(f"the database URL's options {options!r}: expected "
                             "-c name=value")
        settings[name.replace("-", "_")] = value
    return settings


def users_connection_setup(url: str, session: SessionSettings
                           ) -> Callable[[psycopg.Connection], None]:
    """The setup of a connection jobd opens to ``url`` for users' code (the transactional
    handlers' pool, which keeps the user's search_path and settings): through a pooler, no
    automatic prepared statements. Decided per connection, as ``auto`` learns that a URL is
    pooled when jobd's own first connection to it is refused."""
    def setup(conn: psycopg.Connection) -> None:
        if _pooled_for_users(url, session):
            conn.prepare_threshold = None
    return setup


def users_connection_reset(url: str, session: SessionSettings
                           ) -> Callable[[psycopg.Connection], None]:
    """What makes a connection of the transactional handlers' pool as it was opened, before
    the next job gets it: one handler's ``SET search_path`` or ``conn.row_factory`` must not
    reach the next job, which may be another handler's. Server side, what ``DISCARD ALL``
    resets but the prepared statements (:data:`_SESSION_RESET`, one round trip); through a
    transaction-mode pooler the session is not the connection's, so only the client side is
    reset there."""
    def reset(conn: psycopg.Connection) -> None:
        conn.autocommit = True  # as the pool opens them
        conn.read_only = conn.deferrable = None
        conn.row_factory = tuple_row
        conn.cursor_factory = psycopg.Cursor
        if not _pooled_for_users(url, session):
            with conn.pipeline():
                for statement in _SESSION_RESET:
                    conn.execute(statement)
    return reset


# DISCARD ALL but for DEALLOCATE ALL and DISCARD PLANS: psycopg keeps its own record of the
# statements it prepared on a connection and, after the first DISCARD ALL it sees, stops
# noticing them, so the next job's statements named prepared statements that were gone.
_SESSION_RESET = ("CLOSE ALL", "SET SESSION AUTHORIZATION DEFAULT", "RESET ALL", "UNLISTEN *",
                  "SELECT pg_advisory_unlock_all()", "DISCARD TEMP", "DISCARD SEQUENCES")


def _pooled_for_users(url: str, session: SessionSettings) -> bool:
    return session.pooler == "transaction" or url in _refusing_urls


# How libpq refuses an option's value before it connects (a port that is no number, an
# sslmode it does not know): the URL is wrong, where a server away is a runtime failure.
_INVALID_OPTION = re.compile(r'invalid integer value "[^"]*" for connection option "\w+"'
                             r'|invalid port number: "[^"]*"'
                             r'|invalid \w+ value: "[^"]*"'
                             r"|could not match \d+ [\w ]+ to \d+ [\w ]+")


def _refused(url: str, exc: psycopg.OperationalError) -> JobdError:
    """What a failed connection attempt means: an invalid URL, or a database unavailable."""
    invalid = _INVALID_OPTION.search(str(exc))
    if invalid:
        return InvalidDatabaseUrl(f"invalid database URL: {invalid[0]}")
    return _unavailable(url, exc)


def _unavailable(url: str, exc: BaseException) -> DatabaseUnavailable:
    return DatabaseUnavailable(
        f"cannot connect to the database ({redact(url)}): {first_line(exc)}")


def redact(url: str) -> str:
    """The URL with any password replaced, fit for an error message or a log."""
    try:
        params = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "<unparseable URL>"
    if "password" in params:
        params["password"] = "***"
    return make_conninfo("", **params)


def _parse_error(url: str) -> str:
    """Why ``url`` does not parse, in libpq's words but without its password: libpq quotes
    the text it stopped at, the whole URL or the password itself. The message is that of
    the URL with its passwords masked, whose text is all it can quote; when the masked URL
    parses, the password was what libpq could not read."""
    try:
        conninfo_to_dict(_mask_passwords(url))
    except psycopg.ProgrammingError as exc:
        return first_line(exc)
    return ("its password cannot be read (in a URL, write %, @, / and spaces in it as %25, "
            "%40, %2F and %20)")


# Where a password may be in a connection string that need not parse: the userinfo of a URL
# (postgresql://user:PASSWORD@host, up to the authority's last @, as a password may hold an
# unencoded one), a password parameter of a URL's query, and a password=value of the
# keyword form (quoted or not).
_PASSWORD_TEXT = re.compile(
    r"^(?P<scheme>[a-z][a-z0-9+.-]*://[^:@/]*:)[^/]*(?=@)"
    r"|(?P<query>[?&]password=)[^&]*"
    r"|(?P<keyword>\bpassword\s*=\s*)(?:'(?:[^'\\]|\\.)*'?|\S*)",
    re.IGNORECASE)


# A URL with a second @ in its authority (before the path or the query).
_SECOND_AT = re.compile(r"[a-z][a-z0-9+.-]*://[^/@]*@[^/?]*@", re.IGNORECASE)


def _mask_passwords(text: str) -> str:
    """``text``, a connection string that may not parse, with each password it may hold
    written as ***."""
    return _PASSWORD_TEXT.sub(lambda m: (m["scheme"] or m["query"] or m["keyword"]) + "***",
                              text)


# A URL's password anywhere in a text (scheme://user:PASSWORD@), and a password=value.
_PASSWORD_IN_TEXT = re.compile(
    r"(?P<scheme>\b[a-z][a-z0-9+.-]*://[^\s:@/]*:)[^\s/]+(?=@)"
    r"|(?P<keyword>\bpassword\s*=\s*)(?:'[^']*'?|\"[^\"]*\"?|[^\s&'\",;)]+)",
    re.IGNORECASE)


def mask_passwords_in_text(text: str) -> str:
    """``text``, any text (a handler's error message, say), with the passwords of the URLs
    and ``password=`` settings in it written as ***."""
    return _PASSWORD_IN_TEXT.sub(lambda m: (m["scheme"] or m["keyword"]) + "***", text)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# The supervisor's statements are bounded, so no duty can hold up its loop (and with it every
# lane of the node) for long.
SUPERVISOR_STATEMENT_TIMEOUT_MS = 10_000
SUPERVISOR_LOCK_TIMEOUT_MS = 2_000


def supervisor_session(session: SessionSettings) -> SessionSettings:
    """The supervisor's session settings: the configured ones with its bounds, and no JIT
    (the metrics sampler's counts over a large backlog pass its cost threshold, and compiling
    them took longer than running them; the other duties are short statements anyway)."""
    bounded = session.bounded(SUPERVISOR_STATEMENT_TIMEOUT_MS / 1000,
                              SUPERVISOR_LOCK_TIMEOUT_MS / 1000)
    return replace(bounded, jit=False)


def worker_session(session: SessionSettings) -> SessionSettings:
    """A worker's own sessions (its claims and outcomes, not its handlers'): sequential scans
    priced out, and the clock in UTC.

    Every statement a worker runs reads by an index (the claim index from the floors, the
    primary key for a batch of ids), and the plans it prepares outlive the table they were
    made for: made while the jobs table was a few pages, reading it whole for a batch of ids
    is as cheap as the index, and a burst of 20,000 jobs then met claims and completions
    that read the whole table, each, until the plans were renewed (docs/design/queue.md,
    "Plans that age"). With the setting off the planner still reads a table whole where no
    index serves, so no statement fails for it.

    UTC: psycopg turns a timestamptz into a datetime in the zone the session reports, and
    for any zone but "UTC" itself (a server's default is often "Etc/UTC" or a local zone)
    through zoneinfo: a claimed row loaded in 1.6-2.7 us against 0.55-1.0 in "UTC"
    (bench/claim_decode.py), and a worker's CPU a job in a drain fell by about a sixth
    (docs/performance.md, "Claimed jobs' times in UTC"). The instants are the same; a
    handler sees its job's times in UTC. No statement of a worker depends on the session's
    zone (the archive's days are UTC days whoever computes them)."""
    return replace(session, seqscan=False, time_zone=UTC_ZONE)


def worker_reply_cap(worker_timeout: float, report_interval: float) -> float:
    """How long a worker's loop waits for an answer on its connection before it gives the
    connection up, so that it reports to the supervisor before ``worker_timeout`` takes it
    for hung. A wait in a loop turn may follow a connection attempt (up to
    :data:`CONNECT_TIMEOUT_SECONDS`), and the report itself may be a second late.

    Without it a claim that waited for a paused or saturated pooler's queue (PgBouncer's
    PAUSE, a pool other clients held) or for a silent network waited statement_timeout + 5 s
    (65 s by default), and the supervisor aborted the worker as hung at 30 s: a stack dump
    in the log, a restart, and the jobs it held run again once their leases ran out."""
    return max(worker_timeout / 2,
               worker_timeout - CONNECT_TIMEOUT_SECONDS - 2 * report_interval)


class ManagedConnection:
    """One of jobd's long-lived connections (the supervisor's, a worker's, the listener's):
    opened on demand, reopened with backoff, and the one place that tells a statement that
    failed from a connection that was lost.

    After a loss the next attempt is immediate; each failed attempt doubles the wait, from
    ``RECONNECT_DELAY`` up to ``RECONNECT_DELAY_CAP``, until one succeeds. The first failed
    attempt is logged, then every ``UNAVAILABLE_REMINDER`` seconds that they still fail.
    ``on_connect`` runs on each new connection (session settings, LISTEN); if it fails the
    connection counts as failed. ``pause_after_failure`` keeps a caller that would retry a
    failed statement at once (a worker's loop) from spinning on it.
    """

    def __init__(self, url: str, schema: str, application_name: str, *,
                 on_connect: Callable[[psycopg.Connection], object] | None = None,
                 on_lost: Callable[[], object] | None = None,
                 on_failed_attempt: Callable[[str], object] | None = None,
                 pause_after_failure: float = 0.0, label: str = "database connection",
                 session: SessionSettings = SERVER_DEFAULTS) -> None:
        self.url = url
        self.schema = schema
        self.application_name = application_name
        self.session = session
        self.on_connect = on_connect
        self.on_lost = on_lost
        # Replaces the warning of each failed attempt (the listener says so once instead).
        self.on_failed_attempt = on_failed_attempt
        self.pause_after_failure = pause_after_failure
        self.label = label  # names its log events: "<label> lost", "<label> restored"
        self.conn: psycopg.Connection | None = None
        self.retry_at = 0.0  # monotonic: no connection attempt before
        self.usable_at = 0.0  # monotonic: no statement before (after a failed one)
        self.delay = RECONNECT_DELAY
        self.connected_once = False
        # The failed attempts since the last connection, and the last one logged.
        self._failures = 0
        self._logged_at: float | None = None

    def ensure(self) -> bool:
        """Connect if there is no connection and the backoff allows; True when this call
        opened a new one."""
        if self.conn is not None or time.monotonic() < self.retry_at:
            return False
        try:
            conn = connect(self.url, self.schema, application_name=self.application_name,
                           session=self.session)
        except (DatabaseUnavailable, InvalidDatabaseUrl) as exc:
            # An invalid URL too: the listener's (database.listen_url) is first used here,
            # and the node runs on without notifications, saying why at each attempt.
            self._failed_attempt(str(exc))
            return False
        try:
            if self.on_connect is not None:
                self.on_connect(conn)
        except (psycopg.Error, DatabaseUnavailable) as exc:
            # DatabaseUnavailable: the connection works but cannot serve (LISTEN through a
            # transaction-mode pooler).
            conn.close()
            self._failed_attempt(first_line(exc))
            return False
        self.conn = conn
        self.delay = RECONNECT_DELAY
        if not self.connected_once and is_pooled(conn):
            log.info("connected through a transaction-mode pooler: session settings apply "
                     "per transaction", connection=self.application_name,
                     pooler=self.session.pooler)
        if self.connected_once:
            log.info(f"{self.label} restored", connection=self.application_name,
                     failed_attempts=self._failures)
        self.connected_once = True
        self._failures = 0
        self._logged_at = None
        return True

    def _failed_attempt(self, error: str) -> None:
        self._failures += 1
        if self.on_failed_attempt is not None:
            self.on_failed_attempt(error)
        elif self._worth_logging():
            log.warning("database unavailable", connection=self.application_name,
                        error=error, attempts=self._failures, retry_in=round(self.delay, 1))
        self.retry_at = time.monotonic() + self.delay
        self.delay = min(self.delay * 2, RECONNECT_DELAY_CAP)

    def _worth_logging(self) -> bool:
        """The first failure since the connection was up, or a reminder."""
        now = time.monotonic()
        if self._logged_at is not None and now - self._logged_at < UNAVAILABLE_REMINDER:
            return False
        self._logged_at = now
        return True

    def ready_at(self) -> float:
        """When the connection may next be used (monotonic): a connection attempt or, after
        a failed statement, the end of its pause. Callers wait at least until then."""
        return self.retry_at if self.conn is None else self.usable_at

    def run(self, what: str, operation: Callable[[psycopg.Connection], T]) -> T | None:
        """``operation(conn)``, or None when there is no connection or it failed (logged)."""
        if self.conn is None or time.monotonic() < self.usable_at:
            return None
        try:
            return operation(self.conn)
        except psycopg.Error as exc:
            self.failed(what, exc)
            return None

    def failed(self, what: str, exc: psycopg.Error) -> None:
        """Account for a statement of ``what`` that raised ``exc``."""
        assert self.conn is not None
        if connection_lost(self.conn):
            self.lost(what, exc)
            return
        # A deadlock, a serialization failure, a timeout: the statement failed, the
        # connection did not. What the caller retries decides what still applies.
        log.error("database statement failed", connection=self.application_name,
                  during=what, error=first_line(exc))
        self.usable_at = time.monotonic() + self.pause_after_failure
        if self.conn.info.transaction_status in _OPEN_TRANSACTION:
            try:
                self.conn.rollback()
            except psycopg.Error as rollback_failed:
                self.lost(what, rollback_failed)

    def lost(self, what: str, exc: BaseException) -> None:
        log.warning(f"{self.label} lost", connection=self.application_name,
                    during=what, error=first_line(exc))
        self.close()
        self.retry_at = time.monotonic()
        if self.on_lost is not None:
            self.on_lost()

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            finally:
                self.conn = None
