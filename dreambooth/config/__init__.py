"""Every flag, defined once, and the sections of --help."""
