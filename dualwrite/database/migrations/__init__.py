"""dualwrite's own Alembic environment (Alembic's ``script_location`` is
``dualwrite.database:migrations``).

Run it with ``dualwrite db upgrade --db URL`` or :func:`dualwrite.database.upgrade_database`.
"""
