from dghard_cli.cli import entrypoint

entrypoint()
