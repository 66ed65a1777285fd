"""Revisions of dualwrite's schema (Alembic ignores this file)."""
