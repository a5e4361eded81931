"""A bash reader for the importers: a run script's launch command, expanded as bash would, without running anything."""
