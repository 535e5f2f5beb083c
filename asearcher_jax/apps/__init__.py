"""Programs: one module per subcommand, and the wiring they share. The only package that
composes the others; nothing imports it but `main`."""
