"""Alembic environment. `service.ledger` runs it programmatically on a connection it has
already opened (and locked) inside a transaction; the `alembic` CLI, given an ini with
sqlalchemy.url, gets a connection of its own."""

from alembic import context
from sqlalchemy import create_engine

from service.ledger import Base, engine_url

config = context.config
connection = config.attributes.get("connection")


def run(conn) -> None:
    context.configure(connection=conn, target_metadata=Base.metadata,
                      render_as_batch=conn.dialect.name == "sqlite")  # SQLite cannot ALTER most things
    with context.begin_transaction():
        context.run_migrations()


if connection is not None:
    run(connection)
else:
    engine = create_engine(engine_url(config.get_main_option("sqlalchemy.url")))
    with engine.connect() as conn:
        run(conn)
    engine.dispose()
