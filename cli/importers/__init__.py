"""`dgrpo import-config`: a dgrpo stack config from a verl, TRL or open-r1 config or run script."""
