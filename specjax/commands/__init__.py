"""The `specjax` subcommands, one module each (`specjax.cli.COMMANDS`).

`specjax` imports every command module to build its parser, so a command module imports the
library inside its run functions: `--help` and a usage error never import JAX (load time,
the one reason these imports are function-local).
"""
