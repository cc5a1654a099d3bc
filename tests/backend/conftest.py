from registry_fakes import gen, plugins  # noqa: F401  (fixtures)
