"""Tandem on a Ray cluster: ``tandem ray up|down --config cluster.yaml``."""
