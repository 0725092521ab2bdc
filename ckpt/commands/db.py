"""``ckpt db upgrade``: apply the catalog's migrations."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    db_app = typer.Typer(help="Catalog database administration.", no_args_is_help=True)

    @db_app.command("upgrade")
    def upgrade_cmd(url: str = typer.Option(None, "--url", help="catalog URL (default: settings)")) -> None:
        """Apply the catalog's migrations up to the newest schema."""
        from core.settings import load_settings  # deferred: start-up — pydantic-settings
        from db.catalog import upgrade  # deferred: start-up — SQLAlchemy, Alembic

        target = url or load_settings().catalog_url
        rev = upgrade(target)
        typer.echo(f"catalog at revision {rev}")

    app.add_typer(db_app, name="db")
