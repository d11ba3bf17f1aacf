"""The roles that use jobd without owning it: privileges granted by ``jobd migrate``.

Three roles (docs/operations.md, "Roles"):

- the **owner** runs ``jobd migrate`` and owns every object in the schema;
- a **runtime** role (``--grant-runtime ROLE``) runs the daemon and the CLI: rows of every
  table, sequences, functions; no DDL, read-only ledger and settings;
- a **producer** role (``--grant-producer ROLE``) can only call ``enqueue``, which runs
  as the owner (SECURITY DEFINER, migration 0014), so it needs no privilege on any table.

The roles granted are recorded in ``role_grants``; every ``jobd migrate`` grants them again
after applying its migrations, so the objects a new migration adds reach them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import psycopg
from psycopg import sql

from jobd.queries import query, with_identifiers

KINDS = ("runtime", "producer")


class RefusedGrant(ValueError):
    """A grant ``jobd migrate`` will not make; nothing changes (exit code 2)."""


class MissingRole(RefusedGrant):
    """A role named for a grant does not exist (roles are the cluster's; jobd creates none)."""


class OwnerGrant(RefusedGrant):
    """A runtime grant to the role that owns the schema."""


@dataclass(frozen=True, slots=True)
class Granted:
    """What one ``jobd migrate`` did to roles."""

    granted: list[tuple[str, str]] = field(default_factory=list)  # (role, kind), in order
    forgotten: list[tuple[str, str]] = field(default_factory=list)  # roles dropped since


def check_roles(conn: psycopg.Connection, roles: Iterable[str]) -> None:
    for role in roles:
        row = conn.execute(query("role_exists"), {"role": role}).fetchone()
        if row is None or not row[0]:
            quoted = sql.Identifier(role).as_string(conn)
            raise MissingRole(
                f"role {role!r} does not exist; create it first (e.g. CREATE ROLE "
                f"{quoted} LOGIN PASSWORD '...'), then run jobd migrate again")


def usage_problem(conn: psycopg.Connection, schema: str) -> str | None:
    """Why the current role cannot see jobd's tables although the schema exists (it was not
    granted on this database), or None. Without it the tables look missing, and the message
    said to run ``jobd migrate`` first."""
    row = conn.execute(query("schema_usage"), {"schema": schema}).fetchone()
    if row is None or row[0]:
        return None
    return (f"role {row[1]!r} may not use schema {schema} (no USAGE privilege on it): as "
            f"the schema's owner, grant it with jobd migrate --grant-runtime {row[1]} (the "
            "daemon and the CLI) or --grant-producer (enqueue only)")


def check_not_owner(conn: psycopg.Connection, schema: str, runtime: Iterable[str]) -> None:
    """The runtime grant revokes writes to the ledger that ``jobd migrate`` keeps
    (schema_migrations, settings, role_grants): granted to the owner it took those from the
    owner itself, and every later ``jobd migrate`` failed."""
    for role in runtime:
        row = conn.execute(query("role_owns_schema"), {"role": role, "schema": schema}
                           ).fetchone()
        if row is not None and row[0]:
            raise OwnerGrant(
                f"role {role!r} owns schema {schema}: it needs no runtime grant (its "
                "revocations would stop the owner's own jobd migrate); grant the runtime "
                "privileges to the role the daemons run as")


def apply(conn: psycopg.Connection, schema: str, *, runtime: Iterable[str] = (),
          producer: Iterable[str] = ()) -> Granted:
    """Record the roles named now, then grant every recorded role that still exists its
    privileges on ``schema``, after taking the archive maintenance from PUBLIC again (a
    restore without privileges gave it back). Runs inside the caller's (migrate's)
    transaction, with search_path set to ``schema``."""
    wanted = [(role, "runtime") for role in runtime] + [(role, "producer") for role in producer]
    row = conn.execute(query("role_grants_exist")).fetchone()
    if not (row and row[0]):
        # A schema migrated only up to a set before 0014 (the ledger of grants came with it):
        # nothing was ever recorded to grant again.
        if wanted:
            raise ValueError("this schema has no role_grants table yet: migrate it to the "
                             "current set of migrations before granting roles")
        return Granted()
    check_roles(conn, [role for role, _kind in wanted])
    check_not_owner(conn, schema, runtime)
    conn.execute(with_identifiers("revoke_maintenance_qualified", schema=schema))
    for role, kind in wanted:
        conn.execute(query("record_role_grant"), {"role": role, "kind": kind})
    result = Granted()
    for role, kind, exists in conn.execute(query("recorded_role_grants")).fetchall():
        if not exists:
            # Dropped since (DROP OWNED BY took its privileges with it): nothing to grant.
            conn.execute(query("forget_role_grant"), {"role": role, "kind": kind})
            result.forgotten.append((role, kind))
            continue
        conn.execute(with_identifiers(f"grant_{kind}_qualified", schema=schema, role=role))
        result.granted.append((role, kind))
    return result
