# A package so setuptools ships the revisions; Alembic itself skips __init__.py.
