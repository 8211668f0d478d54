"""Alembic migrations of the job ledger. `service.ledger.open_ledger` runs them on open;
they are a package (not a loose alembic/ folder) so that an installed service has them."""
