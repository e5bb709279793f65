"""Spark side: session set-up, the shim bridge and the streaming API."""
