"""Rolling upgrade: the previous release's daemon keeps working on the new schema.

The previous release is the newest git tag or, without one, the newest commit whose
migrations the checkout extends unchanged (the previous migration set). Its ``jobd``
package is exported from git into a temp directory and run from there (PYTHONPATH), so it
is that code, with its own statements, that meets the new schema:

1. the old code migrates an empty database and its daemon runs under a steady enqueue load;
2. the new code's ``jobd migrate`` applies the new migrations while it runs;
3. a new daemon starts beside the old one; both go on completing jobs;
4. every job enqueued is done, none failed or lost, and neither daemon logged a failed
   statement. A migration that drops or renames what the old statements use, or changes a
   row type they prepared, fails here (docs/upgrades.md has the rules).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import daemon_support
import psycopg
import pytest
from daemon_support import Daemon, make_config, wait_until

import jobd
from jobd.db import connect
from jobd.migrate import available

if TYPE_CHECKING:
    from conftest import Databases

daemons = daemon_support.daemons

pytestmark = pytest.mark.slow

Daemons = Callable[..., Daemon]

REPO = Path(__file__).resolve().parent.parent


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True,
                          text=True, timeout=60).stdout.strip()


def migration_blobs(revision: str) -> dict[str, str]:
    """{migration file name: blob hash} at a revision."""
    listing = git("ls-tree", revision, "migrations/").splitlines()
    blobs = {}
    for line in listing:
        meta, path = line.split("\t", 1)
        name = path.rsplit("/", 1)[-1]
        if re.fullmatch(r"\d{4}_\w+\.sql", name):
            blobs[name] = meta.split()[2]
    return blobs


def checked_out_blobs() -> dict[str, str]:
    """{migration file name: blob hash} of the working tree, committed or not."""
    paths = sorted((REPO / "migrations").glob("[0-9][0-9][0-9][0-9]_*.sql"))
    hashes = git("hash-object", *map(str, paths)).splitlines()
    return {path.name: blob for path, blob in zip(paths, hashes, strict=True)}


def is_previous_set(old: dict[str, str], new: dict[str, str]) -> bool:
    """Old is a strict prefix of new, every shared file byte for byte the same."""
    names = sorted(new)
    return (0 < len(old) < len(new) and sorted(old) == names[:len(old)]
            and all(new[name] == blob for name, blob in old.items()))


def previous_release() -> str:
    """The newest tag, else the newest commit whose migrations the checkout only extends.

    A tag is used only if the checkout's migrations extend its set unchanged; a clone
    without tags (as CI makes) walks back along the first parents to the newest commit
    whose migration files are a strict, unchanged prefix of the checkout's, so a
    migration edited before it was released is not taken for the previous set.
    """
    new = checked_out_blobs()
    tags = git("tag", "--sort=-creatordate").splitlines()
    if tags and is_previous_set(migration_blobs(tags[0]), new):
        return tags[0]
    touched = git("rev-list", "--first-parent", "HEAD", "--", "migrations/").splitlines()
    # HEAD first: a migration not committed yet extends the checked-out commit's set.
    for candidate in ["HEAD", *(f"{commit}^" for commit in touched)]:
        if is_previous_set(migration_blobs(candidate), new):
            return candidate
    pytest.fail("no commit in the history holds a previous migration set of this checkout")


@pytest.fixture(scope="module")
def old_code(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(revision, directory holding that revision's jobd package, importable)."""
    if shutil.which("git") is None:
        pytest.skip("needs git (Debian package git)")
    try:
        git("rev-parse", "--git-dir")
    except subprocess.CalledProcessError:
        pytest.skip("needs a git checkout of jobd (the previous release comes from git)")
    revision = previous_release()
    directory = tmp_path_factory.mktemp("previous-release")
    archive = subprocess.run(["git", "-C", str(REPO), "archive", revision, "jobd", "migrations"],
                             check=True, capture_output=True, timeout=60).stdout
    subprocess.run(["tar", "-x", "-C", str(directory)], input=archive, check=True, timeout=60)
    # Laid out as the installed package is: the migrations ship as jobd.migrations.
    (directory / "migrations").rename(directory / "jobd" / "migrations")
    yield revision, directory


def old_env(code: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBD_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(code), env.get("PYTHONPATH", "")) if p)
    return {**env, **extra}


