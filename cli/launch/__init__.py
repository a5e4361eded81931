"""`dgrpo up`: the whole stack on one host: preflight, supervision, hang watch, terminal and the end-of-run report."""
