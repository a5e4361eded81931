"""Generated gRPC contracts of dgrpo (package dgrpo.v1). Source: proto/dgrpo/v1/*.proto; regenerate with
`python proto/generate.py`."""
