"""``ckpt db upgrade``: apply the catalog's migrations."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    db_app = typer.Typer(help="Catalog database administration.", no_args_is_help=True)

    @db_app.command("upgrade")
    def upgrade_cmd(url: str = typer.Option(None, "--url", help="catalog URL (default: settings)")) -> None:
        """Apply the catalog's migrations up to the newest schema, then mark and record the
        configured tier roots that have no recorded identity yet (as ckpt tiers init does)."""
        from core.settings import load_settings  # deferred: start-up — pydantic-settings
        from db.catalog import upgrade  # deferred: start-up — SQLAlchemy, Alembic
        from tasks.tier_roots import init_tiers  # deferred: start-up — storage backends

        settings = load_settings(**({"catalog_url": url} if url else {}))
        rev = upgrade(settings.catalog_url)
        typer.echo(f"catalog at revision {rev}")
        for state in init_tiers(settings, actor="cli"):
            typer.echo(state.line())

    app.add_typer(db_app, name="db")
