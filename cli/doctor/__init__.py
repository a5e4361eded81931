"""`dgrpo doctor`: this host checked before a launch, one concern a module; the services run the same checks
when they start."""
