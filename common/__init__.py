"""Pieces every dgrpo service shares: config base, devices, model folders, gRPC server plumbing.

Services never import each other; they meet only here and in the generated protos (dgrpo.v1).
"""
