"""One module per ``detscale`` subcommand: ``add_arguments(parser)`` and ``run(args) -> int``."""
