"""What every ``jobd`` subcommand receives: the :class:`Context`."""

from __future__ import annotations

from dataclasses import dataclass

import psycopg

from jobd.config import Config
from jobd.db import application_name, connect


@dataclass(frozen=True, slots=True)
class Context:
    """What every subcommand needs: the config (possibly empty) and how to connect."""

    config: Config
    url: str
    schema: str
    as_json: bool

    def connect(self, autocommit: bool = True) -> psycopg.Connection:
        return connect(self.url, self.schema, autocommit=autocommit,
                       application_name=application_name("cli", node=self.config.node_name),
                       session=self.config.session)
