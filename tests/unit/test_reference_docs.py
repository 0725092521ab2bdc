"""The docs' configuration and CLI references are generated from the code (``scripts/reference_docs``):
the committed pages must be what the generator writes now, so a new setting or option cannot be
left out of the docs."""

from scripts.reference_docs import cli, configuration, pages


def test_committed_reference_pages_match_the_code():
    stale = [str(path.name) for path, text in pages().items() if not path.is_file() or path.read_text() != text]
    assert not stale, f"regenerate with `python -m scripts.reference_docs`: {stale} differ from the code"


def test_every_setting_and_command_is_documented():
    from core.settings import Settings

    config = configuration()
    for name in Settings.model_fields:
        assert f"`CKPT_{name.upper()}`" in config
    assert "`KEEP_LAST`" in config  # the nested retention policy's fields
    text = cli()
    for command in ("ckpt retention", "ckpt restore", "ckpt db upgrade", "ckpt plan"):
        assert f"## `{command}`" in text
    assert "`--dry-run`" in text
