"""dualwrite's own Alembic environment (installed as the package ``dualwrite._migrations``).

Run it with ``dualwrite db upgrade --db URL`` or :func:`dualwrite.database.upgrade_database`.
"""
