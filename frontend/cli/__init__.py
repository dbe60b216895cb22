"""The `tern launch` command line, one module per concern, each beside the config it builds:
`add_cli_args(parser)` adds its argparse group and `*_config_from_args(args)` builds its config.
`launch` composes them into the parser and the one Config."""
