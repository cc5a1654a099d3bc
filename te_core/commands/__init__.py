"""The `te-core` subcommands that work on backends: `new-backend` and `certify`."""
