"""One module per command; each registers itself on the shared Typer app."""