def run_old(code: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # In the old package's directory: python puts the working directory first on sys.path.
    return subprocess.run([sys.executable, "-m", "jobd", *args], capture_output=True,
                          text=True, env=old_env(code), cwd=code, timeout=120)


class OldDaemon(Daemon):
    """The previous release's daemon: its package comes first on PYTHONPATH."""

    def __init__(self, directory: Path, db_url: str, name: str, code: Path) -> None:
        super().__init__(directory, db_url, name)
        self.code = code

    def env(self) -> dict[str, str]:
        env = super().env()
        env["PYTHONPATH"] = os.pathsep.join((str(self.code), env["PYTHONPATH"]))
        return env


class Load(threading.Thread):
    """Enqueues a job every few milliseconds from its own connection until stopped."""

    def __init__(self, db_url: str) -> None:
        super().__init__(daemon=True)
        self.db_url = db_url
        self.ids: list[int] = []
        self.halt = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with connect(self.db_url) as conn:
                while not self.halt.wait(0.01):
                    self.ids.append(jobd.enqueue(conn, "ok", {"n": len(self.ids)}))
        except BaseException as exc:  # reported by finish(), in the test's thread
            self.error = exc

    def finish(self) -> list[int]:
        self.halt.set()
        self.join(30)
        if self.error is not None:
            raise self.error
        return list(self.ids)


def ran_by(conn: psycopg.Connection, daemon: Daemon, after: int) -> int:
    """Jobs with an id above ``after`` that a worker of ``daemon`` finished."""
    pids = [entry["pid"] for entry in daemon.events("worker spawned")]
    row = conn.execute("SELECT count(DISTINCT job_id) FROM public.test_effects"
                       " WHERE kind = 'end' AND job_id > %s AND pid = ANY(%s)",
                       (after, pids)).fetchone()
    assert row is not None
    return int(row[0])


def test_the_previous_release_runs_on_beside_the_new_one_through_the_migration(
    daemons: Daemons, databases: Databases, tmp_path: Path, old_code: tuple[str, Path]
) -> None:
    revision, code = old_code
    where = subprocess.run(
        [sys.executable, "-c", "import jobd, jobd.migrate as m; print(jobd.__file__);"
                               " print(max(x.version for x in m.available()))"],
        capture_output=True, text=True, env=old_env(code), cwd=code, check=True, timeout=60)
    old_file, old_version = where.stdout.split()
    assert old_file.startswith(str(code)), old_file
    new_version = max(m.version for m in available())
    assert int(old_version) < new_version, f"{revision} already has migration {new_version}"

    db_url = databases.empty()
    migrated = run_old(code, "migrate", "--database-url", db_url)
    assert migrated.returncode == 0, migrated.stderr
    daemon_support.create_effects_table(db_url)
    config = make_config({"default": {"workers": 2, "concurrency": 4}})
    old = OldDaemon(tmp_path, db_url, "old", code)
    new = Daemon(tmp_path, db_url, "new")
    load = Load(db_url)
    try:
        old.start(config)
        old.wait_workers_started("default", 2, timeout=60)
        load.start()
        with connect(db_url) as conn:
            wait_until(lambda: ran_by(conn, old, 0) >= 50, 60,
                       message=lambda: f"the old daemon to run jobs\n{old.tail()}")
            # The new release's migrations, under load, with the old daemon running.
            upgraded = subprocess.run(
                [sys.executable, "-m", "jobd", "migrate", "--database-url", db_url, "--json"],
                capture_output=True, text=True, timeout=120)
            assert upgraded.returncode == 0, upgraded.stderr
            applied = json.loads(upgraded.stdout)["applied"]
            assert [int(name[:4]) for name in applied] == [
                m.version for m in available() if m.version > int(old_version)]
            mark = max(load.ids)
            new.start(config)
            new.wait_workers_started("default", 2, timeout=60)
            # Both go on: each finishes jobs enqueued after the migration.
            wait_until(lambda: ran_by(conn, old, mark) >= 50 and ran_by(conn, new, mark) >= 50,
                       90, message=lambda: f"both daemons to run jobs after the migration "
                                           f"(old {ran_by(conn, old, mark)}, new "
                                           f"{ran_by(conn, new, mark)})\n{old.tail()}")
            ids = load.finish()

            def all_done() -> bool:
                row = conn.execute("SELECT count(*) FROM all_jobs WHERE id = ANY(%s)"
                                   " AND state = 'done'", (ids,)).fetchone()
                return row is not None and row[0] == len(ids)

            wait_until(all_done, 60, message="every enqueued job to be done")
            ended = conn.execute("SELECT count(DISTINCT job_id) FROM public.test_effects"
                                 " WHERE kind = 'end' AND job_id = ANY(%s)", (ids,)).fetchone()
            assert ended == (len(ids),)
            failed = conn.execute("SELECT count(*) FROM all_jobs WHERE attempts > 1"
                                  " OR state <> 'done'").fetchone()
            assert failed == (0,)
            # The old CLI reads the new schema too, and the new status shows the old node.
            old_status = run_old(code, "status", "--json", "--database-url", db_url)
            assert old_status.returncode == 0, old_status.stderr
            new_status = subprocess.run(
                [sys.executable, "-m", "jobd", "status", "--json", "--database-url", db_url],
                capture_output=True, text=True, timeout=60)
            nodes = json.loads(new_status.stdout)["nodes"]
            assert sorted((n["pid"], n["gone"]) for n in nodes) == sorted(
                [(old.pid, False), (new.pid, False)])
        for daemon in (old, new):
            assert not daemon.events("database statement failed", process=None), daemon.tail()
            daemon.signal(signal.SIGTERM)
            assert daemon.wait_exit(30) == 0, daemon.tail()
    finally:
        load.halt.set()
        old.stop()
        new.stop()
